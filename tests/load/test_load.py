"""load_file end to end on 8 simulated CPU devices (tests/conftest.py).

Every sharded load is compared with ``jax.device_put(full_array, sharding)``: same
sharding, every shard on the same device with the same index and the same bytes.
Sources: one file, an HF index (hand-written and from ``transformers``
``save_pretrained``), a directory without index, a list of files. An instrumented
reader proves the bytes read equal the plan and the in-flight bytes never exceed the
budget, down to a budget smaller than one tensor.
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
import time

import jax
import numpy as np
import pytest
from _arrays import every_kind
from _errors import raises_check
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import nnx_save
from nnx_save.bridges import _pytree
from nnx_save.format._units import human_bytes
from nnx_save.io import _reader
from nnx_save.load import _assemble

DEV = jax.devices()
MESH8 = Mesh(np.array(DEV), ("x",))
MESH24 = Mesh(np.array(DEV).reshape(2, 4), ("x", "y"))
MESH3 = Mesh(np.array(DEV[5:8]), ("x",))  # 3 devices, not from 0
MESH32 = Mesh(np.array([DEV[i] for i in (6, 1, 4, 3, 0, 5)]).reshape(3, 2), ("x", "y"))  # permuted


FULL = every_kind(7)


def _spec(layout: str, ndim: int) -> tuple[Mesh, P]:
    if ndim == 0 or layout == "replicated":
        return MESH8, P()
    if layout == "dim0":
        return MESH8, P("x")
    if layout == "last":
        return MESH8, P(*([None] * (ndim - 1)), "x")
    if layout == "mesh2d":  # both mesh axes, on two dimensions (or both on the one)
        return MESH24, P("x", "y") if ndim >= 2 else P(("x", "y"))
    if layout == "partial":  # split over y, replicated over x
        return MESH24, P(*([None] * (ndim - 1)), "y")
    if layout == "three":
        return MESH3, P("x")
    if layout == "six_permuted":
        return MESH32, P("y", "x") if ndim >= 2 else P(("x", "y"))
    raise ValueError(layout)


LAYOUTS = ["dim0", "last", "mesh2d", "replicated", "partial", "three", "six_permuted"]


def _abstract(layout: str, full: dict[str, np.ndarray] = FULL) -> dict[str, jax.ShapeDtypeStruct]:
    return {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(*_spec(layout, v.ndim)))
        for k, v in full.items()
    }


def _same_bits(x: np.ndarray, y: np.ndarray) -> bool:
    x, y = np.ascontiguousarray(x), np.ascontiguousarray(y)
    return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


def _assert_like_device_put(loaded, full: np.ndarray, sharding) -> None:
    expected = jax.device_put(full, sharding)
    assert loaded.sharding == sharding and loaded.shape == full.shape and loaded.dtype == full.dtype
    got = sorted(loaded.addressable_shards, key=lambda s: s.device.id)
    want = sorted(expected.addressable_shards, key=lambda s: s.device.id)
    assert [s.device for s in got] == [s.device for s in want]
    for g, w in zip(got, want, strict=False):
        assert g.index == w.index
        assert _same_bits(np.asarray(g.data), np.asarray(w.data)), (g.device, g.index)
    assert _same_bits(np.asarray(loaded), full)


@pytest.fixture(scope="module")
def one_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("one") / "model.safetensors"
    nnx_save.save_file(FULL, path)
    return path


def _write_split(directory, index: bool = True) -> list:
    """FULL over three files (and an HF index naming each tensor's file)."""
    groups = [["a", "b", "c"], ["d", "e", "f", "s"], ["g", "m", "z"]]
    paths, weight_map = [], {}
    for i, names in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        nnx_save.save_file({k: FULL[k] for k in names}, directory / name)
        paths.append(directory / name)
        weight_map.update(dict.fromkeys(names, name))
    if index:
        (directory / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map})
        )
    return paths


@pytest.fixture(scope="module")
def split_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("split")
    _write_split(directory)
    return directory


# ----------------------------------------------------------------------------- equal to device_put


@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_file_loads_like_device_put(one_file, layout):
    abstract = _abstract(layout)
    out, report = nnx_save.load_file(one_file, abstract, return_report=True)
    assert sorted(out) == sorted(FULL) and report.clean
    for k, v in out.items():
        _assert_like_device_put(v, FULL[k], abstract[k].sharding)
    data = sum(v.nbytes for v in FULL.values())
    assert report.io.bytes_needed == report.io.bytes_read == data  # replicas are read once


@pytest.mark.parametrize("layout", ["dim0", "last"])
def test_without_jax_internal_batched_put_the_public_path_loads_the_same(one_file, layout, monkeypatch):
    # pxla.batched_device_put is private: when a jax release drops it, the public
    # device_put + make_array_from_single_device_arrays path must give the same arrays
    monkeypatch.setattr(_assemble, "batched_put", lambda: None)
    abstract = _abstract(layout)
    out = nnx_save.load_file(one_file, abstract)
    for k, v in out.items():
        _assert_like_device_put(v, FULL[k], abstract[k].sharding)


@pytest.mark.parametrize("source", ["index", "directory", "list"])
@pytest.mark.parametrize("layout", ["dim0", "last", "mesh2d"])
def test_multi_file_sources_load_like_device_put(tmp_path, source, layout):
    paths = _write_split(tmp_path, index=source == "index")
    src = {"index": tmp_path, "directory": tmp_path, "list": [str(p) for p in paths]}[source]
    abstract = _abstract(layout)
    out, report = nnx_save.load_file(src, abstract, return_report=True)
    for k, v in out.items():
        _assert_like_device_put(v, FULL[k], abstract[k].sharding)
    assert report.io.files == 3 and set(report.io.over_read_by_file) == {str(p) for p in paths}


def test_a_file_written_by_the_reference_writer_loads(tmp_path):
    from safetensors.numpy import save_file

    full = {k: FULL[k] for k in ("a", "b", "e", "g")}
    save_file(full, str(tmp_path / "ref.safetensors"))
    abstract = _abstract("last", full)
    out = nnx_save.load_file(tmp_path / "ref.safetensors", abstract)
    for k, v in out.items():
        _assert_like_device_put(v, full[k], abstract[k].sharding)


@pytest.mark.slow
def test_transformers_save_pretrained_index_loads_sharded(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    model.save_pretrained(tmp_path, max_shard_size="60KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 2 and (tmp_path / "model.safetensors.index.json").exists()
    header = nnx_save.read_header(tmp_path)
    state = {k: v.detach().numpy() for k, v in model.state_dict().items() if k in header.tensors}
    assert set(state) == set(header.tensors)
    for layout in ("dim0", "last"):
        abstract = _abstract(layout, state)
        out, report = nnx_save.load_file(tmp_path, abstract, strict=True, return_report=True)
        assert report.io.files == len(header.files) and report.clean
        for k, v in out.items():
            _assert_like_device_put(v, state[k], abstract[k].sharding)


def test_concrete_arrays_as_abstract_adopt_their_sharding(one_file):
    shardings = {k: NamedSharding(*_spec("mesh2d", v.ndim)) for k, v in FULL.items()}
    abstract = {k: jax.device_put(np.zeros_like(v), shardings[k]) for k, v in FULL.items()}
    out = nnx_save.load_file(one_file, abstract)
    for k, v in out.items():
        _assert_like_device_put(v, FULL[k], shardings[k])
    assert not np.asarray(abstract["a"]).any()  # the caller's arrays are untouched


def test_numpy_leaves_load_as_numpy_and_no_abstract_gives_a_flat_dict(one_file):
    out = nnx_save.load_file(one_file, {"a": np.zeros((48, 24), np.float32), "b": FULL["b"]}, allow_unexpected=["*"])
    assert isinstance(out["a"], np.ndarray) and _same_bits(out["a"], FULL["a"]) and _same_bits(out["b"], FULL["b"])
    flat = nnx_save.load_file(one_file)
    assert sorted(flat) == sorted(FULL) and all(_same_bits(flat[k], FULL[k]) for k in FULL)


def test_loaded_shards_are_aligned_and_replicas_share_one_host_buffer(one_file):
    out = nnx_save.load_file(one_file, _abstract("replicated"))
    pointers = {s.data.unsafe_buffer_pointer() for s in out["a"].addressable_shards}
    assert len(pointers) == 1 and pointers.pop() % 64 == 0
    out = nnx_save.load_file(one_file, _abstract("dim0"))
    assert all(s.data.unsafe_buffer_pointer() % 64 == 0 for s in out["d"].addressable_shards)


# ----------------------------------------------------------------------------- mismatches


def test_shape_mismatch_names_both_shapes(one_file):
    abstract = _abstract("dim0")
    abstract["a"] = jax.ShapeDtypeStruct((24, 48), np.float32, sharding=abstract["a"].sharding)
    line = "a: shape (24, 48) in the model, (48, 24) in the file"
    with pytest.raises(nnx_save.LoadError, match=re.escape(line)):
        nnx_save.load_file(one_file, abstract, strict=True)
    # Without strict: one ShapeMismatchError before any read (no LoadWarning first, no generic error after).
    with pytest.raises(
        nnx_save.ShapeMismatchError,
        match=re.escape(
            f"{one_file}: 1 shape mismatch(es), nothing was read:\n  {line}\nTo keep the abstract tree's values "
            "there, give those leaves as arrays and pass allow_shape_mismatch=['a']"
        ),
    ):
        nnx_save.load_file(one_file, abstract)


def test_allow_shape_mismatch_keeps_the_given_values(one_file):
    abstract = {k: np.zeros(v.shape, v.dtype) for k, v in FULL.items()}
    kept = np.full((24, 48), 7.0, np.float32)
    abstract["a"] = kept
    out, report = nnx_save.load_file(one_file, abstract, allow_shape_mismatch=["a"], return_report=True, strict=True)
    assert out["a"] is kept and report.clean and "a" not in report.loaded
    assert [(m.path, m.model_shape, m.file_shape) for m in report.allowed_shape_mismatches] == [
        ("a", (24, 48), (48, 24))
    ]
    assert all(_same_bits(out[k], FULL[k]) for k in FULL if k != "a")
    assert "(allowed shape mismatches, the model's values kept: a)" in str(report)
    # allowed, but a ShapeDtypeStruct has no value to keep: refused by name before any read
    abstract["a"] = jax.ShapeDtypeStruct(
        (24, 48), np.float32, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])
    )
    with pytest.raises(
        nnx_save.ShapeMismatchError,
        match=re.escape(
            "a: shape (24, 48) in the model, (48, 24) in the file (allowed, but the leaf is a "
            "ShapeDtypeStruct with no value to keep)"
        ),
    ):
        nnx_save.load_file(one_file, abstract, allow_shape_mismatch=["a"])


def test_strict_refusal_names_the_options_that_would_accept_it(one_file):
    abstract = {k: np.zeros(v.shape, v.dtype) for k, v in FULL.items() if k != "b"}
    abstract["a"] = np.zeros((24, 48), np.float32)
    abstract["new"] = np.zeros(3, np.float32)
    with pytest.raises(nnx_save.LoadError) as raised:
        nnx_save.load_file(one_file, abstract, strict=True)
    assert str(raised.value).endswith(
        "To accept them, pass (patterns: glob or regex):\n"
        "  allow_missing=['new'] (those paths keep the model's values)\n"
        "  allow_unexpected=['b'] (those file tensors are not read)\n"
        "  allow_shape_mismatch=['a'] (those paths keep the model's values)"
    )


def test_dtype_cast_is_reported_and_refused_under_strict(one_file, monkeypatch):
    abstract = _abstract("last")
    abstract["c"] = jax.ShapeDtypeStruct((24, 48), np.float32, sharding=abstract["c"].sharding)
    line = "c: float16 in the file -> float32 in the model"
    with pytest.warns(nnx_save.LoadWarning, match=re.escape(line)):
        out, report = nnx_save.load_file(one_file, abstract, return_report=True)
    assert [str(c) for c in report.dtype_casts] == [line]
    _assert_like_device_put(out["c"], FULL["c"].astype(np.float32), abstract["c"].sharding)
    log = _instrument(monkeypatch)
    with pytest.raises(nnx_save.LoadError, match=re.escape(line)):
        nnx_save.load_file(one_file, abstract, strict=True)
    assert log.calls == []  # refused before reading a byte


def test_lossy_and_safe_casts_are_reported_apart(one_file):
    abstract = {k: np.zeros(v.shape, v.dtype) for k, v in FULL.items()}
    a_dtype = FULL["a"].dtype
    abstract["a"] = np.zeros(FULL["a"].shape, np.float64 if a_dtype == np.float32 else np.float32)
    abstract["b"] = np.zeros(FULL["b"].shape, np.int8)
    with pytest.warns(nnx_save.LoadWarning) as caught:
        _, report = nnx_save.load_file(one_file, abstract, return_report=True)
    assert [c.path for c in report.lossy_casts] == ["b"]
    assert {c.path: c.lossy for c in report.dtype_casts} == {"a": False, "b": True}
    (w,) = caught
    assert w.category is nnx_save.LossyCastWarning
    text = str(w.message)
    assert text.startswith("1 LOSSY dtype cast(s)")
    assert f"\n  LOSSY dtype: b: {FULL['b'].dtype} in the file -> int8 in the model\n  dtype: a: " in text


def test_64_bit_tensors_with_x64_off_are_a_reported_cast(tmp_path):
    assert not jax.config.jax_enable_x64
    full = {"i": np.arange(-12, 12, dtype=np.int64).reshape(3, 8), "f": np.linspace(0, 1, 16)}
    nnx_save.save_file(full, tmp_path / "x64.safetensors")
    abstract = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(*_spec("last", v.ndim)))
        for k, v in full.items()
    }
    lines = [
        "f: float64 in the file -> float32 (the model's float64: jax_enable_x64 is off) in the model",
        "i: int64 in the file -> int32 (the model's int64: jax_enable_x64 is off) in the model",
    ]
    # narrowing 64-bit values to 32 bits can change them: a LossyCastWarning, its lines apart
    loud = "2 LOSSY dtype cast(s): the loaded values differ from the file's"
    with pytest.warns(
        nnx_save.LossyCastWarning,
        match="(?s)" + re.escape(loud) + ".*" + re.escape(lines[0] + "\n  LOSSY dtype: " + lines[1]),
    ):
        out = nnx_save.load_file(tmp_path / "x64.safetensors", abstract)
    for k, v in out.items():
        _assert_like_device_put(v, full[k].astype(jax.dtypes.canonicalize_dtype(v.dtype)), abstract[k].sharding)
    with pytest.raises(nnx_save.LoadError, match=re.escape(lines[1])):
        nnx_save.load_file(tmp_path / "x64.safetensors", abstract, strict=True)


def test_missing_and_unused_are_reported(one_file):
    abstract = _abstract("dim0")
    abstract["ghost"] = jax.ShapeDtypeStruct((8,), np.float32, sharding=NamedSharding(MESH8, P("x")))
    del abstract["b"]
    with pytest.raises(nnx_save.LoadError, match=re.escape("missing: ghost\n  unexpected: b")):
        nnx_save.load_file(one_file, abstract, strict=True)


def test_index_naming_an_absent_tensor_is_refused(tmp_path):
    _write_split(tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    body = json.loads(index.read_text())
    body["weight_map"]["ghost"] = "model-00001-of-00003.safetensors"
    index.write_text(json.dumps(body))
    with raises_check(
        "index",
        match=re.escape("names tensor 'ghost' in model-00001-of-00003.safetensors, which does not hold it"),
    ):
        nnx_save.load_file(tmp_path, _abstract("dim0"))


@pytest.mark.parametrize("with_index", [True, False])
def test_a_tensor_in_two_files_is_refused(tmp_path, with_index):
    paths = _write_split(tmp_path, index=with_index)
    nnx_save.save_file({"a": FULL["a"], "x": FULL["b"]}, tmp_path / "model-00004-of-00003.safetensors")
    if with_index:
        index = tmp_path / "model.safetensors.index.json"
        body = json.loads(index.read_text())
        body["weight_map"]["x"] = "model-00004-of-00003.safetensors"
        index.write_text(json.dumps(body))
    with raises_check(
        "index",
        match=re.escape("tensor 'a' appears in two files: ")
        + f".*{paths[0].name} and .*model-00004-of-00003.safetensors",
    ):
        nnx_save.load_file(tmp_path, _abstract("dim0"))


def test_a_sharding_jax_cannot_apply_is_refused_before_reading(one_file, monkeypatch):
    abstract = _abstract("dim0")
    abstract["a"] = jax.ShapeDtypeStruct(
        (48, 24), np.float32, sharding=NamedSharding(Mesh(np.array(DEV[:5]), ("x",)), P("x"))
    )
    log = _instrument(monkeypatch)
    with pytest.raises(nnx_save.ShardingError, match=r"^a: sharding NamedSharding\(.*\) cannot hold shape \(48, 24\)"):
        nnx_save.load_file(one_file, abstract)
    assert log.calls == []


# ----------------------------------------------------------------------------- bytes and budget


class _Log:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []  # (file, offset, bytes)
        self.inflight = self.peak = 0
        self.lock = threading.Lock()
        # Set once two reads are in flight together. With ``hold_first``, the first read
        # waits for it (bounded), so "the engine reads concurrently" is shown by the
        # engine's own threads meeting, not by a sleep outlasting thread start-up under load.
        self.overlapped = threading.Event()
        self.hold_first = False

    def enter(self, file: str, offset: int, n: int) -> None:
        with self.lock:
            self.calls.append((file, offset, n))
            first = len(self.calls) == 1
            self.inflight += n
            self.peak = max(self.peak, self.inflight)
            if self.inflight > n:
                self.overlapped.set()
        if first and self.hold_first:
            self.overlapped.wait(timeout=30)  # a serial engine never sets it: the peak stays one read

    def leave(self, n: int) -> None:
        with self.lock:
            self.inflight -= n


class _Reader:
    """A LocalReader that logs each read and how many bytes are being read at once."""

    def __init__(self, path: str, log: _Log, table: bool, delay: float) -> None:
        self.inner, self.log, self.delay = _reader.LocalReader(path), log, delay
        self.path, self.table = path, table

    @property
    def requests(self) -> int:
        return self.inner.requests

    def close(self) -> None:
        self.inner.close()

    def can_read_tables(self) -> bool:
        return self.table and self.inner.can_read_tables()

    def can_read_runs(self) -> bool:
        return False  # batches of raw-address preads are the local reader's own

    def _timed(self, n: int, offset: int, read) -> None:
        self.log.enter(self.path, offset, n)
        try:
            time.sleep(self.delay)  # widen the window in which reads overlap
            read()
        finally:
            self.log.leave(n)

    def readv(self, buffers, offset):
        self._timed(sum(len(b) for b in buffers), offset, lambda: self.inner.readv(buffers, offset))

    def readv_table(self, table, offset):
        self._timed(int(table[:, 1].sum()), offset, lambda: self.inner.readv_table(table, offset))


def _instrument(monkeypatch, table: bool = True, delay: float = 0.0) -> _Log:
    log = _Log()
    monkeypatch.setattr(_pytree, "reader_factory", lambda header: lambda f: _Reader(f, log, table, delay))
    return log


@pytest.mark.parametrize("table", [True, False], ids=["preadv-table", "memoryview"])
@pytest.mark.parametrize("budget", [3000, 20_000, 1 << 30])
def test_bytes_read_equal_the_plan_and_in_flight_stays_under_the_budget(split_dir, monkeypatch, table, budget):
    assert FULL["a"].nbytes > 3000  # the smallest budget is smaller than one tensor
    log = _instrument(monkeypatch, table=table, delay=0.002)
    log.hold_first = budget > 1e6  # under a smaller budget the first read may rightly run alone
    abstract = _abstract("last")
    out, report = nnx_save.load_file(
        split_dir, abstract, max_inflight_bytes=budget, read_chunk_bytes=8192, num_threads=4, return_report=True
    )
    for k, v in out.items():
        _assert_like_device_put(v, FULL[k], abstract[k].sharding)
    assert sum(n for _, _, n in log.calls) == report.io.bytes_read == report.io.bytes_needed
    assert report.io.requests >= len(log.calls) > 0
    assert log.peak <= budget and report.io.max_inflight_bytes <= budget
    assert max(n for _, _, n in log.calls) <= min(budget, 8192)
    if budget > 1e6:
        assert log.peak > 8192  # chunks really were read concurrently


def test_bytes_read_through_gaps_are_counted_and_within_the_ratio(tmp_path, monkeypatch):
    # two wanted tensors of 5120 bytes around an unused one: the gap is over a page
    full = {name: np.full(1280, i, np.float32) for i, name in enumerate(["k0", "k1", "k2"])}
    nnx_save.save_file(full, tmp_path / "t.safetensors")
    abstract = {
        k: jax.ShapeDtypeStruct((1280,), np.float32, sharding=NamedSharding(MESH8, P("x"))) for k in ("k0", "k2")
    }
    log = _instrument(monkeypatch)
    for ratio, reads, read in [(1.0, 2, 10_240), (1.49, 2, 10_240), (1.5, 1, 15_360), (None, 2, 10_240)]:
        log.calls.clear()
        out, report = nnx_save.load_file(
            tmp_path / "t.safetensors", abstract, max_over_read_ratio=ratio, allow_unexpected=["k1"], return_report=True
        )
        for k, v in out.items():
            _assert_like_device_put(v, full[k], abstract[k].sharding)
        assert len(log.calls) == reads and sum(n for *_, n in log.calls) == report.io.bytes_read == read


# ----------------------------------------------------------------------------- over-read warning


def _sparse_file(path, keep: int) -> dict[str, np.ndarray]:
    """``keep`` one-element tensors, each followed by an unused 4 KiB one."""
    full = {}
    for i in range(keep):
        full[f"{path.stem}.{i:04d}.keep"] = np.array([i], np.float32)  # same rank: laid out by name
        full[f"{path.stem}.{i:04d}.skip"] = np.zeros(1024, np.float32)
    nnx_save.save_file(full, path)
    return {k: v for k, v in full.items() if k.endswith(".keep")}


def test_automatic_ratio_over_read_warns_once_naming_files_ratio_and_tensors(tmp_path):
    kept = [_sparse_file(tmp_path / f"{n}.safetensors", 1100) for n in ("one", "two")]
    abstract = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(MESH8, P()))
        for part in kept
        for k, v in part.items()
    }
    files = [str(tmp_path / "one.safetensors"), str(tmp_path / "two.safetensors")]
    with pytest.warns(nnx_save.OverReadWarning) as caught:
        out, report = nnx_save.load_file(files, abstract, allow_unexpected=["*.skip"], return_report=True)
    assert len(caught) == 1
    message = str(caught[0].message)
    for f in files:
        ratio = report.io.over_read_by_file[f]
        assert ratio > 900 and f"{f}: read" in message and f"over-read {ratio:.2f}x" in message
    assert "the automatic merge cap for this file was" in message and "one.0000.skip (4.0 KiB)" in message
    assert re.search(r"two.\d{4}.skip \(4\.0 KiB\) and 1094 more", message)  # the last one is not read
    assert all(_same_bits(np.asarray(out[k]), v) for part in kept for k, v in part.items())
    # an explicit ratio is the caller's choice: exact reads and no warning
    out, report = nnx_save.load_file(
        files, abstract, allow_unexpected=["*.skip"], max_over_read_ratio=1.0, return_report=True
    )
    assert report.io.bytes_read == report.io.bytes_needed == 2 * 1100 * 4


# ----------------------------------------------------------------------------- statistics


def test_statistics_are_on_the_report_and_logged_at_debug(one_file, caplog):
    with caplog.at_level(logging.DEBUG, logger="nnx_save"):
        _, report = nnx_save.load_file(one_file, _abstract("mesh2d"), return_report=True)
    io = report.io
    data = sum(v.nbytes for v in FULL.values())
    assert (io.files, io.bytes_read, io.bytes_needed) == (1, data, data) and io.requests >= 1
    assert io.over_read_by_file == {str(one_file): 1.0}
    assert min(io.plan_seconds, io.read_seconds, io.assemble_seconds) >= 0
    text = caplog.text
    assert f"loaded {len(FULL)} tensors from {one_file}" in text and str(io) in text
    assert f"{one_file}: FilePlan(runs=" in text and "plan " in text


def test_planning_cost_is_vectorised(tmp_path):
    """A last-dim split of a (20000, 64) tensor is 160K runs: far under a second."""
    full = {"t": np.ones((20000, 64), np.float32)}
    nnx_save.save_file(full, tmp_path / "t.safetensors")
    abstract = {"t": jax.ShapeDtypeStruct((20000, 64), np.float32, sharding=NamedSharding(MESH8, P(None, "x")))}
    _, report = nnx_save.load_file(tmp_path / "t.safetensors", abstract, return_report=True)
    assert report.io.plan_seconds < 1.0 and report.io.requests < 1000
    assert math.isclose(report.io.over_read, 1.0)


def test_the_garbage_collector_is_left_as_it_was(one_file):
    import gc

    assert gc.isenabled()
    try:
        nnx_save.load_file(one_file, _abstract("dim0"))
        assert gc.isenabled()
        gc.disable()
        nnx_save.load_file(one_file, _abstract("dim0"))
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(nnx_save.ShardingError):  # and after a failure
        bad = {
            "a": jax.ShapeDtypeStruct(
                (48, 24), np.float32, sharding=NamedSharding(Mesh(np.array(DEV[:5]), ("x",)), P("x"))
            )
        }
        nnx_save.load_file(one_file, bad, allow_unexpected=["*"])
    assert gc.isenabled()


def test_an_abstract_tree_without_shardings_on_several_devices_is_warned(one_file):
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in FULL.items() if k in "abc"}
    with pytest.warns(
        nnx_save.SingleDeviceWarning,
        match=re.escape(
            "3 arrays have no sharding (a, b, c): all of them are loaded onto cpu:0, although this "
            "process has 8 devices. Give each jax.ShapeDtypeStruct a sharding"
        ),
    ) as caught:
        out = nnx_save.load_file(one_file, abstract, allow_unexpected=["*"])
    assert len(caught) == 1 and caught[0].filename == __file__
    assert {d.id for d in out["a"].devices()} == {0}


def test_io_stats_add_counts_every_field():
    from dataclasses import fields

    from nnx_save import IOStats

    one = IOStats(
        files=1, bytes_read=10, bytes_needed=8, bytes_received=5, requests=2, retries=1, read_whole=["a"],
        plan_seconds=0.5, read_seconds=1.0, assemble_seconds=0.25, max_inflight_bytes=7, over_read_by_file={"f": 1.25},
    )  # fmt: skip
    total = IOStats(files=1, bytes_read=1, bytes_received=1, read_whole=["b"], max_inflight_bytes=9)
    total.add(one)
    counts = (total.bytes_read, total.bytes_needed, total.bytes_received, total.requests, total.retries)
    assert counts == (11, 8, 6, 2, 1)
    assert (total.plan_seconds, total.read_seconds, total.assemble_seconds) == (0.5, 1.0, 0.25)
    kept = (total.read_whole, total.max_inflight_bytes, total.over_read_by_file, total.files)
    assert kept == (["b", "a"], 9, {"f": 1.25}, 1)
    assert {f.name for f in fields(IOStats)} == {
        "files", "bytes_read", "bytes_needed", "bytes_received", "requests", "retries", "read_whole",
        "plan_seconds", "read_seconds", "assemble_seconds", "max_inflight_bytes", "over_read_by_file",
    }, "a new IOStats field: decide how add() combines it"  # fmt: skip


def _gapped_file(path, keep: int, skip: int) -> dict[str, np.ndarray]:
    """``keep`` one-element tensors, each followed by an unused one of ``skip`` float32."""
    full = {}
    for i in range(keep):
        full[f"t.{i:04d}.keep"] = np.array([i], np.float32)  # same rank: laid out by name
        full[f"t.{i:04d}.skip"] = np.zeros(skip, np.float32)
    nnx_save.save_file(full, path)
    return {k: v for k, v in full.items() if k.endswith(".keep")}


@pytest.mark.parametrize("skip", [1024, 1000])
def test_over_read_advice_is_true_for_the_load_at_hand(tmp_path, skip):
    """Advice of "max_over_read_ratio=1.0 to read only the needed bytes" would be false
    where that reads the same bytes (gaps under a page: 4000-byte tensors skipped between
    the needed ones) and only silences the warning; the advice states what ratio 1.0
    reads, and that number is what it reads."""
    path = tmp_path / "gapped.safetensors"
    kept = _gapped_file(path, 1100, skip)
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(MESH8, P())) for k, v in kept.items()}
    with pytest.warns(nnx_save.OverReadWarning) as caught:
        _, auto = nnx_save.load_file(path, abstract, allow_unexpected=["*.skip"], return_report=True)
    _, exact = nnx_save.load_file(
        path, abstract, allow_unexpected=["*.skip"], max_over_read_ratio=1.0, return_report=True
    )
    message = str(caught[0].message)
    floor, read = human_bytes(exact.io.bytes_read), human_bytes(auto.io.bytes_read)
    assert f"max_over_read_ratio=1.0 would read {floor}" in message
    if skip == 1024:  # page-sized gaps: ratio 1.0 skips them
        assert exact.io.bytes_read == exact.io.bytes_needed == 1100 * 4
        assert f"Pass max_over_read_ratio=1.0 to read {floor} instead of {read}" in message
    else:  # sub-page gaps: every ratio reads them
        assert exact.io.bytes_read == auto.io.bytes_read > 900 * exact.io.bytes_needed
        assert (
            f"max_over_read_ratio=1.0 would read the same {read}: most of what is read through are gaps under 4 KiB"
            in message
        )
        assert "Pass max_over_read_ratio" not in message


def test_the_held_dtype_follows_jax_enable_x64_when_it_changes(tmp_path):
    """The dtype a device array holds is cached per tensor dtype: the cache
    follows ``jax_enable_x64`` when it is turned on and off between loads."""
    value = np.arange(-3, 5, dtype=np.int64) * (1 << 40)
    nnx_save.save_file({"i": value}, tmp_path / "i.safetensors")
    abstract = {
        "i": jax.ShapeDtypeStruct(value.shape, np.int64, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    }
    with pytest.warns(nnx_save.LossyCastWarning):
        narrow = nnx_save.load_file(tmp_path / "i.safetensors", abstract)["i"]
    assert narrow.dtype == np.int32
    with jax.enable_x64(True):
        wide = nnx_save.load_file(tmp_path / "i.safetensors", abstract)["i"]
        assert wide.dtype == np.int64 and _same_bits(np.asarray(wide), value)
    with pytest.warns(nnx_save.LossyCastWarning):
        again = nnx_save.load_file(tmp_path / "i.safetensors", abstract)["i"]
    assert again.dtype == np.int32 and _same_bits(np.asarray(again), value.astype(np.int32))


def test_many_small_tensors_land_exact_on_their_own_devices(tmp_path):
    """The per-tensor fast paths (one device: no device-order map; cached groups and
    abstract values) against jax.device_put of the same values: every small tensor on
    the device its sharding names, a replicated and a split one among them."""
    devices = jax.devices()
    full = {f"t{i}": np.arange(32, dtype=np.float32).reshape(8, 4) * i + i for i in range(64)}
    nnx_save.save_file(full, tmp_path / "small.safetensors")
    mesh = Mesh(np.array(devices), ("x",))
    shardings = {k: jax.sharding.SingleDeviceSharding(devices[i % len(devices)]) for i, k in enumerate(full)}
    shardings["t1"], shardings["t2"] = NamedSharding(mesh, P()), NamedSharding(mesh, P("x"))
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k]) for k, v in full.items()}
    out = nnx_save.load_file(tmp_path / "small.safetensors", abstract)
    for k, v in full.items():
        _assert_like_device_put(out[k], v, shardings[k])


_BOOL_WAYS = ("load_file", "one_device", "sharded_stream", "sharded", "safe_open", "get_slice")


@settings(max_examples=25, deadline=None)
@given(
    shape=st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple),
    where=st.floats(0, 1, exclude_max=True),
    byte=st.integers(2, 255),
    way=st.sampled_from(_BOOL_WAYS),
)
def test_a_bool_byte_other_than_0_or_1_is_refused_naming_the_key_and_offset(tmp_path_factory, shape, where, byte, way):
    """A BOOL byte 2 loaded as a numpy bool holding 2 (neither True nor False)."""
    path = tmp_path_factory.mktemp("bool") / "m.safetensors"
    value = np.zeros(shape, np.bool_)
    nnx_save.save_file({"mask": value}, path)
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    flat = int(where * value.size)
    offset = 8 + n + flat
    raw[offset] = byte
    path.write_bytes(bytes(raw))
    at = list(np.unravel_index(flat, shape)) if shape else []
    message = f"{path}: tensor 'mask' (BOOL): element {[int(i) for i in at]} (byte {offset} of the file) is {byte}"
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    sharded = {"mask": jax.ShapeDtypeStruct(shape, np.bool_, sharding=NamedSharding(mesh, P()))}
    with pytest.raises(nnx_save.errors.ChecksumError, match=re.escape(message)):
        if way == "load_file":
            nnx_save.load_file(path)
        elif way == "one_device":  # placed straight from its adopted buffer
            one = jax.sharding.SingleDeviceSharding(jax.devices()[1])
            nnx_save.load_file(path, {"mask": jax.ShapeDtypeStruct(shape, np.bool_, sharding=one)})
        elif way in ("sharded", "sharded_stream"):
            nnx_save.load_file(path, sharded, stream=way == "sharded_stream")
        else:
            with nnx_save.safe_open(path, "numpy") as f:
                f.get_tensor("mask") if way == "safe_open" else f.get_slice("mask")[:]


def test_one_device_targets_are_placed_from_their_adopted_buffers(tmp_path, monkeypatch):
    """A whole tensor on one device skips assemble; its value is still the
    file's, in jax's dtype for the target (a 64-bit target holds the file's 32 bits)."""
    full = {"f": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4), "i": np.arange(-3, 5, dtype=np.int32)}
    nnx_save.save_file(full, tmp_path / "one.safetensors")
    wide = {"f": np.float64, "i": np.int64}  # jax_enable_x64 off: held as the file's float32 / int32
    sharding = jax.sharding.SingleDeviceSharding(DEV[3])
    abstract = {k: jax.ShapeDtypeStruct(v.shape, wide[k], sharding=sharding) for k, v in full.items()}

    def general(*args):
        raise AssertionError("assemble ran for a one-device target")

    monkeypatch.setattr("nnx_save.load._engine.assemble", general)
    out = nnx_save.load_file(tmp_path / "one.safetensors", abstract)
    for k, v in full.items():
        assert out[k].dtype == v.dtype and out[k].sharding == sharding
        np.testing.assert_array_equal(np.asarray(out[k]), v, strict=True)
