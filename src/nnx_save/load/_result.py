"""What one run of the engine did, and what it says when a load read far more than it needed.

The engine fills an :class:`EngineResult` as it reads and places (values, checksums
checked, per file bytes and requests, times, files read far beyond what they gave);
:func:`~nnx_save.load._report.complete` makes the report of it, with the over-read
warning's text (:func:`over_read_message`) and advice true for that load.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..format._units import human_bytes

__all__ = ["OVER_READ_MIN_BYTES", "OVER_READ_WARN", "EngineResult", "over_read_advice", "over_read_message"]

OVER_READ_WARN = 1.5  # a file read beyond this many times what it gave is worth a warning ...
OVER_READ_MIN_BYTES = 1 << 20  # ... when the bytes it did not need cost something (~1 ms of reading)


@dataclass
class EngineResult:
    """What one run of the engine did, per tensor and per file (it reads and places;
    :func:`~nnx_save.load._report.complete` makes the report of it).

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


def over_read_message(result: EngineResult) -> str:
    """The over-read warning's text: ``result``'s files read far beyond what they gave,
    and the remedy (:func:`over_read_advice`)."""
    return (
        "this load read far more bytes than it needed from these files: to make fewer, larger "
        "requests, the automatic read merging (max_over_read_ratio=None) read through the bytes "
        "between the pieces it needed (tensors the load skips, or parts other devices hold):\n  "
        + "\n  ".join(result.over_reads)
        + "\n"
        + over_read_advice(*result.over_read_bytes)
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
