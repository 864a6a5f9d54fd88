"""Object stores (``s3://``, ``gs://``, ``az://``) through obstore, a client made for
them (Rust's ``object_store``): concurrent ranged GETs, multipart uploads.

Reads are pinned to the object's size and ETag: every ranged GET carries ``If-Match``,
and an answer for another version is a :class:`~nnx_save.SourceChangedError`. Each
range arrives in pieces of at most :data:`PIECE_BYTES`, copied once into the caller's
buffers (obstore hands out no way to receive into them), so a request in flight holds
one piece, not its whole range. Writes are multipart uploads of :data:`PART_BYTES`
parts, :data:`UPLOADS_IN_FLIGHT` at once; the object appears only when the upload
completes, and a failed upload is aborted.

Credentials, region and endpoint come from the environment as each store's own SDK
reads them (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``, ``GOOGLE_APPLICATION_CREDENTIALS``,
``AZURE_STORAGE_ACCOUNT_NAME`` ...); plain ``http://`` endpoints are allowed on loopback
(a local S3 server) or with ``AWS_ALLOW_HTTP=true``.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from .. import _config
from ..errors import RemoteError, SaveError
from ._fsspec import one_uploader
from ._http import _MAX_RETRIES, SPECULATIVE_HEADER_BYTES, HttpLimits, RemoteStats, _changed
from ._reader import ViewReader

__all__ = ["ObjectStoreReader", "ObstoreClient", "put", "serves"]

SCHEMES = ("s3", "gs", "az")
PIECE_BYTES = 1 << 20  # what one request in flight holds before it is copied into place
PART_BYTES = 16 << 20  # S3 allows 5 MiB and up (but the last), and 10,000 parts: larger objects, larger parts
MAX_PARTS = 10_000
UPLOADS_IN_FLIGHT = 16
_LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
_STORES: dict[tuple, Any] = {}
_STORES_LOCK = threading.Lock()


def serves(url: str) -> bool:
    """Whether ``url`` is an object store this module reads and writes (``s3://``,
    ``gs://``, ``az://``); fsspec serves the other schemes."""
    return url.split("://", 1)[0].lower() in SCHEMES and "://" in url


def _obstore(url: str, error: type[Exception] = RemoteError) -> Any:
    try:
        import obstore
    except ImportError:
        raise error(f"{url}: object stores are read and written with obstore: pip install 'nnx_save[remote]'") from None
    return obstore


def _split(url: str) -> tuple[str, str, str]:
    """``(scheme, bucket, key)`` of ``url``."""
    parts = urlsplit(url)
    key = url.split("://", 1)[1][len(parts.netloc) :].lstrip("/")
    if not parts.netloc:
        raise RemoteError(f"{url}: no bucket in the URL (expected {parts.scheme}://BUCKET/KEY)")
    return parts.scheme.lower(), parts.netloc, key


def _client_options(endpoint: str | None) -> dict[str, Any]:
    """Timeouts as HTTP reads have them; ``http://`` allowed for a loopback endpoint."""
    limits = HttpLimits.from_env()
    options: dict[str, Any] = {
        "connect_timeout": "10s",
        "timeout": f"{int(limits.seconds(64 << 20))}s",  # the largest range or part this library asks for
        "pool_max_idle_per_host": "64",
    }
    host = urlsplit(endpoint).hostname if endpoint else None
    if endpoint and endpoint.startswith("http://") and host in _LOOPBACK:
        options["allow_http"] = True
    return options


def _make_store(scheme: str, bucket: str, env: dict[str, str]) -> Any:
    from obstore import store

    if scheme == "s3":
        endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
        # Each part's SHA-256 (computed for the request's signature anyway) sent as its
        # checksum, which the store verifies: an upload corrupted in transit is refused, and
        # a store that would otherwise checksum the whole object once complete checksums
        # the parts as they come. AWS_CHECKSUM_ALGORITHM, where set, says otherwise.
        checksum = {} if "AWS_CHECKSUM_ALGORITHM" in env else {"checksum_algorithm": "SHA256"}
        return store.S3Store(bucket, client_options=_client_options(endpoint), **checksum)  # type: ignore[arg-type]
    if scheme == "gs":
        return store.GCSStore(bucket, client_options=_client_options(None))  # type: ignore[arg-type]
    return store.AzureStore(bucket, client_options=_client_options(None))  # type: ignore[arg-type]


def _store(url: str) -> tuple[Any, str]:
    """The process's store for ``url``'s bucket (one connection pool per bucket and
    configuration: a changed environment makes a new one), and the object's key."""
    _obstore(url)
    scheme, bucket, key = _split(url)
    env = _config.store_environment()
    timeouts = (_config.HTTP_TIMEOUT.get(), _config.HTTP_MIN_RATE.get())
    with _STORES_LOCK:
        found = _STORES.get((scheme, bucket, env, timeouts))
        if found is None:
            try:
                found = _STORES[(scheme, bucket, env, timeouts)] = _make_store(scheme, bucket, dict(env))
            except Exception as e:  # obstore's configuration errors: a bad variable, an unknown key
                raise RemoteError(f"{url}: obstore could not configure the store ({type(e).__name__}: {e})") from e
    return found, key


def _reset_in_child() -> None:
    """After ``fork``: a store's pooled connections are the parent's."""
    global _STORES_LOCK
    _STORES.clear()
    _STORES_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_in_child)


def _errors() -> Any:
    from obstore import exceptions

    return exceptions


class _Retry(Exception):
    """A body cut short: read the range again."""


class ObjectStoreReader(ViewReader):
    """Ranged GETs of one object through obstore, pinned to its size and ETag (see the
    module docstring). ``identity``: the ``(size, ETag)`` its header was read with;
    without it, one HEAD request pins the current version."""

    def __init__(self, url: str, stats: RemoteStats | None, identity: tuple[int, str | None] | None) -> None:
        self.url = url
        self.stats = stats or RemoteStats()
        self.store, self.key = _store(url)
        self.requests = 0
        self._lock = threading.Lock()
        self.size, self.version = identity if identity is not None else self._head()

    @property
    def identity(self) -> tuple[int, str | None]:
        return self.size, self.version

    def _head(self) -> tuple[int, str | None]:
        import obstore

        if not self.key or self.key.endswith("/"):
            raise IsADirectoryError(f"{self.url}: a prefix, not an object")
        try:
            meta = obstore.head(self.store, self.key)
        except FileNotFoundError:  # obstore's NotFoundError is one
            raise FileNotFoundError(f"{self.url}: not found") from None
        except Exception as e:
            raise RemoteError(f"{self.url}: obstore could not describe the object ({type(e).__name__}: {e})") from e
        self._count()
        return int(meta["size"]), meta.get("e_tag") or meta.get("version")

    def _count(self, retries: int = 0) -> None:
        with self._lock:
            self.requests += 1
        if retries:
            self.stats.add(retries=retries)

    def close(self) -> None:
        pass  # every GET carried If-Match: a replaced object was refused where it was read

    def readv(self, buffers: list[memoryview], offset: int) -> None:
        """Fill ``buffers`` in order from ``offset`` with one ranged GET (retried whole
        when its body is cut short)."""
        total = sum(len(b) for b in buffers)
        if total == 0:
            return
        for attempt in range(_MAX_RETRIES + 1):
            try:
                return self._once(buffers, offset, total)
            except _Retry as e:
                if attempt == _MAX_RETRIES:
                    raise RemoteError(
                        f"{self.url}: bytes {offset}-{offset + total - 1} failed after {attempt + 1} attempts: {e}"
                    ) from None
                self.stats.add(retries=1)

    def _get(self, offset: int, total: int) -> Any:
        import obstore

        span = f"{offset}-{offset + total - 1}"
        options: dict[str, Any] = {"range": (offset, offset + total)}
        if self.version is not None and not self.version.startswith("W/"):
            options["if_match"] = self.version
        errors = _errors()
        try:
            result = obstore.get(self.store, self.key, options=options)  # type: ignore[arg-type]
        except errors.PreconditionError:
            raise _changed(self.url, self.identity, (self.size, f"not {self.version} (HTTP 412 to If-Match)")) from None
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.url}: not found (asked for bytes {span})") from None
        except Exception as e:  # obstore retried what it could (RetryConfig): name the URL and the range
            raise RemoteError(f"{self.url}: bytes {span}: {type(e).__name__}: {e}") from e
        self._count()
        meta = result.meta
        now = (int(meta["size"]), meta.get("e_tag") or meta.get("version"))
        if now != self.identity:
            raise _changed(self.url, self.identity, now)
        if tuple(result.range) != (offset, offset + total):
            raise RemoteError(f"{self.url}: asked for bytes {span}, got {result.range[0]}-{result.range[1] - 1}")
        return result

    def _once(self, buffers: list[memoryview], offset: int, total: int) -> None:
        result = self._get(offset, total)
        targets = iter([b.cast("B") if b.format != "B" else b for b in buffers])
        view, at, done = next(targets), 0, 0
        try:
            for piece in result.stream(min_chunk_size=PIECE_BYTES):
                data, used = memoryview(piece), 0
                if done + len(data) > total:
                    raise RemoteError(f"{self.url}: the body for bytes {offset}-{offset + total - 1} is longer")
                while used < len(data):
                    n = min(len(view) - at, len(data) - used)
                    view[at : at + n] = data[used : used + n]
                    at, used = at + n, used + n
                    if at == len(view) and done + used < total:
                        view, at = next(targets), 0
                done += len(data)
        except RemoteError:
            raise
        except Exception as e:  # the connection dropped mid-body
            raise _Retry(f"body interrupted after {done} bytes: {type(e).__name__}: {e}") from None
        if done != total:
            raise _Retry(f"body ended {total - done} bytes early")

    def probe(self) -> bytes:
        """The first bytes of the object (speculatively enough for most headers)."""
        return self.read(0, min(SPECULATIVE_HEADER_BYTES, self.size)) if self.size else b""


def put(url: str, write: Callable[[Any], None], size: int = 0) -> None:
    """``write(f)`` into a multipart upload of ``url``: parts uploaded concurrently as
    they fill, the object visible only once every byte is written and the upload
    completes; on any failure the upload is aborted and nothing appears.
    ``size``: the object's size when known, so that it fits in :data:`MAX_PARTS` parts
    (unknown: parts of :data:`PART_BYTES`, objects up to 160 GB).

    Raises:
        SaveError: ``write`` or the upload failed (naming ``url``); a previous object
            there is intact.
    """
    obstore = _obstore(url, SaveError)
    store, key = _store(url)
    part = max(PART_BYTES, -(-size // (MAX_PARTS - 1)))
    try:
        with obstore.open_writer(store, key, buffer_size=part, max_concurrency=UPLOADS_IN_FLIGHT) as f:
            write(f)
    except SaveError:
        raise
    except Exception as error:
        raise SaveError(
            f"{url}: the upload failed ({type(error).__name__}: {error}); nothing was saved", url
        ) from error


class ObstoreClient:
    """An object store through obstore (see :class:`nnx_save.io._storage.ObjectClient`):
    ranged readers pinned by ``If-Match``, multipart uploads, listing and deletes."""

    def __init__(self, url: str) -> None:
        self.url = url

    def reader(self, url: str, stats: RemoteStats | None, identity: tuple[int, str | None] | None) -> ObjectStoreReader:
        return ObjectStoreReader(url, stats, identity)

    def writable(self, url: str) -> None:
        _obstore(url, SaveError)
        one_uploader(url)

    def upload(self, url: str, write: Callable[[Any], None]) -> None:
        put(url, write)

    def names(self, url: str) -> set[str]:
        import obstore

        store, key = _store(url)
        prefix = key.rstrip("/") + "/" if key else ""
        try:
            listed = obstore.list_with_delimiter(store, prefix or None)
        except FileNotFoundError:
            return set()
        except Exception as e:  # obstore's own error types: one typed error naming the prefix
            raise RemoteError(f"{url}: obstore could not list the prefix ({type(e).__name__}: {e})") from e
        return {str(o["path"]).rstrip("/").rsplit("/", 1)[-1] for o in listed["objects"]}

    def remove(self, url: str) -> None:
        import obstore

        store, key = _store(url)
        with contextlib.suppress(FileNotFoundError):
            obstore.delete(store, key)
