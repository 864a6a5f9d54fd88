"""Where bytes live: one :class:`Location` for a local directory, an HTTP(S) prefix
(read-only) and an object-store prefix, so the layouts and the store never ask whether a
path is a URL.

A location lists its names, reads small records and opens readers that fill the
caller's buffers (the transports' own readers), takes data writes and commits them by
the one rule every layout follows: data files first, under names that cannot be mistaken
for the committed version's (staged temporary names on a filesystem, fresh names moved
into place once complete on an object store); then the one record replaced atomically.
It removes, and it locks: ``flock`` where the filesystem has it
(:mod:`nnx_save.io._lock`), nothing on an object store, which has no ``flock``
(its writes are atomic per object; one writer per prefix is the caller's to keep).

:func:`locate` is the one place that tells a path from a URL, and :func:`object_client`
the one place that picks the client of an object store.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol, TypeAlias

from ..errors import SaveError
from . import _files
from ._atomic import (
    TMP_MARKER,
    atomic_file,
    commit_staged,
    discard_staged,
    make_directory,
    remove_stale_temps,
    replace_file,
)

if TYPE_CHECKING:  # the transports are imported with the first URL: reading local files never loads them
    import logging
    from pathlib import Path

    from ._http import RemoteStats

__all__ = [
    "HttpPrefix",
    "LocalDirectory",
    "Location",
    "Lock",
    "ObjectClient",
    "ObjectPrefix",
    "RemoteStats",
    "Staged",
    "Where",
    "absolute",
    "is_url",
    "locate",
    "locate_file",
    "object_client",
    "open_remote",
]

Where = str | os.PathLike
"""Where a checkpoint is: a local path, an HTTP(S) URL or an object-store URL (:func:`locate`)."""
Staged: TypeAlias = "list[tuple[Path, Path]]"
"""Complete data files under temporary names, each with the name it commits to."""


def _log() -> logging.Logger:
    """The package's logger; logging is imported by the first message (a read logs none)."""
    import logging

    return logging.getLogger("nnx_save")


class Lock(Protocol):
    """A writer's hold on a location, given up by :meth:`release` (idempotent)."""

    def release(self) -> None: ...


class ObjectClient(Protocol):
    """The client an object-store prefix reads and writes through (:func:`object_client`)."""

    def reader(self, url: str, stats: RemoteStats | None, identity: tuple[int, str | None] | None) -> Any:
        """A ranged reader of the object ``url`` (pinned to ``identity`` when given)."""
        ...

    def writable(self, url: str) -> None:
        """Raise :class:`SaveError` naming ``url`` when this client cannot write there."""
        ...

    def upload(self, url: str, write: Callable[[BinaryIO], None]) -> None:
        """``write(f)`` into object ``url``, visible there only once complete."""
        ...

    def names(self, url: str) -> set[str]:
        """The names directly under prefix ``url`` (empty when none)."""
        ...

    def remove(self, url: str) -> None:
        """Delete object ``url`` (absent: nothing to do)."""
        ...


class Location(Protocol):
    """A directory-like place a checkpoint is read from and written to."""

    def __str__(self) -> str:
        """The location as the user gave it, for messages."""
        ...

    def member(self, name: str) -> Any:
        """The address of ``name`` inside (a :class:`~pathlib.Path` on a filesystem, a URL string)."""
        ...

    def members(self, names: Iterable[str]) -> tuple[Any, ...]:
        """The address of each of ``names`` (:meth:`member`)."""
        ...

    @property
    def directory(self) -> Path | None:
        """The directory on a filesystem, which several processes may write at byte offsets
        (a pod's shard files, one shared file); ``None`` for a URL prefix, which has none."""
        ...

    def names(self) -> set[str]:
        """The names directly inside (empty when the location does not exist yet)."""
        ...

    def read_bytes(self, name: str, what: str, cap: int, error: Callable[[str], Exception]) -> bytes:
        """The whole of small record ``name`` (at most ``cap`` bytes, else ``error``)."""
        ...

    def open_reader(self, name: str, stats: RemoteStats | None = None) -> Any:
        """A reader of ``name`` with ``size``, ``identity``, ``probe()``, ``read()`` and ``readv()``."""
        ...

    def prepare(self, name: str = "") -> None:
        """Make the location ready for a save (of its file ``name``; a directory created),
        or raise :class:`SaveError` naming it (or ``name`` in it) when it cannot be written."""
        ...

    def upload(self, name: str, write: Callable[[BinaryIO], None]) -> None:
        """``write(f)`` as ``name``, which only ever holds the previous or the complete new content."""
        ...

    def replace(self, name: str, data: bytes) -> None:
        """Replace record ``name`` with ``data`` atomically (the commit of a save)."""
        ...

    def commit(self, staged: Staged, record: str, data: bytes) -> None:
        """Move ``staged`` data files under their names, then replace ``record`` with ``data``."""
        ...

    def discard(self, staged: Staged) -> None:
        """Remove ``staged`` data files (a save failed before its commit)."""
        ...

    def remove(self, name: str) -> None:
        """Remove ``name`` after a commit: a failure is logged (a leftover only costs space)."""
        ...

    def one_writer(self, what: str) -> contextlib.AbstractContextManager[None]:
        """Be the one writer of this location, for the job, while the block runs."""
        ...

    def hold(self, what: str) -> Lock:
        """Be the one writer of this location until the lock is released."""
        ...

    def link_target(self, name: str) -> str | None:
        """Where ``name`` points when it is a symbolic link, else ``None``."""
        ...

    def sweep(self, ours: Callable[[str], bool]) -> None:
        """Remove the temporary files that dead processes of this host left for the names
        ``ours`` accepts (a killed save's; each save names its files anew, so no later
        save of the same name would replace them)."""
        ...


def is_url(source: object) -> bool:
    """Whether ``source`` names a URL the transports read (``scheme://...``). A ``file://``
    name is none: a path, as the OS reads it (the step store alone decodes ``file://`` URLs).

    Examples:
        >>> is_url("https://host/m.safetensors"), is_url("file:///m.safetensors"), is_url("ck/m.safetensors")
        (True, False, False)
    """
    return isinstance(source, str) and "://" in source and not source.startswith("file://")


def locate(where: Where) -> Location:
    """The location of ``where``: a directory on this filesystem, an HTTP(S) prefix,
    or an object-store prefix (:func:`is_url`).

    Examples:
        >>> type(locate("s3://bucket/run")).__name__, type(locate("https://host/m")).__name__
        ('ObjectPrefix', 'HttpPrefix')
        >>> locate("ck/run").member("model.safetensors")
        PosixPath('ck/run/model.safetensors')
    """
    text = os.fspath(where)
    if not is_url(text):
        from pathlib import Path  # imported here: reading one local file needs no Path

        return LocalDirectory(Path(text))
    if text.lower().startswith(("http://", "https://")):
        return HttpPrefix(text)
    return ObjectPrefix(text)


def absolute(where: Where) -> Path | str:
    """``where`` as a save names it once the caller may have changed directory: a local
    path made absolute, a URL as given.

    Examples:
        >>> absolute("s3://bucket/run/"), absolute("/data/./run")
        ('s3://bucket/run/', PosixPath('/data/run'))
    """
    text = os.fspath(where)
    if is_url(text):
        return text
    from pathlib import Path

    return Path(os.path.abspath(text))


def locate_file(where: Where) -> tuple[Location, str]:
    """The location that holds file ``where``, and the file's name in it.

    Examples:
        >>> location, name = locate_file("s3://bucket/run/model.safetensors")
        >>> str(location), name
        ('s3://bucket/run', 'model.safetensors')
    """
    text = os.fspath(where)
    if is_url(text):
        parent, _, name = text.rpartition("/")
        return locate(parent), name
    from pathlib import Path

    path = Path(text)
    return LocalDirectory(path.parent), path.name


def object_client(url: str) -> ObjectClient:
    """The client of object store ``url``: obstore for the schemes it serves (``s3://``,
    ``gs://``, ``az://``: concurrent ranged GETs, multipart uploads), else fsspec's
    filesystem for the scheme (``hf://``, ``memory://`` ...). The one place that picks."""
    from . import _object_store

    if _object_store.serves(url):
        return _object_store.ObstoreClient(url)
    from ._fsspec import FsspecClient

    return FsspecClient(url)


def __getattr__(name: str) -> Any:
    if name == "RemoteStats":
        from ._http import RemoteStats

        return RemoteStats
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def open_remote(url: str, stats: RemoteStats | None = None, identity: tuple[int, str | None] | None = None):
    """A reader for ``url``; with ``identity`` (from a reader's ``identity`` when the
    header was read), pinned to that size and version."""
    if url.startswith(("http://", "https://")):
        from ._http import HttpReader

        size, etag = identity if identity is not None else (None, None)
        return HttpReader(url, stats, size, etag)
    return object_client(url).reader(url, stats, identity)


def _removed(where: object, remove: Callable[[], None]) -> None:
    try:
        remove()
    except FileNotFoundError:
        pass
    except OSError as e:
        _log().warning("could not remove %s (%s)", where, e.strerror or e)


class _FileObject:
    """A local file as the remote readers present an object: size, identity, probe, read
    (each read opens it again: nothing is held open between reads)."""

    def __init__(self, path: Path) -> None:
        self.url = os.fspath(path)
        st = os.stat(self.url)
        self.size, self.identity = st.st_size, (st.st_size, f"{st.st_ino}:{st.st_mtime_ns}")

    def read(self, offset: int, length: int) -> bytes:
        fd = _files.open_regular(self.url)
        try:
            return _files.pread_exact(fd, length, offset, self.url)
        finally:
            os.close(fd)

    def probe(self) -> bytes:
        return self.read(0, min(self.size, 1 << 16))


@dataclasses.dataclass(frozen=True)
class LocalDirectory:
    """A directory on this host's filesystems (shared with other hosts or not)."""

    directory: Path

    def __str__(self) -> str:
        return str(self.directory)

    def member(self, name: str) -> Path:
        return self.directory / name

    def members(self, names: Iterable[str]) -> tuple[Path, ...]:
        return tuple(self.directory / name for name in names)

    def names(self) -> set[str]:
        try:
            return set(os.listdir(self.directory))
        except (FileNotFoundError, NotADirectoryError):
            return set()

    def read_bytes(self, name: str, what: str, cap: int, error: Callable[[str], Exception]) -> bytes:
        return _files.read_capped(os.fspath(self.directory / name), what, cap, error)

    def open_reader(self, name: str, stats: RemoteStats | None = None) -> _FileObject:
        return _FileObject(self.directory / name)

    def prepare(self, name: str = "") -> None:
        make_directory(self.directory)

    def upload(self, name: str, write: Callable[[BinaryIO], None]) -> None:
        with atomic_file(self.directory / name) as fd, io.FileIO(fd, "wb", closefd=False) as f:
            write(f)

    def replace(self, name: str, data: bytes) -> None:
        replace_file(self.directory / name, data)

    def commit(self, staged: Staged, record: str, data: bytes) -> None:
        commit_staged(staged)  # fresh names: one directory fsync for them all, before the record
        replace_file(self.directory / record, data)

    def discard(self, staged: Staged) -> None:
        discard_staged(staged)

    def remove(self, name: str) -> None:
        _removed(self.directory / name, lambda: os.unlink(self.directory / name))

    def one_writer(self, what: str) -> contextlib.AbstractContextManager[None]:
        from ._lock import one_writer  # a save's: a read never loads the lock

        return one_writer(self.directory, what)

    def hold(self, what: str) -> Lock:
        from ._lock import WriterLock

        return WriterLock.acquire(self.directory, what)

    def link_target(self, name: str) -> str | None:
        path = self.directory / name
        return os.readlink(path) if os.path.islink(path) else None

    def sweep(self, ours: Callable[[str], bool]) -> None:
        for name in self.names():  # ".<file>.nnx_save-tmp-<host>-<pid>-<random>"
            if name.startswith(".") and TMP_MARKER in name and ours(name[1 : name.index(TMP_MARKER)]):
                remove_stale_temps(self.directory / name[1 : name.index(TMP_MARKER)])


class _NoLock:
    def release(self) -> None:
        pass


class _Remote:
    """What the two URL prefixes share: members joined by the URL's rules, no links."""

    directory: None = None

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def __str__(self) -> str:
        return self.url

    def member(self, name: str) -> str:
        return f"{self.url}/{name}"

    def members(self, names: Iterable[str]) -> tuple[str, ...]:
        return tuple(f"{self.url}/{name}" for name in names)

    def open_reader(self, name: str, stats: RemoteStats | None = None) -> Any:
        from ._http import RemoteStats

        return open_remote(self.member(name), stats or RemoteStats())

    def read_bytes(self, name: str, what: str, cap: int, error: Callable[[str], Exception]) -> bytes:
        reader = self.open_reader(name)
        if reader.size > cap:
            raise error(f"{self.member(name)}: {what} of {reader.size} bytes exceeds the cap of {cap} bytes")
        return reader.read(0, reader.size) if reader.size else b""

    def commit(self, staged: Staged, record: str, data: bytes) -> None:
        self.discard(staged)  # nothing is staged here: each data object was moved into place once complete
        self.replace(record, data)

    def discard(self, staged: Staged) -> None:
        if staged:
            raise SaveError(f"{self.url}: a URL holds no staged files ({len(staged)} given)", self.url)

    def one_writer(self, what: str) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # no flock on an object store (see the module docstring)

    def hold(self, what: str) -> Lock:
        return _NoLock()

    def link_target(self, name: str) -> str | None:
        return None

    def sweep(self, ours: Callable[[str], bool]) -> None:
        pass  # an upload is moved into place, or removed, by the process that made it

    def replace(self, name: str, data: bytes) -> None:
        def write(f: BinaryIO) -> None:
            f.write(data)

        self.upload(name, write)

    def upload(self, name: str, write: Callable[[BinaryIO], None]) -> None:
        raise NotImplementedError


class HttpPrefix(_Remote):
    """An HTTP(S) prefix: read with ranged GETs, never written, never listed."""

    def names(self) -> set[str]:
        return set()  # HTTP has no listing: a reader joins the names it looks for

    def _refuse(self, name: str) -> SaveError:
        url = self.member(name) if name else self.url
        return SaveError(f"{url}: an HTTP URL cannot be written to; give an object-store URL (s3://, gs:// ...)", url)

    def prepare(self, name: str = "") -> None:
        raise self._refuse(name)

    def upload(self, name: str, write: Callable[[BinaryIO], None]) -> None:
        raise self._refuse(name)

    def remove(self, name: str) -> None:
        raise self._refuse(name)


class ObjectPrefix(_Remote):
    """A prefix of an object store (``s3://``, ``gs://``, ``memory://`` ...), through :func:`object_client`."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.client = object_client(self.url)

    def names(self) -> set[str]:
        return self.client.names(self.url)

    def prepare(self, name: str = "") -> None:
        self.client.writable(self.member(name) if name else self.url)

    def upload(self, name: str, write: Callable[[BinaryIO], None]) -> None:
        self.client.upload(self.member(name), write)

    def remove(self, name: str) -> None:
        try:
            self.client.remove(self.member(name))
        except Exception as e:  # each store has its own errors; a leftover only costs space
            _log().warning("could not remove %s (%s: %s)", self.member(name), type(e).__name__, e)
