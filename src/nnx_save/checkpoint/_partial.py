"""How a restore's templates meet the checkpoint, before and right after arrays are read.

A template drives the restore as a model drives ``load_model``. A template's Python leaf
names the type wanted back; Orbax would cast silently (``2.5`` onto an ``int`` comes back
``2``), so Python types are compared first, like dtypes, and accepted casts are done here,
after Orbax read the stored value, so a cast that changes it is reported.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from ..errors import LossyCastWarning, OptionError
from ..load._report import DtypeCast, LoadReport, ShapeMismatch, is_lossy, matches_any
from ._errors import CheckpointDtypeMismatchError, CheckpointUsageError, DtypeMismatch
from ._tree import Path, Spec, flatten, leaf_spec, segment, show

__all__ = [
    "CastPolicy",
    "PartialOptions",
    "Selection",
    "cast_back",
    "cast_remedy",
    "check_restored",
    "check_template_dtypes",
    "graft",
    "prepare",
    "remedy",
    "select",
]


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
    """Compare each template with the stored specs; raise :class:`CheckpointUsageError`
    for a leaf that is an array on one side, a Python value on the other (always), or any
    mismatch not allowed under ``strict``; else warn once."""
    report, selections = LoadReport(source=source), {}
    problems: list[str] = []
    kinds: list[str] = []
    for name, tree in templates.items():
        selections[name] = _select_item(name, tree, specs[name], options, report, problems, kinds)
    if kinds:
        others = f"; for the others, {remedy(report)}" if options.strict and problems else ""
        raise CheckpointUsageError.for_template(
            step, problems + kinds if options.strict else kinds, _KIND_REMEDY + others
        )
    if options.strict and problems:
        raise CheckpointUsageError.for_template(step, problems, remedy(report))
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


_KIND_REMEDY = (
    "no option accepts a leaf of another kind (an array for a Python value, a string for a number): "
    "build the template as the saved state was built"
)

_OPTIONS = (
    ("allow_unexpected", "unexpected", "stored leaves left unread"),
    ("allow_missing", "missing", "template leaves that keep their value"),
    ("allow_shape_mismatch", "shape_mismatches", "leaves that keep the template's value"),
)


def remedy(report: LoadReport) -> str:
    """The options that accept a strict restore's refused leaves, each with patterns
    covering exactly the kind of disagreement it excuses.

    Examples:
        >>> r = LoadReport(unexpected=["model/drop/rngs/count/value", "model/drop/rngs/key/value"])
        >>> print(remedy(r))
        to accept them, pass allow_unexpected=['model/drop/rngs/*'] (stored leaves left unread), or strict=False (take what matches, warn once)
    """
    parts = []
    for option, field, meaning in _OPTIONS:
        paths = [e if isinstance(e, str) else e.path for e in getattr(report, field)]
        if paths:
            parts.append(f"{option}={_patterns(paths)!r} ({meaning})")
    return f"to accept them, pass {', '.join(parts)}, or strict=False (take what matches, warn once)"


def _patterns(paths: Sequence[str]) -> list[str]:
    """One glob per item covering its ``paths``: the path itself when it is alone, else
    the deepest common prefix followed by ``*``."""
    by_item: dict[str, list[list[str]]] = {}
    for path in paths:
        by_item.setdefault(path.split("/", 1)[0], []).append(path.split("/"))
    out = []
    for parts in by_item.values():
        if len(parts) == 1:
            out.append("/".join(parts[0]))
            continue
        common = []
        for segments in zip(*parts, strict=False):
            if len(set(segments)) > 1:
                break
            common.append(segments[0])
        out.append("/".join([*common, "*"]))
    return out


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


# -- dtypes ------------------------------------------------------------------------------


def _dtype_mismatches(item: str, leaves: Sequence[tuple[Path, Any]], saved: Mapping[Path, str]) -> list[DtypeMismatch]:
    """Array leaves whose dtype differs from the saved one (Python leaves are skipped).

    Examples:
        >>> _dtype_mismatches("model", [(("w",), np.zeros(2, np.float16))], {("w",): "float32"})
        [DtypeMismatch(item='model', leaf='w', saved='float32', restored='float16')]
    """
    return [
        DtypeMismatch(item, show(path), saved[path], spec.dtype)
        for path, leaf in leaves
        if (spec := leaf_spec(leaf)) is not None and path in saved and saved[path] != spec.dtype
    ]


def _explained_by_x64(mismatches: Sequence[DtypeMismatch]) -> bool:
    """True when jax's x64 mode is off and it narrowed a 64-bit array to 32 bits."""
    if jax.config.read("jax_enable_x64"):
        return False
    return any(
        m.saved != m.restored and str(jax.dtypes.canonicalize_dtype(np.dtype(m.saved))) == m.restored
        for m in mismatches
    )


@dataclasses.dataclass(frozen=True)
class CastPolicy:
    """The casts a restore accepts: all (``cast_dtypes=True``), the lossless array casts
    (``allow_casts="lossless"``) or those whose ``item/leaf`` path a pattern matches."""

    every: bool = False
    lossless: bool = False
    patterns: tuple[str, ...] = ()

    @classmethod
    def of(cls, cast_dtypes: bool, allow_casts: str | Sequence[str]) -> CastPolicy:
        if isinstance(allow_casts, str):
            if allow_casts != "lossless":
                raise OptionError(
                    f'allow_casts takes "lossless" or a list of item/leaf path patterns, got {allow_casts!r}',
                    "allow_casts",
                )
            return cls(bool(cast_dtypes), True)
        return cls(bool(cast_dtypes), False, tuple(allow_casts))

    def refused(self, mismatches: Sequence[DtypeMismatch]) -> list[DtypeMismatch]:
        """The casts of ``mismatches`` this policy does not accept."""
        if self.every:
            return []
        return [
            m
            for m in mismatches
            if not (self.lossless and not _lossy(m)) and not matches_any(f"{m.item}/{m.leaf}", self.patterns)
        ]


def _lossy(m: DtypeMismatch) -> bool:
    """A cast that can change a value; a Python leaf's change of type always counts."""
    return _PYTHON in m.saved or is_lossy(m.saved, m.restored)


def cast_remedy(mismatches: Sequence[DtypeMismatch]) -> str:
    """The option accepting ``mismatches``, in ``load_model``'s words."""
    lossy = sorted(f"{m.item}/{m.leaf}" for m in mismatches if _lossy(m))
    if not lossy:
        return 'pass allow_casts="lossless" to accept them (every cast here is lossless: the values stay exact)'
    shown = repr(lossy[:5])[:-1] + (", ...]" if len(lossy) > 5 else "]")
    return f"pass allow_casts={shown} to accept them (LOSSY casts: the restored values can differ from the saved)"


def check_template_dtypes(
    step: int,
    read: Mapping[str, Sequence[tuple[Path, Any]]],
    saved: Mapping[str, Mapping[Path, str]],
    accept: CastPolicy,
    python: Sequence[DtypeMismatch] = (),
) -> list[DtypeMismatch]:
    """The template leaves to be read whose dtype differs from the saved one (and the
    ``python`` leaves of another type); raise before anything is read for a cast ``accept``
    refuses."""
    mismatches = [m for name, pairs in read.items() for m in _dtype_mismatches(name, pairs, saved[name])]
    mismatches += python
    refused = accept.refused(mismatches)
    if refused:
        raise CheckpointDtypeMismatchError(step, refused, before_read=True, remedy=cast_remedy(refused))
    return mismatches


def check_restored(
    step: int, restored: Mapping[str, Any], saved: Mapping[str, Mapping[Path, str]], accept: CastPolicy
) -> None:
    """Compare items restored without a template with the saved dtypes."""
    mismatches = [m for name, tree in restored.items() for m in _dtype_mismatches(name, flatten(tree), saved[name])]
    refused = accept.refused(mismatches)
    if refused:
        raise CheckpointDtypeMismatchError(
            step, refused, x64_off=_explained_by_x64(refused), remedy=cast_remedy(refused)
        )


# -- Python leaves -----------------------------------------------------------------------

_PYTHON = " (Python)"  # the suffix naming a Python type in a DtypeMismatch ("float (Python)")
_TYPES: dict[str, type] = {"bool": bool, "int": int, "float": float, "str": str}  # bool first: a bool is an int
_EXAMPLES: dict[str, Any] = {"bool": False, "int": 0, "float": 0.0, "str": ""}


def _kind_of(leaf: Any) -> str | None:
    """``"bool"``, ``"int"``, ``"float"`` or ``"str"`` for a Python leaf, else None.

    Examples:
        >>> [_kind_of(v) for v in (True, 3, 2.5, "x", [1])]
        ['bool', 'int', 'float', 'str', None]
    """
    if not isinstance(leaf, (int, float, str)):  # an array or a template: one check for the common case
        return None
    return next((name for name, kind in _TYPES.items() if isinstance(leaf, kind)), None)


def _as_stored(template: Any, stored: Mapping[Path, str]) -> Any:
    """The template with each Python leaf replaced by one of its stored type, so
    Orbax reads the value exactly as it was saved."""

    def leaf(keypath: Any, value: Any) -> Any:
        if _kind_of(value) is None:
            return value
        have = stored.get(tuple(segment(e) for e in keypath))
        return value if have is None else _EXAMPLES[have]

    return jax.tree_util.tree_map_with_path(leaf, template) if stored else template


def prepare(
    step: int, templates: Mapping[str, Any], stored: Mapping[str, Mapping[Path, str]]
) -> tuple[dict[str, Any], list[DtypeMismatch]]:
    """The templates to hand Orbax (Python leaves of the stored type) and the Python
    number leaves whose template type differs from the stored one.

    Raises:
        CheckpointUsageError: A string in the template meets a stored number, or
            the reverse (a wrong template, never a cast); before anything is read.

    Examples:
        >>> prepare(1, {"extensions": {"lr": 1, "n": 7}}, {"extensions": {("lr",): "float", ("n",): "int"}})[1]
        [DtypeMismatch(item='extensions', leaf='lr', saved='float (Python)', restored='int (Python)')]
    """
    differ = [
        (name, show(path), want, stored[name][path])
        for name, tree in templates.items()
        if stored[name]  # no Python leaf stored: none can differ (a kind mismatch is select's to refuse)
        for path, leaf in flatten(tree)
        if (want := _kind_of(leaf)) is not None and path in stored[name] and want != stored[name][path]
    ]
    problems = [
        f"{name}/{where}: {_article(want)} in the template, {_article(have)} in the checkpoint"
        for name, where, want, have in differ
        if "str" in (want, have)
    ]
    if problems:
        raise CheckpointUsageError.for_template(step, problems, _KIND_REMEDY)
    mismatches = [DtypeMismatch(name, where, have + _PYTHON, want + _PYTHON) for name, where, want, have in differ]
    return {name: _as_stored(tree, stored[name]) for name, tree in templates.items()}, mismatches


def cast_back(step: int, item: str, restored: Any, casts: Sequence[DtypeMismatch], report: list[DtypeCast]) -> Any:
    """Cast the restored values named in ``casts`` (of ``item``) to their template's type,
    each recorded in ``report``, a warning for a value the cast changed, and a
    :class:`CheckpointUsageError` for one the type cannot hold (NaN onto an ``int``)."""
    wanted = {m.leaf: m for m in casts if m.item == item}
    if not wanted:
        return restored

    def leaf(keypath: Any, value: Any) -> Any:
        where = show(tuple(segment(e) for e in keypath))
        if where not in wanted:
            return value
        mismatch = wanted[where]
        try:
            cast = _TYPES[mismatch.restored.removesuffix(_PYTHON)](value)
        except (ValueError, OverflowError):  # int(nan), int(inf)
            problem = f"{item}/{where}: the stored {mismatch.saved} {value!r} cannot be restored as {mismatch.restored}"
            fix = f"no option casts it: restore {item}/{where} with a float template"
            raise CheckpointUsageError.for_template(step, [problem], fix) from None
        report.append(DtypeCast(f"{item}/{where}", mismatch.saved, mismatch.restored))
        if cast != value:
            warnings.warn(
                f"{item}/{where}: the stored {mismatch.saved} {value!r} is restored as {cast!r} "
                f"({mismatch.restored}, as the template asks)",
                LossyCastWarning,
                stacklevel=4,
            )
        return cast

    return jax.tree_util.tree_map_with_path(leaf, restored)


def _article(kind: str) -> str:
    return f"an {kind}" if kind == "int" else f"a {kind}"
