"""Partial restore: which template leaves are read, and the :class:`~nnx_save.LoadReport`
of that choice (the report ``load_model`` gives).

A template drives the restore, as a model drives ``load_model``: its leaves that the
checkpoint stores with the same shape are read; a leaf the checkpoint lacks is
*missing*, a stored leaf the template lacks is *unexpected* (not read), a leaf of
another shape is a *shape mismatch* (not read). Leaves not read keep the template's
value. Strict (the store's default) refuses any of these the caller did not allow,
before reading; otherwise one :class:`~nnx_save.LoadWarning` sums them up.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from ..errors import CheckpointTemplateError
from ..load._report import LoadReport, ShapeMismatch, matches_any
from ._guard import template_problems
from ._tree import Path, Spec, flatten, leaf_spec, show

__all__ = ["PartialOptions", "Selection", "graft", "select"]

# How template_problems words a leaf that is an array on one side, a Python value on the other.
_KIND_ENDINGS = ("a Python value in the checkpoint", "an array in the checkpoint")


@dataclasses.dataclass(frozen=True)
class PartialOptions:
    """What a restore accepts: patterns (glob or regex) over ``item/leaf`` paths."""

    strict: bool = True
    allow_missing: Sequence[str] = ()
    allow_unexpected: Sequence[str] = ()
    allow_shape_mismatch: Sequence[str] = ()


@dataclasses.dataclass(frozen=True)
class Selection:
    """One templated item: its leaves, its structure, and the paths to read."""

    pairs: list[tuple[Path, Any]]
    treedef: Any
    read: frozenset[Path]
    stored_count: int

    @property
    def whole(self) -> bool:
        """Every template leaf is read and every stored leaf too (the plain restore)."""
        return len(self.read) == len(self.pairs) == self.stored_count

    def read_pairs(self) -> list[tuple[Path, Any]]:
        return [(p, leaf) for p, leaf in self.pairs if p in self.read]


def select(
    step: int,
    templates: Mapping[str, Any],
    specs: Mapping[str, Mapping[Path, Spec | None]],
    options: PartialOptions,
    source: str,
) -> tuple[dict[str, Selection], LoadReport]:
    """Compare each template with the stored specs; raise or warn as ``options`` say.

    Raises:
        CheckpointTemplateError: A leaf is an array on one side and a Python value on
            the other (always), or, under ``strict``, any mismatch not allowed.
    """
    report, selections, problems = LoadReport(source=source), {}, []
    for name, tree in templates.items():
        selection, item_problems = _select_item(name, tree, specs[name], options, report)
        selections[name] = selection
        problems += item_problems
    kinds = [p for p in problems if p.endswith(_KIND_ENDINGS)]  # a wrong template, never accepted
    if kinds or (options.strict and problems):
        raise CheckpointTemplateError(step, problems if options.strict else kinds)
    report.raise_or_warn(False, stacklevel=4)
    return selections, report


def _select_item(
    name: str, tree: Any, stored: Mapping[Path, Spec | None], options: PartialOptions, report: LoadReport
) -> tuple[Selection, list[str]]:
    treedef = jax.tree_util.tree_structure(tree)
    pairs = flatten(tree)
    given = dict(pairs)
    shown = {p: f"{name}/{show(p)}" for p in {*given, *stored}}
    allowed = {
        "missing": {p for p in given if p not in stored and matches_any(shown[p], options.allow_missing)},
        "unexpected": {p for p in stored if p not in given and matches_any(shown[p], options.allow_unexpected)},
        "shape": {p for p in given if p in stored and matches_any(shown[p], options.allow_shape_mismatch)},
    }
    read = set()
    for path, leaf in pairs:
        wanted, have = leaf_spec(leaf), stored.get(path)
        if path not in stored:
            (report.allowed_missing if path in allowed["missing"] else report.missing).append(shown[path])
        elif (wanted is None) != (have is None):
            continue  # refused below, whatever the options
        elif wanted is not None and have is not None and wanted.shape != have.shape:
            mismatch = ShapeMismatch(shown[path], wanted.shape, have.shape)
            (report.allowed_shape_mismatches if path in allowed["shape"] else report.shape_mismatches).append(mismatch)
        else:
            read.add(path)
            report.loaded.append(shown[path])
    for path in stored:
        if path not in given:
            (report.allowed_unexpected if path in allowed["unexpected"] else report.unexpected).append(shown[path])
    skip = allowed["missing"] | allowed["unexpected"] | {p for p in allowed["shape"] if p not in read}
    problems = template_problems(
        name, [(p, leaf) for p, leaf in pairs if p not in skip], {p: s for p, s in stored.items() if p not in skip}
    )
    return Selection(pairs, treedef, frozenset(read), len(stored)), problems


def graft(selection: Selection, read: Mapping[Path, Any]) -> Any:
    """The template's structure, with the values read where they were read."""
    leaves = [read.get(path, leaf) if path in selection.read else leaf for path, leaf in selection.pairs]
    return jax.tree_util.tree_unflatten(selection.treedef, leaves)
