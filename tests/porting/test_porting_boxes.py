"""Porting transforms as maps between boxes: a box of a target names the source
boxes that feed it, and the engine reads exactly those bytes.

The per-box maps are checked against numpy on random boxes of every rule kind (the
whole transform applied to the whole arrays, then sliced); the engine is checked
to read only a box's preimage, and to read whole (and say so) where a reshape has
no per-box map."""

from __future__ import annotations

import math
import re

import jax
import numpy as np
import pytest
from flax import nnx

import nnx_save
from nnx_save.load._engine import load_targets
from nnx_save.load._target import Target
from nnx_save.porting import Rules, concat, rename, reshape, split, stack, transpose, unstack

CASES = {
    "transpose": (
        Rules(rename(r"fc\.weight", "fc/kernel"), transpose("fc/kernel", (1, 0))),
        {"fc.weight": (12, 8)},
        "fc/kernel",
    ),
    "transpose3": (Rules(rename("w", "w"), transpose("w", (2, 0, 1))), {"w": (3, 4, 5)}, "w"),
    "split": (
        Rules(split(r"qkv\.weight", ["q/kernel", "k/kernel", "v/kernel"]), transpose(r"./kernel", (1, 0))),
        {"qkv.weight": (12, 6)},
        "k/kernel",
    ),
    "concat": (
        Rules(concat([r"a\.weight", r"b\.weight"], "ab/kernel", sizes=(4, 6)), transpose("ab/kernel", (1, 0))),
        {"a.weight": (4, 5), "b.weight": (6, 5)},
        "ab/kernel",
    ),
    "stack": (
        Rules(stack(r"h\.(?P<layer>\d+)\.w", "layers/w", axis=1), transpose("layers/w", (2, 1, 0))),
        {f"h.{i}.w": (3, 4) for i in range(5)},
        "layers/w",
    ),
    "split_stacked": (
        Rules(split(r"h\.(?P<layer>\d+)\.qkv", ["q", "k", "v"], axis=1, stacked=True), transpose("k", (0, 2, 1))),
        {f"h.{i}.qkv": (4, 9) for i in range(3)},
        "k",
    ),
    "unstack": (Rules(unstack(r"experts\.w", r"experts/\g<layer>/w", axis=1)), {"experts.w": (4, 3, 5)}, "experts/2/w"),
    "reshape": (Rules(rename("w", "w"), reshape("w", (4, 3, 2))), {"w": (12, 2)}, "w"),
    "reshape_t": (Rules(rename("w", "w"), transpose("w", (1, 0)), reshape("w", (2, 2, 6))), {"w": (6, 4)}, "w"),
}


def _arrays(shapes):
    return {
        k: (np.arange(math.prod(s), dtype=np.float32) + 1000 * i).reshape(s) for i, (k, s) in enumerate(shapes.items())
    }


def _random_box(rng, shape):
    out = []
    for d in shape:
        lo = int(rng.integers(0, d))
        out.append((lo, int(rng.integers(lo + 1, d + 1))))
    return tuple(out)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_box_is_made_from_its_source_boxes_as_numpy_makes_it_whole(case):
    rules, shapes, path = CASES[case]
    arrays = _arrays(shapes)
    a = rules.mapping({k: (s, np.dtype(np.float32)) for k, s in shapes.items()}).assignments[path]
    full = a.materialize(arrays)
    srcs = [arrays[k] for k in a.sources]
    rng, mapped = np.random.default_rng(0), 0
    for _ in range(100):
        box = _random_box(rng, full.shape)
        feeds = a.transform.source_boxes(box, [s.shape for s in srcs])
        if feeds is None:
            assert case.startswith("reshape")  # only a reshape may lack a per-box map
            continue
        mapped += 1
        regions = [srcs[i][tuple(slice(lo, hi) for lo, hi in b)] for i, b in feeds]
        read = sum(r.size for r in regions)
        assert read == math.prod(hi - lo for lo, hi in box)  # exactly the box's elements, nothing more
        got = a.transform.from_boxes(box, regions)
        np.testing.assert_array_equal(got, full[tuple(slice(lo, hi) for lo, hi in box)])
    assert mapped >= 5 if case.startswith("reshape") else mapped == 100  # every box maps but a reshape's


def test_a_reshape_maps_boxes_that_stay_rectangular_and_refuses_others():
    _, shapes, path = CASES["reshape"]
    a = CASES["reshape"][0].mapping({k: (s, np.dtype(np.float32)) for k, s in shapes.items()}).assignments[path]
    assert a.transform.source_boxes(((1, 3), (0, 3), (0, 2)), [(12, 2)]) == [(0, ((3, 9), (0, 2)))]
    assert a.transform.source_boxes(((0, 4), (1, 2), (0, 2)), [(12, 2)]) is None  # rows 1, 4, 7, 10: no box


def _header_and_target(tmp_path, case, box):
    rules, shapes, path = CASES[case]
    arrays = _arrays(shapes)
    file = str(tmp_path / "t.safetensors")
    nnx_save.save_file(arrays, file)
    header = nnx_save.read_header(file)
    a = rules.mapping(header).assignments[path]
    t = Target(
        path, a.shape, np.dtype(np.float32), sources=a.sources, transform=a.transform, source_shape=a.shape, box=box
    )
    return header, t, a.materialize(arrays)


@pytest.mark.parametrize(
    ("case", "box"), [("transpose", ((0, 8), (3, 6))), ("split", ((0, 6), (1, 3))), ("stack", ((0, 4), (1, 3), (0, 3)))]
)
def test_the_engine_reads_only_the_source_boxes_of_the_box_it_needs(tmp_path, case, box):
    header, t, full = _header_and_target(tmp_path, case, box)
    values, report = load_targets(header, [t], warn=False, options=nnx_save.LoadOptions(max_over_read_ratio=1.0))
    np.testing.assert_array_equal(values[t.path], full[tuple(slice(lo, hi) for lo, hi in box)])
    assert report.io.bytes_read == report.io.bytes_needed == 4 * math.prod(hi - lo for lo, hi in box)
    assert report.io.read_whole == []


def test_a_reshape_across_the_box_reads_whole_and_says_so(tmp_path):
    box = ((0, 4), (1, 2), (0, 2))
    header, t, full = _header_and_target(tmp_path, "reshape", box)
    values, report = load_targets(header, [t], warn=False)
    np.testing.assert_array_equal(values[t.path], full)  # a whole-source transform gives the whole value
    assert report.io.read_whole == ["w"] and report.io.bytes_read == 12 * 2 * 4
    assert "1 ported tensor(s) read whole" in str(report.io)


class _Net(nnx.Module):
    def __init__(self):
        init = nnx.with_partitioning(nnx.initializers.zeros, (None, "x"))
        self.rows = nnx.Linear(
            16, 32, kernel_init=nnx.with_partitioning(nnx.initializers.zeros, ("x", None)), rngs=nnx.Rngs(0)
        )
        self.cols = nnx.Linear(16, 32, kernel_init=init, rngs=nnx.Rngs(0))


def test_a_sharded_port_of_torch_linear_weights_loads_the_transposes(tmp_path):
    from nnx_save.porting import torch_linear

    rng = np.random.default_rng(1)
    weights = {f"{n}.weight": rng.standard_normal((32, 16)).astype(np.float32) for n in ("rows", "cols")}
    weights |= {f"{n}.bias": rng.standard_normal((32,)).astype(np.float32) for n in ("rows", "cols")}
    file = str(tmp_path / "torch.safetensors")
    nnx_save.save_file(weights, file)
    mesh = jax.make_mesh((8,), ("x",))
    model, report = nnx_save.load_model(
        _Net,
        file,
        rules=Rules(torch_linear("rows", "rows"), torch_linear("cols", "cols")),
        mesh=mesh,
        strict=True,
        stream=False,
    )
    for n in ("rows", "cols"):
        kernel = getattr(model, n).kernel[...]
        np.testing.assert_array_equal(np.asarray(kernel), weights[f"{n}.weight"].T)
        assert len(kernel.addressable_shards) == 8
    assert report.io.read_whole == [] and report.io.bytes_read == report.io.bytes_needed


def test_a_transform_whose_result_has_the_wrong_shape_is_refused(tmp_path):
    header, t, _ = _header_and_target(tmp_path, "transpose", ((0, 8), (0, 12)))

    class Wrong:
        def __call__(self, arrays):
            return arrays[0]

        def source_boxes(self, box, shapes):
            return [(0, ((0, 2), (0, 2)))]

        def from_boxes(self, box, regions):
            return regions[0]

    bad = Target(t.path, t.shape, t.dtype, sources=t.sources, transform=Wrong(), source_shape=t.shape, box=t.box)
    with pytest.raises(
        nnx_save.errors.ShapeMismatchError,
        match=re.escape("fc/kernel: rule produced shape (2, 2) for box [[0, 8], [0, 12]]"),
    ):
        load_targets(header, [bad], warn=False)


def test_share_reads_on_one_process_reads_as_without(tmp_path):
    file = str(tmp_path / "w.safetensors")
    w = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
    nnx_save.save_file({"w": w}, file)
    sharding = jax.sharding.NamedSharding(jax.make_mesh((8,), ("x",)), jax.sharding.PartitionSpec())
    abstract = {"w": jax.ShapeDtypeStruct((64, 8), np.float32, sharding=sharding)}
    tree, report = nnx_save.load_file(file, abstract, share_reads=True, return_report=True)
    np.testing.assert_array_equal(np.asarray(tree["w"]), w)
    assert tree["w"].sharding == sharding
    assert report.io.bytes_read == w.nbytes and report.io.bytes_received == 0


def test_shared_reads_split_a_transposed_port_where_the_file_tensor_is_contiguous():
    from nnx_save.load._share import _cost

    rules, shapes, path = CASES["transpose"]  # fc.weight (12, 8) -> fc/kernel (8, 12)
    a = rules.mapping({k: (s, np.dtype(np.float32)) for k, s in shapes.items()}).assignments[path]
    t = Target(path, a.shape, np.dtype(np.float32), sources=a.sources, transform=a.transform, source_shape=a.shape)
    assert _cost(t, 1, 2, shapes) == 1  # kernel columns are weight rows: one run
    assert _cost(t, 0, 2, shapes) == 12  # kernel rows are weight columns: one run per weight row
    plain = Target("w", (12, 8), np.dtype(np.float32), sources=("fc.weight",))
    assert (_cost(plain, 0, 2, shapes), _cost(plain, 1, 2, shapes)) == (1, 12)
