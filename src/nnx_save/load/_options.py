"""How a load runs: one frozen :class:`LoadOptions`, validated once.

At the bottom of the import graph (standard library only). The two streaming
settings can also come from the environment, as a testing and benchmarking aid:
``NNX_SAVE_STREAM=1`` forces the streaming path (``0`` forbids it) and
``NNX_SAVE_STAGING=pinned|pageable`` picks the staging memory, when the caller
left them at their defaults.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["STAGING_KINDS", "LoadOptions"]

STAGING_KINDS = ("auto", "pinned", "pageable")


def _env_stream() -> bool | None:
    raw = os.environ.get("NNX_SAVE_STREAM", "").strip().lower()
    if raw in ("", "auto"):
        return None
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"NNX_SAVE_STREAM must be 1, 0 or auto, got {raw!r}")


@dataclass(frozen=True)
class LoadOptions:
    """Settings of one load (see :func:`nnx_save.load_file` for each).

    Attributes:
        max_over_read_ratio: cap on bytes read / bytes needed when merging reads
            (``None``: picked per file).
        read_chunk_bytes: the largest single read.
        max_inflight_bytes: host bytes being read (and, when streaming, staged)
            at once, never exceeded.
        num_threads: concurrent readers (``None``: 2 to 8 by CPU count).
        verify: check recorded checksums of the tensors read in full.
        stream: ``None`` decides from the devices' platform (stream everywhere
            but on the CPU backend, whose arrays adopt host buffers); ``True``
            forces the streaming path (a testing aid on CPU), ``False`` forbids it.
        staging: memory of the streaming path's staging buffers: ``"pinned"``
            (page-locked, jax's ``pinned_host`` memory kind), ``"pageable"``, or
            ``"auto"`` (pinned where the backend offers it, except on CPU).
        staging_bytes: size of one staging buffer (``None``: picked from the budget).
        share_reads: with several processes, read each byte that several of them
            need on one process only and share it over the interconnect with JAX's
            collectives (:mod:`nnx_save.load._share`); off by default.

    Examples:
        >>> LoadOptions(max_inflight_bytes=1 << 20).threads >= 2
        True
        >>> LoadOptions(read_chunk_bytes=0)
        Traceback (most recent call last):
        ...
        ValueError: max_inflight_bytes and read_chunk_bytes must be positive, got 2147483648, 0
    """

    max_over_read_ratio: float | None = None
    read_chunk_bytes: int = 128 << 20
    max_inflight_bytes: int = 2 << 30
    num_threads: int | None = None
    verify: bool = False
    stream: bool | None = None
    staging: str = "auto"
    staging_bytes: int | None = None
    share_reads: bool = False

    def __post_init__(self) -> None:
        if self.max_inflight_bytes <= 0 or self.read_chunk_bytes <= 0:
            raise ValueError(
                "max_inflight_bytes and read_chunk_bytes must be positive, "
                f"got {self.max_inflight_bytes}, {self.read_chunk_bytes}"
            )
        if self.max_over_read_ratio is not None and not self.max_over_read_ratio >= 1.0:
            raise ValueError(f"max_over_read_ratio must be >= 1.0, got {self.max_over_read_ratio}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be at least 1, got {self.num_threads}")
        if self.staging not in STAGING_KINDS:
            raise ValueError(f"staging must be one of {STAGING_KINDS}, got {self.staging!r}")
        if self.staging_bytes is not None and self.staging_bytes <= 0:
            raise ValueError(f"staging_bytes must be positive, got {self.staging_bytes}")

    @property
    def threads(self) -> int:
        """Reading threads: ``num_threads``, or 2 to 8 by CPU count."""
        return self.num_threads or max(2, min(8, os.cpu_count() or 2))

    @property
    def chunk_bytes(self) -> int:
        """The largest single read: never more than the in-flight budget."""
        return min(self.read_chunk_bytes, self.max_inflight_bytes)

    def streaming(self, platform: str) -> bool:
        """Whether a load onto devices of ``platform`` streams (see ``stream``)."""
        forced = self.stream if self.stream is not None else _env_stream()
        return forced if forced is not None else platform != "cpu"

    def staging_kind(self, platform: str, memory_kinds: tuple[str, ...]) -> str:
        """``"pinned"`` or ``"pageable"`` for devices of ``platform`` offering ``memory_kinds``."""
        kind = self.staging
        if kind == "auto":
            kind = os.environ.get("NNX_SAVE_STAGING", "auto").strip().lower() or "auto"
            if kind not in STAGING_KINDS:
                raise ValueError(f"NNX_SAVE_STAGING must be one of {STAGING_KINDS}, got {kind!r}")
        if kind == "auto":
            kind = "pinned" if platform != "cpu" and "pinned_host" in memory_kinds else "pageable"
        return kind
