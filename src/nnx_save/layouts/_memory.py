"""A state dict already in memory as a checkpoint source: ``{key: numpy array}`` laid
out in a virtual file (each tensor's bytes after the previous one's, nothing copied),
so the one engine loads it as it loads a file: the same matching, porting rules,
shardings, casts, report and strict refusal.

Pure numpy: the front door (``nnx_save.bridges._state_dict``) turns jax arrays, torch
tensors and NNX variables into the numpy arrays this module takes.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping

import numpy as np

from ..errors import TruncatedFileError
from ..format import _dtypes
from ..format._header import FileHeader, TensorInfo
from ..io._reader import ViewReader
from ..load._pieces import Piece, whole
from ..load._source import Header

__all__ = ["MEMORY", "MemoryReader", "memory_header"]

MEMORY = "<state dict in memory>"  # the virtual file's name, as reports show it


class MemoryReader(ViewReader):
    """Reads of the virtual file: each run copied from the arrays' own bytes."""

    url = MEMORY

    def __init__(self, begins: list[int], views: list[memoryview]) -> None:
        self.begins, self.views = begins, views
        self.requests = 0

    def readv(self, buffers: list[memoryview], offset: int) -> None:
        self.requests += 1
        at = offset
        for buffer in buffers:
            out = buffer.cast("B")
            done = 0
            while done < len(out):
                i = bisect.bisect_right(self.begins, at) - 1
                view = self.views[i] if i >= 0 else memoryview(b"")
                start = at - self.begins[i] if i >= 0 else 0
                n = min(len(out) - done, len(view) - start)
                if n <= 0:
                    raise TruncatedFileError(f"{MEMORY}: no bytes at offset {at}", MEMORY, at)
                out[done : done + n] = view[start : start + n]
                done, at = done + n, at + n

    def close(self) -> None:
        pass


class MemoryPlacement:
    """Where a state dict's bytes are: the arrays themselves (one whole piece each)."""

    processes = 1
    missing: tuple[str, ...] = ()
    remote = False

    def __init__(self, begins: list[int], views: list[memoryview]) -> None:
        self.begins, self.views = begins, views

    def is_remote(self, file: str) -> bool:
        return False

    def unpinned(self) -> frozenset[str]:
        return frozenset()

    def local_files(self) -> None:
        return None  # no file to map: the engine reads the arrays

    def pieces_of(self, key: str, info: TensorInfo) -> tuple[Piece, ...]:
        return (Piece(whole(info.shape), info),)

    def open_reader(self, file: str) -> MemoryReader:
        return MemoryReader(self.begins, self.views)

    def retries(self) -> int:
        return 0

    def close(self) -> None:
        pass


def _file_bytes(array: np.ndarray, row: _dtypes.DtypeInfo) -> memoryview:
    """The array's bytes as the format lays them out: little-endian, C order, sub-byte
    dtypes packed (only those, and non-contiguous or big-endian arrays, are copied)."""
    if not row.byte_aligned:
        return memoryview(_dtypes.pack_subbyte(np.ascontiguousarray(array), row))
    little = array.dtype.newbyteorder("<")
    array = np.ascontiguousarray(array if array.dtype == little else array.astype(little))
    return memoryview(array.reshape(-1).view(np.uint8).data)


def memory_header(arrays: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> Header:
    """The :class:`Header` of ``arrays`` (file key -> numpy array) as one virtual file.

    Raises:
        HeaderError: an array whose dtype safetensors has no code for (``check="dtype"``, names it).

    Examples:
        >>> header = memory_header({"w": np.arange(3, dtype=np.float32)})
        >>> header["w"].shape, header["w"].dtype.code, header.files[0].file
        ((3,), 'F32', '<state dict in memory>')
    """
    tensors: dict[str, TensorInfo] = {}
    begins: list[int] = []
    views: list[memoryview] = []
    at = 0
    for key, array in arrays.items():
        row = _dtypes.to_code(array.dtype, key)
        view = _file_bytes(array, row)
        tensors[key] = TensorInfo(key, row, tuple(int(d) for d in array.shape), at, at + len(view), MEMORY)
        if len(view):
            begins.append(at)
            views.append(view)
        at += len(view)
    meta = dict(metadata or {})
    placement = MemoryPlacement(begins, views)
    return Header(tensors, meta, (FileHeader(MEMORY, tensors, meta, 0, at),), "memory", placement)
