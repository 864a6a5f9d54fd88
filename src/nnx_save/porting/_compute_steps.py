"""The value steps of computed rules: ``fn`` of the sources on load, a part of
``inverse`` of the model's tensor on export, its round trip checked (see ``_computed``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from ._errors import RuleError
from ._template import ticked

__all__ = ["Computed", "ComputedPart"]

Shape = tuple[int, ...]
Fn = Callable[..., Any]


def name_of(fn: object) -> str:
    return getattr(fn, "__name__", None) or repr(fn)


@dataclass(frozen=True)
class Computed:
    """``fn(*sources)``, checked to make ``shape`` of ``dtype`` (the load's combine)."""

    fn: Fn
    target: str
    shape: Shape
    dtype: str

    def __call__(self, xs: Sequence[np.ndarray]) -> np.ndarray:
        out = np.asarray(self.fn(*xs))
        if out.shape != self.shape or out.dtype != np.dtype(self.dtype):
            raise RuleError(
                f"`{self.target}`: {name_of(self.fn)} made {out.shape} {out.dtype}, the plan expects "
                f"{self.shape} {np.dtype(self.dtype)} (a computed rule never casts: return the sources' dtype)",
                kind="shape",
            )
        return out


@dataclass(frozen=True)
class ComputedPart:
    """Part ``part`` of ``inverse(x)`` for the model's tensor ``x`` (an export's combine),
    after checking that ``fn`` of the parts gives ``x`` back within ``tolerance`` eps.

    ``keys``: the file keys of every part (for messages, and an export against the source
    file: with ``against``, the file's parts follow ``x`` as inputs, and while ``fn`` of
    them is ``x`` bit for bit, the file's own part is written).
    """

    fn: Fn
    inverse: Fn
    part: int
    keys: tuple[str, ...]
    shapes: tuple[Shape, ...]
    dtype: str
    source: str
    tolerance: float
    against: bool = False

    def __call__(self, xs: Sequence[np.ndarray]) -> np.ndarray:
        x = np.asarray(xs[0])
        if self.against and _same_bytes(np.asarray(self.fn(*xs[1:])), x):
            return np.asarray(xs[1 + self.part])
        parts = self._parts(x)
        _check_round_trip(self, x, np.asarray(self.fn(*parts)))
        return parts[self.part]

    def _parts(self, x: np.ndarray) -> list[np.ndarray]:
        made = self.inverse(x)
        parts = [np.asarray(p) for p in (made if isinstance(made, (tuple, list)) else (made,))]
        found = [(p.shape, str(p.dtype)) for p in parts]
        wanted = [(s, str(np.dtype(self.dtype))) for s in self.shapes]
        if found != wanted:
            raise RuleError(
                f"`{self.source}`: {name_of(self.inverse)} made {found} for {ticked(self.keys)}, expected {wanted}",
                kind="shape",
            )
        return parts


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and np.ascontiguousarray(a).tobytes() == b.tobytes()


def _check_round_trip(part: ComputedPart, x: np.ndarray, back: np.ndarray) -> None:
    """``back`` (``fn`` of the inverse's parts) is ``x`` within ``tolerance`` eps of its
    dtype, scaled by ``x``'s largest magnitude (exactly, for an integer dtype)."""
    if back.shape != x.shape:
        raise RuleError(
            f"`{part.source}`: the round trip made shape {back.shape}, the model holds {x.shape}", kind="round_trip"
        )
    wide = np.result_type(x.dtype, np.float64) if x.dtype.kind in "fc" else np.float64
    a, b = x.astype(wide), back.astype(wide)
    finite = np.isfinite(a)
    same_rest = np.array_equal(a[~finite], b[~finite], equal_nan=True)  # inf and NaN where the model has them
    scale = float(np.max(np.abs(a[finite]), initial=0.0))
    diff = np.abs(a[finite] - b[finite])
    worst = float(np.max(diff, initial=0.0)) if np.all(np.isfinite(diff)) else math.inf
    if not same_rest or worst > part.tolerance * _eps(x.dtype) * scale:
        raise RuleError(
            f"`{part.source}`: {name_of(part.inverse)} does not invert {name_of(part.fn)}: writing "
            f"{ticked(part.keys)} from it would load back with max |difference| {worst:.3g}, over "
            f"{part.tolerance:g} eps of {x.dtype} at scale {scale:.3g}"
            f"{'' if same_rest else ', and inf or NaN where the model has other values'}; "
            "fix the inverse, or give the export its own rule",
            kind="round_trip",
        )


def _eps(dtype: np.dtype) -> float:
    """The dtype's machine epsilon (numpy's and ml_dtypes' floats); 0 for exact types."""
    try:
        return float(ml_dtypes.finfo(dtype).eps)
    except (ValueError, TypeError):
        return 0.0
