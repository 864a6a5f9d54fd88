"""Property tests: random files and rule sets; load plans checked against numpy,
export plans (``Rules.inverse``) checked to give every file tensor back exactly."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from nnx_save.porting import Rules, concat, rename, reshape, shapes_of, split, stack, transpose, unstack

DTYPES = [np.dtype(d) for d in ("float32", "float16", "int32", "uint8", "bool")]


class _Case:
    """What one draw builds: file tensors, rules and the model numpy says to expect."""

    def __init__(self) -> None:
        self.tensors: dict[str, np.ndarray] = {}
        self.rules: list = []
        self.expected: dict[str, np.ndarray] = {}
        self.counter = 0

    def array(self, draw: st.DrawFn, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        self.counter += 1
        values = (np.arange(int(np.prod(shape)), dtype=np.int64) * 7 + self.counter * 1000) % 251
        return values.reshape(shape).astype(dtype)


def _shape(draw: st.DrawFn, ndim: int) -> tuple[int, ...]:
    return tuple(draw(st.lists(st.integers(1, 3), min_size=ndim, max_size=ndim)))


def _rename(draw: st.DrawFn, case: _Case, g: int, dtype: np.dtype) -> None:
    x = case.array(draw, _shape(draw, draw(st.integers(0, 3))), dtype)
    case.tensors[f"f{g}.w"] = x
    case.rules.append(rename(rf"f{g}\.w", f"m{g}/w"))
    case.expected[f"m{g}/w"] = x


def _split(draw: st.DrawFn, case: _Case, g: int, dtype: np.dtype) -> None:
    ndim = draw(st.integers(1, 3))
    axis = draw(st.integers(-ndim, ndim - 1))
    sizes = draw(st.lists(st.integers(0, 3), min_size=2, max_size=4))
    equal = draw(st.booleans())
    sizes = [sizes[0]] * len(sizes) if equal else sizes
    shape = list(_shape(draw, ndim))
    shape[axis] = sum(sizes)
    x = case.array(draw, tuple(shape), dtype)
    targets = [f"m{g}/p{i}" for i in range(len(sizes))]
    case.tensors[f"f{g}.fused"] = x
    case.rules.append(split(rf"f{g}\.fused", targets, axis, sizes=None if equal else sizes))
    for target, part in zip(targets, np.split(x, np.cumsum(sizes)[:-1], axis=axis), strict=True):
        case.expected[target] = part


def _concat(draw: st.DrawFn, case: _Case, g: int, dtype: np.dtype) -> None:
    ndim = draw(st.integers(1, 3))
    axis = draw(st.integers(0, ndim - 1))
    base = _shape(draw, ndim)
    parts = []
    for i in range(draw(st.integers(2, 3))):
        shape = list(base)
        shape[axis] = draw(st.integers(0, 3))
        parts.append(case.array(draw, tuple(shape), dtype))
        case.tensors[f"f{g}.part{i}"] = parts[-1]
    sizes = tuple(p.shape[axis] for p in parts) if draw(st.booleans()) else None
    case.rules.append(concat([rf"f{g}\.part{i}" for i in range(len(parts))], f"m{g}/joined", axis, sizes=sizes))
    case.expected[f"m{g}/joined"] = np.concatenate(parts, axis=axis)


def _stack(draw: st.DrawFn, case: _Case, g: int, dtype: np.dtype) -> None:
    shape = _shape(draw, draw(st.integers(0, 2)))
    layers = [case.array(draw, shape, dtype) for _ in range(draw(st.integers(1, 12)))]
    for i, x in enumerate(layers):
        case.tensors[f"f{g}.{i}.w"] = x
    axis = draw(st.integers(0, len(shape)))
    case.rules.append(stack(rf"f{g}\.(?P<layer>\d+)\.w", f"m{g}/stacked", axis))
    case.expected[f"m{g}/stacked"] = np.stack(layers, axis=axis)


def _unstack(draw: st.DrawFn, case: _Case, g: int, dtype: np.dtype) -> None:
    shape = _shape(draw, draw(st.integers(1, 3)))
    x = case.array(draw, shape, dtype)
    axis = draw(st.integers(0, len(shape) - 1))
    case.tensors[f"f{g}.experts"] = x
    case.rules.append(unstack(rf"f{g}\.experts", rf"m{g}/e/\g<layer>", axis))
    for i in range(shape[axis]):
        case.expected[f"m{g}/e/{i}"] = np.take(x, i, axis=axis)


def _value_rules(draw: st.DrawFn, case: _Case, targets: list[str]) -> None:
    """Maybe a transpose, then maybe a reshape, per target (checked against numpy)."""
    for target in targets:
        x = case.expected[target]
        if x.ndim > 1 and draw(st.booleans()):
            axes = tuple(draw(st.permutations(range(x.ndim))))
            case.rules.append(transpose(target, axes))
            x = np.transpose(x, axes)
        if draw(st.booleans()):
            known = draw(st.booleans())
            case.rules.append(reshape(target, (-1,), source_shape=x.shape if known else None))
            x = x.reshape(-1)
        case.expected[target] = x


@st.composite
def cases(draw: st.DrawFn) -> _Case:
    case = _Case()
    kinds = [_rename, _split, _concat, _stack, _unstack]
    for g in range(draw(st.integers(1, 4))):
        before = set(case.expected)
        draw(st.sampled_from(kinds))(draw, case, g, draw(st.sampled_from(DTYPES)))
        _value_rules(draw, case, sorted(set(case.expected) - before))
    order = draw(st.permutations(range(len(case.rules))))
    structural = [r for r in case.rules if not hasattr(r, "matches")]
    value = [r for r in case.rules if hasattr(r, "matches")]
    # Structural rules never overlap, so their order is free; value rules keep theirs.
    case.rules = [structural[i] for i in order if i < len(structural)] + value
    return case


def _assert_same(ours: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert sorted(ours) == sorted(expected)
    for key, value in expected.items():
        assert ours[key].dtype == value.dtype and ours[key].shape == value.shape, key
        np.testing.assert_array_equal(ours[key], value, err_msg=key)


@given(cases())
def test_load_plan_matches_numpy(case: _Case) -> None:
    mapping = Rules(case.rules).mapping(shapes_of(case.tensors))
    _assert_same(mapping.apply(case.tensors), case.expected)
    assert sorted(mapping.landed) == sorted(case.tensors) and all(mapping.landed.values())


@given(cases())
def test_export_plan_gives_every_file_tensor_back(case: _Case) -> None:
    rules = Rules(case.rules)
    mapping = rules.mapping(shapes_of(case.tensors))
    model = mapping.apply(case.tensors)
    exported = rules.inverse(recorded=mapping).mapping(shapes_of(model))
    _assert_same(exported.apply(model), case.tensors)
    assert exported.shapes() == shapes_of(case.tensors)


@given(cases())
def test_inverse_twice_is_the_original_rules(case: _Case) -> None:
    rules = Rules(case.rules)
    recorded = rules.mapping(shapes_of(case.tensors))
    back = rules.inverse(recorded=recorded)
    again = back.inverse(recorded=back.mapping(recorded.shapes()))
    assert again.mapping(shapes_of(case.tensors)) == recorded
