"""Partial restore: which template leaves are read, and the :class:`~nnx_save.LoadReport`
of that choice. A template drives the restore as a model drives ``load_model``: leaves
stored with the same shape are read; *missing*, *unexpected* and *shape mismatch* leaves
are not, and keep the template's value. Strict refuses those not allowed, before reading;
otherwise one :class:`~nnx_save.LoadWarning` sums them up.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from ..errors import CheckpointTemplateError
from ..load._report import LoadReport, ShapeMismatch, matches_any
from ._tree import Path, Spec, flatten, leaf_spec, show

__all__ = ["PartialOptions", "Selection", "graft", "select"]


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
    report, selections = LoadReport(source=source), {}
    problems: list[str] = []
    kinds: list[str] = []
    for name, tree in templates.items():
        selections[name] = _select_item(name, tree, specs[name], options, report, problems, kinds)
    if kinds or (options.strict and problems):
        raise CheckpointTemplateError(step, problems + kinds if options.strict else kinds)
    report.raise_or_warn(False, stacklevel=4)
    return selections, report


def _select_item(
    name: str,
    tree: Any,
    stored: Mapping[Path, Spec | None],
    options: PartialOptions,
    report: LoadReport,
    problems: list[str],
    kinds: list[str],
) -> Selection:
    """One item's selection; its disagreements go to ``report``, those not allowed to
    ``problems``, leaf-kind ones (a wrong template, whatever the options) to ``kinds``."""
    pairs = flatten(tree)
    given = dict(pairs)
    read = set()
    for path, leaf in pairs:
        where, wanted, have = f"{name}/{show(path)}", leaf_spec(leaf), stored.get(path)
        if path not in stored:
            if _refused(report, "missing", where, options.allow_missing, where):
                problems.append(f"{where}: in the template, not stored in the checkpoint")
        elif (wanted is None) != (have is None):
            sides = ("an array", "a Python value") if have is None else ("a Python value", "an array")
            kinds.append(f"{where}: {sides[0]} in the template, {sides[1]} in the checkpoint")
        elif wanted is not None and have is not None and wanted.shape != have.shape:
            mismatch = ShapeMismatch(where, wanted.shape, have.shape)
            if _refused(report, "shape_mismatches", where, options.allow_shape_mismatch, mismatch):
                problems.append(f"{where}: shape {wanted.shape} in the template, {have.shape} in the checkpoint")
        else:
            read.add(path)
            report.loaded.append(where)
    for where in [f"{name}/{show(p)}" for p in stored if p not in given]:
        if _refused(report, "unexpected", where, options.allow_unexpected, where):
            problems.append(f"{where}: stored in the checkpoint, absent from the template")
    return Selection(pairs, jax.tree_util.tree_structure(tree), frozenset(read), len(stored))


def _refused(report: LoadReport, field: str, where: str, patterns: Sequence[str], entry: Any) -> bool:
    """Put ``entry`` on the report's ``allowed_<field>`` list when a pattern allows
    ``where``, else on its ``<field>`` list; True when it was not allowed."""
    allowed = matches_any(where, patterns)
    getattr(report, f"allowed_{field}" if allowed else field).append(entry)
    return not allowed


def graft(selection: Selection, read: Mapping[Path, Any]) -> Any:
    """The template's structure, with the values read where they were read."""
    leaves = [read.get(path, leaf) if path in selection.read else leaf for path, leaf in selection.pairs]
    return jax.tree_util.tree_unflatten(selection.treedef, leaves)
