"""The pod layout: one shard file per process (standard safetensors whose tensors are
pieces, ``embed[0:32,0:64]``, or whole values) and a ``manifest.json`` naming each
tensor's dtype, shape, sharding and pieces. Format, reading, writing and the
manifest's commit live here; docs/multihost.md tells the rest.

:class:`PodLayout` validates the manifest (:func:`~nnx_save.format._boxes.check_tiling`) before any byte is
read. Writing, every process writes one shard file with every distinct box its
devices hold, then the primary commits the manifest, last and atomically, and only
then removes the shard files provably of earlier saves (the save token in their names
and in their metadata, :func:`~nnx_save.layouts._layout.owned`). The steps run over
:class:`~nnx_save.io._kv.Sync`; a crash leaves the previous manifest and its files
intact, and any failure raises the same :class:`SaveError` on every process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ..errors import HeaderError, OptionError, SaveError, short_repr
from ..format import _dtypes
from ..format._boxes import check_tiling, of_index
from ..format._header import FileHeader, TensorInfo, encode_header
from ..io import _files, _storage
from ..io._kv import StepResult, Sync
from ..io._storage import Location, Where
from ..load._pieces import Box, Piece, extents, whole
from ..load._source import Header, LocalFiles
from ..save._entry import Entry, order_entries, spans_processes
from ..save._options import SaveOptions
from ._file import member_header
from ._index import MAX_INDEX_BYTES
from ._layout import (
    SAVE_ID_KEY,
    Committed,
    Metadata,
    WriteFiles,
    load_record,
    new_save_id,
    one_version,
    owned,
    save_id_in,
    single_beside,
)
from ._local import read_file_header

__all__ = [
    "FORMAT",
    "MANIFEST",
    "SHARD_FILE",
    "VERSION",
    "Manifest",
    "PodLayout",
    "piece_name",
    "shard_name",
]

MANIFEST = "manifest.json"
FORMAT = "nnx_save.pod"
VERSION = 1
SHARD_FILE = re.compile(r"^shard_(\d{5})-of-(\d{5})\.(?P<id>[0-9a-f]{8})\.safetensors$")
# A shard file's name gives the process and the count in five digits (SHARD_FILE).
MAX_PROCESSES = 99999
_SAVE_ID = re.compile(r"[0-9a-f]{8}")


# --------------------------------------------------------------------------- manifests


class ManifestPiece(NamedTuple):  # a tuple: a manifest may list a hundred thousand
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
    save_id: str | None = None

    @property
    def files(self) -> list[str]:
        return sorted({p.file for _, _, pieces in self.tensors.values() for p in pieces})


def _fail(where: Path, message: str) -> HeaderError:
    return HeaderError(f"{where}: {message}", check="pieces")


def _bad(where: Path, message: str) -> HeaderError:
    return HeaderError(f"{where}: {message}", check="manifest")


def _check_processes(raw: list, n: int, key: str, where: Path) -> None:
    """Every piece's ``process`` (when it gives one) is a process of the pod: ``0 <= process < n``."""
    for piece in raw:
        if isinstance(piece, dict) and "process" in piece:
            got = piece["process"]
            if type(got) is not int or not 0 <= got < n:
                raise _bad(
                    where,
                    f"tensor {key!r}: piece {short_repr(piece, 80)}: process must be an integer from 0 to {n - 1} "
                    f"(num_processes is {n}), found {short_repr(got, 40)}",
                )


def _check_distinct(pieces: tuple[ManifestPiece, ...], key: str, where: Path) -> None:
    """No tensor of a shard file is listed twice for one tensor (a replica lives in another file)."""
    seen: set[tuple[str, str]] = set()
    for p in pieces:
        if (p.file, p.name) in seen:
            raise _fail(where, f"tensor {key!r}: piece {p.name!r} of {p.file} is listed twice")
        seen.add((p.file, p.name))


def check_save_id(where: Path, save_id: str | None, files: Mapping[str, FileHeader | None]) -> None:
    """Every shard file present is of the save the manifest records (when it records one).

    Raises:
        HeaderError: ``check="manifest"``, naming the first file of another save and both save ids.
    """
    if save_id is None:
        return
    for name, fh in sorted(files.items()):
        got = None if fh is None else fh.metadata.get(SAVE_ID_KEY, "")
        if got is not None and got != save_id:
            raise _bad(
                where,
                f"is save {save_id}, but its shard file {name} is {f'save {got}' if got else 'of no recorded save'}: "
                "the manifest names a file of another save (a copy or a link); save the pod again",
            )


def _load_json(raw: bytes, where: Path) -> dict:
    obj = load_record(raw, where, "manifest")
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise HeaderError(f'{where}: not an nnx_save pod manifest (expected "format": "{FORMAT}")')
    if obj.get("version") != VERSION:
        raise HeaderError(
            f"{where}: pod manifest version {obj.get('version')!r}; this nnx_save reads version {VERSION}"
        )
    if not isinstance(obj.get("tensors"), dict) or not isinstance(obj.get("num_processes"), int):
        raise HeaderError(f'{where}: the manifest needs "tensors" (an object) and "num_processes" (an integer)')
    n, save_id = obj["num_processes"], obj.get("save_id")
    if type(n) is not int or not 1 <= n <= MAX_PROCESSES:
        raise _bad(where, f'"num_processes" must be an integer from 1 to {MAX_PROCESSES}, found {short_repr(n, 40)}')
    if save_id is not None and not (isinstance(save_id, str) and _SAVE_ID.fullmatch(save_id)):
        raise _bad(where, f'"save_id" must be eight lowercase hex digits, found {short_repr(save_id, 40)}')
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


def _listed(raw: list, rank: int, no_bools: bool) -> tuple[ManifestPiece, ...] | None:
    """The pieces ``raw`` lists, checked in bulk, or ``None`` if any is malformed
    (:func:`_piece` then names it). ``no_bools``: the manifest has no JSON ``true``
    or ``false`` anywhere, so numpy cannot have read one of them as an integer."""
    if not raw or not rank or not no_bools or any(type(p) is not dict for p in raw):
        return None
    files, names = [p.get("file") for p in raw], [p.get("name") for p in raw]
    try:
        boxes = np.array([p.get("box") for p in raw])
    except ValueError:  # ragged
        return None
    if boxes.shape != (len(raw), rank, 2) or boxes.dtype != np.int64 or {*map(type, names)} != {str}:
        return None
    if {*map(type, files)} != {str} or not all(SHARD_FILE.match(f) for f in set(files)):
        return None
    procs = [x if type(x) is int else -1 for x in (p.get("process") for p in raw)]
    return tuple(map(ManifestPiece, files, names, (tuple(map(tuple, b)) for b in boxes.tolist()), procs))


def _tensor(key: str, spec: Any, where: Path, no_bools: bool, n: int):
    if not isinstance(spec, dict) or not isinstance(spec.get("pieces"), list):
        raise _fail(where, f'tensor {key!r}: expected an object with "dtype", "shape" and "pieces"')
    dtype = _dtypes.from_code(spec.get("dtype"), key)
    shape = spec.get("shape")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise _fail(where, f"tensor {key!r}: shape must be a list of non-negative integers")
    shape = tuple(shape)
    _check_processes(spec["pieces"], n, key, where)
    pieces = _listed(spec["pieces"], len(shape), no_bools)
    if pieces is None:  # something is off: find and name it, one piece at a time
        pieces = tuple(_piece(raw, len(shape), key, where) for raw in spec["pieces"])
    _check_distinct(pieces, key, where)
    check_tiling(key, shape, [p.box for p in pieces], str(where))
    if not dtype.byte_aligned and any(p.box != whole(shape) for p in pieces):
        raise _fail(where, f"tensor {key!r}: a {dtype.code} tensor packs several elements per byte; it must be whole")
    return dtype, shape, pieces


def parse_manifest(raw: bytes, where: Path) -> Manifest:
    """Validate the bytes of ``manifest.json`` read from ``where`` (JSON without a
    repeated key, pieces tiling every tensor); reads no file."""
    obj = _load_json(raw, where)
    no_bools = b"true" not in raw and b"false" not in raw  # then every integer json gave is an int
    n = obj["num_processes"]
    tensors = {key: _tensor(key, spec, where, no_bools, n) for key, spec in obj["tensors"].items()}
    return Manifest(where, tensors, dict(obj.get("metadata") or {}), n, obj.get("save_id"))


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
            if info is None or info.dtype.code != dtype.code or info.shape != extents(p.box):
                held = "nothing" if info is None else f"{info.dtype.code} {list(info.shape)}"
                raise _fail(
                    where,
                    f"tensor {key!r}: piece {p.name!r} should be {dtype.code} {list(extents(p.box))} in {p.file}, "
                    f"which holds {held}",
                )
            found.append(Piece(p.box, info, p.process))
        nbytes = _dtypes.nbytes_for(dtype, math.prod(shape))
        tensors[key] = TensorInfo(key, dtype, shape, 0, nbytes, str(where))
        pieces[key] = tuple(found)
    return tensors, pieces


# --------------------------------------------------------------------------- reading


class PodFiles(LocalFiles):
    """A pod's shard files: each tensor is the pieces its manifest lists in the
    files present."""

    def __init__(self, processes: int) -> None:
        super().__init__()
        self.processes = processes
        self.pieces: dict[str, tuple[Piece, ...]] = {}

    def pieces_of(self, key: str, info: TensorInfo) -> tuple[Piece, ...]:
        return self.pieces[key]

    def local_files(self) -> None:
        return None  # a tensor is pieces of several files: the engine assembles it


class PodLayout:
    """A directory whose ``manifest.json`` says it is a pod (``"format": "nnx_save.pod"``)."""

    name = "pod"
    record = MANIFEST

    def claims(self, location: Location, names: Collection[str]) -> bool:
        """By content: another tool's ``manifest.json`` is not a pod's."""
        if MANIFEST not in names:
            return False
        try:
            raw = location.read_bytes(MANIFEST, "manifest", MAX_INDEX_BYTES, HeaderError)
        except (OSError, HeaderError):
            return True  # there but unreadable: reading it says why
        return f'"{FORMAT}"'.encode() in raw

    def _manifest(self, path: Path) -> Manifest:
        where = path / MANIFEST
        return parse_manifest(_files.read_capped(os.fspath(where), "manifest", MAX_INDEX_BYTES, HeaderError), where)

    def read(self, path: Path) -> Header:
        """The validated manifest, and the header of every shard file present (a
        shard file that is not there is only an error if a load needs it).

        Raises:
            SourceChangedError: the manifest was replaced while it was read, and a shard
                file it named is gone or failed (a writer's commit removes the previous
                save's files).
        """
        return one_version(path / MANIFEST, lambda: self._read(path), ("index", "manifest", "pieces"))

    def _read(self, path: Path) -> Header:
        manifest = self._manifest(path)
        single_beside(path, MANIFEST, ())
        placement = PodFiles(manifest.num_processes)
        files = {
            f: read_file_header(path / f, placement.pinned) if (path / f).is_file() else None for f in manifest.files
        }
        check_save_id(manifest.where, manifest.save_id, files)
        tensors, placement.pieces = pod_tensors(manifest, files)
        placement.missing = tuple(sorted(f for f, fh in files.items() if fh is None))
        present = tuple(fh for _, fh in sorted(files.items()) if fh is not None)
        return Header(tensors, dict(manifest.metadata), present, "pod", placement)

    def pieces(
        self, directory: Where, entries: Sequence[Entry], metadata: Metadata, options: SaveOptions
    ) -> tuple[list[Entry], WriteFiles]:
        """Create ``directory``; this process's pieces of ``entries``, taken when the
        save is called (before any host snapshot: a process writes every distinct box
        it holds, whatever its replica), and what writes those pieces: this process's
        shard file, then the manifest from the primary (the one commit)."""
        self.check_target(directory)
        _storage.locate(directory).prepare()
        entries = order_entries(entries)
        local, listing, shardings = [], [], {}
        for e in entries:
            shardings[e.key], pieces = _pieces_of(e)
            for box, piece in pieces:
                name = piece_name(e.key, box, e.shape)
                local.append(dataclasses.replace(piece, key=name, shape=extents(box)))
                listing.append([e.key, name, [list(b) for b in box]])
        names = [(e.key, e.code, e.shape) for e in entries]
        posted = {"pieces": listing, "shardings": shardings}
        return local, lambda path, mine: _write(path, mine, names, dict(metadata or {}), posted, options.progress)

    def check_target(self, path: str | os.PathLike) -> None:
        """A directory on a filesystem every process shares (:func:`pieces` creates it).

        Raises:
            OptionError: ``path`` is a URL (an object store has no file that several
                processes write at byte offsets).
        """
        if _storage.locate(path).directory is None:
            raise OptionError(
                f"save_pod: directory {os.fspath(path)!r} is a URL; a pod is written to a (shared) filesystem",
                "directory",
            )

    def retire(self, directory: Location, keep: Collection[str]) -> None:
        files = _owned(directory) - set(keep)
        directory.remove(MANIFEST)
        for name in sorted(files):
            directory.remove(name)


def _owned(location: Location) -> set[str]:
    """The shard files provably of the committed save or of interrupted ones."""
    try:
        obj = json.loads(location.read_bytes(MANIFEST, "manifest", MAX_INDEX_BYTES, HeaderError))
        named = {p["file"] for spec in obj["tensors"].values() for p in spec["pieces"]}
        record_id = obj.get("save_id")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, HeaderError):
        named, record_id = set(), None
    read = lambda name: save_id_in(lambda: member_header(location, name), SAVE_ID_KEY)  # noqa: E731
    return owned(record_id, named, location.names(), SHARD_FILE, read)


# --------------------------------------------------------------------------- writing


def shard_name(p: int, n: int, token: str) -> str:
    return f"shard_{p:05d}-of-{n:05d}.{token}.safetensors"


def piece_name(key: str, box: Box, shape: tuple[int, ...]) -> str:
    """The name of box ``box`` of tensor ``key`` in a shard file (the key itself when whole)."""
    if box == whole(shape):
        return key
    return f"{key}[{','.join(f'{lo}:{hi}' for lo, hi in box)}]"


def _commit_manifest(
    location: Location,
    names: Sequence[tuple[str, str, tuple[int, ...]]],
    meta: Mapping[str, str],
    posted: Mapping[int, dict[str, Any]],
    token: str,
    previous: set[str],
) -> StepResult:
    """Primary: merge the processes' piece lists (``posted``) into the manifest, write
    it atomically, then remove the ``previous`` save's shard files; the result to post."""
    n = len(posted)
    shardings = posted[0]["shardings"]  # the same on every process: they agreed on the tensors
    tensors: dict[str, dict[str, Any]] = {
        key: {"dtype": code, "shape": list(shape), "sharding": shardings[key], "pieces": []}
        for key, code, shape in names
    }
    for p in sorted(posted):
        for key, name, box in posted[p]["pieces"]:
            tensors[key]["pieces"].append({"file": shard_name(p, n, token), "name": name, "box": box, "process": p})
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "num_processes": n,
        "save_id": token,
        "metadata": dict(meta),
        "tensors": tensors,
    }
    try:
        location.replace(MANIFEST, json.dumps(manifest, indent=1).encode() + b"\n")
    except SaveError as e:
        return StepResult(False, error=str(e))
    for stale in sorted(previous - {shard_name(p, n, token) for p in range(n)}):
        location.remove(stale)
    location.sweep(lambda name: SHARD_FILE.match(name) is not None)
    return StepResult(True)


def _describe_sharding(array: Any) -> str:
    sharding = getattr(array, "sharding", None)
    if sharding is None:
        return "host"
    mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", None)
    if mesh is not None and spec is not None:
        return f"NamedSharding(mesh={dict(mesh.shape)}, spec={spec})"
    return type(sharding).__name__


def _pieces_of(e: Entry) -> tuple[str, list[tuple[Box, Any]]]:
    """This process's pieces of one entry: ``(sharding text, [(box, entry of the piece's value)])``."""
    array = e.array
    if array is None or not spans_processes(array):
        return _describe_sharding(array), [(whole(e.shape), e)]
    if not _dtypes.DTYPES[e.code].byte_aligned:
        raise SaveError(
            f"{e.key}: a {e.code} tensor packs several elements per byte; it cannot be saved "
            "in pieces. Replicate it before saving",
            key_path=e.key,
        )
    boxes: dict[Box, Any] = {}
    for shard in array.addressable_shards:  # every distinct box held here, whatever its replica
        box = of_index(shard.index, e.shape)
        boxes.setdefault(box, Entry.of(e.key, e.code, extents(box), shard.data))  # staged, snapshotted as any
    return _describe_sharding(array), sorted(boxes.items())


def _write(
    path: str | os.PathLike,
    local: Sequence[Entry],
    names: list,
    meta: dict[str, str],
    posted: dict[str, Any],
    progress: bool | None,
) -> Committed | None:
    """Every process: agree, write this process's shard file, let the primary commit."""
    from ..save._collective import agree  # the writers: a read never loads them
    from ..save._write import write_file

    location = _storage.locate(path)
    directory = Path(path)
    sync = Sync.open(directory, what="pod save", intact="the previous save in it, if any, is intact")
    if sync.n > 1:
        head, offsets = encode_header(names, meta)
        agree(sync, head, len(names), offsets[-1][1] if offsets else 0)
    plan = sync.on_primary("token", lambda: {"token": new_save_id(), "previous": sorted(_owned(location))})
    token = plan["token"]
    mine = directory / shard_name(sync.pid, sync.n, token)

    def write_mine() -> dict[str, Any]:
        write_file(mine, local, {**meta, SAVE_ID_KEY: token}, progress=progress)
        return posted

    try:
        pieces = sync.step("pieces", StepResult.of(write_mine))
        done = _commit_manifest(location, names, meta, pieces, token, set(plan["previous"])) if sync.pid == 0 else None
        sync.step("commit", done, only=0)
    except SaveError:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(mine)
        raise
    if sync.pid != 0:
        return None
    return Committed(directory / MANIFEST, tuple(directory / shard_name(p, sync.n, token) for p in range(sync.n)))
