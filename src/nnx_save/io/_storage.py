"""Where bytes live: a local path or a URL, and the reader for a URL's transport
(HTTP(S) ranged GETs; obstore for object stores; fsspec for the schemes only it serves)."""

from __future__ import annotations

from .._options import is_url  # re-exported: where the transports' callers look for it
from . import _object_store
from ._fsspec import FsspecReader
from ._http import HttpReader, RemoteStats

__all__ = ["RemoteStats", "is_url", "open_remote"]


def open_remote(url: str, stats: RemoteStats | None = None, identity: tuple[int, str | None] | None = None):
    """A reader for ``url``; with ``identity`` (from a reader's ``identity`` when the
    header was read), pinned to that size and version."""
    if url.startswith(("http://", "https://")):
        size, etag = identity if identity is not None else (None, None)
        return HttpReader(url, stats, size, etag)
    if _object_store.serves(url):
        return _object_store.ObjectStoreReader(url, stats, identity)
    return FsspecReader(url, identity)
