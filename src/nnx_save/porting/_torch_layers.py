"""More torch layers as ready-made rules, with the keywords the other ``torch_*`` helpers
take (``bias``, ``shift``, ``index``, ``weight`` / ``kernel``): ``nn.ConvTranspose{n}d``,
``nn.GroupNorm`` and ``nn.GRU`` (docs/porting.md, "torch layer -> helper -> flax module").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ._computed import ComputeRule, compute
from ._errors import RuleError
from ._hf import TORCH_LINEAR_AXES, Index, Shift, _bias, _transposed, each_layer, torch_conv_axes, torch_layer_norm
from ._rules import RenameRule, StackRule, TransposeRule
from ._template import int_arg

__all__ = ["GruBias", "GruBiasInverse", "torch_conv_transpose", "torch_group_norm", "torch_gru"]


def torch_conv_transpose(
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
    """``nn.ConvTranspose{n}d``: ``weight`` (in, out, *k) into an
    ``nnx.ConvTranspose(..., transpose_kernel=True)``'s ``kernel`` (*k, out, in), ``bias``
    as is. torch's ``padding=p`` is flax's ``padding=((k - 1 - p, k - 1 - p), ...)``
    (``k``: the kernel size on each axis); ``groups`` above 1 has no flax counterpart.

    Examples:
        >>> [str(r) for r in torch_conv_transpose(r"up", "up", spatial_dims=1, bias=False)]
        ['rename(r"up\\\\.weight", r"up/kernel")', 'transpose(r"up/kernel", (2, 1, 0))']
    """
    axes = torch_conv_axes(spatial_dims)
    return (
        *_transposed(source, target, axes, shift, (weight, kernel), index),
        *_bias(source, target, bias, shift, index),
    )


def torch_group_norm(
    source: str, target: str, *, bias: bool = True, shift: Shift = None, index: Index = None
) -> tuple[RenameRule | StackRule, ...]:
    """``nn.GroupNorm(G, C)``: ``weight`` into ``scale``, ``bias`` as is, for
    ``nnx.GroupNorm(C, num_groups=G, epsilon=1e-5)`` (torch's default epsilon); ``bias``
    is ``affine``."""
    return torch_layer_norm(source, target, bias=bias, shift=shift, index=index)


@dataclass(frozen=True)
class GruBias:
    """torch's two GRU biases (gates r, z, n) into ``nnx.GRUCell``'s one input bias:
    ``b_ih + b_hh`` on r and z, ``b_ih`` on n; torch's hidden bias of n (inside ``r * (W h
    + b)``) has no place in the cell and must be zero."""

    key: str = "bias_hh"

    @property
    def __name__(self) -> str:
        return "gru_bias"

    def __call__(self, ih: np.ndarray, hh: np.ndarray) -> np.ndarray:
        h = ih.shape[0] // 3
        if np.any(hh[2 * h :] != 0):
            raise RuleError(
                f"`{self.key}`: torch's GRU keeps a hidden bias on the candidate gate n (entries "
                f"{2 * h}..{3 * h - 1}, max |value| {float(np.max(np.abs(hh[2 * h :]))):.3g}) that nnx.GRUCell has no "
                "param for: this GRU cannot be ported exactly into nnx.GRUCell (zero it in torch, or give the "
                "model a cell with that bias)"
            )
        return np.concatenate([ih[: 2 * h] + hh[: 2 * h], ih[2 * h :]])


@dataclass(frozen=True)
class GruBiasInverse:
    """The cell's bias as ``b_ih``, zeros as ``b_hh`` (which torch adds back to the same)."""

    @property
    def __name__(self) -> str:
        return "gru_bias_inverse"

    def __call__(self, bias: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return bias, np.zeros_like(bias)


def torch_gru(
    source: str,
    target: str,
    *,
    layer: int | None = 0,
    reverse: bool = False,
    layers: int | None = None,
    bidirectional: bool = False,
    directions: tuple[str, str] = ("forward_rnn", "backward_rnn"),
) -> tuple[RenameRule | StackRule | TransposeRule | ComputeRule, ...]:
    """``nn.GRU`` (one layer and direction, or all of them) or ``nn.GRUCell`` into
    ``nnx.GRUCell``: ``weight_ih`` / ``weight_hh`` (gates r, z, n stacked, as flax splits
    them) transposed into ``dense_i`` / ``dense_h`` kernels, the two biases into
    ``dense_i/bias`` (see :class:`GruBias`: torch's hidden bias of gate n must be zero,
    else :class:`RuleError`). The keywords are :func:`torch_lstm`'s.

    Args:
        source: regex of the torch module's key prefix.
        target: the flax cell's path template; with ``layers`` it holds ``{layer}``, with
            ``bidirectional`` ``{direction}``.
        layer: the ``nn.GRU`` layer (keys ``weight_ih_l{layer}``); ``None`` for an ``nn.GRUCell``.
        reverse: the backward direction of a bidirectional layer.
        layers: port layers ``0 .. layers-1`` at once.
        bidirectional: port both directions.
        directions: the names ``{direction}`` takes, forward then backward.

    Examples:
        >>> [str(r) for r in torch_gru(r"gru", "rnn/cell")][0]
        'rename(r"gru\\\\.weight_ih_l0", r"rnn/cell/dense_i/kernel")'
        >>> len(torch_gru(r"gru", "rnn/{layer}/{direction}/cell", layers=2, bidirectional=True))
        20
    """
    return each_layer(
        "torch_gru", target, (layer, layers, reverse, bidirectional), directions, functools.partial(_gru_layer, source)
    )


def _gru_layer(
    source: str, target: str, layer: int | None, reverse: bool
) -> tuple[RenameRule | StackRule | TransposeRule | ComputeRule, ...]:
    tail = ("" if layer is None else f"_l{int_arg(layer, 'torch_gru: layer', 0)}") + ("_reverse" if reverse else "")
    weights = [
        rule
        for name, dense in (("weight_ih", "dense_i"), ("weight_hh", "dense_h"))
        for rule in _transposed(source, f"{target}/{dense}", TORCH_LINEAR_AXES, names=(f"{name}{tail}", "kernel"))
    ]
    biases = (f"{source}\\.bias_ih{tail}", f"{source}\\.bias_hh{tail}")
    bias = compute(biases, f"{target}/dense_i/bias", GruBias(f"bias_hh{tail}"), inverse=GruBiasInverse(), tolerance=0)
    return (*weights, bias)
