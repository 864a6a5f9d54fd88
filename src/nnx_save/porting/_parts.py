"""Checks the part-making rules share: split bounds, layer groups, one dtype.

Each records what does not fit in ``errors`` (so that every problem of a mapping is
raised at once) and returns ``None`` for it.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence

import numpy as np

from ..errors import short_repr
from ._errors import RuleError
from ._template import Template

__all__ = [
    "MAX_INDEX_DIGITS",
    "MAX_LAYERS",
    "axis_of",
    "complete_layers",
    "first_absent",
    "joined",
    "layer_groups",
    "refuse_shared_layer",
    "same_dtype",
    "split_bounds",
    "too_many_layers",
]

Shape = tuple[int, ...]
Info = Mapping[str, tuple[Shape, np.dtype]]


def axis_of(axis: int, ndim: int) -> int | None:
    """``axis`` made non-negative for ``ndim`` dimensions, or ``None`` out of range."""
    return axis + ndim if -ndim <= axis < 0 else (axis if 0 <= axis < ndim else None)


def joined(shapes: Sequence[Shape], axis: int) -> tuple[int, tuple[int, ...], Shape] | None:
    """``(axis, part sizes, shape)`` of parts of ``shapes`` concatenated along ``axis``,
    or ``None`` where they differ in rank or off that axis."""
    at = axis_of(axis, len(shapes[0]))
    if at is None or len({len(s) for s in shapes}) != 1 or len({s[:at] + s[at + 1 :] for s in shapes}) != 1:
        return None
    sizes = tuple(s[at] for s in shapes)
    return at, sizes, (*shapes[0][:at], sum(sizes), *shapes[0][at + 1 :])


def same_dtype(keys: Sequence[str], info: Info, target: str, errors: list[str]) -> np.dtype | None:
    """The one dtype of ``keys``, or ``None`` (recorded in ``errors``)."""
    dtypes = {info[k][1] for k in keys}
    if len(dtypes) == 1:
        return dtypes.pop()
    found = ", ".join(f"`{k}` {info[k][1]}" for k in keys)
    errors.append(f"`{target}`: its sources must share one dtype, found {found}")
    return None


def split_bounds(
    rule: object, key: str, shape: Shape, cut: tuple[int, tuple[int, ...] | None, int], errors: list[str]
) -> tuple[int, list[int]] | None:
    """``(axis, part starts and the end)`` cutting ``shape`` by ``cut`` = ``(axis, sizes,
    count)`` (equal parts when ``sizes`` is ``None``); a problem goes to ``errors``."""
    axis_given, given, count = cut
    axis = axis_of(axis_given, len(shape))
    if axis is None:
        errors.append(f"`{key}`: {rule} needs axis {axis_given}, found shape {shape}")
        return None
    sizes = given
    if sizes is None and shape[axis] % count == 0:
        sizes = (shape[axis] // count,) * count
    if sizes is None or sum(sizes) != shape[axis]:
        want = f"sizes {given} (sum {sum(given)})" if given else f"a multiple of {count}"
        errors.append(f"`{key}`: {rule} needs {want} on axis {axis_given}, found shape {shape}")
        return None
    return axis, [0, *np.cumsum(sizes).tolist()]


def refuse_shared_layer(rule: object, regex: re.Pattern[str], templates: Sequence[Template], group: str) -> None:
    """Refuse a pattern whose layer group no target references: every layer would
    make the same targets (a model path made L times)."""
    number = regex.groupindex.get(group)
    if number is None or any(group in t.refs or number in t.refs for t in templates):
        return
    raise RuleError(
        f"{rule}: the pattern captures the layer index (?P<{group}>...) but no target references it, so "
        f"every layer would make the same targets; reference \\g<{group}> in each target (one param per "
        "layer), or pass stacked=True to stack the layers into one param per target (scanned layers)"
    )


def layer_groups(rule: object, claims: Mapping[str, tuple[str, object]], errors: list[str]) -> dict:
    """``{target: {layer: key}}`` from claims of ``(layer text, target)``; a bad or
    repeated layer index goes to ``errors``."""
    groups: dict[object, dict[int, str]] = defaultdict(dict)
    for key, (layer, target) in sorted(claims.items()):
        if not (layer.isascii() and layer.isdigit()):  # a regex \d also matches "²"
            errors.append(f"`{key}`: {rule} needs a decimal layer index, found {layer!r}")
        elif len(layer) > MAX_INDEX_DIGITS:  # no model has 10**18 layers; int() refuses 4,300 digits
            errors.append(
                f"`{short_repr(key, 80)}`: {rule} needs a layer index of at most {MAX_INDEX_DIGITS} digits, "
                f"found {len(layer)} digits"
            )
        elif int(layer) in groups[target]:
            errors.append(f"`{target}`: produced twice by {rule}, from `{groups[target][int(layer)]}` and `{key}`")
        else:
            groups[target][int(layer)] = key
    return groups


MAX_INDEX_DIGITS = 18  # a key's index past 10**18 is no layer (and int() refuses 4,300 digits)
MAX_LAYERS = 1 << 16  # entries one tensor splits into (unstack): past any model's layers or experts


def too_many_layers(rule: object, key: str, count: int, errors: list[str]) -> bool:
    """Whether splitting ``key`` into ``count`` params (one per entry of its layer axis, a
    size read from the file) passes :data:`MAX_LAYERS`; recorded in ``errors`` if so."""
    if count <= MAX_LAYERS:
        return False
    errors.append(
        f"`{key}`: {rule} would make one param per entry of an axis of {count} (the file's shape); "
        f"at most {MAX_LAYERS} are made from one tensor"
    )
    return True


def first_absent(present: Collection[int], limit: int, below: int) -> list[int]:
    """The first ``limit`` non-negative ints under ``below`` not in ``present``, in
    order, found without counting up to ``below`` (a key's index ``99999999999`` sizes
    nothing: at most ``len(present) + limit`` are looked at).

    Examples:
        >>> first_absent({0, 2, 99999999999}, 3, 99999999999), first_absent({0, 3}, 8, 3)
        ([1, 3, 4], [1, 2])
    """
    out: list[int] = []
    i = 0
    while len(out) < limit and i < below:
        if i not in present:
            out.append(i)
        i += 1
    return out


def _few(layers: Sequence[int], limit: int = 8) -> str:
    return (
        str(layers) if len(layers) <= limit else f"[{', '.join(map(str, layers[:limit]))}, ... ({len(layers)} in all)]"
    )


def complete_layers(
    rule: object, target: object, layers: Mapping[int, str], info: Info, errors: list[str]
) -> tuple[tuple[str, ...], Shape] | None:
    """The keys of layers ``0 .. L-1`` in order and their one shape, or ``None`` (a
    missing layer or two shapes, recorded in ``errors``)."""
    gaps = max(layers) + 1 - len(layers)  # layers are distinct: a gap iff the top is past the count
    if gaps:
        shown = ", ".join(map(str, first_absent(layers, 8, max(layers)))) + (
            f" ... ({gaps} in all)" if gaps > 8 else ""
        )
        errors.append(f"`{target}`: {rule} found layers {_few(sorted(layers))}, missing layers [{shown}]")
        return None
    keys = tuple(layers[i] for i in range(len(layers)))
    shapes = {info[k][0] for k in keys}
    if len(shapes) != 1:
        found = ", ".join(f"`{k}` {info[k][0]}" for k in keys)
        errors.append(f"`{target}`: {rule} needs layers of one shape, found {found}")
        return None
    return keys, shapes.pop()
