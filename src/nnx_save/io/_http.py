"""Ranged reads over HTTP(S).

A reader fetches just the byte ranges the engine planned, one ranged GET per
chunk, many at once over a pooled connection set. urllib3's ``Retry`` follows redirects
and retries a request that failed before its answer (a refused connection, a 503); a
body cut short is retried whole, so partial data is never returned. What a hostile or changing server cannot do
(change the object under a load, send other bytes, hang, redirect silently) and how
each is refused: docs/reliability.md, "Hostile servers and odd sources".
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import itertools
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import urljoin, urlsplit

from .. import _config
from .._version import __version__
from ..errors import RemoteError, SourceChangedError
from ._reader import ViewReader

if TYPE_CHECKING:  # socket and random are imported where an HTTP read needs them, not with nnx_save
    import socket

__all__ = ["HttpLimits", "HttpReader", "RemoteStats"]

SPECULATIVE_HEADER_BYTES = 64 << 10
MAX_REDIRECTS = 5
_MAX_RETRIES, _BACKOFF_S = 5, 0.05  # retried after 50 ms, 100 ms, ... (jittered)
_RETRY_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})


@dataclass
class RemoteStats:
    """The retries of every reader of one load, for its report (thread-safe; each
    reader counts its own requests, and the engine its bytes, in ``IOStats``)."""

    retries: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, retries: int = 0) -> None:
        with self._lock:
            self.retries += retries


@dataclass(frozen=True)
class HttpLimits:
    """How long one HTTP request may take: ``timeout_s`` plus its length at
    ``min_bytes_per_s``. Defaults from ``NNX_SAVE_HTTP_TIMEOUT`` (60 s) and
    ``NNX_SAVE_HTTP_MIN_RATE`` (256 KiB/s)."""

    timeout_s: float = 60.0
    min_bytes_per_s: float = 256 << 10

    @classmethod
    def from_env(cls) -> HttpLimits:
        return cls(_config.HTTP_TIMEOUT.get(), _config.HTTP_MIN_RATE.get())

    def seconds(self, nbytes: int) -> float:
        return self.timeout_s + nbytes / self.min_bytes_per_s


class _Watchdog:
    """One thread that runs an action (shutting a socket) when a deadline passes:
    a server that sends a byte every few seconds never trips a socket timeout."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int]] = []
        self._actions: dict[int, Callable[[], None]] = {}  # armed, not yet fired or disarmed
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    def arm(self, deadline: float, action: Callable[[], None]) -> int:
        with self._cond:
            token = next(self._ids)
            heapq.heappush(self._heap, (deadline, token))
            self._actions[token] = action
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="nnx_save-http-deadline", daemon=True)
                self._thread.start()
            if self._heap[0][1] == token:  # only an earlier deadline than all others needs the thread awake
                self._cond.notify()
            return token

    def disarm(self, token: int) -> None:
        with self._cond:
            self._actions.pop(token, None)  # the heap entry is skipped when it comes up

    def _run(self) -> None:
        with self._cond:
            while True:
                while self._heap and self._heap[0][1] not in self._actions:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cond.wait()
                    continue
                wait = self._heap[0][0] - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                _, token = heapq.heappop(self._heap)
                with contextlib.suppress(OSError):  # the socket is already closed: nothing left to stop
                    self._actions.pop(token)()


_WATCHDOG = _Watchdog()
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


def _reset_in_child() -> None:
    """After ``fork``: pooled connections are the parent's sockets (sharing one
    would interleave two processes' requests), and the watchdog thread is gone."""
    global _POOL, _POOL_LOCK, _WATCHDOG
    _POOL, _POOL_LOCK, _WATCHDOG = None, threading.Lock(), _Watchdog()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_in_child)


def _user_agent() -> str:
    """Names the library and the process, so server logs can tell hosts' reads apart."""
    return f"nnx_save/{__version__} (pid {os.getpid()})"


class _Retry(Exception):
    """A transient failure: try this range again."""


@functools.cache
def _retry():
    """The retry policy of every request (urllib3's ``Retry``; it is immutable, and each
    request's copy records the request's history). A response it retries or follows is
    closed, never drained (a hostile body can be endless); a ``Retry-After`` is not
    waited for (the backoff is ours); a redirect off http(s) is refused before it is
    followed."""
    import urllib3

    class Policy(urllib3.Retry):
        def increment(self, method=None, url=None, response=None, *args, **kwargs):
            if response is not None:
                location = response.get_redirect_location()
                response.close()
                if location and urlsplit(urljoin(url or "", location)).scheme not in ("http", "https"):
                    raise RemoteError(f"HTTP {response.status} redirected to {location!r}, not http(s)")
            return super().increment(method, url, response, *args, **kwargs)

    return Policy(
        total=None, connect=_MAX_RETRIES, read=_MAX_RETRIES, status=_MAX_RETRIES, other=_MAX_RETRIES,
        redirect=MAX_REDIRECTS, status_forcelist=_RETRY_STATUSES, backoff_factor=_BACKOFF_S, backoff_jitter=_BACKOFF_S,
        respect_retry_after_header=False, raise_on_status=False,
    )  # fmt: skip


_NO_RANGES = (
    ". HTTP 200 is the whole file: this server ignores the Range header (python -m http.server does), so it "
    "cannot serve a checkpoint, which is read by byte ranges. Serve it with one that supports ranges: nginx, "
    "Apache, Caddy, an object store's URL (S3, GCS, presigned ones too), the HuggingFace Hub"
)


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


def _version(headers) -> str | None:
    """The response's validator: its ETag, else its Last-Modified date."""
    modified = headers.get("Last-Modified")
    return headers.get("ETag") or (f"Last-Modified: {modified}" if modified else None)


def _changed(url: str, pinned: tuple[int | None, str | None], now: tuple[int, str | None]) -> SourceChangedError:
    return SourceChangedError(
        f"{url}: the object changed during the load (size {pinned[0]} -> {now[0]}, "
        f"version {pinned[1]} -> {now[1]}); reload from the start",
        url,
    )


def _check_body_headers(headers, url: str, span: str, length: int) -> None:
    encoding = headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise RemoteError(
            f"{url}: bytes {span} came with Content-Encoding {encoding!r}; ranges are asked "
            "with Accept-Encoding: identity and must be sent unencoded"
        )
    declared = headers.get("Content-Length")
    if declared is not None and declared.strip() != str(length):
        raise RemoteError(f"{url}: bytes {span} ({length} bytes) came with Content-Length {declared!r}")


class HttpReader(ViewReader):
    """Ranged GETs against one URL; the identity (size, version) is pinned by the
    first response and checked on every later one (see the module docstring)."""

    def __init__(self, url: str, stats: RemoteStats | None, size: int | None, etag: str | None) -> None:
        self.url = url
        self.stats = stats or RemoteStats()
        self.size, self.etag = size, etag
        self.limits = HttpLimits.from_env()
        self.final_url: str | None = None  # where redirects led, once a response came
        self.requests = 0

    @property
    def identity(self) -> tuple[int, str | None]:
        assert self.size is not None, "identity is known after the first response"
        return self.size, self.etag

    def close(self) -> None:
        pass

    def _headers(self, begin: int, length: int) -> dict[str, str]:
        headers = {
            "Range": f"bytes={begin}-{begin + length - 1}",
            "Accept-Encoding": "identity",
            "User-Agent": _user_agent(),
        }
        if self.etag and not self.etag.startswith(("W/", "Last-Modified")):  # If-Match compares strong ETags
            headers["If-Match"] = self.etag
        return headers

    def _request(self, headers: Mapping[str, str], span: str, timeout: float):
        """GET with ``headers``, following redirects and retrying what failed before an
        answer (:func:`_retry`); returns the final response and counts its retries.
        ``timeout`` bounds the connect and each socket read until the headers are in."""
        import urllib3

        try:
            r = _pool().request(
                "GET",
                self.url,
                headers=dict(headers),
                preload_content=False,
                retries=_retry(),
                timeout=urllib3.Timeout(connect=min(10.0, timeout), read=timeout),
            )
        except RemoteError as e:  # the policy's, naming neither the URL nor the range
            why = f": {e}"
        except urllib3.exceptions.MaxRetryError as e:  # a status's retries end in a response, not here
            loop = isinstance(e.reason, urllib3.exceptions.ResponseError)
            why = f" failed after {_MAX_RETRIES + 1} attempts: {e.reason}"
            why = f": more than {MAX_REDIRECTS} redirects (the last to {e.url})" if loop else why
        except urllib3.exceptions.HTTPError as e:
            raise _Retry(f"connection failed: {e}") from None
        else:
            history = r.retries.history
            retried = sum(h.redirect_location is None for h in history)
            self.requests += 1 + len(history)
            self.stats.add(retries=retried)
            hops = [urljoin(h.url, h.redirect_location) for h in history if h.redirect_location]
            self.final_url = hops[-1] if hops else self.url
            if r.status not in _RETRY_STATUSES:
                return r
            r.release_conn()  # closed by the policy, which gave up on it
            why = f" failed after {retried + 1} attempts: HTTP {r.status}"
        raise RemoteError(f"{self.url}: bytes {span}{why}")

    def _check_status(self, r, span: str) -> None:
        if r.status == 404:
            raise FileNotFoundError(f"{self.url}: not found (HTTP 404)")
        if r.status == 412 and self.etag:  # If-Match failed: no longer the pinned version
            raise _changed(
                self.url, (self.size, self.etag), (self.size or 0, f"not {self.etag} (HTTP 412 to If-Match)")
            )
        if r.status >= 400:
            raise RemoteError(f"{self.url}: HTTP {r.status} for bytes {span}")
        if r.status != 206:
            where = f" (redirected to {self.final_url})" if self.final_url != self.url else ""
            raise RemoteError(
                f"{self.url}: range request for bytes {span} got HTTP {r.status}{where}; "
                f"the server must answer ranges with 206{_NO_RANGES if r.status == 200 else ''}"
            )

    def _span(self, r, begin: int, length: int, to_end: bool) -> int:
        """Check the response's range and identity; return its body's length."""
        span = f"{begin}-{begin + length - 1}"
        got_begin, got_end, total = _content_range(r.headers, self.url)
        version = _version(r.headers)
        if self.size is None:
            self.size, self.etag = total, version
        elif total != self.size or version != self.etag:  # a validator that vanished is a change too
            raise _changed(self.url, (self.size, self.etag), (total, version))
        if to_end and got_begin == begin and got_end == total - 1 < begin + length - 1:
            pass  # a speculative range past the end of a small object
        elif got_begin != begin or got_end != begin + length - 1:
            raise RemoteError(f"{self.url}: asked for bytes {span}, got {got_begin}-{got_end}")
        _check_body_headers(r.headers, self.url, span, got_end - got_begin + 1)
        return got_end - got_begin + 1

    def _once(self, begin: int, length: int, sink: Callable[[object, int], None], to_end: bool = False) -> None:
        import socket

        import urllib3

        span = f"{begin}-{begin + length - 1}"
        seconds = self.limits.seconds(length)
        deadline = time.monotonic() + seconds
        r = self._request(self._headers(begin, length), span, min(seconds, self.limits.timeout_s))
        expired = threading.Event()
        sock: socket.socket | None = getattr(getattr(r, "connection", None), "sock", None)

        def stop() -> None:
            expired.set()
            if sock is not None:
                sock.shutdown(socket.SHUT_RDWR)

        token, complete = _WATCHDOG.arm(deadline, stop), False
        try:
            self._check_status(r, span)
            nbytes = self._span(r, begin, length, to_end)
            try:
                sink(r, nbytes)
                longer = r.headers.get("Content-Length") is None and _raw(r).read(1)  # chunked: must end here
            except (urllib3.exceptions.HTTPError, OSError, ValueError, _Retry) as e:
                if expired.is_set():
                    raise self._too_slow(span, seconds) from None
                raise _Retry(f"body interrupted: {e}") from None
            if longer:
                raise RemoteError(f"{self.url}: the body for bytes {span} is longer than the range")
            complete = True
        finally:
            _WATCHDOG.disarm(token)
            if not complete:
                r.close()  # an unread or hostile rest of a body: close the connection, never pool it
            r.release_conn()

    def _too_slow(self, span: str, seconds: float) -> RemoteError:
        return RemoteError(
            f"{self.url}: bytes {span} not received within {seconds:.1f} s (the deadline is "
            f"{_config.HTTP_TIMEOUT.name}={self.limits.timeout_s:g} s plus the length at {_config.HTTP_MIN_RATE.name}="
            f"{self.limits.min_bytes_per_s:g} bytes/s)"
        )

    def _with_retries(self, begin: int, length: int, sink: Callable[[object, int], None], to_end: bool = False) -> None:
        for attempt in range(_MAX_RETRIES + 1):
            try:
                return self._once(begin, length, sink, to_end)
            except _Retry as e:
                if attempt == _MAX_RETRIES:
                    raise RemoteError(
                        f"{self.url}: bytes {begin}-{begin + length - 1} failed after {attempt + 1} attempts: {e}"
                    ) from None
                self.stats.add(retries=1)
                import random

                time.sleep(_BACKOFF_S * (2**attempt) * (0.5 + random.random()))

    def readv(self, buffers: list[memoryview], offset: int) -> None:
        """Fill ``buffers`` in order from ``offset`` with one ranged GET (retried whole)."""
        total = sum(len(b) for b in buffers)
        if total == 0:
            return

        def sink(response, nbytes: int) -> None:
            for buf in buffers:
                _read_exact(response, buf)

        self._with_retries(offset, total, sink)

    def probe(self) -> bytes:
        """The first bytes of the object (speculatively enough for most headers),
        pinning its size and version. One request; never reads more than it asked."""
        if self.size is not None:
            return self.read(0, min(SPECULATIVE_HEADER_BYTES, self.size))
        chunks: list[bytes] = []

        def sink(response, nbytes: int) -> None:
            out = bytearray(nbytes)  # nbytes <= SPECULATIVE_HEADER_BYTES: checked by _span
            _read_exact(response, memoryview(out))
            chunks.append(bytes(out))

        self._with_retries(0, SPECULATIVE_HEADER_BYTES, sink, to_end=True)
        return chunks[-1]


def _raw(response):
    # urllib3 2.x's readinto reads into a temporary bytes object and copies; the
    # http.client response beneath it (identity encoding, Content-Length known)
    # reads from the socket straight into our buffer.
    raw = getattr(response, "_fp", None)
    return raw if raw is not None and hasattr(raw, "readinto") else response


def _read_exact(response, buf: memoryview) -> None:
    view = buf.cast("B") if buf.format != "B" else buf
    reader = _raw(response)
    done = 0
    while done < len(view):
        n = reader.readinto(view[done:])
        if not n:
            raise _Retry(f"body ended {len(view) - done} bytes early")
        done += n
