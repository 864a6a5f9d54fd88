"""What a load did: filled, missing, unexpected, reshaped, cast, and the I/O it took.

A :class:`LoadReport` is built from headers before any value is read, so a strict load
can refuse (one :class:`~nnx_save.LoadError`, grouped and sorted) without touching the target.
"""

from __future__ import annotations

import fnmatch
import logging
import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np

from ..errors import LoadError, LoadWarning, LossyCastWarning, OverReadWarning, SingleDeviceWarning
from ..format._units import human_bytes
from ._assemble import held_of
from ._hints import shape_hints, shape_remedy
from ._renames import suggest_renames

if TYPE_CHECKING:
    from ._source import Header
    from ._target import Target

__all__ = [
    "OVER_READ_MIN_BYTES",
    "OVER_READ_WARN",
    "DtypeCast",
    "IOStats",
    "LoadReport",
    "Outcome",
    "ShapeMismatch",
    "check_targets",
    "complete",
    "describe_source",
    "matches_any",
    "over_read_advice",
    "refuse_nothing_loaded",
    "split_allowed",
    "split_allowed_casts",
    "suggested_renames",
    "suggested_targets",
    "warn_single_device",
]

log = logging.getLogger("nnx_save")
OVER_READ_WARN = 1.5  # a file read beyond this many times what it gave is worth a warning ...
OVER_READ_MIN_BYTES = 1 << 20  # ... when the bytes it did not need cost something (~1 ms of reading)


@dataclass(frozen=True)
class ShapeMismatch:
    path: str
    model_shape: tuple[int, ...]
    file_shape: tuple[int, ...]
    file_key: str = ""

    def __str__(self) -> str:
        src = f" (file key {self.file_key!r})" if self.file_key and self.file_key != self.path else ""
        return f"{self.path}: shape {self.model_shape} in the model, {self.file_shape} in the file{src}"


def warn_single_device(paths: Sequence[str], devices: Sequence[object], fix: str, stacklevel: int) -> None:
    """Warn (:class:`SingleDeviceWarning`) that ``paths`` have no sharding although this
    process has several ``devices``: how many, which, where they land, and ``fix``."""
    if not paths or len(devices) < 2:
        return
    shown = ", ".join(sorted(paths)[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
    message = (
        f"{len(paths)} arrays have no sharding ({shown}): all of them are loaded onto {devices[0]}, although this "
        f"process has {len(devices)} devices. {fix}"
    )
    warnings.warn(message, SingleDeviceWarning, stacklevel=stacklevel + 1)


def is_lossy(source: str, target: str) -> bool:
    """Whether casting dtype ``source`` to ``target`` (numpy / ml_dtypes names; the first
    word) can change values: float to int or bool, a float with fewer mantissa bits or a
    smaller exponent range, an int that does not fit.

    Examples:
        >>> is_lossy("float32", "bfloat16"), is_lossy("bfloat16", "float32"), is_lossy("float32", "int32")
        (True, False, True)
    """
    a, b = np.dtype(source.split()[0]), np.dtype(target.split()[0])
    if a.kind == "f" and b.kind == "f":
        fa, fb = ml_dtypes.finfo(a), ml_dtypes.finfo(b)
        return fb.nmant < fa.nmant or fb.maxexp < fa.maxexp or fb.minexp > fa.minexp
    return (a.kind in "fc" and b.kind in "iub") or not np.can_cast(a, b, "safe")


@dataclass(frozen=True)
class DtypeCast:
    path: str
    file_dtype: str
    model_dtype: str

    @property
    def lossy(self) -> bool:
        """The cast can change values (see :func:`is_lossy`)."""
        return is_lossy(self.file_dtype, self.model_dtype)

    def __str__(self) -> str:
        return f"{self.path}: {self.file_dtype} in the file -> {self.model_dtype} in the model"


@dataclass
class IOStats:
    """Bytes and requests of a load, and where the time went."""

    bytes_read: int = 0
    bytes_needed: int = 0
    requests: int = 0
    files: int = 0
    plan_seconds: float = 0.0
    read_seconds: float = 0.0
    assemble_seconds: float = 0.0
    max_inflight_bytes: int = 0
    retries: int = 0
    over_read_by_file: dict[str, float] = field(default_factory=dict)
    read_whole: list[str] = field(default_factory=list)  # ported targets whose sources were read whole
    bytes_received: int = 0  # bytes of this process's shards that came from peers (share_reads)

    @property
    def over_read(self) -> float:
        return self.bytes_read / self.bytes_needed if self.bytes_needed else 1.0

    def add_file(self, file: str, read: int, needed: int, requests: int = 0) -> None:
        """Count one file read: ``read`` bytes for ``needed``, in ``requests`` requests."""
        self.files += 1
        self.bytes_read += read
        self.bytes_needed += needed
        self.requests += requests
        self.over_read_by_file[file] = read / needed if needed else 1.0

    def add(self, other: IOStats) -> None:
        """Add ``other``'s bytes, requests, retries, times and tensors read whole (``files``
        is the caller's count)."""
        summed = ("bytes_read", "bytes_needed", "bytes_received", "requests", "retries")
        for name in (*summed, "plan_seconds", "read_seconds", "assemble_seconds"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.read_whole += other.read_whole
        self.max_inflight_bytes = max(self.max_inflight_bytes, other.max_inflight_bytes)
        self.over_read_by_file.update(other.over_read_by_file)

    def __str__(self) -> str:
        return (
            f"read {self.bytes_read / 1e6:.1f} MB for {self.bytes_needed / 1e6:.1f} MB needed "
            f"(over-read {self.over_read:.3f}) in {self.requests} requests from {self.files} file(s)"
            f"{f', {self.retries} retried' if self.retries else ''}"
            f"{f', {self.bytes_received / 1e6:.1f} MB received from peers' if self.bytes_received else ''}"
            f"{f', {len(self.read_whole)} ported tensor(s) read whole' if self.read_whole else ''}; "
            f"plan {self.plan_seconds:.3f}s, read {self.read_seconds:.3f}s, assemble {self.assemble_seconds:.3f}s"
        )


def matches_any(path: str, patterns: Iterable[str]) -> bool:
    """True if ``path`` matches a pattern: a regular expression (full match) or a glob."""
    for p in patterns:
        if fnmatch.fnmatchcase(path, p):
            return True
        try:
            if re.fullmatch(p, path):
                return True
        except re.error:
            pass
    return False


@dataclass
class LoadReport:
    """Everything a load found. Empty lists mean a clean, complete load.

    Attributes:
        loaded: paths filled from the source.
        missing: paths the target expects that the source lacks.
        unexpected: source tensors the target does not use.
        shape_mismatches: paths whose shapes differ (not loaded).
        dtype_casts: paths cast on the host from the file dtype.
        allowed_missing / allowed_unexpected: mismatches the caller declared.
        allowed_shape_mismatches: those declared by ``allow_shape_mismatch``; those
            paths keep the model's values.
        allowed_casts: those declared by ``allow_casts`` (done under ``strict=True`` too).
        suggested_renames: ``rename(...)`` rules pairing missing paths with unexpected
            keys of the same shape and name suffix (shown in a strict load's remedy).
        suggested_targets: the porting rules' targets to fix: a key the rules sent to a
            path the model lacks pairs up (name suffix and shape) with a missing path.
        suggested_shape_rules: ``transpose(...)`` / ``reshape(...)`` rules (source text)
            that load shape-mismatched tensors the model's way (load/_hints.py).
        renamed: per file key, the model paths porting rules made of it.
        sources: per target path, the file keys it came from.
        landed: per file key, the target paths it went to (empty: nowhere).
        io: the engine's I/O statistics.
        source: the checkpoint's name, as the summary shows it.
        verified: file keys whose checksum was checked (``verify=True``).
        unverified: file keys loaded under ``verify=True`` whose checksum could not
            be checked: none recorded, or this process read only part of the tensor.
    """

    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    shape_mismatches: list[ShapeMismatch] = field(default_factory=list)
    dtype_casts: list[DtypeCast] = field(default_factory=list)
    allowed_missing: list[str] = field(default_factory=list)
    allowed_unexpected: list[str] = field(default_factory=list)
    allowed_shape_mismatches: list[ShapeMismatch] = field(default_factory=list)
    allowed_casts: list[DtypeCast] = field(default_factory=list)
    suggested_renames: list[str] = field(default_factory=list)
    suggested_targets: list[str] = field(default_factory=list)
    suggested_shape_rules: list[str] = field(default_factory=list)
    renamed: dict[str, tuple[str, ...]] = field(default_factory=dict)
    sources: dict[str, tuple[str, ...]] = field(default_factory=dict)
    landed: dict[str, tuple[str, ...]] = field(default_factory=dict)
    io: IOStats = field(default_factory=IOStats)
    source: str = ""
    verified: list[str] = field(default_factory=list)
    unverified: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        """No missing, unexpected, shape or dtype entry (declared ones excepted)."""
        return not (self.missing or self.unexpected or self.shape_mismatches or self.dtype_casts)

    def problems(self) -> list[str]:
        """Every mismatch as one line, grouped and sorted."""
        return [line for group in self._groups() for line in group]

    def _groups(self) -> list[list[str]]:
        """The problem lines by kind: missing, unexpected, shape, dtype."""
        return [
            [f"missing: {p}" for p in sorted(self.missing)],
            [f"unexpected: {self._unexpected_line(k)}" for k in sorted(self.unexpected)],
            [f"shape: {m}" for m in sorted(self.shape_mismatches, key=lambda m: m.path)],
            [f"LOSSY dtype: {c}" for c in sorted(self.lossy_casts, key=lambda c: c.path)],
            [f"dtype: {c}" for c in sorted(self.dtype_casts, key=lambda c: c.path) if not c.lossy],
        ]

    @property
    def lossy_casts(self) -> list[DtypeCast]:
        """The casts that can change values (float to int, narrower floats or ints)."""
        return [c for c in self.dtype_casts if c.lossy]

    def _unexpected_line(self, key: str) -> str:
        """A file key, with the model paths porting rules renamed it to (none exists)."""
        targets = [t for t in self.renamed.get(key, ()) if t != key]
        return f"{key} -> {', '.join(targets)}: no such model path" if targets else key

    def summary(self) -> str:
        counts = (
            f"{len(self.loaded)} loaded, {len(self.missing)} missing, {len(self.unexpected)} unexpected, "
            f"{len(self.shape_mismatches)} shape mismatches, {len(self.dtype_casts)} dtype casts"
        )
        return f"{self.source}: {counts}" if self.source else counts

    def __str__(self) -> str:
        parts = [self.summary(), *("  " + line for line in self.problems())]
        allowed = (("missing", self.allowed_missing), ("unexpected", self.allowed_unexpected))
        for kind, items in (*allowed, ("dtype casts", self.allowed_casts)):
            if items:
                parts.append(f"  (allowed {kind}: {len(items)})")
        if self.allowed_shape_mismatches:
            kept = ", ".join(sorted(m.path for m in self.allowed_shape_mismatches)[:10])
            parts.append(f"  (allowed shape mismatches, the model's values kept: {kept})")
        if self.verified or self.unverified:
            parts.append(f"  checksums: {len(self.verified)} verified, {len(self.unverified)} not verifiable")
        parts.append(f"  I/O: {self.io}")
        return "\n".join(parts)

    def remedy(self) -> str:
        """The renames that would pair missing paths with unexpected keys, then the
        options that would accept what a strict load refused, one per line."""
        kept, shapes = "those paths keep the model's values", [m.path for m in self.shape_mismatches]
        options = (
            ("allow_missing", self.missing, kept),
            ("allow_unexpected", self.unexpected, "those file tensors are not read"),
            ("allow_shape_mismatch", shapes, kept),
        )
        lines = [f"{option}={_listed(paths)} ({why})" for option, paths, why in options if paths]
        if self.dtype_casts:
            lines.append(_cast_remedy(self.dtype_casts))
        accept = "To accept them, pass (patterns: glob or regex):\n  " + "\n  ".join(lines) if lines else ""
        fixes = _target_remedy(self.suggested_targets) + _rename_remedy(self.suggested_renames)
        return fixes + shape_remedy(self.suggested_shape_rules) + accept

    def raise_or_warn(self, strict: bool, *, limit: int = 20, stacklevel: int = 3) -> None:
        """Raise :class:`LoadError` (strict) or emit one :class:`LoadWarning`, with up to
        ``limit`` lines of each kind (a long missing list never hides the unexpected keys)."""
        if self.clean:
            return
        shown = "\n  ".join(line for group in self._groups() for line in _cut(group, limit))
        if strict:
            raise LoadError(
                f"strict load refused, nothing was changed. {self.summary()}:\n  {shown}\n{self.remedy()}", self
            )
        lossy = self.lossy_casts
        loud = (
            f"{len(lossy)} LOSSY dtype cast(s): the loaded values differ from the file's "
            "(load into the file's dtype, or cast yourself where you mean to). "
            if lossy
            else ""
        )
        casts = (
            f"\nTo accept the dtype casts without a warning: {_cast_remedy(self.dtype_casts)}"
            if self.dtype_casts
            else ""
        )
        warnings.warn(
            f"{loud}{self.summary()}:\n  {shown}{casts}\n(see the returned LoadReport; strict=True raises)",
            LossyCastWarning if lossy else LoadWarning,
            stacklevel=stacklevel,
        )


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
        return (_target_remedy(report.suggested_targets) + _rename_remedy(report.suggested_renames)).rstrip()
    if report.shape_mismatches:
        fixes = shape_remedy(report.suggested_shape_rules).rstrip()
        return fixes or "The names match but the shapes do not: is this checkpoint of the same model configuration?"
    return "No name matches: is this the checkpoint of this model? (nnx-save inspect lists a file's tensors)"


def _cut(lines: list[str], limit: int) -> list[str]:
    if len(lines) <= limit:
        return lines
    kind = lines[0].split(":", 1)[0]
    return [*lines[:limit], f"... and {len(lines) - limit} more {kind}"]


def _listed(paths: Sequence[str], limit: int = 5) -> str:
    shown = sorted(paths)[:limit]
    return repr(shown)[:-1] + (", ...]" if len(paths) > limit else "]")


def _cast_remedy(casts: Sequence[DtypeCast]) -> str:
    lossy = sorted(c.path for c in casts if c.lossy)
    if not lossy:
        return 'allow_casts="lossless" (every cast here is lossless: the values load exactly; strict key and shape checks stay on)'
    return f"allow_casts={_listed(lossy)} (LOSSY casts: the loaded values differ from the file's)"


def _rename_remedy(renames: Sequence[str]) -> str:
    if not renames:
        return ""
    rules = ", ".join(renames)
    return (
        "Missing paths and unexpected keys pair up by structure (the same indices, leaf name and shape, no "
        "tie; the rules are checked against every key): the file names them "
        f"differently. Map them, rather than allowing either:\n  rules=Rules({rules})  "
        "(from nnx_save.porting import Rules, rename; add them to your rules if you pass some)\n"
    )


def _target_remedy(fixes: Sequence[str]) -> str:
    if not fixes:
        return ""
    return (
        "Porting rules send file keys to paths the model lacks, and those pair up with missing paths "
        "(same name suffix and shape): fix the rules' targets, rather than allowing either:\n  "
        + "\n  ".join(fixes)
        + "\n"
    )


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


def suggested_renames(report: LoadReport, model: Mapping[str, Any], file: Mapping[str, Any]) -> list[str]:
    """:func:`~nnx_save.load._renames.suggest_renames` for ``report``'s missing paths
    (shapes in ``model``) and its unexpected keys (shapes in ``file``) that no porting
    rule renamed; the rules are proven on every key of ``file`` and path of ``model``."""
    missing = {p: tuple(model[p]) for p in report.missing}
    plain = {k: tuple(file[k].shape) for k in report.unexpected if report.renamed.get(k, (k,)) == (k,)}
    return suggest_renames(missing, plain, keys=file, paths=model)


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


# ------------------------------------------------------------- built from the engine's answer


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
        report.dtype_casts.append(DtypeCast(t.path, str(np.dtype(dtype)), model))
    return True


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
    loadable = [t for t in targets if _check(header, t, report, x64)]
    used = {k for t in targets for k in t.sources}
    report.missing, report.allowed_missing = split_allowed(report.missing, allow_missing)
    report.shape_mismatches, report.allowed_shape_mismatches = split_allowed(
        report.shape_mismatches, allow_shape_mismatch
    )
    report.dtype_casts, report.allowed_casts = split_allowed_casts(report.dtype_casts, allow_casts)
    unexpected = [k for k in header.tensors if k not in used and k not in ignore_unexpected]
    report.unexpected, report.allowed_unexpected = split_allowed(unexpected, allow_unexpected)
    report.renamed = dict(renamed or {})  # porting: file key -> model paths, shown with unexpected keys
    if report.missing and report.unexpected:  # a renamed module? (same suffixes and shapes)
        report.suggested_renames = suggested_renames(report, {t.path: t.shape for t in targets}, header.tensors)
        report.suggested_targets = suggested_targets(report, {t.path: t.shape for t in targets}, header.tensors)
    report.suggested_shape_rules = shape_hints(report.shape_mismatches, targets)
    report.sources = {t.path: t.sources for t in loadable}
    landed: dict[str, list[str]] = {k: [] for k in header.tensors}
    for t in loadable:
        for k in t.sources:
            landed[k].append(t.path)
    report.landed = {k: tuple(v) for k, v in landed.items()}
    return loadable, report


@dataclass
class Outcome:
    """What one load did, per tensor and per file: the engine's answer (it reads and
    places; :func:`complete` makes the report of it).

    Attributes:
        values: each loaded target's value, by path.
        checked: per file key read, whether every piece was verified against its
            recorded checksum (``False``: not verifiable where it was read).
        read_whole: ported targets whose sources were read whole.
        files: per file read, ``(file, bytes read, bytes needed, requests)``.
        requests: requests not counted with a file (the streaming readers').
        seconds: time spent planning, reading and assembling.
        peak: the most bytes of reads in flight at once.
        over_reads: one line per file read far beyond what it gave (the warning's).
        over_read_bytes: those files' bytes read, and what ``max_over_read_ratio=1.0`` would read.
    """

    values: dict[str, Any] = field(default_factory=dict)
    checked: dict[str, bool] = field(default_factory=dict)
    read_whole: list[str] = field(default_factory=list)
    files: list[tuple[str, int, int, int]] = field(default_factory=list)
    requests: int = 0
    seconds: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    peak: int = 0
    over_reads: list[str] = field(default_factory=list)
    over_read_bytes: list[int] = field(default_factory=lambda: [0, 0])


def complete(report: LoadReport, outcome: Outcome, retries: int) -> None:
    """Fill ``report`` (made by :func:`check_targets`) with what the load did; warn
    once if it read far more than it needed. ``retries``: the transport's requests retried."""
    io = report.io
    for file, read, needed, requests in outcome.files:
        io.add_file(file, read, needed, requests)
    io.requests += outcome.requests
    io.plan_seconds, io.read_seconds, io.assemble_seconds = outcome.seconds
    io.read_whole += outcome.read_whole
    io.max_inflight_bytes, io.retries = outcome.peak, retries
    report.verified = sorted(k for k, ok in outcome.checked.items() if ok)
    report.unverified = sorted(k for k, ok in outcome.checked.items() if not ok)
    report.loaded = sorted(outcome.values)
    log.debug("loaded %d tensors from %s: %s", len(outcome.values), report.source, io)
    if outcome.over_reads:
        warnings.warn(
            "this load read far more bytes than it needed from these files: to make fewer, larger "
            "requests, the automatic read merging (max_over_read_ratio=None) read through the bytes "
            "between the pieces it needed (tensors the load skips, or parts other devices hold):\n  "
            + "\n  ".join(outcome.over_reads)
            + "\n"
            + over_read_advice(*outcome.over_read_bytes),
            OverReadWarning,
            stacklevel=4,
        )


def over_read_advice(read: int, floor: int) -> str:
    """The remedy the over-read warning gives, true for this load: ``read`` bytes were
    read from the over-read files, ``floor`` is what ``max_over_read_ratio=1.0`` would
    read there (computed by planning the same requests at that ratio).

    Examples:
        >>> over_read_advice(8 << 20, 1 << 20).startswith("Pass max_over_read_ratio=1.0 to read 1.0 MiB instead of 8.0 MiB")
        True
        >>> over_read_advice(8 << 20, 8 << 20).startswith("max_over_read_ratio=1.0 would read the same 8.0 MiB")
        True
    """
    contiguous = "shard the leading dimension so that each device's pieces are contiguous"
    if read - floor >= OVER_READ_MIN_BYTES:
        return (
            f"Pass max_over_read_ratio=1.0 to read {human_bytes(floor)} instead of {human_bytes(read)} "
            f"(in more, smaller requests), or {contiguous}."
        )
    same = f"the same {human_bytes(read)}" if floor == read else f"{human_bytes(floor)} of the {human_bytes(read)} read"
    return (
        f"max_over_read_ratio=1.0 would read {same}: most of "
        "what is read through are gaps under 4 KiB between the pieces this process needs, which every ratio reads "
        f"(a request per piece would cost more). To read less, {contiguous}, or save the tensors this load "
        "skips in another file; an explicit max_over_read_ratio (or a warnings filter) only silences this warning."
    )


def describe_source(header: Header) -> str:
    """How the report names a load's source: its file, or how many files of which layout."""
    if len(header.files) == 1:
        return header.files[0].file
    return f"{len(header.files)} files ({header.kind})"
