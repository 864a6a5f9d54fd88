"""Dtype comparisons of a restore with the saved dtype record, before and right after it
reads arrays; each lists every disagreement, so the caller raises once with all of them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from ..errors import CheckpointDtypeMismatchError, DtypeMismatch
from ._tree import Path, flatten, leaf_spec, show

__all__ = ["check_restored", "check_template_dtypes", "dtype_mismatches", "explained_by_x64"]


def dtype_mismatches(item: str, leaves: Sequence[tuple[Path, Any]], saved: Mapping[Path, str]) -> list[DtypeMismatch]:
    """Array leaves whose dtype differs from the saved one (Python leaves are skipped).

    Examples:
        >>> dtype_mismatches("model", [(("w",), np.zeros(2, np.float16))], {("w",): "float32"})
        [DtypeMismatch(item='model', leaf='w', saved='float32', restored='float16')]
    """
    return [
        DtypeMismatch(item, show(path), saved[path], spec.dtype)
        for path, leaf in leaves
        if (spec := leaf_spec(leaf)) is not None and path in saved and saved[path] != spec.dtype
    ]


def explained_by_x64(mismatches: Sequence[DtypeMismatch]) -> bool:
    """True when jax's x64 mode is off and it narrowed a 64-bit array to 32 bits."""
    if jax.config.read("jax_enable_x64"):
        return False
    return any(
        m.saved != m.restored and str(jax.dtypes.canonicalize_dtype(np.dtype(m.saved))) == m.restored
        for m in mismatches
    )


def check_template_dtypes(
    step: int,
    read: Mapping[str, Sequence[tuple[Path, Any]]],
    saved: Mapping[str, Mapping[Path, str]],
    cast_dtypes: bool,
    python: Sequence[DtypeMismatch] = (),
) -> list[DtypeMismatch]:
    """The template leaves to be read whose dtype differs from the saved one (and the
    ``python`` leaves of another type); raise before anything is read unless ``cast_dtypes``."""
    mismatches = [m for name, pairs in read.items() for m in dtype_mismatches(name, pairs, saved[name])]
    mismatches += python
    if mismatches and not cast_dtypes:
        raise CheckpointDtypeMismatchError(step, mismatches, before_read=True)
    return mismatches


def check_restored(step: int, restored: Mapping[str, Any], saved: Mapping[str, Mapping[Path, str]]) -> None:
    """Compare items restored without a template with the saved dtypes."""
    mismatches = [m for name, tree in restored.items() for m in dtype_mismatches(name, flatten(tree), saved[name])]
    if mismatches:
        raise CheckpointDtypeMismatchError(step, mismatches, x64_off=explained_by_x64(mismatches))
