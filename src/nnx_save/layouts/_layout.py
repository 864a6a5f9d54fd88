"""The layout contract: a :class:`Layout` reads its sources into a
:class:`~nnx_save.load._source.Header` (every tensor validated) whose placement says
which pieces of which files make each tensor and how to open them; the one engine
reads pieces for all.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from ..errors import HeaderError, IndexFileError
from ..format._header import FileHeader, TensorInfo, unique_pairs
from ..load._source import Header

__all__ = ["Layout", "load_record", "merge"]


class Layout(Protocol):
    """One on-disk layout: recognise a local source, and read it."""

    name: str
    """``"file"``, ``"index"``, ``"directory"`` or ``"pod"``: the :attr:`Header.kind` it reads."""

    def claims(self, path: Path) -> bool:
        """Whether ``path`` is this layout (a cheap look at names, no parsing)."""
        ...

    def read(self, path: Path) -> Header:
        """Read and validate every header of ``path``, reading no tensor data.

        Raises:
            HeaderError: the subclass names the failed check and the file.
        """
        ...


def load_record(raw: bytes, where: object, what: str, error: type[HeaderError]) -> Any:
    """The JSON of a layout's record (an index, a manifest), refusing a key repeated
    at any level (``json.loads`` alone keeps the last in silence).

    Raises:
        error: naming ``where`` and what is wrong.
    """
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=unique_pairs)
    except HeaderError as e:
        raise error(f"{where}: {e} in the {what} JSON") from None
    except RecursionError:
        raise error(f"{where}: not a valid JSON {what}: nested too deeply") from None
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise error(f"{where}: not a valid JSON {what}: {e}") from None


def merge(files: Sequence[FileHeader], where: str) -> dict[str, TensorInfo]:
    """Every tensor of ``files``, refusing a name held by two of them."""
    tensors: dict[str, TensorInfo] = {}
    for fh in files:
        for name, info in fh.tensors.items():
            if name in tensors:
                raise IndexFileError(
                    f"{where}: tensor {name!r} appears in two files: {tensors[name].file} and {info.file}"
                )
            tensors[name] = info
    return tensors
