"""torch's weight norm as a computed rule: ``w = g * v / ||v||`` (norm over every axis
but ``dim``) into a plain kernel, and back (``g = ||w||``, ``v = w``).

Both of torch's namings: ``torch.nn.utils.weight_norm`` keeps ``weight_g`` /
``weight_v``; ``torch.nn.utils.parametrizations.weight_norm`` keeps
``parametrizations.weight.original0`` / ``original1``. ``dim=None`` (torch also takes
``-1`` for it) normalizes the whole tensor with one scalar ``g``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from ._computed import ComputeRule, compute
from ._errors import RuleError
from ._hf import TORCH_LINEAR_AXES, _bias, torch_conv_axes
from ._rules import TransposeRule
from ._template import int_arg, invert, text_arg

__all__ = ["WEIGHT_NORM_NAMES", "WeightNorm", "WeightNormInverse", "torch_weight_norm", "weight_norm"]

Shape = tuple[int, ...]
WEIGHT_NORM_NAMES = {
    "weight_g": ("{weight}_g", "{weight}_v"),
    "parametrizations": ("parametrizations.{weight}.original0", "parametrizations.{weight}.original1"),
}
"""torch's two namings of a weight-normed parameter's ``g`` and ``v``."""


def _axes(ndim: int, dim: int | None) -> tuple[int, ...]:
    """The axes the norm runs over: all but ``dim`` (all, for ``None``)."""
    return tuple(range(ndim)) if dim is None else tuple(a for a in range(ndim) if a != dim)


def _norm(x: np.ndarray, dim: int | None) -> np.ndarray:
    """``||x||`` over every axis but ``dim``, kept as size-1 axes (0-d for ``None``), in
    the dtype of ``x`` (computed in float32 at least)."""
    wide = x.astype(np.promote_types(x.dtype, np.float32))
    out = np.sqrt(np.sum(wide * wide, axis=_axes(x.ndim, dim), keepdims=dim is not None))
    return np.asarray(out.astype(x.dtype))


def g_shape(shape: Shape, dim: int | None) -> Shape | None:
    """``g``'s shape for a weight of ``shape`` (``None``: ``dim`` is out of range)."""
    if dim is None:
        return ()
    return tuple(d if a == dim else 1 for a, d in enumerate(shape)) if 0 <= dim < len(shape) else None


@dataclass(frozen=True)
class WeightNorm:
    """``w = v * (g / ||v||)``, as torch computes it."""

    dim: int | None = 0

    @property
    def __name__(self) -> str:
        return f"weight_norm(dim={self.dim})"

    def __call__(self, g: np.ndarray, v: np.ndarray) -> np.ndarray:
        wide = np.promote_types(v.dtype, np.float32)
        with np.errstate(invalid="ignore", divide="ignore"):  # a zero v makes NaN, as in torch
            w = v.astype(wide) * (g.astype(wide) / _norm(v, self.dim).astype(wide))
        return np.asarray(w.astype(v.dtype))

    def shape(self, g: Shape, v: Shape) -> Shape | None:
        """``v``'s shape, where ``g`` has the shape weight norm gives it."""
        return v if g_shape(v, self.dim) == tuple(g) else None


@dataclass(frozen=True)
class WeightNormInverse:
    """``(g, v) = (||w||, w)``: ``v * (g / ||v||)`` gives ``w`` back (``x / x`` is 1)."""

    dim: int | None = 0

    @property
    def __name__(self) -> str:
        return f"weight_norm_inverse(dim={self.dim})"

    def __call__(self, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return _norm(w, self.dim), w

    def shapes(self, shape: Shape) -> tuple[Shape, Shape] | None:
        g = g_shape(shape, self.dim)
        return None if g is None else (g, shape)


def _dim(dim: int | None) -> int | None:
    if dim is None or dim == -1:  # torch's weight_norm reads -1 as None: the whole tensor
        return None
    return int_arg(dim, "weight_norm: dim", 0, 64)


def weight_norm(
    source: str, target: str, *, dim: int | None = 0, names: str = "weight_g", weight: str = "weight"
) -> ComputeRule:
    """torch's weight-normed ``{source}.{weight}`` (its ``g`` and ``v``) into the one
    model param ``target``: ``w = g * v / ||v||``, the norm over every axis but ``dim``.

    Args:
        source: regex of the torch module's key prefix.
        target: the model path template (the whole param: ``"head/kernel"``).
        dim: torch's ``dim`` (``None`` or ``-1``: one ``g`` for the whole tensor).
        names: ``"weight_g"`` (``weight_g`` / ``weight_v``, ``torch.nn.utils.weight_norm``)
            or ``"parametrizations"`` (``parametrizations.weight.original0`` / ``original1``).
        weight: the normed parameter's name.

    Examples:
        >>> import numpy as np
        >>> from nnx_save.porting import Rules, weight_norm
        >>> rules = Rules(weight_norm(r"head", "head/w"))
        >>> g, v = np.full((2, 1), 2.0, np.float32), np.array([[3, 4], [0, 5]], np.float32)
        >>> rules.mapping({"head.weight_g": g, "head.weight_v": v}).apply({"head.weight_g": g, "head.weight_v": v})["head/w"].tolist()
        [[1.2000000476837158, 1.600000023841858], [0.0, 2.0]]
    """
    if not isinstance(names, str) or names not in WEIGHT_NORM_NAMES:
        raise RuleError(f"weight_norm: names must be one of {sorted(WEIGHT_NORM_NAMES)}, got {str(names)[:80]!r}")
    source, weight = text_arg(source, "weight_norm: source"), text_arg(weight, "weight_norm: weight")
    at = _dim(dim)
    parts = [f"{source}\\.{re.escape(n.format(weight=weight))}" for n in WEIGHT_NORM_NAMES[names]]
    fn, back = WeightNorm(at), WeightNormInverse(at)
    return compute(parts, target, fn, inverse=back, shape=fn.shape, part_shapes=back.shapes, tolerance=4.0)


def torch_weight_norm(
    source: str,
    target: str,
    *,
    spatial_dims: int = 0,
    dim: int | None = 0,
    names: str = "weight_g",
    bias: bool = True,
    weight: str = "weight",
    kernel: str = "kernel",
) -> tuple[ComputeRule | TransposeRule, ...]:
    """A weight-normed ``nn.Linear`` (``spatial_dims=0``) or ``nn.Conv{n}d`` into a plain
    ``nnx.Linear`` / ``nnx.Conv``: :func:`weight_norm` into ``kernel``, transposed as
    :func:`torch_linear` / :func:`torch_conv` transpose it, and ``bias`` as is.

    Args:
        source / target: as for :func:`torch_linear`.
        spatial_dims: 0 for a linear layer, 1 to 3 for a conv.
        dim / names: as for :func:`weight_norm`.
        bias: the layer has a bias.
        weight / kernel: the torch and NNX names of the normed parameter.

    Examples:
        >>> [str(r) for r in torch_weight_norm(r"head", "head", bias=False)][1]
        'transpose(r"head/kernel", (1, 0))'
    """
    spatial = int_arg(spatial_dims, "torch_weight_norm: spatial_dims", 0, 3)
    axes = TORCH_LINEAR_AXES if spatial == 0 else torch_conv_axes(spatial)
    rule = weight_norm(source, f"{target}/{kernel}", dim=dim, names=names, weight=weight)
    model_path = invert(rule.patterns[0], rule.target)[0]
    return (rule, TransposeRule(model_path, axes, rule), *_bias(source, target, bias))  # type: ignore[arg-type]  # a computed rule owns its transpose as a rename does
