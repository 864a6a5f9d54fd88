"""The directory and list layouts: the ``*.safetensors`` files of a directory that
has no index or manifest, or an explicit list of files, read as the parts of one
checkpoint. Every tensor is one whole piece of the file that holds it; a tensor
name held by two files is refused.

No record says which files go together, so a writer replacing them one by one leaves
states that mix two saves, and a load may read one (save with ``max_shard_size`` for one
version per load). What a load reads is what the directory held at one moment: every
file it opened is still there, unchanged, once all the headers are read (and a
directory still lists the same files), else :class:`~nnx_save.errors.SourceChangedError`;
never a file of one save beside a file that save had already replaced.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from pathlib import Path

from ..errors import HeaderError, SourceChangedError
from ..format import _formats
from ..io._storage import Location
from ..load._source import Header, LocalFiles
from ._index import INDEX_NAME
from ._layout import merge
from ._local import read_file_headers

__all__ = ["DirectoryLayout", "read_list"]


def read_list(paths: Sequence[Path], kind: str = "list", where: str = "file list") -> Header:
    """The header of the checkpoint made of ``paths`` (each a safetensors file).

    Raises:
        SourceChangedError: a file was replaced while the headers were read.
    """
    placement = LocalFiles()
    files = read_file_headers(paths, placement.pinned)
    replaced = placement.pinned.replaced()
    if replaced:
        placement.close()
        raise _changed(f"{replaced[0]}: was replaced", replaced[0])
    meta = dict(files[0].metadata) if files else {}
    try:
        tensors = merge(files, where)
    except HeaderError as e:  # a tensor in two files: merge's only error
        if kind != "directory":
            raise
        raise HeaderError(
            f"{e}. {where} has no {INDEX_NAME}, so all its *.safetensors files are read as the parts of one "
            "checkpoint; files holding the same tensor names are separate checkpoints (copies, or different "
            f"steps): load one file, move the others out, or write the {INDEX_NAME} of a sharded checkpoint",
            check="index",
        ) from None
    return Header(tensors, meta, files, kind, placement)


class DirectoryLayout:
    """Any directory: its ``*.safetensors`` files (the registry asks it last)."""

    name = "directory"

    def claims(self, location: Location, names: Collection[str]) -> bool:
        return any(name.endswith(".safetensors") for name in names)

    def read(self, path: Path) -> Header:
        _formats.refuse_directory(path)  # Orbax / TensorStore: say what it is and what to run
        found = sorted(path.glob("*.safetensors"))
        if not found:
            raise HeaderError(f"{path}: directory holds neither {INDEX_NAME} nor any *.safetensors file{_bins(path)}")
        try:
            header = read_list(found, "directory", str(path))
        except FileNotFoundError as e:  # a file went between the listing and its open
            if sorted(path.glob("*.safetensors")) == found:
                raise
            raise _changed(f"{path}: {e.filename} went", str(path)) from None
        if sorted(path.glob("*.safetensors")) != found:
            header.close()
            raise _changed(f"{path}: its *.safetensors files changed", str(path))
        return header


def _changed(what: str, file: str) -> SourceChangedError:
    return SourceChangedError(
        f"{what} while the checkpoint's headers were read (a writer saving its files one by one?); load it again",
        file,
    )


def _bins(path: Path) -> str:
    """What to run when the directory holds PyTorch weights instead (an HF ``.bin`` checkpoint)."""
    bins = sorted(p.name for p in path.glob("*.bin"))
    if not bins:
        return ""
    what = (
        "pytorch_model.bin.index.json and its shards" if (path / "pytorch_model.bin.index.json").is_file() else bins[0]
    )
    return (
        f"; it holds {what}, PyTorch weights: convert them once with `nnx-save convert {path} OUT` "
        "(or nnx_save.convert) and load OUT"
    )
