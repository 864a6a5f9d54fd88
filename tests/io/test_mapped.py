"""Gathers of scattered runs out of a map (``nnx_save.io._mapped``), both ways: the
native copy whose SIGBUS is caught and ``process_vm_readv``; and the lazy slices that
use them: the runs equal the file's bytes (hypothesis), a truncated file is a refusal
the caller reads again (then a typed error), never a signal, and a SIGBUS that is not
the gather's still reaches the handler before it (it kills, or faulthandler reports it);
single runs (``quick_run``) equal numpy's slicing, and small ones (one native ``read_at``,
or ``preadv``) are the file's values or a typed error once it changed."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import nnx_save
from nnx_save import errors
from nnx_save.io import _files, _mapped
from nnx_save.io._mapped import MappedFile, can_map
from nnx_save.load._direct import one_run, quick_run
from nnx_save.load._slices import normalize_index

pytestmark = pytest.mark.skipif(not can_map(), reason="no process_vm_readv in this sandbox")

# The two ways of gathering; this checkout's install builds the native one (setup.py):
# its absence is a broken build, not a reason to skip.
WAYS = ["native", "process_vm_readv"]


@contextlib.contextmanager
def _way(way: str):
    """Gathers in this block go ``way``; ``"process_vm_readv"`` runs as an install built
    without the extension (small runs then go through ``os.preadv`` too, not ``read_at``)."""
    assert _mapped._native is not None, "the native gather was not built (pip install -e . with a C compiler)"
    saved = _mapped._native
    _mapped._native = _files._native = saved if way == "native" else None
    try:
        yield
    finally:
        _mapped._native = _files._native = saved


DATA = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()  # three blocks' worth


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("mapped") / "data.bin"
    path.write_bytes(DATA)
    return path


def _map(path) -> MappedFile:
    fd = os.open(path, os.O_RDONLY)
    try:
        return MappedFile(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


@given(
    starts=st.lists(st.integers(0, len(DATA) - 4097), min_size=1, max_size=3000),
    length=st.integers(1, 4096),
    release=st.booleans(),
    way=st.sampled_from(WAYS),
)
def test_gathered_runs_are_the_files_bytes(data_file, starts, length, release, way):
    offsets = np.array(sorted(starts), np.int64)
    out = np.zeros(len(offsets) * length, np.uint8)
    mapped = _map(data_file)
    try:
        with _way(way):
            assert mapped.gather(out.ctypes.data, offsets, length, release=release)
    finally:
        mapped.close()
    want = b"".join(DATA[o : o + length] for o in offsets.tolist())
    assert out.tobytes() == want


def _resident(base: int) -> int:
    """The bytes of this process's mapping that starts at ``base`` its page tables hold (smaps' Rss)."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    at = next(i for i, line in enumerate(lines) if re.match(rf"{base:x}-", line))
    return next(int(line.split()[1]) * 1024 for line in lines[at + 1 :] if line.startswith("Rss:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads the mapping's resident size from smaps")
@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("seed", range(3))
def test_a_releasing_gather_leaves_none_of_the_maps_pages_resident(tmp_path, way, seed):
    """A column's runs across a file of several blocks: gathered with ``release``, the
    map holds no page once done (each block's dropped as it is copied); without, it holds
    every page the runs touched."""
    rng = np.random.default_rng(seed)
    size = int(rng.integers(3, 7)) * _mapped.BLOCK_BYTES + int(rng.integers(0, 4096))
    path = tmp_path / "big.bin"
    path.write_bytes(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
    stride, length = int(rng.integers(4096, 20000)), int(rng.integers(1, 512))
    offsets = np.arange(int(rng.integers(0, 4096)), size - length, stride, dtype=np.int64)
    out = np.zeros(len(offsets) * length, np.uint8)
    resident = {}
    with _way(way):
        for release in (True, False):
            mapped = _map(path)
            try:
                assert mapped.gather(out.ctypes.data, offsets, length, release=release)
                resident[release] = _resident(mapped.base)
            finally:
                mapped.close()
    data = path.read_bytes()
    assert out.tobytes() == b"".join(data[o : o + length] for o in offsets.tolist())
    assert resident[True] == 0 and resident[False] >= len(offsets) * 4096, resident  # a page per run at least


@pytest.mark.parametrize("way", WAYS)
def test_a_truncated_file_is_a_refusal_not_a_signal(tmp_path, way):
    path = tmp_path / "t.bin"
    path.write_bytes(DATA)
    mapped = _map(path)
    out = np.zeros(2 * 100, np.uint8)
    with _way(way):
        assert mapped.gather(out.ctypes.data, np.array([0, 4096 + (2 << 20)]), 100)  # pages mapped first
        os.truncate(path, 1 << 20)  # the map's pages past 1 MiB are gone, those it had mapped too
        assert not mapped.gather(out.ctypes.data, np.array([0, 2 << 20]), 100)
        assert mapped.gather(out.ctypes.data, np.array([0, 4096]), 100)  # within the file: still read
        assert out.tobytes() == DATA[:100] + DATA[4096:4196]
        mapped.close()
        assert not mapped.gather(out.ctypes.data, np.array([0, 4096]), 100)  # closed: refused, not read


def test_the_native_gather_refuses_runs_outside_its_map(data_file):
    mapped = _map(data_file)
    out = np.zeros(200, np.uint8)
    try:
        with pytest.raises(ValueError, match=r"run 1 \(bytes 3145700\.\.3145800\) is outside the map's 3145728 bytes"):
            _mapped._native.gather(out.ctypes.data, mapped.base, mapped.size, np.array([0, len(DATA) - 28]), 100)
        with pytest.raises(ValueError, match="int64"):
            _mapped._native.gather(
                out.ctypes.data, mapped.base, mapped.size, np.zeros(3, np.int32).view(np.uint8)[:5], 1
            )
    finally:
        mapped.close()


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    """``script`` in a fresh Python process that imports this nnx_save, with ``args``."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )


# A process that gathers out of a truncated file's map in threads while its main thread
# loads from another truncated map (numpy, not the gather): the gathers are refused, and
# the main thread's SIGBUS goes to the handler the process had (faulthandler's, then the
# default one): the process dies of it, with faulthandler's report.
_FOREIGN_FAULT = """
import faulthandler, os, sys, threading
import numpy as np
from nnx_save.io._mapped import MappedFile
faulthandler.enable()
def mapped(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        return MappedFile(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
gathered, foreign = sys.argv[1], sys.argv[2]
m = mapped(gathered)
offsets = np.arange(0, 3 << 20, 4096, dtype=np.int64)
out = np.zeros(len(offsets) * 64, np.uint8)
assert m.gather(out.ctypes.data, offsets, 64)
os.truncate(gathered, 1 << 20)
refused = []
def gather():
    for _ in range(200):
        refused.append(not m.gather(out.ctypes.data, offsets, 64))
threads = [threading.Thread(target=gather) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("refused", all(refused), len(refused), flush=True)
view = np.memmap(foreign, np.uint8, mode="r")
os.truncate(foreign, 0)
print(int(view[len(view) - 1]), flush=True)  # a load past the end: SIGBUS, not the gather's
print("survived", flush=True)
"""


@pytest.mark.parametrize("way", WAYS)
def test_a_sigbus_that_is_not_the_gathers_still_kills(tmp_path, way):
    gathered, foreign = tmp_path / "gathered.bin", tmp_path / "foreign.bin"
    gathered.write_bytes(DATA)
    foreign.write_bytes(DATA[: 1 << 20])
    script = (
        _FOREIGN_FAULT if way == "native" else "import nnx_save.io._mapped as m; m._native = None\n" + _FOREIGN_FAULT
    )
    done = _run(script, str(gathered), str(foreign))
    assert done.stdout.splitlines()[0] == "refused True 800", (done.stdout, done.stderr)
    assert "survived" not in done.stdout
    assert done.returncode == -signal.SIGBUS, (done.returncode, done.stderr[-2000:])
    assert "Fatal Python error: Bus error" in done.stderr  # faulthandler, the handler before, reported it


_ENABLED_MEANWHILE = """
import faulthandler, os, sys, threading, time
import numpy as np
from nnx_save.io._mapped import MappedFile
path = sys.argv[1]
fd = os.open(path, os.O_RDONLY)
m = MappedFile(fd, os.fstat(fd).st_size)
# Many runs within the first MiB, then one past it: each gather copies for milliseconds
# before it faults, so the handler below is installed while threads copy.
offsets = np.append(np.repeat(np.arange(0, 1 << 20, 4096, dtype=np.int64), 300), 2 << 20)
first = np.zeros(len(offsets) * 64, np.uint8)  # held: the gather writes at its address
assert m.gather(first.ctypes.data, offsets, 64)
os.truncate(path, 1 << 20)
stop, results, started = False, [], threading.Event()
def gather():
    out = np.zeros(len(offsets) * 64, np.uint8)
    while not stop:
        results.append(m.gather(out.ctypes.data, offsets, 64))
        started.set()
threads = [threading.Thread(target=gather) for _ in range(3)]
for t in threads:
    t.start()
started.wait()
faulthandler.enable()  # installed over the gathers' handler while they copy
time.sleep(0.3)
stop = True
for t in threads:
    t.join()
print("refused", len(results), not any(results), flush=True)
"""


def test_faulthandler_enabled_while_gathers_copy_does_not_kill_them(tmp_path):
    """faulthandler installed over the gathers' handler sees a gather's fault first; it
    reports it, puts the handler back and raises the signal again, which the gather
    takes as its own: every gather is refused and the process exits normally."""
    path = tmp_path / "t.bin"
    path.write_bytes(DATA)
    done = _run(_ENABLED_MEANWHILE, str(path))
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    count, none_read = done.stdout.split()[1:]
    assert int(count) > 3 and none_read == "True", done.stdout


_FORKED_MEANWHILE = """
import os, sys, threading
import numpy as np
from nnx_save.io._mapped import MappedFile
path, foreign = sys.argv[1], sys.argv[2]
fd = os.open(path, os.O_RDONLY)
m = MappedFile(fd, os.fstat(fd).st_size)
offsets = np.append(np.repeat(np.arange(0, 1 << 20, 4096, dtype=np.int64), 300), 2 << 20)
os.truncate(path, 1 << 20)
view = np.memmap(foreign, np.uint8, mode="r", shape=(8192,))
os.truncate(foreign, 0)
stop = False
def gather():
    out = np.zeros(len(offsets) * 64, np.uint8)
    while not stop:
        m.gather(out.ctypes.data, offsets, 64)
threads = [threading.Thread(target=gather) for _ in range(3)]
for t in threads:
    t.start()
statuses = set()
for i in range(30):
    pid = os.fork()
    if pid == 0:  # forked while threads copy: the child has none copying
        out = np.zeros(len(offsets) * 64, np.uint8)
        refused = not m.gather(out.ctypes.data, offsets, 64)
        if i % 2:
            print(int(view[5000]))  # a load past the end of the foreign file: SIGBUS kills
        os._exit(0 if refused else 3)
    status = os.waitpid(pid, 0)[1]
    statuses.add((i % 2, os.WTERMSIG(status) if os.WIFSIGNALED(status) else -os.WEXITSTATUS(status)))
stop = True
for t in threads:
    t.join()
print(sorted(statuses))
"""


def test_a_child_forked_while_threads_gather_gathers_and_dies_of_a_foreign_sigbus(tmp_path):
    """A child forked while other threads copy out of a map has no thread copying: its own
    gathers of a truncated file are refused (no lock left held, no handler calling itself),
    and its own load past a truncated file's end kills it with SIGBUS."""
    path, foreign = tmp_path / "t.bin", tmp_path / "foreign.bin"
    path.write_bytes(DATA)
    foreign.write_bytes(bytes(8192))
    done = _run(_FORKED_MEANWHILE, str(path), str(foreign))
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    assert done.stdout.strip().splitlines()[-1] == f"[(0, 0), (1, {int(signal.SIGBUS)})]", done.stdout


@pytest.mark.parametrize("way", WAYS)
def test_column_slices_are_gathered_from_the_map_then_refused_when_truncated(tmp_path, way):
    path = tmp_path / "w.safetensors"
    w = np.arange(512 * 2048, dtype=np.float32).reshape(512, 2048)
    nnx_save.save_file({"w": w}, path)
    with _way(way), nnx_save.safe_open(path) as f:
        for _ in range(3):  # the first gather drops its pages, later ones keep them
            np.testing.assert_array_equal(f.get_slice("w")[:, 100:164], w[:, 100:164])
        assert [m for m in f._state.direct._maps.values() if m is not None], "no map was used"
        os.truncate(path, os.path.getsize(path) - (1 << 20))
        with pytest.raises(errors.TruncatedFileError, match=re.escape("tensor 'w' needs bytes up to")):
            f.get_slice("w")[:, 100:164]


@pytest.mark.parametrize("way", WAYS)
def test_large_runs_of_a_tensor_read_before_come_from_the_map_then_refuse_when_truncated(tmp_path, way):
    path = tmp_path / "w.safetensors"
    w = np.arange(512 * 2048, dtype=np.float32).reshape(512, 2048)  # 8 KiB rows
    nnx_save.save_file({"w": w}, path)
    with _way(way), nnx_save.safe_open(path) as f:
        for _ in range(3):  # the first read is preadv's; then the map's, natively
            np.testing.assert_array_equal(f.get_slice("w")[100:228], w[100:228])  # 1 MiB, one run
        maps = [m for m in f._state.direct._maps.values() if m is not None]
        assert len(maps) == (1 if way == "native" else 0)
        os.truncate(path, os.path.getsize(path) - (1 << 20))
        with pytest.raises(errors.TruncatedFileError, match=re.escape("tensor 'w' needs bytes up to")):
            f.get_slice("w")[300:500]


SMALL = np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024)  # 4 KiB rows


@pytest.fixture(scope="module")
def small_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("small") / "w.safetensors"
    nnx_save.save_file({"pad": np.zeros(3, np.uint8), "w": SMALL}, path)  # w's bytes start unaligned
    return path


@given(row=st.integers(0, 63), col=st.integers(0, 1023), rows=st.integers(1, 17), way=st.sampled_from(WAYS))
def test_small_runs_are_the_files_values(small_file, row, col, rows, way):
    """Elements and row ranges up to 68 KiB (either side of ``_direct.READ_AT_BYTES``),
    through a handle opened once per example, are numpy's."""
    stop = min(row + rows, 64)  # past the end is a SliceError, as in safetensors
    with _way(way), nnx_save.safe_open(small_file) as f:
        assert f.get_slice("w")[row, col] == SMALL[row, col]
        np.testing.assert_array_equal(f.get_slice("w")[row:stop], SMALL[row:stop])
        np.testing.assert_array_equal(f.get_slice("w")[row, col:], SMALL[row, col:])


def test_a_small_run_is_one_native_read_on_the_pools_descriptor(small_file, monkeypatch):
    """An element and a few rows take ``read_at`` (once each, no duplicate descriptor);
    a large run does not. The values are the file's."""
    calls, dups = [], []
    native = _files._native

    class Spy:
        def read_at(self, *args):
            calls.append(args[3:])  # (size, mtime_ns) of the header's file
            return native.read_at(*args)

    monkeypatch.setattr(_files, "_native", Spy())
    real_dup = os.dup
    monkeypatch.setattr(_files.os, "dup", lambda fd: dups.append(fd) or real_dup(fd))
    with nnx_save.safe_open(small_file) as f:
        dups.clear()  # the open's own
        assert f.get_slice("w")[5, 7] == SMALL[5, 7]
        np.testing.assert_array_equal(f.get_slice("w")[3:9], SMALL[3:9])  # 24 KiB
        assert len(calls) == 2 and dups == []
        np.testing.assert_array_equal(f.get_slice("w")[0:20], SMALL[0:20])  # 80 KiB: preadv
        assert len(calls) == 2 and len(dups) == 1
    st_ = os.stat(small_file)
    assert calls[0] == (st_.st_size, st_.st_mtime_ns)


@pytest.mark.parametrize("way", WAYS)
def test_small_runs_of_a_changed_file_are_typed_errors(tmp_path, way):
    """An element and a few rows of a file rewritten in place (same size, another
    modification time) raise SourceError; of a truncated one, TruncatedFileError."""
    path = tmp_path / "w.safetensors"
    nnx_save.save_file({"w": SMALL}, path)
    with _way(way), nnx_save.safe_open(path) as f:
        assert f.get_slice("w")[5, 7] == SMALL[5, 7]
        with open(path, "r+b") as w:
            w.seek(os.path.getsize(path) - 4096)
            w.write(np.full(1024, -1, np.float32).tobytes())
        os.utime(path, ns=(0, 1))  # a modification time of its own, whatever the clock's tick
        for index in ((5, 7), (slice(0, 2),), (63, 5)):
            with pytest.raises(errors.SourceError, match=re.escape(f"{path}: changed while open")):
                f.get_slice("w")[index]
    with _way(way), nnx_save.safe_open(path) as f:
        os.truncate(path, os.path.getsize(path) - 8192)
        for index in ((5, 7), (63, 5)):  # before where it now ends too: the file is not the one read
            with pytest.raises(errors.TruncatedFileError, match=re.escape("tensor 'w' needs bytes up to")):
                f.get_slice("w")[index]


SHAPES = st.lists(st.integers(1, 5), min_size=0, max_size=4)


@st.composite
def _indexed(draw):
    shape = tuple(draw(SHAPES))
    items = []
    for size in shape[: draw(st.integers(0, len(shape)))]:
        if draw(st.booleans()):
            items.append(draw(st.integers(-size - 1, size)))
        else:
            bounds = st.one_of(st.none(), st.integers(-size - 1, size + 1))
            items.append(slice(draw(bounds), draw(bounds), draw(st.sampled_from([None, 1, 2]))))
    return shape, tuple(items) if draw(st.booleans()) or len(items) != 1 else items[0]


@given(_indexed())
def test_one_run_and_quick_run_select_what_numpy_does(case):
    shape, index = case
    array = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    quick = quick_run(index, shape)
    try:
        items = normalize_index(index, shape)
    except errors.SliceError:
        assert quick is None  # the general path refuses it, naming why
        return
    runs = [r for r in (quick, one_run(items, shape) if items is not None else None) if r is not None]
    if quick is not None:
        assert one_run(items, shape) == quick
    for first, out in runs:
        want = array[items]
        assert list(want.shape) == out
        np.testing.assert_array_equal(array.reshape(-1)[first : first + want.size].reshape(out), want)


def test_closing_a_handle_unmaps_its_files(tmp_path):
    """A handle's gathers map its file; ``close()`` unmaps it (a file removed meanwhile
    frees its space then, not when the handle is collected); a slice taken before
    still reads, mapping it again."""
    path = tmp_path / "w.safetensors"
    w = np.arange(512 * 2048, dtype=np.float32).reshape(512, 2048)
    nnx_save.save_file({"w": w}, path)

    def maps() -> int:
        with open("/proc/self/maps") as f:
            return f.read().count(str(path))

    f = nnx_save.safe_open(path)
    kept = f.get_slice("w")
    np.testing.assert_array_equal(kept[:, 100:164], w[:, 100:164])
    assert maps() == 1
    f.close()
    assert maps() == 0
    np.testing.assert_array_equal(kept[:, 200:264], w[:, 200:264])


_CUT_INDICES = [(5, 7), (slice(3, 9),), (slice(0, 200),), (slice(None), slice(10, 12)), (slice(50, 90), slice(5, 60))]


@given(
    cut=st.integers(0, 255),
    index=st.sampled_from(_CUT_INDICES),
    backend=st.sampled_from(["mmap", "pread"]),
    way=st.sampled_from(WAYS),
)
def test_a_read_of_a_file_cut_below_it_names_where_the_file_ends(cut, index, backend, way):
    """A file truncated under an open handle, at a random point of its data (often below
    where the read begins): every slice kind (an element, rows over and under 64 KiB, a
    column, a block), both backends, both ways, is the file's values or a
    TruncatedFileError naming the byte where the file now ends (it named where the read
    began)."""
    import tempfile

    value = np.arange(256 * 256, dtype=np.float32).reshape(256, 256)
    with tempfile.TemporaryDirectory() as where:
        path = os.path.join(where, "w.safetensors")
        nnx_save.save_file({"w": value}, path)
        with _way(way), nnx_save.safe_open(path, backend=backend) as f:
            begin = os.path.getsize(path) - value.nbytes
            end = begin + cut * 1024  # 1 KiB steps through the 256 KiB of data
            os.truncate(path, end)
            try:
                got = f.get_slice("w")[index]
            except errors.TruncatedFileError as error:
                assert error.offset == end and f"byte {end}" in str(error), (end, str(error))
            else:
                np.testing.assert_array_equal(got, value[index])
