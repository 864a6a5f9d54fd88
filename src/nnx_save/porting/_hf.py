"""HuggingFace / PyTorch layer conventions as ready-made rules (docs/porting.md, "HF / torch
conventions"): ``source`` is a torch module's key prefix regex, ``target`` the NNX module's path.

The transposes find the model path by inverting the rename, so both must be of the simple
invertible form (each group referenced once). A *layer pattern* (``source`` captures
``(?P<layer>\\d+)``, ``target`` does not use it) stacks the layers on a new leading axis.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from ._compose import SumRule
from ._constructors import add, rename, split, stack
from ._errors import RuleError
from ._rules import ConstantRule, IgnoreRule, RenameRule, SplitRule, StackRule, TransposeRule
from ._template import Template, compile_pattern, int_arg, invert

Shift = Mapping[int | str, int] | None
Index = Mapping[int | str, Sequence[int]] | None
LAYER = "layer"  # the named group of a layer pattern
TORCH_LINEAR_AXES = (1, 0)
"""torch ``Linear.weight`` (out, in) -> NNX ``Linear.kernel`` (in, out)."""


def torch_conv_axes(spatial_dims: int) -> tuple[int, ...]:
    """torch conv ``weight`` (out, in, *k) -> NNX ``Conv.kernel`` (*k, in, out).

    Examples:
        >>> torch_conv_axes(2)
        (2, 3, 1, 0)
    """
    return (*range(2, 2 + int_arg(spatial_dims, "torch_conv_axes: spatial_dims", 1, 3)), 1, 0)


def _stacked(source: str, target: str) -> bool:
    """A layer pattern: ``source`` captures ``(?P<layer>...)`` and ``target`` ignores it,
    so the helper stacks the layers into one param (scanned layers)."""
    regex = compile_pattern(source)
    number = regex.groupindex.get(LAYER)
    return number is not None and not {LAYER, number} & set(Template.parse(target).refs)


def _param(
    source: str, target: str, name: str, param: str, shift: Shift = None, index: Index = None
) -> RenameRule | StackRule:
    if _stacked(source, target):
        if shift or index:
            raise RuleError(f"shift= / index= do not apply to stacked layers ({source!r} -> {target!r})")
        return stack(f"{source}\\.{name}", f"{target}/{param}")
    return _renamed(source, target, name, param, shift, index)


def _renamed(source: str, target: str, name: str, param: str, shift: Shift = None, index: Index = None) -> RenameRule:
    return rename(f"{source}\\.{name}", f"{target}/{param}", shift=shift, index=index)


def _transposed(
    source: str,
    target: str,
    axes: tuple[int, ...],
    shift: Shift = None,
    names: tuple[str, str] = ("weight", "kernel"),
    index: Index = None,
) -> tuple[RenameRule | StackRule, TransposeRule]:
    weight = _param(source, target, *names, shift, index)
    return weight, owned_transpose(weight, axes)


def owned_transpose(weight: RenameRule | StackRule, axes: tuple[int, ...]) -> TransposeRule:
    """The transpose of the tensors ``weight`` makes, and of no other (see ``TransposeRule.of``)."""
    if isinstance(weight, StackRule):  # the layer axis leads and stays put
        model_pattern, _ = invert(weight.pattern, weight.target, consumed=LAYER)
        return TransposeRule(model_pattern, (0, *(a + 1 for a in axes)), weight)
    inverse = weight.inverse()
    assert isinstance(inverse, RenameRule)
    return TransposeRule(inverse.pattern, axes, weight)


def _bias(
    source: str, target: str, bias: bool, shift: Shift = None, index: Index = None
) -> tuple[RenameRule | StackRule, ...]:
    return (_param(source, target, "bias", "bias", shift, index),) if bias else ()


def torch_linear(
    source: str,
    target: str,
    *,
    bias: bool = True,
    shift: Shift = None,
    index: Index = None,
    weight: str = "weight",
    kernel: str = "kernel",
) -> tuple[RenameRule | StackRule | TransposeRule, ...]:
    """``nn.Linear``: ``weight`` transposed into ``kernel``, ``bias`` as is
    (``shift`` / ``index``: as in :func:`~nnx_save.porting.rename`; a layer pattern stacks).
    The transpose applies only to the kernels this helper's rename makes; ``weight`` /
    ``kernel`` name the tensors when they are not a linear module's.

    Examples:
        >>> [str(r) for r in torch_linear(r"fc", "fc", bias=False)]
        ['rename(r"fc\\\\.weight", r"fc/kernel")', 'transpose(r"fc/kernel", (1, 0))']
        >>> [str(r) for r in torch_linear(r"h\\.(?P<layer>\\d+)\\.fc", "blocks/fc", bias=False)]
        ['stack(r"h\\\\.(?P<layer>\\\\d+)\\\\.fc\\\\.weight", r"blocks/fc/kernel", axis=0)', 'transpose(r"blocks/fc/kernel", (0, 2, 1))']
    """
    return (
        *_transposed(source, target, TORCH_LINEAR_AXES, shift, (weight, kernel), index),
        *_bias(source, target, bias, shift, index),
    )


def hf_conv1d(source: str, target: str, *, bias: bool = True) -> tuple[RenameRule | StackRule, ...]:
    """HF ``Conv1D`` (GPT-2 family) already stores (in, out): renamed, not transposed."""
    return (_param(source, target, "weight", "kernel"), *_bias(source, target, bias))


def torch_conv(
    source: str,
    target: str,
    *,
    spatial_dims: int = 2,
    bias: bool = True,
    shift: Shift = None,
    index: Index = None,
    weight: str = "weight",
    kernel: str = "kernel",
) -> tuple[RenameRule | StackRule | TransposeRule, ...]:
    """``nn.Conv{n}d``: ``weight`` (out, in, *k) into ``kernel`` (*k, in, out)
    (``shift`` / ``index``: as in :func:`~nnx_save.porting.rename`; a layer pattern stacks).

    ``weight`` / ``kernel`` name the tensors when they are not a conv module's (a filter
    bank kept as a buffer). Give the NNX conv torch's explicit padding, not ``'SAME'``
    (docs/porting.md, "CNNs").
    """
    axes = torch_conv_axes(spatial_dims)
    return (
        *_transposed(source, target, axes, shift, (weight, kernel), index),
        *_bias(source, target, bias, shift, index),
    )


def torch_embedding(
    source: str, target: str, *, shift: Shift = None, index: Index = None
) -> tuple[RenameRule | StackRule, ...]:
    """``nn.Embedding``: ``weight`` into ``embedding``."""
    return (_param(source, target, "weight", "embedding", shift, index),)


def torch_layer_norm(
    source: str, target: str, *, bias: bool = True, shift: Shift = None, index: Index = None
) -> tuple[RenameRule | StackRule, ...]:
    """``nn.LayerNorm`` (and ``nn.GroupNorm``: :func:`torch_group_norm`): ``weight`` into
    ``scale``, ``bias`` as is (a layer pattern stacks)."""
    return (_param(source, target, "weight", "scale", shift, index), *_bias(source, target, bias, shift, index))


def torch_rms_norm(source: str, target: str) -> tuple[RenameRule | StackRule, ...]:
    """RMS norms (Llama's ``LlamaRMSNorm``): ``weight`` into ``scale``; Gemma's
    ``weight = scale - 1`` is a value change these rules do not make."""
    return (_param(source, target, "weight", "scale"),)


def torch_batch_norm(
    source: str, target: str, *, affine: bool = True, shift: Shift = None, index: Index = None
) -> tuple[RenameRule | IgnoreRule, ...]:
    """``nn.BatchNorm{1,2,3}d``: ``weight`` / ``bias`` into ``scale`` / ``bias``,
    ``running_mean`` / ``running_var`` into ``mean`` / ``var``; ``num_batches_tracked``
    is ignored (NNX keeps no such count) and written as 0 on export. torch's defaults
    are ``nnx.BatchNorm(..., epsilon=1e-5, momentum=0.9)``.

    Examples:
        >>> [r.match("features.0.1.running_var") for r in torch_batch_norm(r"features\\.0\\.1", "stem/bn")][3]
        'stem/bn/var'
    """
    if _stacked(source, target):
        raise RuleError(f"torch_batch_norm does not stack layers ({source!r} -> {target!r}): give each its path")
    params = (
        _renamed(source, target, "weight", "scale", shift, index),
        _renamed(source, target, "bias", "bias", shift, index),
    )
    running_mean = _renamed(source, target, "running_mean", "mean", shift, index)
    return (
        *(params if affine else ()),
        running_mean,
        _renamed(source, target, "running_var", "var", shift, index),
        IgnoreRule(f"{source}\\.num_batches_tracked", export=_batches_tracked(running_mean)),
    )


def _batches_tracked(running_mean: RenameRule) -> ConstantRule:
    """On export: ``num_batches_tracked`` = 0 next to each ``running_mean`` this rule
    writes (and no other), as torch expects."""
    inverse = running_mean.inverse()
    assert isinstance(inverse, RenameRule)
    key = inverse.replacement.removesuffix("running_mean") + "num_batches_tracked"
    return ConstantRule(replace(inverse, replacement=key, inverse_rule=None), 0, "int64", of=inverse)


LSTM_GATES = (("ii", "if_", "ig", "io"), ("hi", "hf", "hg", "ho"))
"""``nnx.LSTMCell``'s input and hidden Linear layers, in torch's gate order (i, f, g, o)."""


def torch_lstm(
    source: str,
    target: str,
    *,
    layer: int | None = 0,
    reverse: bool = False,
    cell: str = "lstm",
    layers: int | None = None,
    bidirectional: bool = False,
    directions: tuple[str, str] = ("forward_rnn", "backward_rnn"),
) -> tuple[RenameRule | SplitRule | TransposeRule | SumRule, ...]:
    """torch's ``nn.LSTM`` (one layer and direction, or all of them) or an ``nn.LSTMCell``
    into flax LSTM cells.

    torch's weights stack the gates (i, f, g, o) and its two biases are added into
    flax's one (on export: the sum as ``bias_ih``, zeros as ``bias_hh``, or, against the
    source file, its own two biases; see :func:`add`). ``cell="lstm"`` cuts each weight
    into the gates' kernels (``ii`` ... ``ho``, transposed); ``cell="optimized"`` keeps
    them fused in ``dense_i`` / ``dense_h``.

    Args:
        source: regex of the torch module's key prefix (``r"rnn"``).
        target: the flax cell's path template (``"rnn/cell"``); with ``layers`` it holds
            ``{layer}``, with ``bidirectional`` ``{direction}`` (``"rnn/{layer}/{direction}/cell"``).
        layer: the ``nn.LSTM`` layer (keys ``weight_ih_l{layer}``); ``None`` for an
            ``nn.LSTMCell`` (keys ``weight_ih``).
        reverse: the backward direction of a bidirectional layer (``..._reverse``).
        cell: ``"lstm"`` (``nnx.LSTMCell``) or ``"optimized"`` (``nnx.OptimizedLSTMCell``).
        layers: port layers ``0 .. layers-1`` at once (``layer`` is then unused).
        bidirectional: port both directions (``reverse`` is then unused).
        directions: the names ``{direction}`` takes, forward then backward
            (``nnx.Bidirectional``'s ``forward_rnn`` / ``backward_rnn``).

    Raises:
        RuleError: an unknown ``cell``, or a ``target`` without the ``{layer}`` /
            ``{direction}`` fields that ``layers`` / ``bidirectional`` fill.

    Examples:
        >>> rules = torch_lstm(r"rnn", "rnn/cell", cell="optimized")
        >>> [str(r) for r in rules][-1]
        'add((r"rnn\\\\.bias_ih_l0", r"rnn\\\\.bias_hh_l0"), (r"rnn/cell/dense_h/bias"), axis=0, into=0)'
        >>> both = torch_lstm(r"lstm", "lstm/{layer}/{direction}/cell", layers=2, bidirectional=True)
        >>> sorted({r.targets[0].rsplit("/", 3)[0] for r in both if isinstance(r, SplitRule)})
        ['lstm/0/backward_rnn', 'lstm/0/forward_rnn', 'lstm/1/backward_rnn', 'lstm/1/forward_rnn']
    """
    if not isinstance(cell, str) or cell not in ("lstm", "optimized"):
        raise RuleError(f"torch_lstm: cell must be 'lstm' or 'optimized', got {cell!r}")
    return each_layer(
        "torch_lstm",
        target,
        (layer, layers, reverse, bidirectional),
        directions,
        lambda at, number, back: _lstm_layer(source, at, number, back, cell),
    )


def each_layer(
    name: str,
    target: str,
    which: tuple[int | None, int | None, bool, bool],
    directions: tuple[str, str],
    one: Callable[[str, int | None, bool], tuple[Any, ...]],
) -> tuple[Any, ...]:
    """The rules of a torch recurrent module: ``one(target, layer, reverse)`` for one
    layer and direction, or for each of ``layers`` and both directions, the target's
    ``{layer}`` / ``{direction}`` filled in. ``which``: ``(layer, layers, reverse,
    bidirectional)`` as the helper ``name`` was given them."""
    layer, layers, reverse, bidirectional = which
    if layers is None and not bidirectional:
        return one(target, layer, reverse)
    fields = (("{layer}", layers is not None), ("{direction}", bidirectional))
    absent = [field for field, needed in fields if needed and field not in target]
    if absent:
        raise RuleError(
            f"{name}: target {target!r} needs the field(s) {', '.join(absent)} that layers= / bidirectional= fill"
        )
    numbers = [layer] if layers is None else list(range(int_arg(layers, f"{name}: layers", 1, 4096)))
    sides = (False, True) if bidirectional else (reverse,)
    return tuple(
        rule
        for number in numbers
        for back in sides
        for rule in one(target.format(layer=number, direction=directions[back]), number, back)
    )


def _lstm_layer(
    source: str, target: str, layer: int | None, reverse: bool, cell: str
) -> tuple[RenameRule | SplitRule | TransposeRule | SumRule, ...]:
    tail = ("" if layer is None else f"_l{int_arg(layer, 'torch_lstm: layer', 0)}") + ("_reverse" if reverse else "")
    key = {n: f"{source}\\.{n}{tail}" for n in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")}
    biases = (key["bias_ih"], key["bias_hh"])
    if cell == "optimized":
        weights = [
            _linear_kernel(key[n], f"{target}/{d}/kernel")
            for n, d in (("weight_ih", "dense_i"), ("weight_hh", "dense_h"))
        ]
        return (*weights[0], *weights[1], add(biases, f"{target}/dense_h/bias"))
    rules: list[RenameRule | SplitRule | TransposeRule | SumRule] = []
    for name, gates in zip(("weight_ih", "weight_hh"), LSTM_GATES, strict=True):
        cut = split(key[name], [f"{target}/{g}/kernel" for g in gates], axis=0)
        assert isinstance(cut, SplitRule)
        rules += [cut, *(TransposeRule(invert(cut.pattern, t)[0], TORCH_LINEAR_AXES, cut) for t in cut.targets)]
    return (*rules, add(biases, [f"{target}/{g}/bias" for g in LSTM_GATES[1]], axis=0))


def _linear_kernel(key: str, path: str) -> tuple[RenameRule, TransposeRule]:
    weight = rename(key, path)
    return weight, owned_transpose(weight, TORCH_LINEAR_AXES)
