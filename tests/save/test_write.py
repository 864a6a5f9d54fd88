"""save_file: keys, layout, refusals, purity, atomicity, streaming, round trips."""

import copy
import math
import os
import re
import stat
import struct
import tracemalloc

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _errors import raises_check
from hypothesis import given, settings
from hypothesis import strategies as st

import nnx_save
from nnx_save.format import _dtypes
from nnx_save.io._atomic import TMP_MARKER
from nnx_save.save import _sink, _write


def header_of(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, raw[8 : 8 + n], raw[8 + n :]


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def leftovers(directory):
    return [p for p in os.listdir(directory) if TMP_MARKER in p]


# --- keys and layout ---------------------------------------------------------------------------


def test_keys_are_paths_joined_with_slash_and_list_indices_in_decimal(tmp_path):
    tree = {
        "embed": np.arange(6, dtype=np.float32).reshape(2, 3),
        "layers": [{"w": np.ones((2, 2), np.float16)}, {"w": np.zeros((2, 2), np.float16)}],
        "pair": (np.int8(3), np.array([True, False])),
        "deep": {"x": {"y": [[np.uint64(7)]] * 11}},
    }
    nnx_save.save_file(tree, tmp_path / "m.safetensors")
    out = nnx_save.load_file(tmp_path / "m.safetensors")
    assert sorted(out) == sorted(
        ["embed", "layers/0/w", "layers/1/w", "pair/0", "pair/1"] + [f"deep/x/y/{i}/0" for i in range(11)]
    )
    assert same_bits(out["embed"], tree["embed"])
    assert same_bits(out["layers/1/w"], tree["layers"][1]["w"])
    assert same_bits(out["pair/0"], np.array(3, np.int8))
    assert same_bits(out["deep/x/y/10/0"], np.array(7, np.uint64))


def test_layout_is_dtype_rank_descending_then_name_and_header_is_space_padded(tmp_path):
    tree = {
        "b": np.zeros(3, np.uint8),
        "a": np.zeros(1, np.float32),
        "c": np.zeros(2, np.float64),
        "aa": np.zeros(1, np.float32),
        "z": np.zeros(1, np.bool_),
    }
    nnx_save.save_file(tree, tmp_path / "m.safetensors")
    n, raw, data = header_of(tmp_path / "m.safetensors")
    assert n % 8 == 0
    stripped = raw.rstrip(b" ")
    assert stripped.endswith(b"}") and set(raw[len(stripped) :]) <= {0x20} and len(raw) - len(stripped) < 8
    h = nnx_save.read_header(tmp_path / "m.safetensors")
    assert list(h.tensors) == ["c", "a", "aa", "b", "z"]
    assert [h[k].begin - h.files[0].data_start for k in h] == [0, 16, 20, 24, 27]
    assert len(data) == 28


def test_metadata_is_stored(tmp_path):
    nnx_save.save_file({"w": np.zeros(1, np.float32)}, tmp_path / "m.safetensors", metadata={"format": "np", "é": "ü"})
    meta = nnx_save.read_header(tmp_path / "m.safetensors").metadata
    assert meta["format"] == "np" and meta["é"] == "ü"


def test_empty_tree(tmp_path):
    nnx_save.save_file({}, tmp_path / "e.safetensors")
    assert nnx_save.load_file(tmp_path / "e.safetensors") == {}


def test_overwrites_an_existing_file(tmp_path):
    path = tmp_path / "m.safetensors"
    nnx_save.save_file({"old": np.zeros(100, np.float32)}, path)
    nnx_save.save_file({"new": np.ones(2, np.float32)}, path)
    assert list(nnx_save.load_file(path)) == ["new"]
    assert leftovers(tmp_path) == []


def test_golden_bytes(tmp_path):
    path = tmp_path / "g.safetensors"
    nnx_save.save_file(
        {"b": np.array([True, False, True]), "a": np.array([[1.0, -2.0]], np.float32), "i": np.array(-2, np.int16)},
        path,
    )
    # Header: dtype rank descending (F32, I16, BOOL), then name; the JSON padded with spaces
    # to a multiple of 8; data little-endian. Any __metadata__ the writer adds is checked by
    # value below, the rest of the file byte for byte.
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = raw[8 : 8 + n].decode()
    tensors = (
        '"a":{"dtype":"F32","shape":[1,2],"data_offsets":[0,8]},'
        '"i":{"dtype":"I16","shape":[],"data_offsets":[8,10]},'
        '"b":{"dtype":"BOOL","shape":[3],"data_offsets":[10,13]}}'
    )
    assert header.rstrip(" ").endswith(tensors)
    assert raw[8 + n :] == b"\x00\x00\x80\x3f\x00\x00\x00\xc0\xfe\xff\x01\x00\x01"
    head = header.rstrip(" ")
    if head.startswith('{"__metadata__":'):
        meta = head[len('{"__metadata__":') : -len(tensors) - 1]
        assert head == '{"__metadata__":' + meta + "," + tensors
        import json

        assert all(k.startswith("nnx_save.") for k in json.loads(meta))
    else:
        assert raw == (
            b"\x98\x00\x00\x00\x00\x00\x00\x00{"
            + tensors.encode()
            + b"    "
            + b"\x00\x00\x80\x3f\x00\x00\x00\xc0\xfe\xff\x01\x00\x01"
        )


# --- values --------------------------------------------------------------------------------------


def test_jax_arrays_sharded_bf16_scalars_and_empty(tmp_path):
    mesh = jax.make_mesh((8,), ("d",))
    sharded = jax.device_put(
        jnp.arange(64, dtype=jnp.float32).reshape(16, 4),
        jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d")),
    )
    tree = {
        "sharded": sharded,
        "bf16": jnp.linspace(-3, 3, 7, dtype=jnp.bfloat16),
        "scalar": jnp.float32(2.5),
        "empty": jnp.zeros((0, 5), jnp.int32),
        "key": jax.random.key_data(jax.random.key(0)),
    }
    nnx_save.save_file(tree, tmp_path / "j.safetensors")
    out = nnx_save.load_file(tmp_path / "j.safetensors")
    for k, v in tree.items():
        assert same_bits(out[k], np.asarray(v)), k
    assert out["bf16"].dtype == ml_dtypes.bfloat16 and out["scalar"].shape == () and out["empty"].shape == (0, 5)


def test_big_endian_and_non_contiguous_inputs_are_stored_little_endian_c_order(tmp_path):
    be = np.arange(6, dtype=">i4").reshape(2, 3)
    fortran = np.asfortranarray(np.arange(12, dtype=np.float64).reshape(3, 4))
    strided = np.arange(20, dtype=np.int16)[::3]
    nnx_save.save_file({"be": be, "f": fortran, "s": strided}, tmp_path / "m.safetensors")
    _, _, data = header_of(tmp_path / "m.safetensors")
    assert (
        data == fortran.astype("<f8").tobytes(order="C") + be.astype("<i4").tobytes() + strided.astype("<i2").tobytes()
    )
    out = nnx_save.load_file(tmp_path / "m.safetensors")
    assert out["be"].tolist() == be.tolist() and out["f"].tolist() == fortran.tolist()


SUBBYTE = {"F4", "F6_E2M3", "F6_E3M2"}


def random_array(code, shape, rng):
    row = _dtypes.DTYPES[code]
    numel = math.prod(shape)
    if row.byte_aligned:
        raw = rng.integers(0, 256, numel * row.itemsize, dtype=np.uint8)
        if code == "BOOL":
            raw &= 1
        return raw.view(row.numpy).reshape(shape)
    raw = rng.integers(0, 1 << row.bits, numel, dtype=np.uint8)
    return raw.view(row.numpy).reshape(shape)


@st.composite
def trees(draw):
    n = draw(st.integers(0, 6))
    out = {}
    for i in range(n):
        code = draw(st.sampled_from(list(_dtypes.DTYPES)))
        shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
        bits = _dtypes.DTYPES[code].bits
        if math.prod(shape) * bits % 8:
            shape = (*shape, 8 // math.gcd(8, bits))
            if math.prod(shape) * bits % 8:  # the product was odd before: double the new axis
                shape = (*shape[:-1], shape[-1] * 2)
        name = draw(st.text(min_size=1, max_size=5).filter(lambda s: "/" not in s and s != "__metadata__"))
        out[f"{name}{i}"] = (code, shape)
    return out


@settings(max_examples=40)
@given(spec=trees(), seed=st.integers(0, 2**32 - 1))
def test_round_trip_every_dtype_bit_for_bit(tmp_path_factory, spec, seed):
    rng = np.random.default_rng(seed)
    tree = {k: random_array(code, shape, rng) for k, (code, shape) in spec.items()}
    path = tmp_path_factory.mktemp("rt") / "rt.safetensors"
    nnx_save.save_file(tree, path)
    header = nnx_save.read_header(path)
    assert {k: (t.dtype.code, t.shape) for k, t in header.tensors.items()} == spec
    out = nnx_save.load_file(path)
    assert set(out) == set(tree)
    for k, v in tree.items():
        assert same_bits(out[k], v), (k, spec[k])


# --- refusals ------------------------------------------------------------------------------------

ARRAYS_ONLY = "; save_file stores arrays only (use save_model for NNX scalars and rng keys)"


@pytest.mark.parametrize(
    "tree, cls, message",
    [
        (
            {"a": {"name": "hello"}},
            nnx_save.UnsupportedValueError,
            "a/name: expected an array, found a str ('hello')" + ARRAYS_ONLY,
        ),
        (
            {"a": [np.zeros(1), None]},
            nnx_save.UnsupportedValueError,
            "a/1: expected an array, found a NoneType (None)" + ARRAYS_ONLY,
        ),
        ({"lr": 1.5}, nnx_save.UnsupportedValueError, "lr: expected an array, found a float (1.5)" + ARRAYS_ONLY),
        (
            {"o": np.array([1, "x"], dtype=object)},
            nnx_save.UnsupportedValueError,
            "o: a numpy array of dtype object has no safetensors dtype",
        ),
        (
            {"s": np.array(["ab", "c"])},
            nnx_save.UnsupportedValueError,
            "s: a numpy array of dtype <U2 has no safetensors dtype",
        ),
        (
            {"m": {"q/k": np.zeros(1)}},  # nested: a flat mapping of file keys ({"q/k": ...}) saves as those keys
            nnx_save.KeyPathError,
            "m/'q/k': name contains /; file keys join names with '/' so this one could not be read back to the same place.",
        ),
        ({"a": {"": np.zeros(1)}}, nnx_save.KeyPathError, "a/'': empty name;"),
        (
            {0: np.zeros(1), "0": np.ones(1)},
            nnx_save.KeyPathError,
            "0: int key 0 and str key '0' of the dict at <root> both make the file key '0'; rename one of them",
        ),
        (
            {"l": {1: np.zeros(1), "w": np.ones(1)}},
            nnx_save.KeyPathError,
            "l: a dict with keys of mixed types ['w', 1]; jax cannot flatten it. Use keys of one type",
        ),
        (
            {"c": np.zeros(2, np.complex128)},
            "dtype",
            "tensor 'c': dtype complex128 has no safetensors code",
        ),
        (
            {"k": jax.random.key(0)},
            nnx_save.UnsupportedValueError,
            "k: a typed PRNG key array; store jax.random.key_data(key) or use save_model",
        ),
        (
            {"__metadata__": np.zeros(1)},
            nnx_save.KeyPathError,
            "'__metadata__': the safetensors format reserves this key for metadata; rename the tensor",
        ),
        (
            {"f4": np.zeros(3, ml_dtypes.float4_e2m1fn)},
            nnx_save.UnsupportedValueError,
            "f4: 3 F4 elements are 12 bits, not a whole number of bytes; safetensors readers refuse such a tensor.",
        ),
        ({"x": {"\ud800": np.zeros(1)}}, nnx_save.KeyPathError, "is not valid Unicode (a lone surrogate)"),
    ],
    ids=[
        "str",
        "none",
        "float",
        "object",
        "unicode",
        "slash",
        "empty",
        "int-str-0",
        "mixed",
        "c128",
        "prng",
        "metadata-key",
        "odd-f4",
        "surrogate",
    ],
)
def test_refusals_name_the_path_and_write_nothing(tmp_path, tree, cls, message):
    with raises_check(cls, match=re.escape(message)):
        nnx_save.save_file(tree, tmp_path / "m.safetensors")
    assert os.listdir(tmp_path) == []


def test_refused_leaf_error_carries_the_path(tmp_path):
    with pytest.raises(nnx_save.UnsupportedValueError) as info:
        nnx_save.save_file({"a": [np.zeros(1), "x"]}, tmp_path / "m.safetensors")
    assert info.value.key_path == "a/1"


@pytest.mark.parametrize(
    "metadata, detail",
    [
        ({"ok": "x", "k": 1}, ": 'k': 1 is str: int"),
        ({1: "v"}, ": 1: 'v' is int: str"),
        ({"k": None}, ": 'k': None is str: NoneType"),
        ([("k", "v")], ", found a list"),
        ({"k": "\udcff"}, ": 'k': '\\udcff' is not valid Unicode (a lone surrogate)"),
    ],
)
def test_metadata_must_be_str_to_str(tmp_path, metadata, detail):
    with pytest.raises(nnx_save.UnsupportedValueError, match=re.escape("metadata must map str to str" + detail)):
        nnx_save.save_file({"w": np.zeros(1)}, tmp_path / "m.safetensors", metadata=metadata)
    assert os.listdir(tmp_path) == []


def test_missing_directory_is_a_save_error(tmp_path):
    path = tmp_path / "nope" / "m.safetensors"
    with pytest.raises(
        nnx_save.SaveError,
        match=re.escape(f"{path}: cannot create a temporary file in {path.parent}: No such file or directory"),
    ):
        nnx_save.save_file({"w": np.zeros(1)}, path)


def _make_fifo(path):
    os.mkfifo(path)


def _make_socket(path):
    import socket

    with socket.socket(socket.AF_UNIX) as s:
        s.bind(os.fspath(path))


@pytest.mark.parametrize(
    ("make", "kind", "mode"),
    [
        (_make_fifo, "a FIFO", stat.S_IFIFO),
        (_make_socket, "a socket", stat.S_IFSOCK),
        (os.mkdir, "a directory", stat.S_IFDIR),
    ],
)
def test_a_path_that_is_not_a_regular_file_is_never_replaced(tmp_path, make, kind, mode):
    # as root, save_file(tree, "/dev/null") renamed a checkpoint over the device node
    path = tmp_path / "m.safetensors"
    make(path)
    with pytest.raises(
        nnx_save.SaveError,
        match=re.escape(f"{path}: is {kind}; a save replaces a regular file only, so nothing was written"),
    ):
        nnx_save.save_file({"w": np.zeros(1)}, path)
    assert stat.S_IFMT(os.lstat(path).st_mode) == mode and leftovers(tmp_path) == []


# --- purity --------------------------------------------------------------------------------------


def test_input_is_not_mutated(tmp_path):
    a = np.arange(6, dtype=">f4").reshape(2, 3)
    f = np.asfortranarray(np.ones((3, 2), np.int64))
    ro = np.arange(4, dtype=np.uint8)
    ro.setflags(write=False)
    j = jnp.arange(5, dtype=jnp.bfloat16)
    inner = [a, {"f": f}]
    tree = {"inner": inner, "ro": ro, "j": j}
    snapshot = copy.deepcopy({"inner": [a, {"f": f}], "ro": ro})
    flags = [(x.flags.writeable, x.flags.c_contiguous, x.flags.f_contiguous, x.dtype.byteorder) for x in (a, f, ro)]
    nnx_save.save_file(tree, tmp_path / "m.safetensors", metadata={"k": "v"})
    assert tree.keys() == {"inner", "ro", "j"} and tree["inner"] is inner and inner[0] is a and inner[1]["f"] is f
    assert (
        same_bits(a, snapshot["inner"][0]) and same_bits(f, snapshot["inner"][1]["f"]) and same_bits(ro, snapshot["ro"])
    )
    assert flags == [
        (x.flags.writeable, x.flags.c_contiguous, x.flags.f_contiguous, x.dtype.byteorder) for x in (a, f, ro)
    ]
    assert not j.is_deleted() and j.tolist() == jnp.arange(5, dtype=jnp.bfloat16).tolist()


def test_metadata_argument_is_not_mutated(tmp_path):
    meta = {"b": "1", "a": "2"}
    nnx_save.save_file({"w": np.zeros(1)}, tmp_path / "m.safetensors", metadata=meta)
    assert meta == {"b": "1", "a": "2"} and list(meta) == ["b", "a"]


# --- atomicity -----------------------------------------------------------------------------------


def test_failure_mid_write_keeps_the_previous_file_and_leaves_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "m.safetensors"
    nnx_save.save_file({"w": np.arange(4, dtype=np.float32)}, path)
    before = path.read_bytes()
    real, calls = _write.host_bytes, []

    def dies(array, code):  # the second tensor's host copy fails once the first is written
        calls.append(code)
        if len(calls) == 2:
            raise RuntimeError("Array has been deleted")
        return real(array, code)

    # (A deleted jax array is now refused before writing: test_reliability_edges.py.)
    monkeypatch.setattr(_write, "host_bytes", dies)
    with pytest.raises(RuntimeError, match=re.escape("Array has been deleted")):
        nnx_save.save_file({"a": np.zeros(1 << 16, np.float32), "z": jnp.ones(3, jnp.float32)}, path)
    assert len(calls) == 2
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["m.safetensors"]


def test_disk_full_is_a_save_error_and_keeps_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "m.safetensors"
    nnx_save.save_file({"w": np.arange(4, dtype=np.float32)}, path)
    before = path.read_bytes()
    real, calls = _sink.pwrite_all, []

    def full(fd, data, *args):
        calls.append(len(data))
        if len(calls) == 2:  # the header went through; the first tensor does not fit
            raise OSError(28, "No space left on device")
        return real(fd, data, *args)

    monkeypatch.setattr(_sink, "pwrite_all", full)
    with pytest.raises(
        nnx_save.SaveError,
        match=re.escape(f"{path}: save failed (no space left on the device); the previous file, if any, is intact"),
    ) as info:
        nnx_save.save_file({"a": np.zeros(8, np.float32), "b": np.zeros(8, np.float32)}, path)
    assert info.value.file == str(path) and isinstance(info.value, OSError)
    assert path.read_bytes() == before and leftovers(tmp_path) == []


def test_a_value_that_disagrees_with_its_header_is_refused(tmp_path):
    path = tmp_path / "m.safetensors"
    entry = _write.Entry("w", "F32", (4,), lambda: np.zeros(3, np.float32))
    with pytest.raises(
        nnx_save.SaveError,
        match=re.escape(f"{path}: tensor 'w' gave 12 bytes, its header entry F32 [4] says 16; nothing was saved"),
    ):
        _write.write_file(path, [entry])
    assert os.listdir(tmp_path) == []


def test_fsync_file_then_rename_in_the_same_directory_then_fsync_directory(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.path.dirname(src) == os.path.dirname(dst), os.path.basename(src)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    nnx_save.save_file({"w": np.zeros(4, np.float32)}, tmp_path / "m.safetensors")
    assert [e[:2] for e in events] == [("fsync", "file"), ("replace", True), ("fsync", "dir")]
    assert events[1][2].startswith(".m.safetensors" + TMP_MARKER)


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_file_mode_is_what_open_gives_under_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        with open(tmp_path / "plain", "wb"):
            pass
        (tmp_path / "m.safetensors").write_bytes(b"")
        os.chmod(tmp_path / "m.safetensors", 0o600)  # a previous file's mode is not inherited
        nnx_save.save_file({"w": np.zeros(1)}, tmp_path / "m.safetensors")
    finally:
        os.umask(old)
    mode = stat.S_IMODE(os.stat(tmp_path / "m.safetensors").st_mode)
    assert mode == stat.S_IMODE(os.stat(tmp_path / "plain").st_mode) == 0o666 & ~umask


# --- streaming -----------------------------------------------------------------------------------


def test_host_memory_above_the_arrays_stays_under_one_tensor(tmp_path):
    # Fortran-ordered arrays force a C-order copy of each tensor as it is written: the
    # writer must hold one such copy at a time, never the whole checkpoint.
    one = 1 << 20
    tree = {f"w{i}": np.asfortranarray(np.full((512, 512), i, np.float32)) for i in range(8)}
    tracemalloc.start()
    try:
        nnx_save.save_file(tree, tmp_path / "m.safetensors")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < one + (one // 2), peak
    assert (tmp_path / "m.safetensors").stat().st_size > 8 * one


def test_checksums_of_small_and_large_tensors_are_right(tmp_path):
    # Small tensors are hashed on the writing thread, large ones on the helper: both
    # must record the xxh3 of exactly the bytes on disk.
    import xxhash

    big = np.arange(_write.HASH_THREAD_MIN_BYTES // 4 + 3, dtype=np.float32)
    small = np.arange(10, dtype=np.int16)
    path = tmp_path / "m.safetensors"
    nnx_save.save_file({"big": big, "small": small}, path)
    h = nnx_save.read_header(path)
    import json

    recorded = json.loads(h.metadata["nnx_save.checksums"])
    assert recorded == {
        "big": xxhash.xxh3_64_hexdigest(big.tobytes()),
        "small": xxhash.xxh3_64_hexdigest(small.tobytes()),
    }
    nnx_save.load_file(path, verify=True)
    raw = bytearray(path.read_bytes())
    raw[h["small"].begin] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(nnx_save.ChecksumError, match=re.escape(f"{path}: tensor 'small': checksum mismatch")):
        nnx_save.load_file(path, verify=True)
