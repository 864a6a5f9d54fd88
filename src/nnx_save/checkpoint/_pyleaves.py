"""Python leaves (bools, ints, floats, strings) restored through a template.

A template's Python leaf says which type the caller wants back. Orbax would cast the
stored value silently (``2.5`` onto an ``int`` template comes back ``2``), so types are
compared first, as dtypes are: another number type is a ``DtypeMismatch`` (refused
unless ``cast_dtypes``), a string against a number a template error. Accepted casts are
done here, after Orbax read the value as stored, so a cast that changes it is reported.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from ..errors import CheckpointTemplateError, DtypeMismatch
from ..load._report import DtypeCast, LossyCastWarning
from ._tree import Path, flatten, segment, show

__all__ = ["PYTHON", "cast_back", "kind_of", "prepare"]

PYTHON = " (Python)"  # the suffix naming a Python type in a DtypeMismatch ("float (Python)")
_TYPES: dict[str, type] = {"bool": bool, "int": int, "float": float, "str": str}  # bool first: a bool is an int
_EXAMPLES: dict[str, Any] = {"bool": False, "int": 0, "float": 0.0, "str": ""}


def kind_of(leaf: Any) -> str | None:
    """``"bool"``, ``"int"``, ``"float"`` or ``"str"`` for a Python leaf, else None.

    Examples:
        >>> [kind_of(v) for v in (True, 3, 2.5, "x", [1])]
        ['bool', 'int', 'float', 'str', None]
    """
    return next((name for name, kind in _TYPES.items() if isinstance(leaf, kind)), None)


def _as_stored(template: Any, stored: Mapping[Path, str]) -> Any:
    """The template with each Python leaf replaced by one of its stored type, so
    Orbax reads the value exactly as it was saved."""

    def leaf(keypath: Any, value: Any) -> Any:
        have = stored.get(tuple(segment(e) for e in keypath))
        return _EXAMPLES[have] if kind_of(value) is not None and have is not None else value

    return jax.tree_util.tree_map_with_path(leaf, template)


def prepare(
    step: int, templates: Mapping[str, Any], stored: Mapping[str, Mapping[Path, str]]
) -> tuple[dict[str, Any], list[DtypeMismatch]]:
    """The templates to hand Orbax (Python leaves of the stored type) and the Python
    number leaves whose template type differs from the stored one.

    Raises:
        CheckpointTemplateError: A string in the template meets a stored number, or
            the reverse (a wrong template, never a cast); before anything is read.

    Examples:
        >>> prepare(1, {"extensions": {"lr": 1, "n": 7}}, {"extensions": {("lr",): "float", ("n",): "int"}})[1]
        [DtypeMismatch(item='extensions', leaf='lr', saved='float (Python)', restored='int (Python)')]
    """
    differ = [
        (name, show(path), want, stored[name][path])
        for name, tree in templates.items()
        for path, leaf in flatten(tree)
        if (want := kind_of(leaf)) is not None and path in stored[name] and want != stored[name][path]
    ]
    problems = [
        f"{name}/{where}: {_article(want)} in the template, {_article(have)} in the checkpoint"
        for name, where, want, have in differ
        if "str" in (want, have)
    ]
    if problems:
        raise CheckpointTemplateError(step, problems)
    mismatches = [DtypeMismatch(name, where, have + PYTHON, want + PYTHON) for name, where, want, have in differ]
    return {name: _as_stored(tree, stored[name]) for name, tree in templates.items()}, mismatches


def cast_back(step: int, item: str, restored: Any, casts: Sequence[DtypeMismatch], report: list[DtypeCast]) -> Any:
    """Cast the restored values named in ``casts`` (of ``item``) to their template's
    type; record each cast in ``report`` and warn for a value the cast changed.

    Raises:
        CheckpointTemplateError: A value the template's type cannot hold (NaN or an
            infinity onto an ``int``).
    """
    wanted = {m.leaf: m for m in casts if m.item == item}
    if not wanted:
        return restored

    def leaf(keypath: Any, value: Any) -> Any:
        where = show(tuple(segment(e) for e in keypath))
        if where not in wanted:
            return value
        mismatch = wanted[where]
        try:
            cast = _TYPES[mismatch.restored.removesuffix(PYTHON)](value)
        except (ValueError, OverflowError):  # int(nan), int(inf)
            problem = f"{item}/{where}: the stored {mismatch.saved} {value!r} cannot be restored as {mismatch.restored}"
            raise CheckpointTemplateError(step, [problem]) from None
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
