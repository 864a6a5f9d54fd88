"""A save never writes what its own load refuses: for every value and every layout, each
save path either refuses it, typed and before anything appears on disk, or every load
path returns it exactly. Generated: every dtype of the format x byte orders x odd bit
patterns (random bytes: NaN payloads, bool bytes other than 0/1, sub-byte codes'
spare bits) x 0-d, zero-size and non-contiguous views (strided, transposed, reversed,
Fortran order), as numpy and as jax arrays, through save_file (sync, async,
multi-file), save_pod, save_model and the store, read back by load_file (plain and
verified), safe_open, iter_tensors, load_model and the store's restore."""

from __future__ import annotations

import os

import fsspec
import jax
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import nnx_save
from nnx_save.checkpoint import OrbaxCheckpointStore
from nnx_save.format._dtypes import DTYPES

CODES = list(DTYPES)
LAYOUTS = ["contiguous", "0-d", "zero-size", "strided", "transposed", "reversed", "fortran"]


def _base_shape(layout: str) -> tuple[int, ...]:
    return {"0-d": (), "zero-size": (0, 3), "strided": (4, 6), "fortran": (3, 4)}.get(layout, (2, 4))


@st.composite
def values(draw, code: str):
    """An array of ``code``'s dtype: random bytes in a drawn layout and byte order."""
    dtype = DTYPES[code].numpy
    layout = draw(st.sampled_from(LAYOUTS))
    shape = _base_shape(layout)
    n = int(np.prod(shape))
    raw = draw(st.binary(min_size=n * dtype.itemsize, max_size=n * dtype.itemsize))
    base = np.frombuffer(raw, np.uint8).view(dtype).reshape(shape).copy()
    if dtype.itemsize > 1 and draw(st.booleans()):  # the same values, big-endian
        base = base.astype(dtype.newbyteorder(">"))
    array = {
        "strided": lambda a: a[::2, ::3],
        "transposed": lambda a: a.T,
        "reversed": lambda a: a[::-1, ::-1],
        "fortran": np.asfortranarray,
    }.get(layout, lambda a: a)(base)
    return array


def exactly(kept: np.ndarray, got) -> bool:
    """``got`` is ``kept``: the same shape, dtype (any byte order) and values, bit for bit
    (a sub-byte code's value is its low bits: ml_dtypes reads no other)."""
    got = np.asarray(got)
    native = np.array(kept, dtype=kept.dtype.newbyteorder("="), order="C")  # keeps 0-d
    if got.shape != native.shape or got.dtype != native.dtype:
        return False
    a, b = native.reshape(-1).view(np.uint8), np.array(got, order="C").reshape(-1).view(np.uint8)
    bits = DTYPES[_code(native.dtype)].bits
    if bits < 8:
        a, b = a & ((1 << bits) - 1), b & ((1 << bits) - 1)
    return bool(np.array_equal(a, b))


def _code(dtype: np.dtype) -> str:
    return next(c for c, row in DTYPES.items() if row.numpy == dtype)


class Holder(nnx.Module):
    def __init__(self, value) -> None:
        self.x = nnx.Variable(value)


def _file_loads(path: str, key: str = "x") -> list:
    """What each file reader returns for ``key``."""
    got = [nnx_save.load_file(path)[key], nnx_save.load_file(path, verify=True)[key]]
    with nnx_save.safe_open(path) as f:
        got.append(f.get_tensor(key))
    got.append(dict(nnx_save.iter_tensors(path))[key])
    return got


def _save_file(value, d):
    nnx_save.save_file({"x": value}, os.path.join(d, "a.safetensors"))
    return _file_loads(os.path.join(d, "a.safetensors"))


def _save_async(value, d):
    handle = nnx_save.save_file({"x": value}, os.path.join(d, "a.safetensors"), blocking=False)
    handle.result()
    return _file_loads(os.path.join(d, "a.safetensors"))


def _save_sharded(value, d):
    nnx_save.save_file({"x": value, "y": np.zeros(64, np.float32)}, d, max_shard_size=64)
    return _file_loads(d)


def _save_pod(value, d):
    nnx_save.save_pod({"x": value}, os.path.join(d, "pod"))
    return _file_loads(os.path.join(d, "pod"))


def _save_model(value, d):
    nnx_save.save_model(Holder(value), os.path.join(d, "m.safetensors"))
    model = Holder(np.zeros_like(np.asarray(value)))  # not the saved values: a no-op load fails
    nnx_save.load_model(model, os.path.join(d, "m.safetensors"), strict=True)
    return [*_file_loads(os.path.join(d, "m.safetensors")), model.x.get_value()]


def _save_remote(value, d):
    url = f"memory://{d}/a.safetensors"
    nnx_save.save_file({"x": value}, url)
    return _file_loads(url)


SAVES = {
    "save_file": _save_file,
    "async": _save_async,
    "multi-file": _save_sharded,
    "save_pod": _save_pod,
    "save_model": _save_model,
    "fsspec-url": _save_remote,
}


def _check(save, value, kept: np.ndarray, d: str) -> str:
    """Refused, typed, with nothing on disk; or every load returns ``kept`` exactly."""
    try:
        got = save(value, d)
    except nnx_save.NnxSaveError as e:
        left = [os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs]
        left += fsspec.filesystem("memory").find(d)
        assert left == [], f"refused ({type(e).__name__}: {e}) but left {left}"
        return "refused"
    for i, g in enumerate(got):
        assert exactly(kept, g), f"load path {i} returned {np.asarray(g)!r} for {kept!r}"
    return "returned"


def _jax_holds(dtype: np.dtype) -> bool:
    """jax holds ``dtype`` as it is (not float6, not 64-bit types without x64)."""
    try:
        return jax.device_put(np.zeros(1, dtype)).dtype == dtype.newbyteorder("=")
    except Exception:  # jax has no such dtype: a numpy value only
        return False


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("save", list(SAVES))
@settings(max_examples=6)
@given(data=st.data())
def test_every_save_path_refuses_or_round_trips(tmp_path_factory, save, code, data):
    array = data.draw(values(code))
    value, kept = array, array
    if data.draw(st.booleans()) and _jax_holds(array.dtype):
        value = jax.device_put(array)
        kept = np.asarray(value)  # what jax holds: the value handed to the save
    _check(SAVES[save], value, kept, str(tmp_path_factory.mktemp("s")))


@pytest.mark.parametrize("save", list(SAVES))
def test_a_bool_mask_of_other_bytes_is_refused_before_writing(tmp_path, save):
    """The case that was written, then refused by its own load (``ChecksumError``)."""
    mask = np.array([[0, 1], [2, 255]], np.uint8).view(np.bool_)
    for i, value in enumerate([mask, jax.device_put(mask)]):
        d = tmp_path / str(i)
        d.mkdir()
        with pytest.raises(nnx_save.errors.UnsupportedValueError, match=r"byte 2 at element \[1, 0\]"):
            SAVES[save](value, str(d))
        assert list(d.rglob("*")) == [] and fsspec.filesystem("memory").find(str(d)) == []


@settings(max_examples=12)
@given(code=st.sampled_from([c for c in CODES if DTYPES[c].bits >= 8]), data=st.data())
def test_the_store_refuses_or_restores(tmp_path_factory, code, data):
    array = data.draw(values(code))
    directory = tmp_path_factory.mktemp("store") / "ckpt"
    with OrbaxCheckpointStore(directory) as store:
        try:
            store.save(1, {"model": {"x": array}})
        except nnx_save.NnxSaveError:
            assert store.list_steps() == []
            return
        restored = store.restore(1)
    assert exactly(array, restored.items["model"]["x"]), (array, restored.items["model"]["x"])


def test_the_store_refuses_a_bool_mask_of_other_bytes(tmp_path):
    mask = np.array([[0, 1], [2, 255]], np.uint8).view(np.bool_)
    for i, value in enumerate([mask, jax.device_put(mask)]):
        with OrbaxCheckpointStore(tmp_path / str(i)) as store:
            with pytest.raises(nnx_save.errors.UnsupportedValueError, match=r"model/x: a bool array holding byte 2"):
                store.save(1, {"model": {"x": value}})
            assert store.list_steps() == []
