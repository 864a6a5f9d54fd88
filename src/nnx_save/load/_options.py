"""How a load runs: one public, frozen :class:`LoadOptions`, validated when it is made.

Every entry point takes ``options=`` and keeps the common fields as keyword shortcuts;
:func:`merge` joins the two. ``NNX_SAVE_STREAM`` and ``NNX_SAVE_STAGING`` (testing aids,
docs/configuration.md) apply where the caller left those fields at their defaults.
"""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass, replace

from .. import _config
from .._options import DEFAULT, check, is_int, merge, optional

__all__ = ["DEFAULT", "LoadOptions", "check", "merge"]

STAGING_KINDS = ("auto", "pinned", "pageable")
LOCAL_CHUNK_BYTES = 128 << 20
REMOTE_REQUESTS = 32  # requests in flight per process from a URL
REMOTE_CHUNK_BYTES = 16 << 20
MIN_REMOTE_CHUNK = 1 << 20
# Requests per reading thread a remote load is cut into at least (chunks permitting): a
# load is as long as its last round of requests, so a few short rounds end closer together
# than one long one (a 400 MB checkpoint in 16 MiB requests is 25 for 32 threads).
REMOTE_ROUNDS = 4


@dataclass(frozen=True)
class LoadOptions:
    """How a load runs: the settings of :func:`~nnx_save.load_file` and
    :func:`~nnx_save.load_model`, each also a keyword of both that may set a field
    ``options=`` leaves at its default (not ``staging_bytes``).

    Attributes:
        max_over_read_ratio: cap on bytes read / bytes needed when merging reads
            (``None``: picked per file).
        read_chunk_bytes: the largest single read (``None``: set by the source,
            128 MiB from local files, 16 MiB per request from a URL; never more than
            ``max_inflight_bytes`` over the requests in flight, nor under 1 MiB).
        max_inflight_bytes: host bytes being read (and, when streaming, staged)
            at once, never exceeded by reads. A cast target (a float32 tensor into a
            bfloat16 param) is read in slabs of at most a thread's share of it, each
            cast into the result as it lands. Read whole in the file's dtype, beside
            the budget and counted in ``report.io.max_inflight_bytes``: sub-byte
            tensors and a porting rule's whole sources (docs/performance.md).
        num_threads: concurrent reads (``None``: set by the source, 2 to 8 by CPU
            count from local files, 32 requests in flight from a URL).
        verify: check each tensor read in full against its recorded checksum
            (:class:`~nnx_save.ChecksumError` on a mismatch); the others are listed
            in ``report.unverified``.
        stream: ``None`` decides from the devices' platform (stream everywhere
            but on the CPU backend, whose arrays adopt host buffers); ``True``
            forces the streaming path (a testing aid on CPU), ``False`` forbids it.
        staging: memory of the streaming path's staging buffers: ``"pinned"``
            (page-locked, jax's ``pinned_host`` memory kind), ``"pageable"``, or
            ``"auto"`` (pinned where the backend offers it, except on CPU).
        staging_bytes: size of one staging buffer (``None``: picked from the budget).
        progress: progress on stderr: ``None`` a bar on a terminal above
            ``NNX_SAVE_PROGRESS_MIN_BYTES`` (256 MiB), nothing on a pipe; ``True`` a bar
            on a terminal, plain lines at a bounded rate elsewhere (a log); ``False`` never.
        share_reads: with several processes, read each byte that several need on one
            of them and share it over the interconnect with JAX's collectives. ``None``:
            on for a URL or processes on several hosts, off for local files on one
            host; ``True`` / ``False`` force it (docs/multihost.md).

    Raises:
        OptionError: a field out of range or of the wrong type (names it).

    Examples:
        >>> LoadOptions(max_inflight_bytes=1 << 20).threads >= 2
        True
        >>> LoadOptions(read_chunk_bytes=0)
        Traceback (most recent call last):
        ...
        nnx_save.errors.OptionError: read_chunk_bytes must be a positive int (bytes), got 0
    """

    max_over_read_ratio: float | None = None
    read_chunk_bytes: int | None = None
    max_inflight_bytes: int = 2 << 30
    num_threads: int | None = None
    verify: bool = False
    stream: bool | None = None
    staging: str = "auto"
    staging_bytes: int | None = None
    progress: bool | None = None
    share_reads: bool | None = None

    def __post_init__(self) -> None:
        ratio = self.max_over_read_ratio
        check(
            is_int(self.max_inflight_bytes, 1), "max_inflight_bytes", "a positive int (bytes)", self.max_inflight_bytes
        )
        chunk = self.read_chunk_bytes
        check(optional(chunk, is_int(chunk, 1)), "read_chunk_bytes", "a positive int (bytes)", chunk)
        ok = isinstance(ratio, numbers.Real) and not isinstance(ratio, bool) and 1.0 <= ratio <= 1e300  # not NaN
        check(optional(ratio, ok), "max_over_read_ratio", ">= 1.0", ratio)
        check(
            optional(self.num_threads, is_int(self.num_threads, 1, 4096)), "num_threads", "1 to 4096", self.num_threads
        )
        check(isinstance(self.verify, bool), "verify", "True or False", self.verify)
        check(self.staging in STAGING_KINDS, "staging", f"one of {STAGING_KINDS}", self.staging)
        size = self.staging_bytes
        check(optional(size, is_int(size, 1)), "staging_bytes", "a positive int (bytes)", size)
        for name in ("stream", "progress", "share_reads"):  # a bool, not 1 or 0 (== True, False)
            value = getattr(self, name)
            check(optional(value, isinstance(value, bool)), name, "None, True or False", value)

    @property
    def threads(self) -> int:
        """Reading threads: ``num_threads``, or 2 to 8 by CPU count."""
        return self.num_threads or max(2, min(8, os.cpu_count() or 2))

    @property
    def chunk_bytes(self) -> int:
        """The largest single read: never more than the in-flight budget."""
        return min(self.read_chunk_bytes or LOCAL_CHUNK_BYTES, self.max_inflight_bytes)

    def for_source(self, remote: bool, total_bytes: int | None = None) -> LoadOptions:
        """These options with ``num_threads`` and ``read_chunk_bytes`` set by the
        source where they are ``None``: tens of requests in flight over a network,
        each a few MiB (a stream per request is what object stores and CDNs cap),
        all within ``max_inflight_bytes``, and, given the ``total_bytes`` to read,
        small enough that every thread has :data:`REMOTE_ROUNDS` of them; a few
        threads of large reads from a disk.

        Examples:
            >>> o = LoadOptions(max_inflight_bytes=64 << 20).for_source(remote=True)
            >>> o.num_threads, o.read_chunk_bytes >> 20
            (32, 2)
            >>> LoadOptions().for_source(remote=True, total_bytes=400 << 20).read_chunk_bytes >> 20
            3
        """
        if not remote:
            return replace(self, num_threads=self.threads, read_chunk_bytes=self.chunk_bytes)
        threads = self.num_threads or REMOTE_REQUESTS
        share = max(MIN_REMOTE_CHUNK, self.max_inflight_bytes // threads)  # every request in flight at once
        if total_bytes is not None:
            share = min(share, max(MIN_REMOTE_CHUNK, total_bytes // (threads * REMOTE_ROUNDS)))
        chunk = self.read_chunk_bytes or min(REMOTE_CHUNK_BYTES, share)
        return replace(self, num_threads=threads, read_chunk_bytes=min(chunk, self.max_inflight_bytes))

    def streaming(self, platform: str) -> bool:
        """Whether a load onto devices of ``platform`` streams (see ``stream``)."""
        forced = self.stream if self.stream is not None else _config.STREAM.get()
        return forced if forced is not None else platform != "cpu"

    def staging_kind(self, platform: str, memory_kinds: tuple[str, ...]) -> str:
        """``"pinned"`` or ``"pageable"`` for devices of ``platform`` offering ``memory_kinds``."""
        kind = self.staging if self.staging != "auto" else _config.STAGING.get()
        if kind == "auto":
            kind = "pinned" if platform != "cpu" and "pinned_host" in memory_kinds else "pageable"
        return kind
