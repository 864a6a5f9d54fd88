"""Where a save's data files go: the one place that writes them into a
:class:`~nnx_save.io._storage.Location` as it can take them. A directory on a filesystem
takes files at byte offsets (:mod:`nnx_save.save._write`, or every process of a job into
one shared file, :mod:`nnx_save.save._collective`); an object store takes whole objects
(:mod:`nnx_save.save._remote`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from ..io._storage import Location, Staged
from . import _collective, _remote, _write  # by module: a test may stand in for a writer
from ._entry import Entry

__all__ = ["write_at", "write_one"]


def write_at(
    location: Location,
    files: Sequence[tuple[str, Sequence[Entry]]],
    metadata: Mapping[str, str] | None,
    *,
    staged: Staged,
    progress: bool | None,
    written: list[str],
) -> None:
    """Write each ``(name, entries)`` of ``files`` into ``location``: on a filesystem,
    staged under temporary names (:func:`~nnx_save.save._write.write_files`) for the location's commit; in an
    object store, each object uploaded whole (:func:`~nnx_save.save._remote.write_remote`)
    under its fresh name. Each name written is added to ``written``."""
    root = location.directory
    if root is None:
        for name, entries in files:
            _remote.write_remote(location, name, entries, metadata, progress)
            written.append(name)
        return
    done: list[Path] = []
    try:
        _write.write_files([(root / n, g) for n, g in files], metadata, staged=staged, progress=progress, written=done)
    finally:
        written.extend(path.name for path in done)


def write_one(
    location: Location, name: str, entries: Sequence[Entry], metadata: Mapping[str, str] | None, progress: bool | None
) -> None:
    """Write ``entries`` as file ``name`` of ``location``, replacing it atomically: from
    this process, from every process of the job into one shared file
    (:func:`~nnx_save.save._collective.write_collective`), or uploaded whole."""
    import jax  # the process count: a read never loads this module

    root = location.directory
    if root is None:
        _remote.write_remote(location, name, entries, metadata, progress)
    elif jax.process_count() == 1:
        _write.write_file(root / name, entries, metadata, progress=progress)
    else:
        _collective.write_collective(root / name, entries, metadata)
