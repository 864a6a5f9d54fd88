"""What a layout says: "this tensor is these pieces at (file, byte range, box)".

Every layout (a single file, an HF index, a directory, a list, a pod manifest, a
URL) reduces to :class:`Piece` s: a box of a global tensor, stored as one tensor
of one file. A single-file tensor is one piece whose box is the whole tensor; a
pod directory's tensors are the boxes each process wrote. The loading engine
plans, reads and assembles pieces and nothing else.

This module also parses and validates a pod directory's ``manifest.json``
(:func:`parse_manifest`): for every tensor its pieces must lie inside the shape,
be pairwise disjoint (a box listed by several processes is one replicated piece)
and cover it exactly (:func:`check_tiling`), before any byte is read.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import DuplicateKeyError, HeaderError, PieceLayoutError, short_repr
from ..format import _dtypes
from ..format._header import FileHeader, TensorInfo, unique_pairs
from ..load._plan import Request

__all__ = [
    "FORMAT",
    "MANIFEST",
    "SHARD_FILE",
    "VERSION",
    "Box",
    "Manifest",
    "Piece",
    "check_tiling",
    "extents",
    "intersect",
    "parse_manifest",
    "pod_tensors",
    "request",
    "whole",
]

MANIFEST = "manifest.json"
FORMAT = "nnx_save.pod"
VERSION = 1
SHARD_FILE = re.compile(r"^shard_(\d{5})-of-(\d{5})\.([0-9a-f]{8})\.safetensors$")

Box = tuple[tuple[int, int], ...]


def whole(shape: tuple[int, ...]) -> Box:
    """The box of a whole tensor of ``shape``."""
    return tuple((0, d) for d in shape)


def intersect(a: Box, b: Box) -> Box | None:
    """The common box of ``a`` and ``b``, or ``None`` when they share no element."""
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return out if all(lo < hi for lo, hi in out) else None


@dataclass(frozen=True)
class Piece:
    """Box ``box`` of a global tensor, stored as tensor ``info`` of ``info.file``
    (whose shape is the box's extents). ``process``: the pod process that wrote it
    (-1 for layouts without processes)."""

    box: Box
    info: TensorInfo
    process: int = -1


def _overlaps(lo: np.ndarray, hi: np.ndarray) -> tuple[int, int] | None:
    """A pair ``(i, j)`` of boxes (rows of ``lo``/``hi``) that share an element, or None.
    Vectorised in blocks of rows, so a tensor of thousands of pieces checks in ms."""
    n = len(lo)
    for a in range(0, n, 512):
        b = min(a + 512, n)
        share = (np.maximum(lo[a:b, None], lo[None]) < np.minimum(hi[a:b, None], hi[None])).all(-1)
        share[np.arange(b - a), np.arange(a, b)] = False
        hit = np.argwhere(share)
        if len(hit):
            return a + int(hit[0][0]), int(hit[0][1])
    return None


def check_tiling(key: str, shape: tuple[int, ...], boxes: list[Box], where: str) -> None:
    """Refuse unless the distinct ``boxes`` lie inside ``shape``, are pairwise
    disjoint and cover it exactly.

    Raises:
        PieceLayoutError: naming ``key`` and the offending boxes.

    Examples:
        >>> check_tiling("w", (8,), [((0, 4),), ((4, 8),), ((0, 4),)], "m.json")  # a replica: fine
        >>> check_tiling("w", (8,), [((0, 6),), ((1, 3),)], "m.json")
        Traceback (most recent call last):
        ...
        nnx_save.errors.PieceLayoutError: m.json: tensor 'w': pieces [[0, 6]] and [[1, 3]] overlap
    """
    distinct = list(dict.fromkeys(boxes))
    for box in distinct:
        if len(box) != len(shape) or not all(0 <= lo <= hi <= d for (lo, hi), d in zip(box, shape, strict=True)):
            raise PieceLayoutError(
                f"{where}: tensor {key!r}: piece {_show(box)} does not lie inside shape {list(shape)}"
            )
    nonempty = [b for b in distinct if all(lo < hi for lo, hi in b)]
    if shape and len(nonempty) > 1:
        arr = np.array(nonempty, np.int64)
        pair = _overlaps(arr[:, :, 0], arr[:, :, 1])
        if pair is not None:
            i, j = sorted(pair)
            raise PieceLayoutError(
                f"{where}: tensor {key!r}: pieces {_show(nonempty[i])} and {_show(nonempty[j])} overlap"
            )
    covered, total = sum(_volume(b) for b in nonempty), _volume(whole(shape))
    if covered != total or (not shape and not distinct):
        raise PieceLayoutError(
            f"{where}: tensor {key!r}: pieces {[_show(b) for b in distinct][:8]} cover {covered} of the "
            f"{total} elements of shape {list(shape)}"
        )


def _volume(box: Box) -> int:
    n = 1
    for lo, hi in box:
        n *= hi - lo
    return n


def _show(box: Box) -> list[list[int]]:
    return [[lo, hi] for lo, hi in box]


def request(piece: Piece, part: Box, box: Box, dest: int) -> Request:
    """The read of ``part`` (global coordinates, inside ``piece`` and ``box``) into
    destination ``dest``, which holds ``box``."""
    info = piece.info
    if not info.dtype.byte_aligned:  # packed: the whole (single) piece, sliced after
        return Request(dest, info.begin, (info.nbytes,), 1, ((0, info.nbytes),))
    local = tuple((lo - p, hi - p) for (lo, hi), (p, _) in zip(part, piece.box, strict=True))
    if part == box:
        return Request(dest, info.begin, info.shape, info.dtype.itemsize, local)
    at = tuple(lo - b for (lo, _), (b, _) in zip(part, box, strict=True))
    return Request(dest, info.begin, info.shape, info.dtype.itemsize, local, extents(box), at)


def extents(box: Box) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in box)


# --------------------------------------------------------------------------- pod manifests


@dataclass(frozen=True)
class ManifestPiece:
    file: str
    name: str
    box: Box
    process: int


@dataclass(frozen=True)
class Manifest:
    """A validated ``manifest.json``: each tensor's dtype, shape and pieces (by file name)."""

    where: Path
    tensors: Mapping[str, tuple[_dtypes.DtypeInfo, tuple[int, ...], tuple[ManifestPiece, ...]]]
    metadata: Mapping[str, str]
    num_processes: int

    @property
    def files(self) -> list[str]:
        return sorted({p.file for _, _, pieces in self.tensors.values() for p in pieces})


def _fail(where: Path, message: str) -> PieceLayoutError:
    return PieceLayoutError(f"{where}: {message}")


def _load_json(raw: bytes, where: Path) -> dict:
    try:
        obj = json.loads(raw.decode("utf-8"), object_pairs_hook=unique_pairs)
    except DuplicateKeyError as e:  # json.loads alone keeps the last of two in silence
        raise HeaderError(f"{where}: {e} in the manifest JSON") from None
    except RecursionError:
        raise HeaderError(f"{where}: not a valid JSON manifest: nested too deeply") from None
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise HeaderError(f"{where}: not a valid JSON manifest: {e}") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise HeaderError(f'{where}: not an nnx_save pod manifest (expected "format": "{FORMAT}")')
    if obj.get("version") != VERSION:
        raise HeaderError(
            f"{where}: pod manifest version {obj.get('version')!r}; this nnx_save reads version {VERSION}"
        )
    if not isinstance(obj.get("tensors"), dict) or not isinstance(obj.get("num_processes"), int):
        raise HeaderError(f'{where}: the manifest needs "tensors" (an object) and "num_processes" (an integer)')
    meta = obj.get("metadata") or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise HeaderError(f'{where}: "metadata" must map strings to strings')
    return obj


def _box(raw: Any, rank: int, key: str, where: Path) -> Box:
    ok = (
        isinstance(raw, list)
        and len(raw) == rank
        and all(isinstance(b, list) and len(b) == 2 and all(type(x) is int for x in b) for b in raw)
    )
    if not ok:
        raise _fail(
            where, f"tensor {key!r}: piece box {short_repr(raw, 80)} must be {rank} [start, stop) integer pairs"
        )
    return tuple((lo, hi) for lo, hi in raw)


def _piece(raw: Any, rank: int, key: str, where: Path) -> ManifestPiece:
    if not isinstance(raw, dict):
        raise _fail(where, f"tensor {key!r}: piece {short_repr(raw, 80)} must be an object with file, name and box")
    name, file, process = raw.get("name"), raw.get("file"), raw.get("process")
    if not isinstance(file, str) or not SHARD_FILE.match(file) or not isinstance(name, str):
        raise _fail(
            where, f"tensor {key!r}: piece {short_repr(raw, 80)} must name a shard_*.safetensors file and a tensor"
        )
    return ManifestPiece(file, name, _box(raw.get("box"), rank, key, where), process if type(process) is int else -1)


def _tensor(key: str, spec: Any, where: Path):
    if not isinstance(spec, dict) or not isinstance(spec.get("pieces"), list):
        raise _fail(where, f'tensor {key!r}: expected an object with "dtype", "shape" and "pieces"')
    dtype = _dtypes.from_code(spec.get("dtype"), key)
    shape = spec.get("shape")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise _fail(where, f"tensor {key!r}: shape must be a list of non-negative integers")
    shape = tuple(shape)
    pieces = tuple(_piece(raw, len(shape), key, where) for raw in spec["pieces"])
    check_tiling(key, shape, [p.box for p in pieces], str(where))
    if not dtype.byte_aligned and any(p.box != whole(shape) for p in pieces):
        raise _fail(where, f"tensor {key!r}: a {dtype.code} tensor packs several elements per byte; it must be whole")
    return dtype, shape, pieces


def parse_manifest(raw: bytes, where: Path) -> Manifest:
    """Validate the bytes of ``manifest.json`` read from ``where`` (JSON without a
    repeated key, pieces tiling every tensor); reads no file."""
    obj = _load_json(raw, where)
    tensors = {key: _tensor(key, spec, where) for key, spec in obj["tensors"].items()}
    return Manifest(where, tensors, dict(obj.get("metadata") or {}), obj["num_processes"])


def pod_tensors(
    manifest: Manifest, files: Mapping[str, FileHeader | None]
) -> tuple[dict[str, TensorInfo], dict[str, tuple[Piece, ...]]]:
    """Global tensors (whose ``file`` is the manifest) and their pieces in the shard
    files present (``files[name]`` is ``None`` for a shard file that is not there)."""
    where, tensors, pieces = manifest.where, {}, {}
    for key, (dtype, shape, listed) in manifest.tensors.items():
        found = []
        for p in listed:
            fh = files[p.file]
            if fh is None:
                continue
            info = fh.tensors.get(p.name)
            extents = tuple(hi - lo for lo, hi in p.box)
            if info is None or info.dtype.code != dtype.code or info.shape != extents:
                held = "nothing" if info is None else f"{info.dtype.code} {list(info.shape)}"
                raise _fail(
                    where,
                    f"tensor {key!r}: piece {p.name!r} should be {dtype.code} {list(extents)} in {p.file}, "
                    f"which holds {held}",
                )
            found.append(Piece(p.box, info, p.process))
        nbytes = _dtypes.nbytes_for(dtype, math.prod(shape))
        tensors[key] = TensorInfo(key, dtype, shape, 0, nbytes, str(where))
        pieces[key] = tuple(found)
    return tensors, pieces
