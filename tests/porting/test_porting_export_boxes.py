"""Export transforms map boxes forward: the images of a grid of source boxes
(``Transform.image``, what each process writes of a ported export) tile the
transformed tensor exactly once and hold its values (checked against numpy)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from nnx_save.porting import Concatenate, Index, Reshape, Stack, Sum, Take, Transform, Transpose

T = (Transpose((1, 0)),)
CASES = {
    "transpose": (Transform((T,), None, ()), [(6, 4)]),
    "concatenate": (Transform(((), (), ()), Concatenate(1, (4, 4, 4)), ()), [(6, 4)] * 3),
    "transpose_concatenate": (Transform((T, T), Concatenate(0, (4, 4)), ()), [(6, 4)] * 2),
    "stack": (Transform((T, T, T), Stack(0), ()), [(6, 4)] * 3),
    "unstack": (Transform(((Transpose((0, 2, 1)),),), Index(0, 2), ()), [(4, 6, 4)]),
    "split": (Transform(((),), Take(1, 4, 8), ()), [(6, 12)]),
    "reshape": (Transform(((Reshape((2, 3, 4), (6, 4)),),), None, ()), [(6, 4)]),
}


def _grid(shape, cuts):
    """Boxes cutting each dimension at ``cuts`` (those inside it)."""
    edges = [sorted({0, n, *(c for c in cuts if 0 < c < n)}) for n in shape]
    return list(itertools.product(*[list(itertools.pairwise(e)) for e in edges]))


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("cuts", [(), (2,), (1, 3)], ids=["whole", "halves", "uneven"])
def test_images_of_a_grid_tile_the_result_once(name, cuts):
    t, shapes = CASES[name]
    rng = np.random.default_rng(0)
    sources = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    want = t(sources)
    got, hits, mapped = np.zeros_like(want), np.zeros(want.shape, np.int64), 0
    for i, x in enumerate(sources):
        for box in _grid(x.shape, cuts):
            parts = t.image(i, box, x[tuple(slice(lo, hi) for lo, hi in box)])
            if parts is None:  # only a reshape refuses, for boxes across its groups
                assert name == "reshape" and box[0] != (0, 6), box
                continue
            for out, value in parts:
                region = tuple(slice(lo, hi) for lo, hi in out)
                assert value.shape == got[region].shape, (box, out)
                got[region] = value
                hits[region] += 1
                mapped += 1
    if name == "reshape" and cuts:
        return  # refused above, as it must be: the export gathers that tensor instead
    assert mapped and (hits == 1).all(), hits
    assert got.tobytes() == want.tobytes()


def test_a_sum_has_no_box_map_forward():
    assert Transform(((), ()), Sum(), ()).image(0, ((0, 2),), np.zeros(2)) is None
