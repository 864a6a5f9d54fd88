"""The one place that chooses a save's writer: layout x number of processes x transport.

- **one file**: :func:`~nnx_save.save._write.write_file` from one process,
  :func:`~nnx_save.save._collective.write_collective` (one shared file) from several,
  :func:`~nnx_save.save._remote.write_remote` for an fsspec URL (one process).
- **HF index** (``max_shard_size``): :func:`~nnx_save.layouts._index_save.write_sharded`,
  into a local directory or an fsspec URL from one process; from several, each file
  is written by all of them together and the primary commits the index.
- **pod** (``pod=True``, ``save_pod``): :class:`~nnx_save.layouts._pod_save.PodWriter`, one
  file per process whatever the count, and a manifest.

:func:`save` runs it (progress, blocking or in the background). Every writer
follows the one commit rule (docs/design.md).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping, Sequence

from .. import _progress
from ..format._units import parse_size
from ..io._remote import is_url
from ..save import _background
from ..save._collective import write_collective
from ..save._entry import Entry
from ..save._remote import write_remote
from ..save._write import write_file
from ._index_save import write_sharded
from ._pod_save import PodWriter

__all__ = ["Writer", "save", "writer"]

Writer = Callable[[str | os.PathLike, Sequence[Entry]], None]


def writer(metadata: Mapping[str, str] | None, *, max_shard_size: int | str | None = None, pod: bool = False) -> Writer:
    """The writer for a save: ``writer(path, entries)``, chosen when it runs (the
    process count and the path's transport). ``max_shard_size`` asks for an HF
    multi-file checkpoint; it is parsed here, where it is given. ``pod`` asks for a
    pod directory (``metadata`` then is the manifest's and every shard file's).

    Raises:
        OptionError: ``max_shard_size`` is not a size.
    """
    if pod:
        return PodWriter(dict(metadata or {}))
    if max_shard_size is None:
        return functools.partial(_one_file, metadata=metadata)
    return functools.partial(write_sharded, metadata=metadata, max_shard_size=parse_size(max_shard_size))


def _one_file(path: str | os.PathLike, entries: Sequence[Entry], metadata: Mapping[str, str] | None) -> None:
    import jax

    if is_url(path):
        write_remote(str(path), entries, metadata)
    elif jax.process_count() == 1:
        write_file(path, entries, metadata)
    else:
        write_collective(path, entries, metadata)


def save(
    path: str | os.PathLike,
    entries: Sequence[Entry],
    write: Writer,
    *,
    blocking: bool = True,
    progress: bool | None = None,
) -> _background.SaveHandle | None:
    """Run ``write(path, entries)`` with ``progress`` in force: now (``blocking``), or
    on a host snapshot in the background (see :mod:`._background`). A pod writer's
    pieces are taken first, from the caller's arrays."""
    if isinstance(write, PodWriter):
        entries, write = write.pieces(path, entries)
    with _progress.saving(progress):
        return _background.save(path, entries, write, blocking=blocking)
