"""Targets matched to the source's tensors before any byte is read.

:func:`check_targets` makes the :class:`~nnx_save.load._report.LoadReport` of what will
load and what will not (missing, unexpected, reshaped, cast), moves what the caller
allowed to the allowed lists, and pairs the rest up where the names say how: renames
(:mod:`nnx_save.load._renames`), porting targets to fix, transpose / reshape rules
(:mod:`nnx_save.load._hints`). A strict load can then refuse (one
:class:`~nnx_save.LoadError`, grouped and sorted) without touching the target, and a
load that would fill nothing refuses whatever ``strict`` says.
"""

from __future__ import annotations

import functools
import itertools
import operator
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import DtypeMismatchError, LoadError
from ._assemble import held_of
from ._hints import shape_hints, shape_remedy
from ._renames import suggest_renames
from ._report import DtypeCast, LoadReport, ShapeMismatch, matches_any, rename_remedy, target_remedy
from ._target import WholeReads, one_source_each

if TYPE_CHECKING:
    from ._source import Header
    from ._target import Target

__all__ = [
    "check_targets",
    "describe_source",
    "refuse_nothing_loaded",
    "split_allowed",
    "split_allowed_casts",
    "suggested_renames",
    "suggested_targets",
    "whole_reads",
]

_PATH, _SHAPE, _DTYPE, _SHARDING, _SOURCES = map(operator.attrgetter, ("path", "shape", "dtype", "sharding", "sources"))
_NUMPY = operator.attrgetter("dtype.numpy")
_FIRST = operator.itemgetter(0)


def check_targets(
    header: Header,
    targets: Sequence[Target],
    allow_missing: Sequence[str],
    allow_unexpected: Sequence[str],
    allow_shape_mismatch: Sequence[str],
    ignore_unexpected: frozenset[str],
    renamed: Mapping[str, tuple[str, ...]] | None,
    allow_casts: str | Sequence[str],
) -> tuple[list[Target], LoadReport]:
    """The report of what will and will not load, before any byte is read (the
    ``allow_*`` patterns move mismatches to the allowed lists); and the targets that
    can be loaded."""
    report = LoadReport(source=describe_source(header))
    import jax

    x64 = jax.config.jax_enable_x64  # type: ignore[attr-defined]  # asked once, not per target
    whole = targets if isinstance(targets, WholeReads) else whole_reads(header.tensors, targets, x64)
    loadable: list[Target] = [t for t in targets if _check(header, t, report, x64)] if whole is None else whole
    used = set(itertools.chain.from_iterable(map(_SOURCES, targets))) if whole is None else whole.used
    report.missing, report.allowed_missing = split_allowed(report.missing, allow_missing)
    report.shape_mismatches, report.allowed_shape_mismatches = split_allowed(
        report.shape_mismatches, allow_shape_mismatch
    )
    report.dtype_casts, report.allowed_casts = split_allowed_casts(report.dtype_casts, allow_casts)
    unexpected = (
        []
        if used.issuperset(header.tensors)
        else [k for k in header.tensors if k not in used and k not in ignore_unexpected]
    )
    report.unexpected, report.allowed_unexpected = split_allowed(unexpected, allow_unexpected)
    report.renamed = dict(renamed or {})  # porting: file key -> model paths, shown with unexpected keys
    if report.missing and report.unexpected:  # a renamed module? (same suffixes and shapes)
        report.suggested_renames = suggested_renames(report, {t.path: t.shape for t in targets}, header.tensors)
        report.suggested_targets = suggested_targets(report, {t.path: t.shape for t in targets}, header.tensors)
    report.suggested_shape_rules = shape_hints(report.shape_mismatches, targets)
    report.sources = dict(zip(map(_PATH, loadable), map(_SOURCES, loadable), strict=True))
    report.landed = _landed(header.tensors, loadable, report.sources)
    return loadable, report


def whole_reads(tensors: Mapping[str, Any], targets: Sequence[Target], x64: bool) -> WholeReads | None:
    """``targets`` as :class:`~nnx_save.load._target.WholeReads` when every one reads one
    tensor of ``tensors`` as it is stored, in its shape and held dtype (under
    ``jax_enable_x64`` = ``x64``: nothing to report); else ``None``. Asked of them all at
    once, at C speed, before asking :func:`_check` of each (a load of a hundred
    thousand leaves); :func:`check_targets` trusts targets given as ``WholeReads``."""
    keys = one_source_each(targets)
    if keys is None or not all(map(tensors.__contains__, keys)):
        return None
    infos = list(map(tensors.__getitem__, keys))
    if list(map(_SHAPE, infos)) != list(map(_SHAPE, targets)):
        return None
    on_device = map(operator.is_not, map(_SHARDING, targets), itertools.repeat(None))
    try:
        kinds = set(zip(map(_NUMPY, infos), map(_DTYPE, targets), on_device, strict=True))
        if all(np.dtype(have) == held_of(np.dtype(want), device, x64) for have, want, device in kinds):
            return WholeReads(targets, keys, infos)
    except (TypeError, ValueError):  # a dtype numpy cannot make, or hash: _check says what
        pass
    return None


def _landed(
    tensors: Mapping[str, Any], loadable: Sequence[Target], sources_of: Mapping[str, tuple[str, ...]]
) -> dict[str, tuple[str, ...]]:
    """Per file key of ``tensors``, the paths of ``loadable`` (whose sources are all
    there, ``sources_of`` by path) it goes to: in bulk when each reads its own one tensor."""
    if isinstance(loadable, WholeReads):
        keys: list[str] | None = loadable.keys
    else:
        sources = list(map(_SOURCES, loadable))
        keys = list(map(_FIRST, sources)) if set(map(len, sources)) == {1} else None
    if keys is not None and len(loadable.used if isinstance(loadable, WholeReads) else set(keys)) == len(keys):
        landed: dict[str, tuple[str, ...]] = dict.fromkeys(tensors, ())
        paths = list(map(_PATH, loadable))
        if paths == keys:  # each path its own key: the key lands at (path,), its sources
            landed.update(sources_of)
        else:
            landed.update(zip(keys, zip(paths), strict=True))  # one (path,) per key
        return landed
    lists: dict[str, list[str]] = {k: [] for k in tensors}
    for t in loadable:
        for k in t.sources:
            lists[k].append(t.path)
    return {k: tuple(v) for k, v in lists.items()}


def _check(header: Header, t: Target, report: LoadReport, x64: bool) -> bool:
    """Record what is wrong with ``t`` (``x64``: jax's current ``jax_enable_x64``); True if it can be loaded."""
    tensors = header.tensors
    sources = t.sources
    if not sources or not all(map(tensors.__contains__, sources)):  # no generator per target
        report.missing.append(t.path)
        return False
    if t.transform is None:
        info = header.tensors[t.sources[0]]
        shape, dtype = info.shape, info.dtype.numpy
    else:
        shape = t.source_shape if t.source_shape is not None else t.shape
        dtype = np.result_type(*(header.tensors[k].dtype.numpy for k in t.sources))
    if tuple(shape) != tuple(t.shape):
        report.shape_mismatches.append(ShapeMismatch(t.path, tuple(t.shape), tuple(shape), t.sources[0]))
        return False
    wanted = np.dtype(t.dtype)
    held = held_of(wanted, t.sharding is not None, x64)  # held_dtype(t), cached
    if np.dtype(dtype) != held:
        model = str(held) if held == wanted else f"{held} (the model's {wanted}: jax_enable_x64 is off)"
        if not castable(np.dtype(dtype), held):
            raise DtypeMismatchError(
                f"{header.tensors[sources[0]].file}: tensor {t.path!r}: stored as {np.dtype(dtype)}, the target "
                f"holds {model}, and numpy has no cast between the two (nothing was read); load it as stored "
                "(a template of its dtype, or none) and convert it yourself"
            )
        report.dtype_casts.append(DtypeCast(t.path, str(np.dtype(dtype)), model))
    return True


@functools.cache
def castable(source: np.dtype, target: np.dtype) -> bool:
    """Whether numpy casts ``source`` to ``target`` at all (ml_dtypes leaves some pairs of
    its own formats without one, such as float8_e5m2 to float8_e8m0fnu), asked of one element."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # complex to real: a cast, with a warning numpy gives per call
            np.zeros(1, source).astype(target)
    except (TypeError, ValueError):
        return False
    return True


def describe_source(header: Header) -> str:
    """How the report names a load's source: its file, or how many files of which layout."""
    if len(header.files) == 1:
        return header.files[0].file
    return f"{len(header.files)} files ({header.kind})"


def split_allowed_casts(casts: Sequence[DtypeCast], allow: str | Sequence[str]) -> tuple[list, list]:
    """Partition casts into (not allowed, allowed) by ``"lossless"`` or path patterns; any
    other string is a :class:`LoadError` (a pattern list must be a list)."""
    if isinstance(allow, str):
        if allow != "lossless":
            raise LoadError(f'allow_casts takes "lossless" or a list of path patterns, got {allow!r}')
        return [c for c in casts if c.lossy], [c for c in casts if not c.lossy]
    return split_allowed(casts, allow)


def split_allowed(items: Sequence[Any], patterns: Iterable[str]) -> tuple[list, list]:
    """Partition ``items`` (paths, or entries with a ``.path``) into (not allowed, allowed) by ``patterns``."""
    patterns = list(patterns)
    ok = [matches_any(i if isinstance(i, str) else i.path, patterns) for i in items]
    return [i for i, a in zip(items, ok, strict=True) if not a], [i for i, a in zip(items, ok, strict=True) if a]


def suggested_renames(report: LoadReport, model: Mapping[str, Any], file: Mapping[str, Any]) -> list[str]:
    """:func:`~nnx_save.load._renames.suggest_renames` for ``report``'s missing paths
    (shapes in ``model``) and its unexpected keys (shapes in ``file``) that no porting
    rule renamed; the rules are proven on every key of ``file`` and path of ``model``."""
    missing = {p: tuple(model[p]) for p in report.missing}
    plain = {k: tuple(file[k].shape) for k in report.unexpected if report.renamed.get(k, (k,)) == (k,)}
    return suggest_renames(missing, plain, keys=file, paths=model)


def suggested_targets(report: LoadReport, model: Mapping[str, Any], file: Mapping[str, Any]) -> list[str]:
    """The target fixes pairing ``report``'s missing paths with the paths porting rules
    made of its unexpected keys (one path per key; shapes compared as sets of sizes, a
    transpose aside), the commonest first.

    Examples:
        >>> r = LoadReport(missing=["ln_f/scale"], unexpected=["t.ln_f.weight"], renamed={"t.ln_f.weight": ("final_norm/scale",)})
        >>> suggested_targets(r, {"ln_f/scale": (4,)}, {"t.ln_f.weight": type("T", (), {"shape": (4,)})})
        ['`final_norm/...` -> `ln_f/...` (`t.ln_f.weight` goes to `final_norm/scale`, the model has `ln_f/scale`)']
    """
    free = {p: sorted(model[p]) for p in report.missing}
    counts: dict[tuple[str, str], list[str]] = {}
    for key in sorted(report.unexpected):
        made = report.renamed.get(key, ())
        if len(made) != 1 or made[0] == key:
            continue
        shape = sorted(file[key].shape)
        best = max(((_common_tail(made[0], m), m) for m, s in free.items() if s == shape), default=(0, ""))
        if best[0]:
            pair = (made[0][: -best[0]], best[1][: -best[0]])
            counts.setdefault(pair, []).append(f"`{key}` goes to `{made[0]}`, the model has `{best[1]}`")
            del free[best[1]]
    ranked = sorted(counts, key=lambda p: (-len(counts[p]), p))
    return [f"`{a}...` -> `{b}...` ({counts[(a, b)][0]})" for a, b in ranked]


def _common_tail(a: str, b: str) -> int:
    """The length of the longest common suffix of ``a`` and ``b`` that starts right
    after a separator (``/`` or ``.``) in both, leaving both prefixes non-empty."""
    best = 0
    for k in range(1, min(len(a), len(b))):
        if a[-k] != b[-k]:
            break
        if a[-k - 1] in "/." and b[-k - 1] in "/.":
            best = k
    return best


def refuse_nothing_loaded(
    report: LoadReport, wanted: Mapping[str, tuple[int, ...]], held: Mapping[str, tuple[int, ...]], loadable: int
) -> None:
    """Raise :class:`LoadError` when none of the ``wanted`` paths (the model's, with
    their shapes) can load from the source (``held``: its tensors' shapes), unless the
    caller allowed every one of them: loading nothing into a model that has tensors is
    never what was meant, strict or not. The message sets what the source holds against
    what the model wants, and never advises allowing everything."""
    if loadable or not (report.missing or report.shape_mismatches):
        return
    reshaped = len(report.shape_mismatches)
    lines = [
        f"{report.source}: nothing to load, nothing was read or changed: none of the {len(wanted)} tensors the "
        f"model wants is in the source" + (f" with the model's shape ({reshaped} with another)" if reshaped else ""),
        f"  the model wants {len(wanted)}: {_shapes(wanted)}",
        f"  the source holds {len(held)}: {_shapes(held) if held else 'no tensors'}",
    ]
    hint = _nothing_hint(report, wanted, held)
    raise LoadError("\n".join(lines) + (f"\n{hint}" if hint else ""), report)


def _shapes(shapes: Mapping[str, tuple[int, ...]], limit: int = 5) -> str:
    shown = [f"{k} {tuple(shapes[k])}" for k in sorted(shapes)[:limit]]
    return ", ".join(shown) + (f" ... and {len(shapes) - limit} more" if len(shapes) > limit else "")


def _nothing_hint(
    report: LoadReport, wanted: Mapping[str, tuple[int, ...]], held: Mapping[str, tuple[int, ...]]
) -> str:
    """What the names say: ``.../value`` keys of an NNX state, names that pair up under a
    rename, or another checkpoint altogether."""
    valued = [k for k in held if k.endswith("/value") and k.removesuffix("/value") in wanted]
    if valued:
        return (
            f"The source's keys are the model's with '/value' added ({valued[0]!r}): it was written from nnx.state(model) "
            "by an older save_file. Save it again with save_model, or load it through "
            'rules=Rules(rename(r"(.*)/value", r"\\1")) (from nnx_save.porting import Rules, rename)'
        )
    if report.suggested_targets or report.suggested_renames:
        return (target_remedy(report.suggested_targets) + rename_remedy(report.suggested_renames)).rstrip()
    if report.shape_mismatches:
        fixes = shape_remedy(report.suggested_shape_rules).rstrip()
        return fixes or "The names match but the shapes do not: is this checkpoint of the same model configuration?"
    return "No name matches: is this the checkpoint of this model? (nnx-save inspect lists a file's tensors)"
