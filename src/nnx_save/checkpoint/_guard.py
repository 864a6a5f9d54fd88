"""Pure comparisons of templates (``(path, leaf)`` pairs) with the checkpoint
(``{path: Spec | None}``, ``None`` for a Python leaf), before and right after a restore
reads arrays; each lists every disagreement, so the caller raises once with all of them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from ..errors import CheckpointDtypeMismatchError, DtypeMismatch
from ._tree import Path, Spec, flatten, leaf_spec, show

__all__ = ["check_restored", "check_template_dtypes", "dtype_mismatches", "explained_by_x64", "template_problems"]


def template_problems(item: str, template: Sequence[tuple[Path, Any]], stored: Mapping[Path, Spec | None]) -> list[str]:
    """Paths, leaf kinds and shapes on which a template and the checkpoint disagree.

    Examples:
        >>> template_problems("model", [(("w",), np.zeros((2, 3)))], {("w",): Spec((3, 3), "float64")})
        ['model/w: shape (2, 3) in the template, (3, 3) in the checkpoint']
    """
    given = dict(template)
    problems = [
        f"{item}/{show(p)}: stored in the checkpoint, absent from the template" for p in stored if p not in given
    ]
    problems += [f"{item}/{show(p)}: in the template, not stored in the checkpoint" for p in given if p not in stored]
    for path in given.keys() & stored.keys():
        problem = _leaf_problem(leaf_spec(given[path]), stored[path])
        if problem:
            problems.append(f"{item}/{show(path)}: {problem}")
    return problems


def _leaf_problem(wanted: Spec | None, stored: Spec | None) -> str | None:
    if wanted is None and stored is None:
        return None
    if wanted is None or stored is None:
        kinds = ("an array", "a Python value") if stored is None else ("a Python value", "an array")
        return f"{kinds[0]} in the template, {kinds[1]} in the checkpoint"
    if wanted.shape != stored.shape:
        return f"shape {wanted.shape} in the template, {stored.shape} in the checkpoint"
    return None


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
