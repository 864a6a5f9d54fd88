"""``nnx_save.safe_open`` as a drop-in for ``safetensors.safe_open``: each test names
the behaviour of safetensors' own Python tests (``bindings/python/tests/``) or of the
installed safetensors it mirrors, and compares against the real ``safetensors.safe_open``
in the same test where it can."""

import json
import os
import pickle
import re
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy
import torch

import nnx_save
from nnx_save import errors


@pytest.fixture
def plain(tmp_path):
    """A file written by safetensors itself, without metadata."""
    path = tmp_path / "plain.safetensors"
    safetensors.numpy.save_file(
        {"test": np.arange(6, dtype=np.float32).reshape(1, 2, 3), "a": np.arange(50, dtype=np.float32).reshape(10, 5)},
        str(path),
    )
    return path


def test_pt_slice_bytes(plain):
    """Mirrors test_pt_comparison.py SliceTestCase.test_deserialization_slice."""
    for module in (nnx_save, safetensors):
        with module.safe_open(plain, framework="pt") as f:
            tensor = f.get_slice("test")[:, :, 1:2]
        assert isinstance(tensor, torch.Tensor)
        assert tensor.numpy().tobytes() == b"\x00\x00\x80?\x00\x00\x80@"
        assert torch.equal(tensor, torch.Tensor([[[1.0], [4.0]]]))


def test_metadata_none_or_dict(plain, tmp_path):
    """Mirrors SliceTestCase.test_deserialization_metadata: None without metadata."""
    with nnx_save.safe_open(plain, "pt") as ours, safetensors.safe_open(str(plain), "pt") as theirs:
        assert ours.metadata() is None and theirs.metadata() is None
    other = tmp_path / "meta.safetensors"
    safetensors.numpy.save_file({"test": np.zeros(3, np.float32)}, str(other), metadata={"Something": "more"})
    with nnx_save.safe_open(other, "np") as ours, safetensors.safe_open(str(other), "np") as theirs:
        assert ours.metadata() == theirs.metadata() == {"Something": "more"}


@pytest.mark.parametrize("framework", ["np", "numpy", "flax", "jax", "pt", "torch"])
def test_frameworks_give_their_arrays(plain, framework):
    """Mirrors safe_open(framework=...) in the numpy, flax and torch tests: each
    framework's own array type, equal values; get_tensors / keys / offset_keys."""
    kind = {"np": np.ndarray, "numpy": np.ndarray, "flax": jax.Array, "jax": jax.Array}.get(framework, torch.Tensor)
    theirs_fw = "flax" if framework == "jax" else "pt" if framework == "torch" else framework
    with nnx_save.safe_open(plain, framework) as ours, safetensors.safe_open(str(plain), theirs_fw) as theirs:
        assert ours.keys() == theirs.keys() and ours.offset_keys() == theirs.offset_keys()
        got, want = ours.get_tensors(), theirs.get_tensors()
        assert list(got) == list(want)
        for key in want:
            assert isinstance(got[key], kind)
            np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]))
        assert isinstance(ours.get_slice("a")[2:4], kind)


def test_flax_device_and_torch_bfloat16(tmp_path):
    """jax arrays land on ``device``; bfloat16 comes back as torch.bfloat16 (as
    test_pt_comparison.py test_odd_dtype: bf16, f16, bool)."""
    path = tmp_path / "odd.safetensors"
    values = {
        "bf": np.arange(4).astype(ml_dtypes.bfloat16).reshape(2, 2),
        "f16": np.ones((2, 2), np.float16),
        "b": np.array([[True, False]]),
    }
    nnx_save.save_file(values, path)
    device = jax.devices("cpu")[3]
    with nnx_save.safe_open(path, "flax", device=device) as f:
        assert f.get_tensor("bf").devices() == {device}
    with nnx_save.safe_open(path, "pt") as ours, safetensors.safe_open(str(path), "pt") as theirs:
        for key in values:
            assert ours.get_tensor(key).dtype == theirs.get_tensor(key).dtype
            assert torch.equal(ours.get_tensor(key), theirs.get_tensor(key))


BYTE_ALIGNED = [  # every byte-aligned dtype of the safetensors format, by its numpy / ml_dtypes name
    *("bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64"),
    *("float16", "bfloat16", "float32", "float64", "complex64"),
    *("float8_e5m2", "float8_e4m3fn", "float8_e8m0fnu", "float8_e4m3fnuz", "float8_e5m2fnuz"),
]


def test_torch_gets_every_byte_aligned_dtype_and_refuses_sub_byte_ones(tmp_path):
    """Each byte-aligned code becomes the torch dtype of its numpy / ml_dtypes name with
    the same bytes; F4 (which torch has only packed in pairs) is refused, naming it."""
    raw = bytes([1, 0, 1, 1, 0, 0, 1, 0])  # a valid value of every dtype (bool included)
    dtypes = [np.dtype(getattr(ml_dtypes, name, name)) for name in BYTE_ALIGNED]
    nnx_save.save_file({d.name: np.frombuffer(raw, d) for d in dtypes}, tmp_path / "codes.safetensors")
    header = nnx_save.read_header(tmp_path / "codes.safetensors")
    rows = [header[d.name].dtype for d in dtypes]  # each one's code
    assert [(r.numpy, r.byte_aligned) for r in rows] == [(d, True) for d in dtypes]
    values = {r.code: np.frombuffer(raw, r.numpy) for r in rows}
    values["F4"] = np.zeros(2, ml_dtypes.float4_e2m1fn)
    nnx_save.save_file(values, tmp_path / "all.safetensors")
    with nnx_save.safe_open(tmp_path / "all.safetensors", "pt") as f:
        for r in rows:
            tensor = f.get_tensor(r.code)
            assert tensor.dtype == getattr(torch, r.numpy.name), r.code
            assert tensor.view(torch.uint8).numpy().tobytes() == raw, r.code
        with pytest.raises(errors.SafetensorError, match=re.escape("safe_open: dtype F4 has no torch dtype in torch")):
            f.get_tensor("F4")


def test_errors_are_safetensor_errors(plain):
    """The errors safetensors' callers catch: ``except safetensors.SafetensorError``
    catches ours (unknown tensor, refused index, closed handle, bad framework, device,
    backend), which stay NnxSaveErrors and pickle as nnx_save classes."""
    f = nnx_save.safe_open(plain, "np")
    calls = {
        "unknown tensor": lambda: f.get_tensor("zz"),
        "non-empty list": lambda: f.get_slice("a")[[1, 3]],
        "stop past the end": lambda: f.get_slice("a")[:20],
        "negative step": lambda: f.get_slice("a")[::-1],
        "bad framework": lambda: nnx_save.safe_open(plain, "zz"),
        "bad device": lambda: nnx_save.safe_open(plain, "np", device="cuda:0"),
        "bad backend": lambda: nnx_save.safe_open(plain, "np", backend="zz"),
    }
    for what, call in calls.items():
        with pytest.raises(safetensors.SafetensorError) as theirs_caught:
            call()
        assert isinstance(theirs_caught.value, errors.SafetensorError), what
        assert isinstance(theirs_caught.value, nnx_save.NnxSaveError), what
        back = pickle.loads(pickle.dumps(theirs_caught.value))
        assert type(back).__module__ == "nnx_save.errors" and str(back) == str(theirs_caught.value)
    f.close()
    with pytest.raises(safetensors.SafetensorError, match=re.escape("File is closed")):
        f.keys()
    with pytest.raises(errors.SafetensorError, match=re.escape("File is closed")):
        f.get_tensor("a")


def test_missing_file_message(tmp_path):
    """The installed safetensors: FileNotFoundError 'No such file or directory: PATH'."""
    missing = str(tmp_path / "nope.safetensors")
    with pytest.raises(FileNotFoundError) as theirs:
        safetensors.safe_open(missing, "np")
    with pytest.raises(errors.SourceNotFoundError, match=re.escape(str(theirs.value))) as ours:
        nnx_save.safe_open(missing, "np")
    assert isinstance(ours.value, FileNotFoundError) and ours.value.file == missing


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_slicing_rules(plain, backend):
    """The installed safetensors' slicing: an empty list gives no rows; bools are ints;
    an Ellipsis, a 0-d tensor's ``[...]`` and ``[()]``; what it refuses, we refuse."""
    with nnx_save.safe_open(plain, "np", backend=backend) as ours, safetensors.safe_open(str(plain), "np") as theirs:
        a, b = ours.get_slice("a"), theirs.get_slice("a")
        for index in [[], True, (slice(None), slice(1, 3), Ellipsis), (Ellipsis, 1), (1, Ellipsis, 2), slice(0, 0)]:
            got, want = a[index], b[index]
            assert got.shape == want.shape and got.dtype == want.dtype
            np.testing.assert_array_equal(got, want)
        refused = [
            [1, 3],
            (slice(None), [1]),
            None,
            1.0,
            (slice(None),) * 3,
            slice(10, None),
            (slice(None), slice(4, 6)),
        ]
        for index in refused:
            with pytest.raises(safetensors.SafetensorError):
                b[index]
            with pytest.raises(nnx_save.SliceError, match=re.escape("a: cannot slice a tensor of shape [10, 5]")):
                a[index]


def test_slice_outlives_close_and_counts_one_file(plain):
    """The installed safetensors: a slice taken before the handle closes still reads.
    ``f.io.files`` counts distinct files, one for a single-file handle."""
    with nnx_save.safe_open(plain, "np") as f:
        view = f.get_slice("a")
        for _ in range(5):
            f.get_slice("a")[1:3]
        f.get_tensor("test")
        assert f.io.files == 1
    np.testing.assert_array_equal(view[2:4], np.arange(10, 20, dtype=np.float32).reshape(2, 5))


def test_small_slices_skip_the_engine(plain, monkeypatch):
    """A small local slice is read with one pread per row straight into the result: no engine."""

    def refuse(*args, **kwargs):
        raise AssertionError("the engine was asked for a small local slice")

    with nnx_save.safe_open(plain, "np") as f:
        monkeypatch.setattr("nnx_save.load._engine.load_targets", refuse)  # where the handle imports it from
        np.testing.assert_array_equal(f.get_slice("a")[:, 1:3], np.arange(50, dtype=np.float32).reshape(10, 5)[:, 1:3])
        assert (f.io.bytes_read, f.io.bytes_needed, f.io.requests) == (80, 80, 10)  # 10 rows of 8 bytes
    with nnx_save.safe_open(plain, "np", backend="pread") as f, pytest.raises(AssertionError, match="engine"):
        f.get_slice("a")[:, 1:3]


def test_io_sums_the_reads_made_before_and_after_it_is_first_asked_for(tmp_path):
    """``f.io`` counts the direct reads made before anyone asked for it, then goes on
    counting in the same object: direct reads and the engine's alike."""
    value = np.arange(5000 * 2, dtype=np.float32).reshape(5000, 2)
    nnx_save.save_file({"w": value}, tmp_path / "w.safetensors")
    with nnx_save.safe_open(tmp_path / "w.safetensors", "np") as f:
        np.testing.assert_array_equal(f.get_slice("w")[3], value[3])  # one run of 8 bytes
        np.testing.assert_array_equal(f.get_slice("w")[10:20, 1], value[10:20, 1])  # 10 runs of 4 bytes
        first = f.io
        assert (first.bytes_read, first.bytes_needed, first.requests, first.files) == (48, 48, 11, 1)
        np.testing.assert_array_equal(f.get_slice("w")[7], value[7])
        np.testing.assert_array_equal(f.get_slice("w")[:, 0], value[:, 0])  # 5000 runs: the engine's
        assert f.io is first
        assert (first.bytes_needed, first.files) == (48 + 8 + 20000, 1)
        assert first.bytes_read >= first.bytes_needed and first.requests > 12


def test_truncated_file_is_a_typed_error(tmp_path):
    """A file truncated in place while mapped: a TruncatedFileError, not a SIGBUS."""
    path = tmp_path / "t.safetensors"
    nnx_save.save_file({"w": np.ones((64, 1024), np.float32)}, path)
    with nnx_save.safe_open(path) as f:
        f.get_slice("w")[0:1]
        os.truncate(path, os.path.getsize(path) - 4096)
        with pytest.raises(errors.TruncatedFileError, match=re.escape("tensor 'w' needs bytes up to")):
            f.get_slice("w")[60:64]


def test_directory_metadata(tmp_path):
    """A multi-file checkpoint's metadata: what every file agrees on, with the index's
    over it; per-file entries (checksums) only in file_metadata()."""
    one, two = tmp_path / "model-00001-of-00002.safetensors", tmp_path / "model-00002-of-00002.safetensors"
    nnx_save.save_file({"a": np.ones(3, np.float32)}, one, metadata={"format": "pt", "part": "1"})
    nnx_save.save_file({"b": np.ones(4, np.float32)}, two, metadata={"format": "pt", "part": "2"})
    index = {"metadata": {"total_size": "28"}, "weight_map": {"a": one.name, "b": two.name}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with nnx_save.safe_open(tmp_path) as f:
        assert f.metadata() == {"format": "pt", "nnx_save.checksum_algorithm": "xxh3_64", "total_size": "28"}
        per_file = f.file_metadata()
        assert per_file[str(one)]["part"] == "1" and "nnx_save.checksums" in per_file[str(two)]


_PEAK = """
import sys
import numpy as np
def status(field):
    return int(open("/proc/self/status").read().split(field + ":")[1].split()[0])
lib, path = sys.argv[1], sys.argv[2]
if lib == "nnx_save":
    import nnx_save
    safe_open = nnx_save.safe_open
else:
    from safetensors import safe_open
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
before = status("VmRSS")
with safe_open(path, "np") as f:
    cols = f.get_slice("w")[:, 1000:1064]
assert cols.shape == (2048, 64) and cols[1, 0] == 4096 + 1000
print(status("VmHWM") - before)
"""


def test_first_slice_holds_a_block_of_pages_not_the_tensor(tmp_path):
    """The peak RSS a fresh process adds for one column slice of a 32 MiB matrix: the
    slice and one 4 MiB block of mapped pages for nnx_save; the whole matrix's pages
    for safetensors (the kernel maps 64 KiB around each fault)."""
    path = tmp_path / "w.safetensors"
    nnx_save.save_file({"w": np.arange(2048 * 4096, dtype=np.float32).reshape(2048, 4096)}, path)
    path.read_bytes()  # page cache warm
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    added = {
        lib: int(subprocess.check_output([sys.executable, "-c", _PEAK, lib, str(path)], env=env, text=True)) / 1024
        for lib in ("nnx_save", "safetensors")
    }
    assert added["nnx_save"] < 8 and added["safetensors"] > 16, added
