"""One version per load of a multi-file checkpoint: every save draws a fresh save id,
recorded in the index's ``metadata`` and each file's ``__metadata__``. A reader that
finds files of another save, or a file gone while the index was replaced, raced a
writer: an :class:`~nnx_save.errors.IndexChangedError` tells it to load again,
never a mix. Files of other tools carry no save id and are not checked.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from ..errors import IndexChangedError, IndexFileError, SourceError
from ..format._header import FileHeader

__all__ = ["SAVE_ID_KEY", "check_one_version", "new_save_id", "one_version"]

SAVE_ID_KEY = "nnx_save.save_id"
T = TypeVar("T")


def new_save_id() -> str:
    """A fresh save id: eight hex digits, also the suffix of the save's new file names."""
    return os.urandom(4).hex()  # secrets.token_hex(4), without importing secrets (hashlib, hmac)


def check_one_version(where: str, index_metadata: Mapping[str, str], files: Sequence[FileHeader]) -> None:
    """Every file is of the save the index records (when it records one).

    Raises:
        IndexChangedError: naming the first file of another save, both save ids.
    """
    want = index_metadata.get(SAVE_ID_KEY)
    if want is None:
        return
    for fh in files:
        got = fh.metadata.get(SAVE_ID_KEY)
        if got != want:
            raise IndexChangedError(
                f"{where}: is save {want}, but {fh.file} is {f'save {got}' if got else 'of no recorded save'}: "
                "the checkpoint was replaced while it was read; load it again"
            )


def _identity(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def one_version(index: Path, read: Callable[[], T]) -> T:
    """``read()`` (an index and the files it names); a missing or unreadable file
    while ``index`` itself was replaced meanwhile is a race with a writer.

    Raises:
        IndexChangedError: the index changed during ``read`` and a file it named failed.
    """
    before = _identity(index)
    try:
        return read()
    except (FileNotFoundError, IndexFileError, SourceError) as e:
        if isinstance(e, IndexChangedError) or _identity(index) == before:
            raise
        raise IndexChangedError(
            f"{index}: was replaced while it was read ({e}); the checkpoint changed under the reader; load it again"
        ) from e
