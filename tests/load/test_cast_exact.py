"""A cast on load is numpy's ``astype`` of the whole tensor, bit for bit, however the load
cuts it: for every pair of byte-aligned file dtypes that numpy casts, a tensor cut into many slabs, one
whose rows are each cut across, a small one gathered with others and a scalar, each into
poisoned templates (numpy, one device, the 8 simulated devices) so that a value left
unwritten shows. Float values include NaN, infinities, subnormals and signed zeros;
float to integer casts take values in the integer's range (numpy leaves the others
undefined, and says so)."""

from __future__ import annotations

import warnings

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

import nnx_save
from nnx_save.format._dtypes import DTYPES
from nnx_save.load import _boxed, _engine, _match

CODES = [code for code, row in DTYPES.items() if row.byte_aligned]
SHAPES = {"slabs": (64, 37), "rows": (3, 1504), "small": (7,), "scalar": ()}  # rows: 6 KiB of float32 each
MESH = jax.make_mesh((8,), ("x",))
BUDGET = 8 << 10  # under what the tensors of one layout hold in any file dtype: a whole read would show


def _finfo(dtype: np.dtype):
    return ml_dtypes.finfo(dtype) if dtype.kind == "V" or dtype.type.__module__ == "ml_dtypes" else np.finfo(dtype)


def _special(dtype: np.dtype, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` values of ``dtype``: its edges (NaN, infinities, subnormals, signed zeros,
    extremes) first, then random ones across its range."""
    if dtype == np.bool_:
        return rng.integers(0, 2, n).astype(np.bool_)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        edges = np.array([info.min, info.max, 0, 1, info.max - 1], dtype)
        return np.concatenate([edges, rng.integers(info.min, info.max, n, dtype, endpoint=True)])[:n]
    real = np.float32 if dtype == np.complex64 else dtype
    f = _finfo(np.dtype(real))
    edges = [np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, float(f.smallest_subnormal), -float(f.smallest_subnormal)]
    edges += [float(f.tiny), float(f.max), -float(f.max), float(f.eps), 1.0, -1.5]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a format without infinities or negatives makes NaN of them: still values
        values = np.concatenate([np.array(edges), rng.standard_normal(n) * float(f.max) ** rng.random(n)])[:n]
        out = values.astype(dtype)
    if dtype == np.complex64:
        out.imag = rng.standard_normal(n).astype(np.float32)
    return out


def _tame(dtype: np.dtype, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` small whole numbers (0 to 100) as ``dtype``: in range for every integer dtype."""
    values = rng.integers(0, 101, n)
    return (values % 2).astype(np.bool_) if dtype == np.bool_ else values.astype(dtype)


def _sharding(layout: str, shape: tuple[int, ...]):
    if layout == "one":
        return SingleDeviceSharding(jax.devices()[3])
    spec = [None] * len(shape)
    for axis in (0, len(shape) - 1):
        if shape and shape[axis] % 8 == 0:
            spec[axis] = "x"
            break
    return NamedSharding(MESH, PartitionSpec(*spec))


def _poisoned(dtype: np.dtype, shape: tuple[int, ...], layout: str):
    garbage = np.full(int(np.prod(shape)) * dtype.itemsize, 0xA5, np.uint8).view(dtype).reshape(shape)
    return garbage if layout == "host" else jax.device_put(garbage, _sharding(layout, shape))


def _float_to_int(src: np.dtype, dst: np.dtype) -> bool:
    return src.kind in "fcV" and dst.kind in "iu"


@pytest.mark.parametrize("code", CODES)
def test_a_cast_on_load_is_numpys_astype_bit_for_bit(tmp_path, monkeypatch, code):
    src = DTYPES[code].numpy
    rng = np.random.default_rng(len(code) * 1000 + CODES.index(code))
    values = {}
    for name, shape in SHAPES.items():
        n = int(np.prod(shape))
        values[f"special/{name}"] = _special(src, n, rng).reshape(shape)
        values[f"tame/{name}"] = _tame(src, n, rng).reshape(shape)
    layouts = ("host", "one", "eight")
    path = tmp_path / "t.safetensors"
    nnx_save.save_file({f"{layout}/{k}": v for layout in layouts for k, v in values.items()}, path)
    monkeypatch.setattr(_boxed, "UNIT_BYTES", 1024)  # slabs of a few rows, rows cut across, small ones gathered
    for other in CODES:
        dst = DTYPES[other].numpy
        if not np.can_cast(src, dst, "unsafe"):  # some ml_dtypes pairs have no cast (the load raises numpy's error)
            continue
        kind = "tame" if _float_to_int(src, dst) else "special"
        held = {"host": dst, "one": jax.dtypes.canonicalize_dtype(dst), "eight": jax.dtypes.canonicalize_dtype(dst)}
        template = {
            layout: {kind: {name: _poisoned(held[layout], shape, layout) for name, shape in SHAPES.items()}}
            for layout in layouts
        }
        with warnings.catch_warnings():
            # the loader's cast warning, and numpy's own (overflow to inf, the imaginary part dropped): asked for
            warnings.simplefilter("ignore")
            tree, report = nnx_save.load_file(
                path, template, allow_unexpected=["*"], max_inflight_bytes=BUDGET, return_report=True
            )
            assert report.io.max_inflight_bytes <= BUDGET, (code, other)  # cast in slabs, not read whole
            for layout in layouts:
                for name in SHAPES:
                    got = np.asarray(tree[layout][kind][name])
                    want = values[f"{kind}/{name}"].astype(held[layout])
                    assert got.dtype == want.dtype and got.shape == want.shape, (code, other, layout, name)
                    same = got.reshape(-1).view(np.uint8) == want.reshape(-1).view(np.uint8)
                    assert same.all(), (code, other, layout, name, got.ravel()[:8], want.ravel()[:8])


@pytest.mark.parametrize("layout", ["host", "eight"])
def test_under_verify_a_cast_cut_into_slabs_is_hashed_in_file_order(tmp_path, monkeypatch, layout):
    rng = np.random.default_rng(1)
    tensors = {"w": rng.standard_normal((64, 320), np.float32), "b": rng.standard_normal(320).astype(np.float32)}
    path = tmp_path / "w.safetensors"
    nnx_save.save_file(tensors, path)  # with checksums
    monkeypatch.setattr(_boxed, "UNIT_BYTES", 4096)  # w: 80 KiB in slabs of 3 rows; b: one gathered unit
    budget = 16 << 10
    template = {k: _poisoned(np.dtype(ml_dtypes.bfloat16), v.shape, layout) for k, v in tensors.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nnx_save.LossyCastWarning)
        tree, report = nnx_save.load_file(path, template, verify=True, max_inflight_bytes=budget, return_report=True)
    assert sorted(report.verified) == ["b", "w"] and report.unverified == []
    assert report.io.max_inflight_bytes <= budget  # in slabs, the hash read again a slab at a time
    for k, v in tensors.items():
        np.testing.assert_array_equal(np.asarray(tree[k]).view(np.uint16), v.astype(ml_dtypes.bfloat16).view(np.uint16))
    begin = nnx_save.read_header(path).tensors["w"].begin
    with open(path, "r+b") as f:  # the last slab's byte: the hash covers the whole tensor
        f.seek(begin + tensors["w"].nbytes - 3)
        f.write(b"\x7f")
    with warnings.catch_warnings(), pytest.raises(nnx_save.ChecksumError, match="tensor 'w': checksum mismatch"):
        warnings.simplefilter("ignore", nnx_save.LossyCastWarning)
        nnx_save.load_file(path, template, verify=True, max_inflight_bytes=budget)


UNCASTABLE = [
    (a, b)
    for a, ra in DTYPES.items()
    for b, rb in DTYPES.items()
    if ra.numpy is not None and rb.numpy is not None and not _match.castable(np.dtype(ra.numpy), np.dtype(rb.numpy))
]


def test_the_pairs_without_a_cast_include_the_known_one():  # the next test's list is not empty
    assert ("F8_E5M2", "F8_E8M0") in UNCASTABLE


@pytest.mark.parametrize(("stored", "wanted"), UNCASTABLE)
def test_a_pair_numpy_cannot_cast_is_refused_typed_before_any_read(tmp_path, monkeypatch, stored, wanted):
    src, dst = np.dtype(DTYPES[stored].numpy), np.dtype(DTYPES[wanted].numpy)
    path = tmp_path / "w.safetensors"
    nnx_save.save_file({"w": np.zeros((4, 8), src)}, path)

    def no_read(*args, **kwargs):
        raise AssertionError("read before the cast was refused")

    for module in (_engine, _boxed):
        monkeypatch.setattr(module, "execute", no_read)
    with pytest.raises(nnx_save.DtypeMismatchError, match=rf"'w'.*{src}.*{dst}.*nothing was read"):
        nnx_save.load_file(path, {"w": np.ones((4, 8), dst)})
