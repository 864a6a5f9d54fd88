"""A file truncated (and re-extended) in place by another process while ``safe_open``
handles read it: the reader never dies (no SIGBUS), and every read is the right bytes or
a typed NnxSaveError (issue 30, items 4-5)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import nnx_save
from nnx_save import errors

ROWS, COLS = 256, 1024  # 1 MiB of float32: small slices go the direct path, whole reads the engine

_WRITER = """
import os, random, sys, time
path, seconds = sys.argv[1], float(sys.argv[2])
original = open(path, "rb").read()
rng, end = random.Random(0), time.monotonic() + seconds
fd = os.open(path, os.O_WRONLY)
while time.monotonic() < end:
    cut = rng.randrange(0, len(original))
    os.ftruncate(fd, cut)  # truncated in place: pages a map held are gone
    time.sleep(rng.random() * 0.002)
    os.pwrite(fd, original[cut:], cut)  # re-extended with the very same bytes
    time.sleep(rng.random() * 0.004)
os.close(fd)
"""

_READER = """
import json, os, sys, time, traceback
import numpy as np
import nnx_save
from nnx_save.errors import NnxSaveError
path, backend, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
want = np.arange({rows} * {cols}, dtype=np.float32).reshape({rows}, {cols}) + 1
rng, end = np.random.default_rng(0), time.monotonic() + seconds
counts = {{"right": 0, "typed": 0}}
while time.monotonic() < end:
    try:
        with nnx_save.safe_open(path, "np", backend=backend) as f:
            for _ in range(20):
                a, b = sorted(int(x) for x in rng.integers(0, {rows} + 1, 2))
                c = int(rng.integers(0, {cols}))
                got = f.get_slice("w")[a:b, c:] if rng.random() < 0.5 else f.get_tensor("w")
                ref = want[a:b, c:] if got.shape != want.shape else want
                if not np.array_equal(got, ref):
                    print("WRONG BYTES", a, b, c, flush=True)
                    sys.exit(3)
                counts["right"] += 1
    except NnxSaveError:
        counts["typed"] += 1
    except BaseException:
        traceback.print_exc()
        sys.exit(4)
print(json.dumps(counts), flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_truncating_writer_against_readers(tmp_path, backend):
    """About 15 s per backend: a writer truncates the file at a random byte and writes the
    tail back, over and over, while a reader process opens and reads slices and whole
    tensors. The reader exits cleanly; no read returns wrong bytes; both right reads and
    typed refusals happen."""
    path = tmp_path / "w.safetensors"
    nnx_save.save_file({"w": np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS) + 1}, path)
    reader_src = textwrap.dedent(_READER).format(rows=ROWS, cols=COLS)
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    seconds = 11.0
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(path), str(seconds + 1)], env=env)
    try:
        reader = subprocess.run(
            [sys.executable, "-c", reader_src, str(path), backend, str(seconds)],
            env=env,
            capture_output=True,
            text=True,
            timeout=seconds + 60,
        )
    finally:
        writer.wait(timeout=seconds + 60)
    assert reader.returncode == 0, (reader.returncode, reader.stdout[-2000:], reader.stderr[-4000:])
    counts = json.loads(reader.stdout.strip().splitlines()[-1])
    assert counts["right"] > 0 and counts["typed"] > 0, counts


def test_truncated_before_first_read_is_typed(tmp_path):
    """Truncated after safe_open, before the first read: a TruncatedFileError naming the
    tensor (was numpy's TypeError "buffer is too small" from an array built over a map)."""
    path = tmp_path / "t.safetensors"
    nnx_save.save_file({"w": np.ones((64, 1024), np.float32)}, path)
    with nnx_save.safe_open(path) as f:
        os.truncate(path, os.path.getsize(path) - 4096)
        with pytest.raises(errors.TruncatedFileError, match=re.escape("tensor 'w' needs bytes up to")):
            f.get_slice("w")[0:2]
        with pytest.raises(errors.NnxSaveError, match=re.escape(str(path))):
            f.get_tensor("w")


def test_changed_in_place_is_typed(tmp_path):
    """Rewritten in place at the same size (a writer truncated it and wrote other bytes
    back): a SourceError naming the file, both backends, never the other version's bytes."""
    path = tmp_path / "c.safetensors"
    nnx_save.save_file({"w": np.ones((8, 8), np.float32)}, path)
    data_at = os.path.getsize(path) - 256
    for n, backend in enumerate(("mmap", "pread")):
        with nnx_save.safe_open(path, backend=backend) as f:
            with open(path, "r+b") as w:
                w.seek(data_at)
                w.write(np.full(64, 2 + n, np.float32).tobytes())
            os.utime(path, ns=(0, n + 1))  # a modification time of its own, whatever the clock's tick
            with pytest.raises(errors.SourceError, match=re.escape(f"{path}: changed while open")):
                f.get_slice("w")[0:2]
