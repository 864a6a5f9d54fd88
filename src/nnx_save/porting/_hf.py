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
=================  =======================  ==================================

The transposes select the model path by inverting the rename, so ``source`` and
``target`` must be of the simple invertible form (each group referenced once).
"""

from __future__ import annotations

from ._constructors import rename, transpose
from ._rules import RenameRule, TransposeRule
from ._template import invert

__all__ = [
    "TORCH_LINEAR_AXES",
    "hf_conv1d",
    "torch_conv",
    "torch_conv_axes",
    "torch_embedding",
    "torch_layer_norm",
    "torch_linear",
    "torch_rms_norm",
]

TORCH_LINEAR_AXES = (1, 0)
"""torch ``Linear.weight`` (out, in) -> NNX ``Linear.kernel`` (in, out)."""


def torch_conv_axes(spatial_dims: int) -> tuple[int, ...]:
    """torch conv ``weight`` (out, in, *k) -> NNX ``Conv.kernel`` (*k, in, out).

    Examples:
        >>> torch_conv_axes(2)
        (2, 3, 1, 0)
    """
    return (*range(2, 2 + spatial_dims), 1, 0)


def _param(source: str, target: str, name: str, param: str) -> RenameRule:
    return rename(f"{source}\\.{name}", f"{target}/{param}")


def _transposed(source: str, target: str, axes: tuple[int, ...]) -> tuple[RenameRule, TransposeRule]:
    weight = _param(source, target, "weight", "kernel")
    model_pattern, _ = invert(weight.pattern, weight.replacement)
    return weight, transpose(model_pattern, axes)


def _bias(source: str, target: str, bias: bool) -> tuple[RenameRule, ...]:
    return (_param(source, target, "bias", "bias"),) if bias else ()


def torch_linear(source: str, target: str, *, bias: bool = True) -> tuple[RenameRule | TransposeRule, ...]:
    """``nn.Linear``: ``weight`` transposed into ``kernel``, ``bias`` as is.

    Examples:
        >>> [str(r) for r in torch_linear(r"fc", "fc", bias=False)]
        ['rename(r"fc\\\\.weight", r"fc/kernel")', 'transpose(r"fc/kernel", (1, 0))']
    """
    return (*_transposed(source, target, TORCH_LINEAR_AXES), *_bias(source, target, bias))


def hf_conv1d(source: str, target: str, *, bias: bool = True) -> tuple[RenameRule, ...]:
    """HF ``Conv1D`` (GPT-2 family) already stores (in, out): renamed, not transposed."""
    return (_param(source, target, "weight", "kernel"), *_bias(source, target, bias))


def torch_conv(
    source: str, target: str, *, spatial_dims: int = 2, bias: bool = True
) -> tuple[RenameRule | TransposeRule, ...]:
    """``nn.Conv{n}d``: ``weight`` (out, in, *k) into ``kernel`` (*k, in, out)."""
    return (*_transposed(source, target, torch_conv_axes(spatial_dims)), *_bias(source, target, bias))


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
