"""The pod layout: one shard file per process and a manifest, for saves that
should not funnel a whole model through one file.

A pod directory holds::

    manifest.json                               what every tensor is, and where its pieces are
    shard_00000-of-00002.<token>.safetensors    process 0's pieces
    shard_00001-of-00002.<token>.safetensors    process 1's pieces

Each shard file is a standard safetensors file (validated header, checksums): its
tensors are *pieces*, each one box of a global tensor (``embed[0:32,0:64]``), or a
whole tensor. A process writes every distinct box its own devices hold (for arrays
split across processes) and every value it holds whole (host arrays, scalars), so
a load on the same process layout reads only its own file. The shard file's header
is the process's sidecar: after every process has written its file, the primary
merges the piece lists into ``manifest.json`` (written last, atomically) and removes
shard files of earlier saves. The ``<token>`` is new for every save, so a crash
leaves the previous manifest and the files it names intact.

Loading (:class:`PodEngine`, used by the loading engine for a :class:`PodHeader`)
intersects each box the target sharding needs with the pieces: a piece that is
exactly a needed box is read straight into its buffer; otherwise each overlap is
read (its byte runs, as for any file) and copied into place. Pieces in this
process's own file are preferred; a needed piece in a file that is not there (a
host-local disk) is an error naming that file.

``manifest.json``::

    {"format": "nnx_save.pod", "version": 1, "num_processes": 2, "metadata": {...},
     "tensors": {"embed": {"dtype": "F32", "shape": [64, 32],
                           "sharding": "NamedSharding(mesh={'a': 2}, spec=P('a', None))",
                           "pieces": [{"file": "shard_00000-of-00002.1a2b3c4d.safetensors",
                                       "name": "embed[0:32,0:32]", "box": [[0, 32], [0, 32]],
                                       "process": 0}, ...]}}}
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import _checksum, _dtypes
from ._errors import HeaderError, NnxSaveError, ShapeMismatchError
from ._header import FileHeader, TensorInfo
from ._sources import Header, read_file_header

__all__ = ["MANIFEST", "Piece", "PodEngine", "PodHeader", "is_pod", "read_pod"]

MANIFEST = "manifest.json"
FORMAT = "nnx_save.pod"
VERSION = 1
_SHARD = re.compile(r"^shard_(\d{5})-of-(\d{5})\.([0-9a-f]{8})\.safetensors$")

Box = tuple[tuple[int, int], ...]


# --------------------------------------------------------------------------- reading the manifest


@dataclass(frozen=True)
class Piece:
    """One box of a global tensor, stored as tensor ``info`` of a shard file."""

    box: Box
    info: TensorInfo
    process: int


@dataclass(frozen=True)
class PodHeader(Header):
    """A pod directory as the engine sees it: global tensors (``tensors``, whose
    ``file`` is the manifest) made of pieces in the shard files (``files``)."""

    pieces: Mapping[str, tuple[Piece, ...]] = field(default_factory=dict)
    missing_files: tuple[str, ...] = ()
    num_processes: int = 1


def is_pod(directory: Path) -> bool:
    return (directory / MANIFEST).is_file()


def _fail(where: Path, message: str) -> HeaderError:
    return HeaderError(f"{where}: {message}")


def _load_manifest(where: Path) -> dict:
    try:
        obj = json.loads(where.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:
        raise _fail(where, f"not a valid JSON manifest: {e}") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise _fail(where, f'not an nnx_save pod manifest (expected "format": "{FORMAT}")')
    if obj.get("version") != VERSION:
        raise _fail(where, f"pod manifest version {obj.get('version')!r}; this nnx_save reads version {VERSION}")
    if not isinstance(obj.get("tensors"), dict) or not isinstance(obj.get("num_processes"), int):
        raise _fail(where, 'the manifest needs "tensors" (an object) and "num_processes" (an integer)')
    meta = obj.get("metadata") or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise _fail(where, '"metadata" must map strings to strings')
    return obj


def _box(raw: Any, shape: tuple[int, ...], key: str, where: Path) -> Box:
    ok = (
        isinstance(raw, list)
        and len(raw) == len(shape)
        and all(
            isinstance(b, list) and len(b) == 2 and all(isinstance(x, int) for x in b) and 0 <= b[0] <= b[1] <= d
            for b, d in zip(raw, shape, strict=False)
        )
    )
    if not ok:
        raise _fail(where, f"tensor {key!r}: piece box {raw!r:.80} does not lie inside shape {list(shape)}")
    return tuple((lo, hi) for lo, hi in raw)


def _tensor(
    key: str, spec: Any, where: Path, files: dict[str, FileHeader | None]
) -> tuple[TensorInfo, tuple[Piece, ...]]:
    if not isinstance(spec, dict) or not isinstance(spec.get("pieces"), list):
        raise _fail(where, f'tensor {key!r}: expected an object with "dtype", "shape" and "pieces"')
    dtype = _dtypes.from_code(spec.get("dtype"), key)
    shape = spec.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise _fail(where, f"tensor {key!r}: shape must be a list of non-negative integers")
    shape = tuple(shape)
    pieces, covered = [], {}
    for raw in spec["pieces"]:
        name, file, process = raw.get("name"), raw.get("file"), raw.get("process")
        if not isinstance(file, str) or not _SHARD.match(file) or not isinstance(name, str):
            raise _fail(where, f"tensor {key!r}: piece {raw!r:.80} must name a shard_*.safetensors file and a tensor")
        box = _box(raw.get("box"), shape, key, where)
        fh = files.setdefault(file, _file_header(where.parent / file))
        if fh is None:
            covered.setdefault(box, None)
            continue
        info = fh.tensors.get(name)
        extents = tuple(hi - lo for lo, hi in box)
        if info is None or info.dtype.code != dtype.code or info.shape != extents:
            found = "nothing" if info is None else f"{info.dtype.code} {list(info.shape)}"
            raise _fail(
                where,
                f"tensor {key!r}: piece {name!r} should be {dtype.code} {list(extents)} in {file}, which holds {found}",
            )
        pieces.append(Piece(box, info, process if isinstance(process, int) else -1))
        covered[box] = True
    if sum(math.prod(hi - lo for lo, hi in b) for b in covered) != math.prod(shape):
        raise _fail(where, f"tensor {key!r}: its pieces do not tile shape {list(shape)}")
    nbytes = _dtypes.nbytes_for(dtype, math.prod(shape))
    return TensorInfo(key, dtype, shape, 0, nbytes, str(where)), tuple(pieces)


def _file_header(path: Path) -> FileHeader | None:
    return read_file_header(path) if path.is_file() else None


def read_pod(directory: str | os.PathLike) -> PodHeader:
    """Read and validate a pod directory's manifest and every shard file header
    present (a shard file that is not there is only an error if a load needs it)."""
    directory = Path(directory)
    where = directory / MANIFEST
    obj = _load_manifest(where)
    files: dict[str, FileHeader | None] = {}
    tensors, pieces = {}, {}
    for key, spec in obj["tensors"].items():
        tensors[key], pieces[key] = _tensor(key, spec, where, files)
    present = tuple(fh for _, fh in sorted(files.items()) if fh is not None)
    missing = tuple(sorted(f for f, fh in files.items() if fh is None))
    return PodHeader(
        tensors,
        dict(obj.get("metadata") or {}),
        present,
        "pod",
        pieces=pieces,
        missing_files=missing,
        num_processes=obj["num_processes"],
    )


# --------------------------------------------------------------------------- loading


def _intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=False))
    return out if all(lo < hi for lo, hi in out) or not out else None


def _volume(box: Box) -> int:
    return math.prod(hi - lo for lo, hi in box)


def _relative(box: Box, origin: Box) -> Box:
    return tuple((lo - o, hi - o) for (lo, hi), (o, _) in zip(box, origin, strict=False))


@dataclass
class _Slot:
    """One buffer to fill: a box of a value, for some local devices."""

    owner: str  # target path, or "source:<key>" for a transform's whole source
    key: str
    box: Box
    devices: list[Any]
    buffer: Any = None
    remaining: int = 0
    verified: bool = True


@dataclass(frozen=True)
class _Part:
    slot: int
    piece: Piece
    box: Box  # global coordinates: the slot's box within the piece


class PodEngine:
    """The loading engine's counterpart for a pod directory (same interface as
    ``_load._Engine``: ``run_file``, ``results``, ``checked``, ``budget``)."""

    def __init__(self, header: PodHeader, targets: Sequence[Any], report: Any, options: dict) -> None:
        import jax

        from ._load import _boxes
        from ._read import Budget, aligned_empty

        self.header, self.report, self.opt = header, report, options
        self.results: dict[str, Any] = {}
        self.checked: dict[str, bool] = {}
        self.over_reads: list[str] = []  # the engine's over-read notes (none here: pieces are read as planned)
        self.budget = Budget(options["max_inflight_bytes"])
        self.targets = {t.path: t for t in targets}
        self.own = jax.process_index() if header.num_processes == jax.process_count() else None
        self.slots: list[_Slot] = []
        self.open: dict[str, set[int]] = {}  # owner -> slots still being filled
        self.wholes: dict[str, np.ndarray] = {}
        self.parts: dict[str, list[_Part]] = {}
        for t in targets:
            if t.transform is None:
                for box, devices in _boxes(t):
                    self._add(t.path, t.sources[0], box, devices)
            else:
                for k in t.sources:
                    if f"source:{k}" not in self.open:
                        self._add(f"source:{k}", k, tuple((0, d) for d in header.tensors[k].shape), [None])
        for index, slot in enumerate(self.slots):
            if slot.remaining == 0:  # an empty tensor: nothing to read
                slot.buffer = aligned_empty(0)
                self._done(index)

    def _add(self, owner: str, key: str, box: Box, devices: list[Any]) -> None:
        info = self.header.tensors[key]
        if not info.dtype.byte_aligned:
            box = tuple((0, d) for d in info.shape)  # packed: read whole, slice after
        index = len(self.slots)
        self.slots.append(_Slot(owner, key, box, devices, remaining=_volume(box)))
        self.open.setdefault(owner, set()).add(index)
        for piece in self._choose(key, box):
            part = _Part(index, piece, _intersect(piece.box, box))
            self.parts.setdefault(piece.info.file, []).append(part)

    def _choose(self, key: str, box: Box) -> list[Piece]:
        """One piece per distinct overlapping box: this process's own file first."""
        best: dict[Box, Piece] = {}
        for piece in self.header.pieces[key]:
            if _intersect(piece.box, box) is None:
                continue
            rank = (piece.process != self.own, piece.process)
            if piece.box not in best or rank < (best[piece.box].process != self.own, best[piece.box].process):
                best[piece.box] = piece
        if sum(_volume(_intersect(b, box)) for b in best) != _volume(box):
            raise NnxSaveError(
                f"{self.header.tensors[key].file}: tensor {key!r}: the part {list(box)} this process needs is in "
                f"shard file(s) {list(self.header.missing_files)}, not present in this directory; copy them here, "
                "or load on the process layout that wrote them"
            )
        return list(best.values())

    def run_file(self, file: str) -> None:
        from ._plan import Request, plan_file
        from ._read import aligned_empty, execute

        parts = self.parts.pop(file, [])
        if not parts:
            return
        io, t0 = self.report.io, time.perf_counter()
        requests, dests, copies = [], [], []
        for part in parts:
            slot, info = self.slots[part.slot], part.piece.info
            row = info.dtype
            if slot.buffer is None:
                slot.buffer = aligned_empty(self._nbytes(slot))
            local = _relative(part.box, part.piece.box)
            direct = part.box == slot.box
            dest = slot.buffer if direct else aligned_empty(_volume(part.box) * row.itemsize)
            dests.append(dest)
            if row.byte_aligned:
                requests.append(Request(len(dests) - 1, info.begin, info.shape, row.itemsize, local))
            else:
                requests.append(Request(len(dests) - 1, info.begin, (info.nbytes,), 1, ((0, info.nbytes),)))
            copies.append((part, dest, direct))
        plan = plan_file(
            requests,
            max_over_read_ratio=self.opt["max_over_read_ratio"],
            chunk_bytes=min(self.opt["read_chunk_bytes"], self.opt["max_inflight_bytes"]),
        )
        t1 = time.perf_counter()
        reader = self.opt["open_reader"](file)
        try:
            execute(reader, plan, dests, budget=self.budget, num_threads=self.opt["num_threads"])
        finally:
            reader.close()
        t2 = time.perf_counter()
        io.files += 1
        io.bytes_read += plan.read_bytes
        io.bytes_needed += plan.needed_bytes
        io.requests += reader.requests
        io.over_read_by_file[file] = plan.read_bytes / plan.needed_bytes if plan.needed_bytes else 1.0
        digests = _checksum.read_digests(self._file(file).metadata, file) if self.opt.get("verify") else {}
        for part, dest, direct in copies:
            self._fill(part, dest, direct, digests)
        io.plan_seconds += t1 - t0
        io.read_seconds += t2 - t1
        io.assemble_seconds += time.perf_counter() - t2

    def _file(self, file: str) -> FileHeader:
        return next(fh for fh in self.header.files if fh.file == file)

    def _nbytes(self, slot: _Slot) -> int:
        info = self.header.tensors[slot.key]
        return info.nbytes if not info.dtype.byte_aligned else _volume(slot.box) * info.dtype.itemsize

    def _fill(self, part: _Part, dest: np.ndarray, direct: bool, digests: Mapping[str, str]) -> None:
        slot, info = self.slots[part.slot], self.header.tensors[self.slots[part.slot].key]
        expected = digests.get(part.piece.info.name)
        if expected and part.box == part.piece.box:
            _checksum.check(part.piece.info.name, part.piece.info.file, expected, [memoryview(dest)])
        else:
            slot.verified = False
        if not direct:
            shape = tuple(hi - lo for lo, hi in slot.box)
            whole = slot.buffer.view(info.dtype.numpy).reshape(shape)
            region = tuple(slice(lo, hi) for lo, hi in _relative(part.box, slot.box))
            whole[region] = dest.view(info.dtype.numpy).reshape(tuple(hi - lo for lo, hi in part.box))
        slot.remaining -= _volume(part.box) if info.dtype.byte_aligned else slot.remaining
        if slot.remaining == 0:
            self._done(part.slot)

    def _done(self, index: int) -> None:
        from ._load import _host_view

        slot = self.slots[index]
        waiting = self.open[slot.owner]
        waiting.discard(index)
        if self.opt.get("verify"):
            self.checked[slot.key] = self.checked.get(slot.key, True) and slot.verified
        if waiting:
            return
        mine = [self.slots[i] for i in range(len(self.slots)) if self.slots[i].owner == slot.owner]
        info = self.header.tensors[slot.key]
        views = [(_host_view(s.buffer, info, s.box), s.devices) for s in mine]
        if slot.owner.startswith("source:"):
            self.wholes[slot.key] = views[0][0]
            self._transforms()
        else:
            self._place(self.targets[slot.owner], views)
        for s in mine:
            s.buffer = None  # released as soon as the value exists

    def _place(self, t: Any, views: list[tuple[np.ndarray, list[Any]]]) -> None:
        from ._load import _place

        cast = [(v if v.dtype == np.dtype(t.dtype) else v.astype(t.dtype), d) for v, d in views]
        self.results[t.path] = _place(t, cast)

    def _transforms(self) -> None:
        from ._load import _place_whole

        for t in list(self.targets.values()):
            if t.transform is None or t.path in self.results or not all(k in self.wholes for k in t.sources):
                continue
            value = np.asarray(t.transform([self.wholes[k] for k in t.sources]))
            if value.shape != tuple(t.shape):
                raise ShapeMismatchError(
                    f"{t.path}: rule produced shape {value.shape} from {list(t.sources)}, the target has {t.shape}"
                )
            self.results[t.path] = _place_whole(t, value.astype(t.dtype, copy=False))
