"""The rule constructors users write: ``rename``, ``split``, ``stack`` and the rest.

Patterns are regexes matched against the whole key (``re.fullmatch``), targets replacement
templates (``\\1``, ``\\g<name>``); only ``transpose`` and ``reshape`` match model paths.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ._compose import SplitStackRule, SumRule, TieRule
from ._rules import (
    ConcatRule,
    IgnoreRule,
    RenameRule,
    ReshapeRule,
    SplitRule,
    StackRule,
    StructuralRule,
    TransposeRule,
    UnstackRule,
)
from ._template import int_arg, ints_arg, text_arg, texts_arg

__all__ = ["add", "concat", "ignore", "rename", "reshape", "split", "stack", "tie", "transpose", "unstack"]


def rename(
    pattern: str,
    replacement: str,
    *,
    shift: Mapping[int | str, int] | None = None,
    index: Mapping[int | str, Sequence[int] | Mapping[int, int]] | None = None,
    inverse: StructuralRule | None = None,
) -> RenameRule:
    """File keys matching ``pattern`` go to the model path ``replacement``.

    Args:
        pattern: regex matched against the whole file key.
        replacement: the model path, with group references.
        shift: ``{group: offset}`` added to captured indices (``{1: -1}``:
            ``features.1`` -> ``blocks/0``); inverted on export.
        index: ``{group: [n0, n1, ...]}`` renumbers a captured index through a table:
            ``n_i`` becomes ``i`` (an ``nn.Sequential`` whose convs sit at 0, 3, 6, 8:
            ``{1: [0, 3, 6, 8]}``; ``features.6`` -> ``blocks/2``), or ``{group: {n: i}}``;
            an index the table lacks is not matched. Inverted on export.
        inverse: the rule to use on export, when the automatic inverse is refused.

    Examples:
        >>> rule = rename(r"h\\.(\\d+)\\.attn\\.c_proj\\.weight", r"blocks/\\1/attn/proj/kernel")
        >>> rule.match("h.3.attn.c_proj.weight")
        'blocks/3/attn/proj/kernel'
        >>> rule.inverse().match("blocks/3/attn/proj/kernel")
        'h.3.attn.c_proj.weight'
        >>> shifted = rename(r"features\\.(\\d+)\\.(\\w+)", r"blocks/\\1/\\2", shift={1: -1})
        >>> shifted.match("features.4.weight"), shifted.inverse().match("blocks/3/weight")
        ('blocks/3/weight', 'features.4.weight')
        >>> mapped = rename(r"features\\.(\\d+)\\.(\\w+)", r"convs/\\1/\\2", index={1: [0, 3, 6, 8]})
        >>> mapped.match("features.6.weight"), mapped.match("features.5.weight"), mapped.inverse().match("convs/3/bias")
        ('convs/2/weight', None, 'features.8.bias')
    """
    tables = tuple((g, _index_pairs(t)) for g, t in (index or {}).items())
    return RenameRule(pattern, replacement, inverse_rule=inverse, shift=tuple((shift or {}).items()), index=tables)


def _index_pairs(table: Sequence[int] | Mapping[int, int]) -> tuple[tuple[int, int], ...]:
    """``(file index, model index)`` pairs of an ``index=`` table."""
    if isinstance(table, Mapping):
        return tuple((a, b) for a, b in table.items())
    return tuple((n, i) for i, n in enumerate(table))


def ignore(pattern: str) -> IgnoreRule:
    """File keys matching ``pattern`` are dropped on purpose (listed in ``KeyMapping.unused``).

    Examples:
        >>> ignore(r"lm_head\\.weight").match("lm_head.weight")
        True
    """
    return IgnoreRule(pattern)


def split(
    pattern: str,
    targets: Sequence[str],
    axis: int = 0,
    *,
    sizes: Sequence[int] | None = None,
    stacked: bool = False,
    inverse: StructuralRule | None = None,
) -> SplitRule | SplitStackRule:
    """One file tensor cut along ``axis`` into the model params ``targets``.

    Args:
        pattern: regex matched against the whole file key.
        targets: one model path template per part, in order along ``axis``.
        axis: the axis to cut (negative counts from the end).
        sizes: the parts' sizes on ``axis``; equal parts when omitted.
        stacked: the pattern's ``(?P<layer>\\d+)`` is a layer index the targets do not
            use: each layer's tensor is cut and each part stacked over the layers on a
            new leading axis (separate q / k / v in a scanned model); refused without it.
        inverse: the rule to use on export, when the automatic inverse is refused.

    Examples:
        >>> rule = split(r"(\\d+)\\.qkv", (r"\\1/q", r"\\1/k", r"\\1/v"), axis=1)
        >>> rule.match("0.qkv")
        ('0/q', '0/k', '0/v')
        >>> scanned = split(r"h\\.(?P<layer>\\d+)\\.qkv", ("q", "k", "v"), axis=1, stacked=True)
        >>> scanned.match("h.3.qkv")
        ('3', ('q', 'k', 'v'))
    """
    cut = None if sizes is None else ints_arg(sizes, "split: sizes")
    names, axis = texts_arg(targets, "split: targets"), int_arg(axis, "split: axis")
    if stacked:
        return SplitStackRule(pattern, names, axis, cut)
    return SplitRule(pattern, names, axis, cut, inverse_rule=inverse)


def add(patterns: Sequence[str], targets: str | Sequence[str], axis: int = 0, *, into: int = 0) -> SumRule:
    """File tensors matching ``patterns`` (one each, of one shape) added into ``targets``.

    For torch's two LSTM biases, only ever added. A sum cannot be undone: on export the
    whole sum goes into part ``into``, zeros into the others, which add back the same.

    Args:
        patterns: one regex per summed part (they must capture the same groups).
        targets: the model path template; several cut the sum along ``axis`` in
            equal parts (one bias per gate).
        axis: the axis to cut when there are several targets.
        into: the part that holds the sum on export.

    Examples:
        >>> rule = add((r"(\\w+)\\.bias_ih", r"(\\w+)\\.bias_hh"), r"\\1/bias")
        >>> rule.match("rnn.bias_hh")
        (1, ('rnn/bias',))
    """
    names = (targets,) if isinstance(targets, str) else texts_arg(targets, "add: targets")
    axis, into = int_arg(axis, "add: axis"), int_arg(into, "add: into")
    return SumRule(texts_arg(patterns, "add: patterns"), names, axis, into)


def tie(source: str, *copies: str, check: bool = True) -> TieRule:
    """The file keys ``copies`` hold the same tensor as ``source`` (a tied head).

    The model keeps one param, read from ``source``. On load each copy is checked equal
    to it (:class:`~nnx_save.porting.RuleError` if not) or, with ``check=False``,
    only listed in ``KeyMapping.tied`` and ``unused``; on export every copy is written too.

    Args:
        source: regex of the file key the model reads.
        copies: templates of the tied keys (``\\1`` etc. from ``source``'s groups).
        check: read the copies on load and check them equal to the source.

    Examples:
        >>> rule = tie(r"transformer\\.wte\\.weight", "lm_head.weight")
        >>> rule.copies_of("transformer.wte.weight"), rule.inverse().writes
        (('lm_head.weight',), True)
    """
    return TieRule(source, tuple(copies), check)


def concat(
    patterns: Sequence[str],
    target: str,
    axis: int = 0,
    *,
    sizes: Sequence[int] | None = None,
    inverse: StructuralRule | None = None,
) -> ConcatRule:
    """File tensors matching ``patterns`` (one each) joined along ``axis`` into ``target``.

    Args:
        patterns: one regex per part, in order along ``axis``.
        target: the model path template (every part must give the same path).
        axis: the axis to join on.
        sizes: the parts' sizes on ``axis``: checked on load, needed to invert.
        inverse: the rule to use on export, when the automatic inverse is refused.

    Examples:
        >>> rule = concat((r"(\\d+)\\.q", r"(\\d+)\\.k"), r"\\1/qk", axis=0)
        >>> rule.match("2.k")
        (1, '2/qk')
    """
    sizes = None if sizes is None else ints_arg(sizes, "concat: sizes")
    parts = texts_arg(patterns, "concat: patterns")
    return ConcatRule(
        parts,
        (text_arg(target, "concat: target"),) * len(parts),
        int_arg(axis, "concat: axis"),
        sizes,
        inverse_rule=inverse,
    )


def stack(
    pattern: str, target: str, axis: int = 0, *, group: str = "layer", inverse: StructuralRule | None = None
) -> StackRule:
    """Per-layer file tensors stacked along ``axis`` into one model param.

    Args:
        pattern: regex with a named group ``(?P<layer>\\d+)`` (see ``group``).
        target: the model path template; it must not reference the layer group.
        axis: where the new layer axis goes.
        group: the name of the layer-index group.
        inverse: the rule to use on export, when the automatic inverse is refused.

    Examples:
        >>> rule = stack(r"h\\.(?P<layer>\\d+)\\.w", "layers/w")
        >>> rule.match("h.7.w")
        ('7', 'layers/w')
    """
    return StackRule(pattern, target, int_arg(axis, "stack: axis"), group, inverse_rule=inverse)


def unstack(
    pattern: str, target: str, axis: int = 0, *, group: str = "layer", inverse: StructuralRule | None = None
) -> UnstackRule:
    """One file tensor cut along ``axis`` into one model param per entry.

    Examples:
        >>> unstack(r"experts\\.w", r"experts/\\g<layer>/w").match("experts.w") is not None
        True
    """
    return UnstackRule(pattern, target, int_arg(axis, "unstack: axis"), group, inverse_rule=inverse)


def transpose(
    pattern: str,
    axes: Sequence[int],
    *,
    of: RenameRule | SplitRule | ConcatRule | StackRule | UnstackRule | None = None,
) -> TransposeRule:
    """Model params matching ``pattern`` hold the file tensor transposed by ``axes``.

    Args:
        pattern: regex matched against the whole model path.
        axes: the permutation, as ``np.transpose`` takes it.
        of: the structural rule whose tensors it transposes, and no other's (what the
            ``torch_*`` helpers make): a path an earlier rule made (first match wins) is
            left alone.

    Examples:
        >>> transpose(r".*/kernel", (1, 0)).inverse().axes
        (1, 0)
    """
    return TransposeRule(pattern, ints_arg(axes, "transpose: axes"), of)


def reshape(pattern: str, shape: Sequence[int], *, source_shape: Sequence[int] | None = None) -> ReshapeRule:
    """Model params matching ``pattern`` hold the file tensor reshaped to ``shape``.

    Args:
        pattern: regex matched against the whole model path.
        shape: the model's shape (one ``-1`` allowed).
        source_shape: the file's shape (one ``-1`` allowed), for export; without it,
            ``Rules.inverse`` needs a recorded mapping.

    Examples:
        >>> reshape("cls", (-1,), source_shape=(1, 1, -1)).inverse().shape
        (1, 1, -1)
    """
    back = None if source_shape is None else ints_arg(source_shape, "reshape: source_shape")
    return ReshapeRule(pattern, ints_arg(shape, "reshape: shape"), back)
