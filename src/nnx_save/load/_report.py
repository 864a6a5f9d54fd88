"""What a load found: the public records of the load report.

:class:`LoadReport` (filled, missing, unexpected, reshaped, cast, allowed, and the I/O it
took), :class:`ShapeMismatch`, :class:`DtypeCast` and :class:`IOStats`, with the remedies a
strict refusal names and the two rules the checkpoint store shares with the load: what a
lossy cast is (:func:`is_lossy`) and what an ``allow_*`` pattern matches (:func:`matches_any`).
The report is made before any byte is read (:mod:`nnx_save.load._match`); :func:`complete`
fills it in from what the engine did (:class:`~nnx_save.load._result.EngineResult`).
"""

from __future__ import annotations

import fnmatch
import logging
import re
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from ..errors import LoadError, LoadWarning, LossyCastWarning, OverReadWarning
from ._hints import shape_remedy
from ._result import EngineResult, over_read_message

__all__ = [
    "DtypeCast",
    "IOStats",
    "LoadReport",
    "ShapeMismatch",
    "complete",
    "is_lossy",
    "matches_any",
    "rename_remedy",
    "target_remedy",
]

log = logging.getLogger("nnx_save")


@dataclass(frozen=True)
class ShapeMismatch:
    path: str
    model_shape: tuple[int, ...]
    file_shape: tuple[int, ...]
    file_key: str = ""

    def __str__(self) -> str:
        src = f" (file key {self.file_key!r})" if self.file_key and self.file_key != self.path else ""
        return f"{self.path}: shape {self.model_shape} in the model, {self.file_shape} in the file{src}"


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
        fixes = target_remedy(self.suggested_targets) + rename_remedy(self.suggested_renames)
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


def rename_remedy(renames: Sequence[str]) -> str:
    if not renames:
        return ""
    rules = ", ".join(renames)
    return (
        "Missing paths and unexpected keys pair up by structure (the same indices, leaf name and shape, no "
        "tie; the rules are checked against every key): the file names them "
        f"differently. Map them, rather than allowing either:\n  rules=Rules({rules})  "
        "(from nnx_save.porting import Rules, rename; add them to your rules if you pass some)\n"
    )


def target_remedy(fixes: Sequence[str]) -> str:
    if not fixes:
        return ""
    return (
        "Porting rules send file keys to paths the model lacks, and those pair up with missing paths "
        "(same name suffix and shape): fix the rules' targets, rather than allowing either:\n  "
        + "\n  ".join(fixes)
        + "\n"
    )


def complete(report: LoadReport, result: EngineResult, retries: int) -> None:
    """Fill ``report`` (made by :func:`~nnx_save.load._match.check_targets`) in with what
    the engine did; warn once if the load read far more than it needed. ``retries``: the
    transport's requests retried."""
    io = report.io
    for file, read, needed, requests in result.files:
        io.add_file(file, read, needed, requests)
    io.requests += result.requests
    io.plan_seconds, io.read_seconds, io.assemble_seconds = result.seconds
    io.read_whole += result.read_whole
    io.max_inflight_bytes, io.retries = result.peak, retries
    report.verified = sorted(k for k, ok in result.checked.items() if ok)
    report.unverified = sorted(k for k, ok in result.checked.items() if not ok)
    report.loaded = sorted(result.values)
    log.debug("loaded %d tensors from %s: %s", len(result.values), report.source, io)
    if result.over_reads:
        warnings.warn(over_read_message(result), OverReadWarning, stacklevel=4)
