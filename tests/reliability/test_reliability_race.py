"""A file truncated (and re-extended) in place by another process while ``safe_open``
handles read it: the reader never dies (no SIGBUS), and every read is the right bytes or
a typed NnxSaveError."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time

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


_SLICES = {  # which read path each takes, on a 256 x 1024 float32 matrix
    "columns": (slice(None), slice(100, 164)),  # runs 3.8 KiB apart: gathered from a map
    "block": (slice(10, 200), slice(300, 800)),  # runs 2 KiB apart: gathered from a map
    "tight columns": (slice(None), slice(0, 900)),  # runs 0.5 KiB apart: the map (native), else one preadv
    "rows": (slice(3, 9),),  # one run: one preadv
    "many rows": (slice(20, 220),),  # one run of 800 KiB: one preadv, then copied out of the map (native)
    "element": (7, 9),
    "strided": (slice(0, 256, 3), slice(5, 1000, 7)),  # the engine (steps)
}

_THREADED_READER = """
import json, os, sys, threading, time, traceback
import numpy as np
import nnx_save
from nnx_save.errors import NnxSaveError
path, seconds = sys.argv[1], float(sys.argv[2])
slices = {slices}
base = np.arange({rows} * {cols}, dtype=np.float32).reshape({rows}, {cols})
versions = (base + 1, -base - 1)  # the file's two versions: one replaces the other by rename
counts = {{"right": 0, "typed": 0, "by kind": {{k: 0 for k in slices}}, "bad": []}}
lock, end = threading.Lock(), time.monotonic() + seconds

def read(worker):
    rng = np.random.default_rng(worker)
    names = list(slices)
    while time.monotonic() < end:
        backend = "pread" if worker % 4 == 3 else "mmap"
        try:
            with nnx_save.safe_open(path, "np", backend=backend) as f:
                for _ in range(40):
                    kind = names[int(rng.integers(len(names)))]
                    got = f.get_slice("w")[slices[kind]]
                    if not any(np.array_equal(got, v[slices[kind]]) for v in versions):
                        with lock:
                            counts["bad"].append(f"wrong values: {{kind}} ({{backend}})")
                        return
                    with lock:
                        counts["right"] += 1
                        counts["by kind"][kind] += 1
        except NnxSaveError:
            with lock:
                counts["typed"] += 1
        except BaseException:
            with lock:
                counts["bad"].append(traceback.format_exc())
            return

threads = [threading.Thread(target=read, args=(n,)) for n in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps(counts), flush=True)
"""


def _mutate(path, seconds: float) -> dict[str, int]:
    """Truncate ``path`` in place at random bytes (writing the tail back each time), and
    replace it by rename with its other version, over and over for ``seconds``."""
    rng = np.random.default_rng(1)
    other = path.with_name("other.safetensors")
    base = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)
    nnx_save.save_file({"w": -base - 1}, other)
    swap = other.read_bytes()
    done = {"truncated": 0, "replaced": 0}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        original = path.read_bytes()
        if rng.random() < 0.7:
            with open(path, "r+b") as f:
                cut = int(rng.integers(0, len(original)))
                os.ftruncate(f.fileno(), cut)  # a map over the old length now has no pages past cut
                time.sleep(float(rng.random()) * 0.003)
                os.pwrite(f.fileno(), original[cut:], cut)
            done["truncated"] += 1
        else:
            staged = path.with_name("staged.safetensors")
            staged.write_bytes(swap)
            os.replace(staged, path)  # open handles keep the old file; new ones see this one
            swap = original
            done["replaced"] += 1
        time.sleep(float(rng.random()) * 0.004)
    return done


def test_truncated_and_replaced_under_threaded_readers_in_two_processes(tmp_path):
    """Two reader processes of eight threads each take column slices (gathered from a
    map), blocks, rows, elements and strided slices through both backends while this
    process truncates the file in place and replaces it by rename, over and over. Neither
    reader is killed by a signal (SIGBUS); every read is one version's exact values or an
    NnxSaveError; every kind of slice is read right at least once, and typed refusals
    happen."""
    path = tmp_path / "w.safetensors"
    nnx_save.save_file({"w": np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS) + 1}, path)
    source = textwrap.dedent(_THREADED_READER).format(rows=ROWS, cols=COLS, slices=repr(_SLICES))
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    seconds = 5.0
    readers = [
        subprocess.Popen(
            [sys.executable, "-c", source, str(path), str(seconds)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        time.sleep(1.0)  # both have imported nnx_save and are reading
        done = _mutate(path, seconds - 1.5)
    finally:
        outputs = [r.communicate(timeout=seconds + 120) for r in readers]
    for reader, (out, err) in zip(readers, outputs, strict=True):
        assert reader.returncode == 0, (reader.returncode, out[-2000:], err[-4000:])  # -7: killed by SIGBUS
        counts = json.loads(out.strip().splitlines()[-1])
        assert counts["bad"] == [], counts["bad"][:3]
        assert counts["typed"] > 0 and min(counts["by kind"].values()) > 0, counts
    assert done["truncated"] > 0 and done["replaced"] > 0, done
