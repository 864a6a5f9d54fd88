"""The planner against numpy slicing.

Every plan is executed by an in-memory fake reader (``_execute``: slice the file's
bytes per chunk, copy each run) and each destination must equal ``full[box]``. The
boxes come from real jax shardings (1-, 2- and 3-D meshes over the 8 simulated
devices; leading, inner, several, replicated and partially replicated splits) and
from arbitrary boxes, over random shapes, item sizes (1, 2, 3, 4, 6, 8, 16
bytes), chunk sizes and over-read ratios. Invariants checked on every plan: each
destination byte is written exactly once, chunks never exceed the chunk size,
runs sit inside their chunk, sorted and disjoint, read >= needed, and the ratio
cap holds.
"""

from __future__ import annotations

import itertools
import math
import re
import time

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_save.format._boxes import box_runs
from nnx_save.load._pieces import Request
from nnx_save.load._plan import AUTO_MAX_READS, PAGE_GAP, FilePlan, chunk_runs, over_read_by_range, plan_file

ITEMSIZES = [1, 2, 3, 4, 6, 8, 16]  # uint8, f16/bf16, 'V3', f32, 'V6', f64/c64, c128
MESHES = [(1,), (2,), (3,), (8,), (2, 4), (4, 2), (1, 8), (2, 2, 2), (2, 1, 4)]
CHUNKS = [1, 5, 64, 4096, 1 << 20]
RATIOS = [None, 1.0, 1.3, 4.0, 1e9]


# ----------------------------------------------------------------------------- helpers


def _execute(plan: FilePlan, data: np.ndarray, dests: list[np.ndarray], chunk_bytes: int) -> list:
    """The fake reader: what any executor must do, in plain numpy, with the plan's
    invariants asserted on the way. Returns every piece written."""
    pieces = []
    for i in range(plan.num_chunks):
        cs, ce = int(plan.chunk_start[i]), int(plan.chunk_end[i])
        lo, hi = int(plan.chunk_lo[i]), int(plan.chunk_hi[i])
        assert 0 < ce - cs <= chunk_bytes
        assert lo < hi, "a chunk without runs reads only gap"
        block = data[cs:ce]  # one read
        off, ln = plan.offset[lo:hi], plan.length[lo:hi]
        assert (ln > 0).all() and (off[1:] >= off[:-1] + ln[:-1]).all(), "runs in a chunk overlap or are unsorted"
        assert off[0] < ce and off[-1] + ln[-1] > cs, "a run outside its chunk"
        c_off, c_len, c_dest, c_doff = chunk_runs(plan, i)
        assert c_off[0] == cs and c_off[-1] + c_len[-1] == ce, "chunk not trimmed to its runs"
        assert (c_len > 0).all() and int(c_len.sum()) == plan.chunk_needed[i]
        for o, n, d, do in zip(c_off.tolist(), c_len.tolist(), c_dest.tolist(), c_doff.tolist(), strict=False):
            dests[d][do : do + n] = block[o - cs : o - cs + n]
            pieces.append((d, do, n))
    return pieces


def _check_invariants(plan: FilePlan, pieces: list, sizes: list[int], ratio: float | None, chunk_bytes: int) -> None:
    # every destination byte is written by exactly one piece of one chunk
    for d, size in enumerate(sizes):
        mine = sorted((do, n) for dd, do, n in pieces if dd == d)
        assert [do for do, _ in mine] == list(np.cumsum([0] + [n for _, n in mine])[:-1]), f"dest {d} not tiled"
        assert sum(n for _, n in mine) == size, f"dest {d}: {sum(n for _, n in mine)} bytes written, {size} needed"
    assert plan.needed_bytes == sum(sizes) == int(plan.chunk_needed.sum())
    assert plan.read_bytes >= plan.needed_bytes
    assert ((plan.chunk_end - plan.chunk_start) <= chunk_bytes).all()
    # inside a chunk, gaps under a page are always read through; larger ones only
    # under the ratio: a merged block keeps span <= ratio * needed, so its big gaps
    # sum to at most (ratio - 1) * needed
    big = 0
    for i in range(plan.num_chunks):
        off, ln, _, _ = chunk_runs(plan, i)
        gaps = off[1:] - (off[:-1] + ln[:-1])
        big += int(gaps[gaps >= PAGE_GAP].sum())
    cap = (ratio if ratio is not None else plan.ratio) - 1.0
    assert big <= cap * plan.needed_bytes * (1 + 1e-9)


def _boxes_of(sharding, shape) -> list[tuple[tuple[int, int], ...]]:
    """What the engine asks for: one box per distinct shard index."""
    boxes = []
    for index in sharding.devices_indices_map(shape).values():
        box = tuple(s.indices(d)[:2] for s, d in zip(index, shape, strict=False))
        if box not in boxes:
            boxes.append(box)
    return boxes


@st.composite
def sharded_tensor(draw):
    """(shape, sharding) for a random mesh and partition spec JAX accepts."""
    mesh_shape = draw(st.sampled_from(MESHES))
    names = ("x", "y", "z")[: len(mesh_shape)]
    mesh = Mesh(np.array(jax.devices()[: math.prod(mesh_shape)]).reshape(mesh_shape), names)
    rank = draw(st.integers(0, 4))
    free = list(names)
    spec, shape = [], []
    for _ in range(rank):
        use = draw(st.sampled_from(["none", "one", "two"])) if free else "none"
        axes = []
        if use != "none" and free:
            for _ in range(1 if use == "one" else min(2, len(free))):
                axes.append(free.pop(draw(st.integers(0, len(free) - 1))))
        split = math.prod(mesh.shape[a] for a in axes)
        most = 4 if rank <= 2 else 2  # keep tensors small: the fake reader loops per run
        shape.append(split * draw(st.integers(0 if draw(st.booleans()) and rank else 1, most)))
        spec.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return tuple(shape), NamedSharding(mesh, P(*spec))


@st.composite
def file_case(draw):
    """1-4 tensors laid out one after another; each with a sharding's boxes, and
    sometimes also wanted whole (boxes that overlap)."""
    base = draw(st.sampled_from([0, 8, 8 + 4096]))
    tensors, requests, sizes = [], [], []
    for _ in range(draw(st.integers(1, 4))):
        shape, sharding = draw(sharded_tensor())
        itemsize = draw(st.sampled_from(ITEMSIZES))
        boxes = _boxes_of(sharding, shape)
        if draw(st.integers(0, 5)) == 0:
            boxes.append(tuple((0, d) for d in shape))  # a second target wants it whole
        tensors.append((base, shape, itemsize))
        for box in boxes:
            requests.append(Request(len(requests), base, shape, itemsize, box))
            sizes.append(itemsize * math.prod(hi - lo for lo, hi in box))
        base += itemsize * math.prod(shape) + draw(st.sampled_from([0, 0, 8, 5000]))
    return tensors, requests, sizes, base


def _run_case(tensors, requests, sizes, size, ratio, chunk_bytes, seed=0):
    data = np.random.default_rng(seed).integers(0, 256, size + 16, dtype=np.uint8)
    plan = plan_file(requests, max_over_read_ratio=ratio, chunk_bytes=chunk_bytes)
    dests = [np.full(n, 0xAB, np.uint8) for n in sizes]  # poisoned
    pieces = _execute(plan, data, dests, chunk_bytes)
    _check_invariants(plan, pieces, sizes, ratio, chunk_bytes)
    for r, dest in zip(requests, dests, strict=False):
        full = data[r.base : r.base + r.itemsize * math.prod(r.shape)].reshape(*r.shape, r.itemsize)
        expected = full[tuple(slice(lo, hi) for lo, hi in r.box)]
        assert np.array_equal(dest, np.ascontiguousarray(expected).reshape(-1)), (r, plan)
    return plan


# ----------------------------------------------------------------------------- properties


@settings(max_examples=100)
@given(file_case(), st.sampled_from(RATIOS), st.sampled_from(CHUNKS))
def test_plans_from_jax_shardings_fill_every_box_like_numpy_slicing(case, ratio, chunk_bytes):
    tensors, requests, sizes, size = case
    _run_case(tensors, requests, sizes, size, ratio, chunk_bytes)


@st.composite
def arbitrary_boxes(draw):
    """Any boxes at all, including uneven and overlapping ones, over one tensor."""
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=4)))
    itemsize = draw(st.sampled_from(ITEMSIZES))
    requests, sizes = [], []
    for i in range(draw(st.integers(1, 6))):
        box = []
        for d in shape:
            lo = draw(st.integers(0, d - 1))
            box.append((lo, draw(st.integers(lo + 1, d))))
        requests.append(Request(i, 24, shape, itemsize, tuple(box)))
        sizes.append(itemsize * math.prod(hi - lo for lo, hi in box))
    return [(24, shape, itemsize)], requests, sizes, 24 + itemsize * math.prod(shape)


@settings(max_examples=100)
@given(arbitrary_boxes(), st.sampled_from(RATIOS), st.sampled_from(CHUNKS))
def test_arbitrary_and_overlapping_boxes_fill_like_numpy_slicing(case, ratio, chunk_bytes):
    tensors, requests, sizes, size = case
    _run_case(tensors, requests, sizes, size, ratio, chunk_bytes)


@settings(max_examples=40)
@given(file_case(), st.sampled_from(RATIOS), st.sampled_from(CHUNKS))
def test_over_read_by_range_matches_a_byte_map(case, ratio, chunk_bytes):
    tensors, requests, _sizes, size = case
    plan = plan_file(requests, max_over_read_ratio=ratio, chunk_bytes=chunk_bytes)
    read = np.zeros(size + 1, np.int64)
    need = np.zeros(size + 1, np.int64)
    for cs, ce in zip(plan.chunk_start.tolist(), plan.chunk_end.tolist(), strict=False):
        read[cs:ce] += 1
    for o, n in zip(plan.offset.tolist(), plan.length.tolist(), strict=False):
        need[o : o + n] += 1
    begin = np.array([t[0] for t in tensors] + [0])
    end = np.array([t[0] + t[2] * math.prod(t[1]) for t in tensors] + [size])
    got = over_read_by_range(plan, begin, end)
    assert got.tolist() == [int((read[b:e] - need[b:e]).sum()) for b, e in zip(begin, end, strict=False)]
    assert got[-1] == plan.read_bytes - plan.needed_bytes


@settings(max_examples=60)
@given(st.lists(st.integers(1, 5), min_size=0, max_size=4), st.sampled_from(ITEMSIZES), st.data())
def test_box_runs_are_the_c_order_rows_of_the_box(shape, itemsize, data):
    shape = tuple(shape)
    box = tuple(data.draw(st.tuples(st.integers(0, d), st.integers(0, d)).map(sorted).map(tuple)) for d in shape)
    offsets, length = box_runs(shape, itemsize, box, base=100)
    index = np.arange(math.prod(shape) * itemsize).reshape(*shape, itemsize) + 100
    expected = index[tuple(slice(lo, hi) for lo, hi in box)].reshape(-1)
    if expected.size == 0:
        assert len(offsets) == 0
        return
    got = (offsets[:, None] + np.arange(length)).reshape(-1)
    assert got.tolist() == expected.tolist()


# ----------------------------------------------------------------------------- named behaviour


def _last_dim_requests(rows: int, cols: int, parts: int, itemsize: int = 4, base: int = 0):
    step = cols // parts
    return [Request(i, base, (rows, cols), itemsize, ((0, rows), (i * step, (i + 1) * step))) for i in range(parts)]


def test_dim0_shards_are_one_run_each_and_one_read():
    reqs = [Request(i, 64, (16, 32), 4, ((2 * i, 2 * i + 2), (0, 32))) for i in range(8)]
    plan = plan_file(reqs)
    assert len(plan.offset) == 8 and plan.num_chunks == 1
    assert plan.read_bytes == plan.needed_bytes == 16 * 32 * 4


def test_last_dim_split_is_equally_spaced_runs_read_as_one_span():
    plan = plan_file(_last_dim_requests(1000, 64, 8))
    assert len(plan.offset) == 8000 and plan.num_chunks == 1 and plan.read_bytes == plan.needed_bytes
    assert set(np.diff(plan.offset).tolist()) == {32}


def test_auto_ratio_keeps_exact_reads_while_they_are_few():
    # one shard of 8 on the last dim, 1000 rows: gaps of 224 bytes merge under a page
    plan = plan_file(_last_dim_requests(1000, 64, 8)[:1])
    assert plan.page_blocks == 1 and plan.ratio == 1.0
    # rows of 8 KiB with 56 KiB gaps: 2000 page blocks > AUTO_MAX_READS -> span / needed
    plan = plan_file(_last_dim_requests(2000, 16384, 8)[:1])
    assert plan.page_blocks == 2000 > AUTO_MAX_READS
    assert plan.ratio == pytest.approx((1999 * 65536 + 8192) / (2000 * 8192))
    assert plan.num_chunks == 1 and plan.read_bytes == 1999 * 65536 + 8192
    # the same with a cap: exact reads
    exact = plan_file(_last_dim_requests(2000, 16384, 8)[:1], max_over_read_ratio=1.0)
    assert exact.num_chunks == 2000 and exact.read_bytes == exact.needed_bytes


def test_ratio_cap_merges_only_what_it_allows():
    # runs of 8 KiB every 16 KiB: merging two costs 24/16 = 1.5
    reqs = [Request(0, 0, (8, 4096), 4, ((0, 8), (0, 2048)))]
    assert plan_file(reqs, max_over_read_ratio=1.49).num_chunks == 8
    merged = plan_file(reqs, max_over_read_ratio=1.5)
    assert merged.read_bytes <= 1.5 * merged.needed_bytes and merged.num_chunks < 8


def test_chunks_cut_large_runs_at_the_chunk_size_without_copying_them():
    plan = plan_file([Request(0, 10, (1000,), 8, ((0, 1000),))], chunk_bytes=3000)
    assert (plan.chunk_end - plan.chunk_start).tolist() == [3000, 3000, 2000]
    assert len(plan.offset) == 1 and plan.chunk_lo.tolist() == [0, 0, 0] and plan.chunk_hi.tolist() == [1, 1, 1]
    assert [chunk_runs(plan, i)[3].tolist() for i in range(3)] == [[0], [3000], [6000]]
    assert plan.chunk_needed.tolist() == [3000, 3000, 2000]


def test_empty_and_zero_size_requests_plan_nothing():
    plan = plan_file([Request(0, 8, (0, 4), 4, ((0, 0), (0, 4))), Request(1, 8, (3,), 4, ((1, 1),))])
    assert plan.num_chunks == 0 and plan.read_bytes == plan.needed_bytes == 0
    assert plan_file([]).num_chunks == 0


def test_refuses_ratio_below_one_and_non_positive_chunks():
    reqs = [Request(0, 0, (4,), 4, ((0, 4),))]
    with pytest.raises(ValueError, match=re.escape("max_over_read_ratio must be >= 1.0, got 0.5")):
        plan_file(reqs, max_over_read_ratio=0.5)
    with pytest.raises(ValueError, match=re.escape("max_over_read_ratio must be >= 1.0, got nan")):
        plan_file(reqs, max_over_read_ratio=float("nan"))
    with pytest.raises(ValueError, match=re.escape("chunk_bytes must be positive, got 0")):
        plan_file(reqs, chunk_bytes=0)


def _gpt2_last_dim_requests() -> list[Request]:
    d, vocab, ctx = 768, 50257, 1024
    shapes = [(vocab, d), (ctx, d)]
    for _ in range(12):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    shapes += [(d,), (d,)]
    reqs, base = [], 8
    for shape in shapes:
        step = shape[-1] // 8
        for i in range(8):
            box = (*tuple((0, n) for n in shape[:-1]), (i * step, (i + 1) * step))
            reqs.append(Request(len(reqs), base, shape, 4, box))
        base += 4 * math.prod(shape)
    return reqs


def test_planning_gpt2_small_split_on_the_last_dim_is_fast():
    """926K runs (orbax 0.12.8 spends ~4.9 s planning them)."""
    reqs = _gpt2_last_dim_requests()
    best = math.inf
    for _ in range(2):
        t0 = time.perf_counter()
        plan = plan_file(reqs)
        best = min(best, time.perf_counter() - t0)
    assert len(plan.offset) > 926_000 and plan.read_bytes == plan.needed_bytes == 497_759_232
    assert plan.num_chunks == 4
    assert best < 1.5, f"planning took {best:.2f}s"


def test_docstring_examples_run():
    import doctest

    from nnx_save.load import _plan

    result = doctest.testmod(_plan)
    assert result.attempted >= 5 and result.failed == 0


# ----------------------------------------------------------------------------- pieces into sub-boxes


def _split(draw, shape):
    """Piece boxes that tile ``shape``: each dimension cut at random points."""
    cuts = []
    for d in shape:
        inner = sorted(set(draw(st.lists(st.integers(1, max(d - 1, 1)), max_size=2)))) if d > 1 else []
        cuts.append([0, *[c for c in inner if 0 < c < d], d])
    grids = [list(itertools.pairwise(c)) for c in cuts]
    boxes = [()]
    for g in grids:
        boxes = [(*b, r) for b in boxes for r in g]
    return boxes


@st.composite
def pieces_case(draw):
    """A tensor stored as pieces (a pod's boxes, one file tensor each, laid out one
    after another), and the boxes a load needs: each needed box gets one request
    per overlapping piece, landing at its offset in the one destination buffer."""
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    itemsize = draw(st.sampled_from(ITEMSIZES))
    pieces, base = [], draw(st.sampled_from([0, 8, 8 + 4096]))
    for box in _split(draw, shape):
        pieces.append((base, box))
        base += itemsize * math.prod(hi - lo for lo, hi in box) + draw(st.sampled_from([0, 0, 8, 5000]))
    needed = _split(draw, shape) if draw(st.booleans()) else [tuple((0, d) for d in shape)]
    requests, sizes = [], []
    for dest, want in enumerate(needed):
        for pbase, pbox in pieces:
            part = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(pbox, want, strict=True))
            if all(lo < hi for lo, hi in part):
                local = tuple((lo - p, hi - p) for (lo, hi), (p, _) in zip(part, pbox, strict=True))
                at = tuple(lo - w for (lo, _), (w, _) in zip(part, want, strict=True))
                pshape = tuple(hi - lo for lo, hi in pbox)
                wshape = tuple(hi - lo for lo, hi in want)
                requests.append(Request(dest, pbase, pshape, itemsize, local, wshape, at))
        sizes.append(itemsize * math.prod(hi - lo for lo, hi in want))
    return shape, itemsize, pieces, needed, requests, sizes, base


@settings(max_examples=150)
@given(pieces_case(), st.sampled_from(RATIOS), st.sampled_from(CHUNKS))
def test_pieces_land_at_strided_offsets_of_one_buffer_like_numpy_slicing(case, ratio, chunk_bytes):
    shape, itemsize, pieces, needed, requests, sizes, size = case
    data = np.random.default_rng(1).integers(0, 256, size + 16, dtype=np.uint8)
    full = np.zeros((*shape, itemsize), np.uint8)  # the global tensor the pieces make up
    for pbase, pbox in pieces:
        pshape = tuple(hi - lo for lo, hi in pbox)
        full[tuple(slice(lo, hi) for lo, hi in pbox)] = data[pbase : pbase + itemsize * math.prod(pshape)].reshape(
            *pshape, itemsize
        )
    plan = plan_file(requests, max_over_read_ratio=ratio, chunk_bytes=chunk_bytes)
    dests = [np.full(n, 0xAB, np.uint8) for n in sizes]  # poisoned
    written = _execute(plan, data, dests, chunk_bytes)
    _check_invariants(plan, written, sizes, ratio, chunk_bytes)
    for want, dest in zip(needed, dests, strict=True):
        expected = np.ascontiguousarray(full[tuple(slice(lo, hi) for lo, hi in want)]).reshape(-1)
        assert np.array_equal(dest, expected), (want, plan)


def test_a_piece_inside_a_larger_destination_makes_strided_runs():
    # a [4, 6] shard of 4-byte items; the piece holds its columns 2:5 of rows 1:3
    r = Request(0, 100, (2, 3), 4, ((0, 2), (0, 3)), dest_shape=(4, 6), dest_at=(1, 2))
    p = plan_file([r])
    assert p.offset.tolist() == [100, 112] and p.length.tolist() == [12, 12]
    assert p.dest_offset.tolist() == [(1 * 6 + 2) * 4, (2 * 6 + 2) * 4]
