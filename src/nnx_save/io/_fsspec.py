"""Object stores through fsspec (``s3://``, ``gs://``, ``hf://`` ...), when the matching
fsspec implementation is installed: ranged reads pinned to the object's size and
version, and writes committed under their final name only once complete.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import RemoteError, SaveError
from ._atomic import TMP_MARKER
from ._http import SPECULATIVE_HEADER_BYTES, _changed
from ._reader import ViewReader

__all__ = ["FsspecClient", "FsspecReader", "filesystem", "put"]

# info() fields that name a version of an object, over the fsspec implementations
# (s3fs, gcsfs, adlfs, huggingface_hub, local, memory): any change is a new object.
_VERSION_FIELDS = (
    "ETag", "etag", "generation", "VersionId", "version_id", "md5Hash", "crc32c", "checksum",
    "blob_id", "lfs", "last_commit", "LastModified", "last_modified", "updated", "mtime", "created", "ino",
)  # fmt: skip


def _fsspec_version(info: Mapping[str, object]) -> str | None:
    found = [f"{k}={info[k]}" for k in _VERSION_FIELDS if info.get(k) not in (None, "")]
    return "; ".join(found) or None


class FsspecReader(ViewReader):
    """Ranged reads through fsspec (``s3://``, ``gs://``, ``hf://`` ...), pinned to
    the object's size and version (see the module docstring)."""

    def __init__(self, url: str, identity: tuple[int, str | None] | None) -> None:
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
        self.url = url
        self.requests = 0
        self.size, self.version = self._current()
        if identity is not None:
            self._check(identity)

    @property
    def identity(self) -> tuple[int, str | None]:
        return self.size, self.version

    def _current(self) -> tuple[int, str | None]:
        try:
            self.fs.invalidate_cache(self.url)  # a cached listing would hide a new version
            info = self.fs.info(self.url)
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.url}: not found") from None
        except Exception as e:  # each store has its own errors (botocore's NoCredentialsError, ...)
            raise RemoteError(f"{self.url}: fsspec could not describe the object ({type(e).__name__}: {e})") from e
        size = info.get("size") if isinstance(info, Mapping) else None
        if (
            isinstance(info, Mapping) and info.get("type") == "directory"
        ):  # a prefix, no object: the caller may look inside
            raise IsADirectoryError(f"{self.url}: a directory, not an object")
        if not isinstance(size, int):
            raise RemoteError(f"{self.url}: fsspec reports no size ({size!r})")
        return size, _fsspec_version(info)

    def _check(self, pinned: tuple[int, str | None]) -> None:
        now = self._current()
        if now != tuple(pinned):
            raise _changed(self.url, pinned, now)

    def close(self) -> None:
        """Check the object is still the version read (a replacement during the load
        would have mixed versions)."""
        self._check(self.identity)

    def readv(self, buffers: list[memoryview], offset: int) -> None:
        total = sum(len(b) for b in buffers)
        try:
            data = self.fs.cat_file(self.url, start=offset, end=offset + total)
        except Exception as e:  # as in _current: one error type, naming the URL and the range
            raise RemoteError(
                f"{self.url}: fsspec failed to read {total} bytes at {offset} ({type(e).__name__}: {e})"
            ) from e
        if len(data) != total:
            raise RemoteError(f"{self.url}: asked for {total} bytes at {offset}, got {len(data)}")
        self.requests += 1
        pos = 0
        for b in buffers:
            b.cast("B")[:] = data[pos : pos + len(b)]
            pos += len(b)

    def probe(self) -> bytes:
        return self.read(0, min(SPECULATIVE_HEADER_BYTES, self.size))


def put(fs: Any, url: str, write: Callable[[Any], None]) -> None:
    """``write(f)`` into a temporary object beside ``url``, moved under ``url`` only
    once complete; on any failure the temporary object is removed.

    Raises:
        SaveError: ``write`` or the upload failed (naming ``url``); a previous object
            there is intact.
    """
    temp = f"{url}{TMP_MARKER}{uuid.uuid4().hex[:12]}"
    try:
        with fs.open(temp, "wb") as f:
            write(f)
        fs.mv(temp, url)
    except BaseException as error:
        with contextlib.suppress(Exception):
            fs.rm(temp)
        if isinstance(error, SaveError) or not isinstance(error, Exception):
            raise
        raise SaveError(
            f"{url}: the upload failed ({type(error).__name__}: {error}); nothing was saved", url
        ) from error


def filesystem(url: str) -> Any:
    """The fsspec filesystem for ``url``'s scheme, after the checks that need no I/O."""
    try:
        import fsspec
    except ImportError:
        raise SaveError(f"{url}: writing to a URL needs fsspec: pip install 'nnx_save[remote]'", url) from None
    protocol = url.split("://", 1)[0]
    if protocol in ("http", "https"):
        raise SaveError(f"{url}: an HTTP URL cannot be written to; give an object-store URL (s3://, gs:// ...)", url)
    try:
        fs = fsspec.filesystem(protocol)
    except (ImportError, ValueError) as error:
        raise SaveError(f"{url}: no fsspec filesystem for {protocol!r} ({error})", url) from None
    if getattr(fs, "read_only", False):
        raise SaveError(f"{url}: fsspec's {protocol!r} filesystem cannot write", url)
    return fs


def one_uploader(url: str) -> None:
    """Refuse a save that every process of a JAX job would upload alike.

    Raises:
        SaveError: naming ``url`` and the process count.
    """
    import jax

    if jax.process_count() > 1:
        raise SaveError(
            f"{url}: saving to a URL from {jax.process_count()} processes is not supported (each would upload the "
            "object); save from one process, or save to a shared filesystem path",
            url,
        )


class FsspecClient:
    """An object store through fsspec's filesystem for the URL's scheme (see
    :class:`nnx_save.io._storage.ObjectClient`): the filesystem is made on the first
    write, listing or whole read; a ranged reader makes its own."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._fs: Any = None

    def fs(self, url: str | None = None) -> Any:
        """The filesystem, made (and checked, naming ``url``) on the first call."""
        if self._fs is None:
            self._fs = filesystem(url or self.url)
        return self._fs

    def reader(self, url: str, stats: object, identity: tuple[int, str | None] | None) -> FsspecReader:
        return FsspecReader(url, identity)

    def writable(self, url: str) -> None:
        one_uploader(url)
        self.fs(url)

    def upload(self, url: str, write: Callable[[Any], None]) -> None:
        put(self.fs(), url, write)

    def names(self, url: str) -> set[str]:
        try:
            return {str(p).rstrip("/").rsplit("/", 1)[-1] for p in self.fs().ls(url, detail=False)}
        except FileNotFoundError:
            return set()

    def remove(self, url: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs().rm(url)
