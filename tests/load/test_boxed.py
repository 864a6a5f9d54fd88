"""Porting transforms applied in the copy (load/_boxed.py): a target box cut into
slabs, each slab's source boxes read into small temporaries and transformed into its
part of the final buffer on the reader threads.

Checked against numpy (the whole transform on the whole arrays, then sliced) for every
rule kind, on random boxes and on 8-device shardings, with slabs cut down to a few
elements so that every box takes many units, read alone or with their file's plan."""

from __future__ import annotations

import itertools
import math
import re
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding, PartitionSpec

import nnx_save
from nnx_save import LoadOptions
from nnx_save.load import _boxed
from nnx_save.load._boxed import copy_into
from nnx_save.load._engine import load_targets
from nnx_save.load._pieces import Request
from nnx_save.load._plan import plan_file
from nnx_save.load._slabs import plan_units
from nnx_save.load._target import Target

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "porting"))
from test_porting_boxes import CASES, _arrays


@settings(max_examples=200)
@given(st.data())
def test_copy_into_equals_numpy_assignment(data):
    ndim = data.draw(st.integers(1, 3))
    shape = tuple(data.draw(st.lists(st.integers(1, 40), min_size=ndim, max_size=ndim)))
    axes = tuple(data.draw(st.permutations(range(ndim))))
    src_dtype = data.draw(st.sampled_from([np.float32, np.float16, np.int8, np.float64]))
    dst_dtype = data.draw(st.sampled_from([np.float32, np.float64, src_dtype]))
    source = np.arange(math.prod(shape)).astype(src_dtype).reshape(shape)
    view = np.transpose(source, axes)
    expected = np.empty(view.shape, dst_dtype)
    expected[...] = view
    out = np.full(view.shape, 7, dst_dtype)  # poisoned
    copy_into(out, view)
    np.testing.assert_array_equal(out, expected)


def _load(tmp_path, case, boxes_or_sharding, unit_bytes, eager_bytes, monkeypatch):
    rules, shapes, path = CASES[case]
    arrays = _arrays(shapes)
    file = str(tmp_path / "t.safetensors")
    nnx_save.save_file(arrays, file)
    header = nnx_save.read_header(file)
    a = rules.mapping(header).assignments[path]
    full = a.materialize(arrays)
    monkeypatch.setattr(_boxed, "UNIT_BYTES", unit_bytes)
    monkeypatch.setattr(_boxed, "EAGER_BYTES", eager_bytes)
    kw = {"sources": a.sources, "transform": a.transform, "source_shape": a.shape}
    if isinstance(boxes_or_sharding, NamedSharding):
        t = Target(path, a.shape, np.dtype(np.float32), sharding=boxes_or_sharding, **kw)
    else:
        t = Target(path, a.shape, np.dtype(np.float32), box=boxes_or_sharding, **kw)
    values, report = load_targets(header, [t], LoadOptions(max_over_read_ratio=1.0), warn=False)
    return values[path], report, full


BOX_CASES = sorted(k for k in CASES if not k.startswith("reshape"))


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(BOX_CASES), st.integers(0, 2**31), st.sampled_from([4, 24, 1 << 20]), st.booleans())
def test_a_box_loads_as_numpy_slices_it_whatever_the_slabs(tmp_path_factory, case, seed, unit, eager):
    rng = np.random.default_rng(seed)
    _, shapes, path = CASES[case]
    a = CASES[case][0].mapping({k: (s, np.dtype(np.float32)) for k, s in shapes.items()}).assignments[path]
    box = tuple((lo, int(rng.integers(lo + 1, d + 1))) for d in a.shape for lo in [int(rng.integers(0, d))])
    with pytest.MonkeyPatch.context() as m:
        where = tmp_path_factory.mktemp("b")
        value, report, full = _load(where, case, box, unit, 1 << 20 if eager else 0, m)
    np.testing.assert_array_equal(value, full[tuple(slice(lo, hi) for lo, hi in box)])
    assert report.io.read_whole == [] and report.io.bytes_needed == 4 * math.prod(hi - lo for lo, hi in box)
    # the slabs read no byte the box's own plan would not (it reads through gaps under a page)
    assert report.io.bytes_read <= _whole_box_read(where, case, box)


def _whole_box_read(tmp_path, case, box):
    """What one plan of all of ``box``'s source boxes reads (the engine before slabs)."""
    rules, _, path = CASES[case]
    header = nnx_save.read_header(str(tmp_path / "t.safetensors"))
    a = rules.mapping(header).assignments[path]
    infos = [header.tensors[k] for k in a.sources]
    feeds = a.transform.source_boxes(box, [info.shape for info in infos])
    requests = [Request(j, infos[i].begin, infos[i].shape, 4, b) for j, (i, b) in enumerate(feeds)]
    return plan_file(requests, max_over_read_ratio=1.0).read_bytes


@pytest.mark.parametrize("case", BOX_CASES)
@pytest.mark.parametrize("axis", [0, -1])
def test_a_sharded_box_target_loads_every_shard(tmp_path, monkeypatch, case, axis):
    _, shapes, path = CASES[case]
    a = CASES[case][0].mapping({k: (s, np.dtype(np.float32)) for k, s in shapes.items()}).assignments[path]
    mesh = jax.make_mesh((8,), ("x",))
    split = axis % len(a.shape)
    spec = [None] * len(a.shape)
    if a.shape[split] % 8 == 0:
        spec[split] = "x"
    value, report, full = _load(tmp_path, case, NamedSharding(mesh, PartitionSpec(*spec)), 8, 0, monkeypatch)
    np.testing.assert_array_equal(np.asarray(value), full)
    for shard in value.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index])
    assert report.io.bytes_needed == full.nbytes  # every shard's sources once
    assert report.io.bytes_read <= _whole_box_read(tmp_path, case, tuple((0, d) for d in full.shape))


def test_units_of_sharded_rows_read_one_contiguous_slab_of_every_shard():
    from nnx_save.porting._transforms import Transform, Transpose

    t = Transform((), None, (Transpose((1, 0)),))  # kernel (16, 32) from weight (32, 16); 8 shards of 2 rows
    boxes = [((2 * i, 2 * i + 2), (0, 32)) for i in range(8)]
    planned = plan_units(t, boxes, [(32, 16)], [4], 1024)  # 1 KiB: 16 weight rows a unit
    assert [len(unit) for unit in planned] == [8, 8]  # each unit: its columns of all 8 shards
    first_shard = planned[0][0]  # (box, slab, feeds)
    assert first_shard[1:] == (((0, 2), (0, 16)), [(0, ((0, 16), (0, 2)))])  # weight rows 0-15, columns 0-1


def test_a_transposed_load_holds_no_second_full_size_buffer(tmp_path):
    """The transpose happens in the copy out of slab-sized temporaries, so host
    memory at peak is the final buffer and a few MiB, not the source beside it."""
    import tracemalloc

    from nnx_save.porting import Rules, torch_linear

    weight = np.arange(2048 * 2048, dtype=np.float32).reshape(2048, 2048)  # 16 MiB
    file = str(tmp_path / "w.safetensors")
    nnx_save.save_file({"fc.weight": weight}, file)
    header = nnx_save.read_header(file)
    a = Rules(torch_linear("fc", "fc", bias=False)).mapping(header).assignments["fc/kernel"]
    t = Target(
        "fc/kernel", a.shape, np.dtype(np.float32), sources=a.sources, transform=a.transform, source_shape=a.shape
    )
    tracemalloc.start()
    try:
        values, _ = load_targets(header, [t], LoadOptions(num_threads=1), warn=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(values["fc/kernel"], weight.T)
    assert peak <= weight.nbytes + (6 << 20), peak  # final buffer + one slab's scratch (4 MiB) + change


def _sharded_kernel(tmp_path, rows: int = 64, cols: int = 256):
    """A transposed (cols, rows) kernel from a torch ``fc.weight`` (rows, cols), sharded
    8 ways on its last axis: its header and target."""
    from nnx_save.porting import Rules, torch_linear

    weight = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
    file = str(tmp_path / "w.safetensors")
    nnx_save.save_file({"fc.weight": weight}, file)
    header = nnx_save.read_header(file)
    a = Rules(torch_linear("fc", "fc", bias=False)).mapping(header).assignments["fc/kernel"]
    sharding = NamedSharding(jax.make_mesh((8,), ("x",)), PartitionSpec(None, "x"))
    kw = {"sources": a.sources, "transform": a.transform, "source_shape": a.shape}
    return weight, file, header, Target("fc/kernel", a.shape, np.dtype(np.float32), sharding=sharding, **kw)


def test_the_shards_of_a_transposed_target_are_carved_from_one_allocation(tmp_path):
    """The final buffers of a sharded target's boxes are packed into large
    allocations (huge pages fault in far cheaper than one small buffer per shard), and
    each device's array adopts its part without a copy."""
    weight, _, header, t = _sharded_kernel(tmp_path)
    values, _ = load_targets(header, [t], LoadOptions(), warn=False)
    value = values["fc/kernel"]
    np.testing.assert_array_equal(np.asarray(value), weight.T)
    starts = sorted(s.data.unsafe_buffer_pointer() for s in value.addressable_shards)
    shard_bytes = weight.nbytes // 8  # a multiple of 64: packed back to back, no gap
    assert [b - a for a, b in itertools.pairwise(starts)] == [shard_bytes] * 7


def test_a_transposed_target_whose_buffers_cannot_be_allocated_is_a_typed_error(tmp_path, monkeypatch):
    _, file, header, t = _sharded_kernel(tmp_path)

    def refuse(sizes, slab_bytes):
        raise MemoryError

    monkeypatch.setattr(_boxed, "pack_buffers", refuse)
    message = (
        f"{file}: cannot allocate host memory for 'fc/kernel' (8.0 KiB; 64.0 KiB for the 8 transformed shard(s) "
        "filled from this file); nothing was read from this file. Free memory or raise the process's memory limit"
    )
    with pytest.raises(nnx_save.HostMemoryError, match=re.escape(message)) as caught:
        load_targets(header, [t], LoadOptions(), warn=False)
    assert (caught.value.file, caught.value.key, caught.value.nbytes) == (file, "fc/kernel", 8192)
