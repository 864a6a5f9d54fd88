"""Where bytes live: a local path or a URL, and the reader for a URL's transport
(HTTP(S) ranged GETs, or fsspec for object stores). The transports are imported with
the first URL: reading local files never loads them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._options import is_url  # re-exported: where the transports' callers look for it

if TYPE_CHECKING:
    from ._http import RemoteStats

__all__ = ["RemoteStats", "is_url", "open_remote"]


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
    from ._fsspec import FsspecReader

    return FsspecReader(url, identity)
