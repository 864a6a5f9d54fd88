"""HuggingFace / PyTorch layer conventions as ready-made rule pairs.

Each helper takes ``source``, a regex for a torch module's key prefix (without the
trailing ``.weight``), and ``target``, the NNX module's path template (without the
trailing ``/kernel``), and returns the rules for that module's parameters:

=================  =======================  ==================================
torch module       file tensor              NNX param
=================  =======================  ==================================
``nn.Linear``      ``weight`` (out, in)     ``kernel`` (in, out), transposed
HF ``Conv1D``      ``weight`` (in, out)     ``kernel`` (in, out), as is
``nn.Conv{1,2,3}d`` ``weight`` (out, in, *k) ``kernel`` (*k, in, out)
``nn.Embedding``   ``weight`` (vocab, dim)  ``embedding`` (vocab, dim)
``nn.LayerNorm``   ``weight``, ``bias``     ``scale``, ``bias``
RMS norms          ``weight``               ``scale``
``nn.BatchNorm*``  ``weight``, ``bias``,    ``scale``, ``bias``, ``mean``,
                   ``running_mean/var``     ``var``; ``num_batches_tracked``
                                            ignored on load
=================  =======================  ==================================

The transposes select the model path by inverting the rename, so ``source`` and
``target`` must be of the simple invertible form (each group referenced once).
"""

from __future__ import annotations

from collections.abc import Mapping

from ._constructors import rename, transpose
from ._rules import ConstantRule, IgnoreRule, RenameRule, TransposeRule
from ._template import invert

__all__ = [
    "TORCH_LINEAR_AXES",
    "hf_conv1d",
    "torch_batch_norm",
    "torch_conv",
    "torch_conv_axes",
    "torch_embedding",
    "torch_layer_norm",
    "torch_linear",
    "torch_rms_norm",
]

Shift = Mapping[int | str, int] | None
TORCH_LINEAR_AXES = (1, 0)
"""torch ``Linear.weight`` (out, in) -> NNX ``Linear.kernel`` (in, out)."""


def torch_conv_axes(spatial_dims: int) -> tuple[int, ...]:
    """torch conv ``weight`` (out, in, *k) -> NNX ``Conv.kernel`` (*k, in, out).

    Examples:
        >>> torch_conv_axes(2)
        (2, 3, 1, 0)
    """
    return (*range(2, 2 + spatial_dims), 1, 0)


def _param(source: str, target: str, name: str, param: str, shift: Shift = None) -> RenameRule:
    return rename(f"{source}\\.{name}", f"{target}/{param}", shift=shift)


def _transposed(
    source: str, target: str, axes: tuple[int, ...], shift: Shift = None
) -> tuple[RenameRule, TransposeRule]:
    weight = _param(source, target, "weight", "kernel", shift)
    model_pattern, _ = invert(weight.pattern, weight.replacement)
    return weight, transpose(model_pattern, axes)


def _bias(source: str, target: str, bias: bool, shift: Shift = None) -> tuple[RenameRule, ...]:
    return (_param(source, target, "bias", "bias", shift),) if bias else ()


def torch_linear(
    source: str, target: str, *, bias: bool = True, shift: Shift = None
) -> tuple[RenameRule | TransposeRule, ...]:
    """``nn.Linear``: ``weight`` transposed into ``kernel``, ``bias`` as is
    (``shift``: as in :func:`~nnx_save.porting.rename`).

    Examples:
        >>> [str(r) for r in torch_linear(r"fc", "fc", bias=False)]
        ['rename(r"fc\\\\.weight", r"fc/kernel")', 'transpose(r"fc/kernel", (1, 0))']
    """
    return (*_transposed(source, target, TORCH_LINEAR_AXES, shift), *_bias(source, target, bias, shift))


def hf_conv1d(source: str, target: str, *, bias: bool = True) -> tuple[RenameRule, ...]:
    """HF ``Conv1D`` (GPT-2 family) already stores (in, out): renamed, not transposed."""
    return (_param(source, target, "weight", "kernel"), *_bias(source, target, bias))


def torch_conv(
    source: str, target: str, *, spatial_dims: int = 2, bias: bool = True, shift: Shift = None
) -> tuple[RenameRule | TransposeRule, ...]:
    """``nn.Conv{n}d``: ``weight`` (out, in, *k) into ``kernel`` (*k, in, out)
    (``shift``: as in :func:`~nnx_save.porting.rename`).

    torch pads symmetrically (``padding=1`` on a 3x3 kernel: one row / column on
    each side); give the NNX conv the same explicit padding, ``padding=((1, 1), (1, 1))``.
    ``'SAME'`` agrees for stride 1 and odd kernels, but with stride 2 it pads the
    bottom / right more than the top / left, and the outputs differ.
    """
    axes = torch_conv_axes(spatial_dims)
    return (*_transposed(source, target, axes, shift), *_bias(source, target, bias, shift))


def torch_embedding(source: str, target: str) -> tuple[RenameRule, ...]:
    """``nn.Embedding``: ``weight`` into ``embedding``."""
    return (_param(source, target, "weight", "embedding"),)


def torch_layer_norm(source: str, target: str, *, bias: bool = True) -> tuple[RenameRule, ...]:
    """``nn.LayerNorm``: ``weight`` into ``scale``, ``bias`` as is."""
    return (_param(source, target, "weight", "scale"), *_bias(source, target, bias))


def torch_rms_norm(source: str, target: str) -> tuple[RenameRule, ...]:
    """RMS norms (Llama's ``LlamaRMSNorm``): ``weight`` into ``scale``.

    Some families (Gemma) store ``weight`` as ``scale - 1``; that is a value change,
    not a layout change, and these rules do not do it.
    """
    return (_param(source, target, "weight", "scale"),)


def torch_batch_norm(
    source: str, target: str, *, affine: bool = True, shift: Shift = None
) -> tuple[RenameRule | IgnoreRule, ...]:
    """``nn.BatchNorm{1,2,3}d``: ``weight`` / ``bias`` into ``scale`` / ``bias``,
    ``running_mean`` / ``running_var`` into ``mean`` / ``var`` (``nnx.BatchNorm``'s
    batch statistics); ``num_batches_tracked`` is ignored (NNX keeps no such count),
    and written as 0 on export (``rules.inverse()``), as torch expects the buffer.

    torch's ``eps`` (1e-5) and ``momentum`` (0.1, weighting the *new* batch) are
    ``nnx.BatchNorm(..., epsilon=1e-5, momentum=0.9)`` (weighting the running value).

    Examples:
        >>> [r.match("features.0.1.running_var") for r in torch_batch_norm(r"features\\.0\\.1", "stem/bn")][3]
        'stem/bn/var'
    """
    params = (_param(source, target, "weight", "scale", shift), *_bias(source, target, True, shift)) if affine else ()
    running_mean = _param(source, target, "running_mean", "mean", shift)
    return (
        *params,
        running_mean,
        _param(source, target, "running_var", "var", shift),
        IgnoreRule(f"{source}\\.num_batches_tracked", export=_batches_tracked(running_mean)),
    )


def _batches_tracked(running_mean: RenameRule) -> ConstantRule:
    """On export: ``num_batches_tracked`` = 0 next to each ``running_mean``, so torch's
    ``load_state_dict(strict=True)`` and transformers find every buffer they expect."""
    inverse = running_mean.inverse()
    assert isinstance(inverse, RenameRule)
    key = inverse.replacement.removesuffix("running_mean") + "num_batches_tracked"
    return ConstantRule(RenameRule(inverse.pattern, key, shift=inverse.shift), 0, "int64")
