"""Remote sources: ranged reads over HTTP(S), and fsspec URLs (``s3://``, ``gs://``,
``hf://``) when the matching fsspec implementation is installed.

The engine already knows the exact byte ranges each process needs; a remote reader
fetches just those, one ranged GET per chunk, many at once over a pooled connection
set, under the engine's in-flight byte budget. A failed or short range is retried
whole (with backoff), so partial data is never returned; a change of the object's
size or ETag during a load is an error naming the URL.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ._errors import NnxSaveError
from ._version import __version__

__all__ = ["FsspecReader", "HttpReader", "RemoteChangedError", "RemoteError", "RemoteStats", "is_url", "open_remote"]

SPECULATIVE_HEADER_BYTES = 64 << 10
_RETRY_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})


class RemoteError(NnxSaveError, OSError):
    """A remote read failed after its retries, or the server does not serve ranges."""


class RemoteChangedError(RemoteError):
    """The remote object changed (size or ETag) while it was being read."""


def is_url(source: object) -> bool:
    return isinstance(source, str) and "://" in source and not source.startswith("file://")


@dataclass
class RemoteStats:
    """Counters shared by every reader of one load (thread-safe)."""

    requests: int = 0
    bytes: int = 0
    retries: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, requests: int = 0, nbytes: int = 0, retries: int = 0) -> None:
        with self._lock:
            self.requests += requests
            self.bytes += nbytes
            self.retries += retries


_POOL = None
_POOL_LOCK = threading.Lock()


def _pool():
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            import urllib3

            _POOL = urllib3.PoolManager(
                num_pools=16, maxsize=32, retries=False, timeout=urllib3.Timeout(connect=10.0, read=60.0)
            )
        return _POOL


def _user_agent() -> str:
    """Names the library and the process, so server logs can tell hosts' reads apart."""
    return f"nnx_save/{__version__} (pid {os.getpid()})"


class _Retry(Exception):
    """A transient failure: try this range again."""


def _content_range(headers, url: str) -> tuple[int, int, int]:
    value = headers.get("Content-Range", "")
    try:
        _unit, rest = value.split(" ", 1)
        span, total = rest.split("/")
        begin, end = span.split("-")
        return int(begin), int(end), int(total)
    except ValueError:
        raise RemoteError(
            f"{url}: expected a 206 response with Content-Range, got {value!r}; "
            "the server must support HTTP range requests"
        ) from None


class HttpReader:
    """Ranged GETs against one URL; the identity (size, ETag) is pinned by the first
    response and checked on every later one."""

    def __init__(
        self,
        url: str,
        *,
        stats: RemoteStats | None = None,
        max_retries: int = 5,
        backoff: float = 0.05,
        size: int | None = None,
        etag: str | None = None,
    ) -> None:
        self.url, self.path = url, url
        self.stats = stats or RemoteStats()
        self.max_retries, self.backoff = max_retries, backoff
        self.size, self.etag = size, etag
        self.requests = 0

    def close(self) -> None:
        pass

    def _check_identity(self, total: int, etag: str | None) -> None:
        if self.size is None:
            self.size, self.etag = total, etag
        elif total != self.size or (etag and self.etag and etag != self.etag):
            raise RemoteChangedError(
                f"{self.url}: the object changed during the load (size {self.size} -> {total}, "
                f"ETag {self.etag} -> {etag}); reload from the start"
            )

    def _once(self, begin: int, length: int, sink: Callable[[object], None], to_end: bool = False) -> None:
        import urllib3

        headers = {
            "Range": f"bytes={begin}-{begin + length - 1}",
            "Accept-Encoding": "identity",
            "User-Agent": _user_agent(),
        }
        try:
            r = _pool().request("GET", self.url, headers=headers, preload_content=False, redirect=True)
        except urllib3.exceptions.HTTPError as e:
            raise _Retry(f"connection failed: {e}") from None
        try:
            self.requests += 1
            self.stats.add(requests=1)
            if r.status in _RETRY_STATUSES:
                raise _Retry(f"HTTP {r.status}")
            if r.status == 404:
                raise FileNotFoundError(f"{self.url}: not found (HTTP 404)")
            if r.status >= 400:
                raise RemoteError(f"{self.url}: HTTP {r.status} for bytes {begin}-{begin + length - 1}")
            if r.status != 206:
                raise RemoteError(
                    f"{self.url}: range request for bytes {begin}-{begin + length - 1} got HTTP {r.status}; "
                    "the server must answer ranges with 206"
                )
            got_begin, got_end, total = _content_range(r.headers, self.url)
            self._check_identity(total, r.headers.get("ETag"))
            if to_end and got_begin == begin and got_end == total - 1 < begin + length - 1:
                pass  # a speculative range past the end of a small object
            elif got_begin != begin or got_end != begin + length - 1:
                raise RemoteError(
                    f"{self.url}: asked for bytes {begin}-{begin + length - 1}, got {got_begin}-{got_end}"
                )
            try:
                sink(r)
            except (urllib3.exceptions.HTTPError, ConnectionError, _Short) as e:
                raise _Retry(f"body interrupted: {e}") from None
        finally:
            r.release_conn()

    def _with_retries(self, begin: int, length: int, sink: Callable[[object], None], to_end: bool = False) -> None:
        for attempt in range(self.max_retries + 1):
            try:
                return self._once(begin, length, sink, to_end)
            except _Retry as e:
                if attempt == self.max_retries:
                    raise RemoteError(
                        f"{self.url}: bytes {begin}-{begin + length - 1} failed after {attempt + 1} attempts: {e}"
                    ) from None
                self.stats.add(retries=1)
                time.sleep(self.backoff * (2**attempt) * (0.5 + random.random()))

    def readv(self, buffers: list[memoryview], offset: int) -> None:
        """Fill ``buffers`` in order from ``offset`` with one ranged GET (retried whole)."""
        total = sum(len(b) for b in buffers)
        if total == 0:
            return

        def sink(response) -> None:
            for buf in buffers:
                _read_exact(response, buf)
            self.stats.add(nbytes=total)

        self._with_retries(offset, total, sink)

    def read(self, offset: int, length: int) -> bytes:
        out = bytearray(length)
        self.readv([memoryview(out)], offset)
        return bytes(out)

    def probe(self) -> bytes:
        """The first bytes of the object (speculatively enough for most headers),
        pinning its size and ETag. One request."""
        chunks: list[bytes] = []

        def sink(response) -> None:
            chunks.append(response.read())

        if self.size is not None:
            return self.read(0, min(SPECULATIVE_HEADER_BYTES, self.size))
        self._with_retries(0, SPECULATIVE_HEADER_BYTES, sink, to_end=True)
        return chunks[-1]


class _Short(Exception):
    pass


def _read_exact(response, buf: memoryview) -> None:
    view = buf.cast("B") if buf.format != "B" else buf
    # urllib3 2.x's readinto reads into a temporary bytes object and copies; the
    # http.client response beneath it (identity encoding, Content-Length known)
    # reads from the socket straight into our buffer.
    raw = getattr(response, "_fp", None)
    reader = raw if raw is not None and hasattr(raw, "readinto") else response
    done = 0
    while done < len(view):
        n = reader.readinto(view[done:])
        if not n:
            raise _Short(f"body ended {len(view) - done} bytes early")
        done += n


class FsspecReader:
    """Ranged reads through fsspec (``s3://``, ``gs://``, ``hf://`` ...)."""

    def __init__(self, url: str, *, stats: RemoteStats | None = None) -> None:
        try:
            import fsspec
        except ImportError:
            raise RemoteError(f"{url}: reading this URL needs fsspec: pip install 'nnx_save[remote]'") from None
        protocol = url.split("://", 1)[0]
        try:
            self.fs = fsspec.filesystem(protocol)
        except (ImportError, ValueError) as e:
            extra = {"s3": "s3fs", "gs": "gcsfs", "hf": "huggingface_hub"}.get(
                protocol, f"an fsspec implementation for {protocol}"
            )
            raise RemoteError(f"{url}: no fsspec implementation for {protocol}:// ({e}); install {extra}") from None
        self.url, self.path = url, url
        self.stats = stats or RemoteStats()
        self.size = self.fs.size(url)
        self.requests = 0

    def close(self) -> None:
        pass

    def readv(self, buffers: list[memoryview], offset: int) -> None:
        total = sum(len(b) for b in buffers)
        data = self.fs.cat_file(self.url, start=offset, end=offset + total)
        if len(data) != total:
            raise RemoteError(f"{self.url}: asked for {total} bytes at {offset}, got {len(data)}")
        self.requests += 1
        self.stats.add(requests=1, nbytes=total)
        pos = 0
        for b in buffers:
            b.cast("B")[:] = data[pos : pos + len(b)]
            pos += len(b)

    def read(self, offset: int, length: int) -> bytes:
        out = bytearray(length)
        self.readv([memoryview(out)], offset)
        return bytes(out)

    def probe(self) -> bytes:
        return self.read(0, min(SPECULATIVE_HEADER_BYTES, self.size))


def open_remote(url: str, stats: RemoteStats | None = None):
    if url.startswith(("http://", "https://")):
        return HttpReader(url, stats=stats)
    return FsspecReader(url, stats=stats)
