"""What a store's directory holds: its steps, the damaged ones, each step's JSON records.

Files only (no Orbax manager, so no barrier), run on process 0 and shared. A truncated
array file is found only when the step is read (here it would mean reading every byte);
a step without an nnx_save record is foreign, not damaged (refused on read).
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from etils import epath

from ..errors import NnxSaveError
from ..format._header import strict_json
from . import _orbax
from ._errors import CheckpointCorruptError, UnsupportedCheckpointError
from ._format import DTYPES_ITEM, METADATA_ITEM
from ._metadata import CheckpointMetadata
from ._tree import Path, Recorded, parse_dtype_record, parse_leaf_record

__all__ = [
    "DirectoryView",
    "corrupt_from",
    "load_metadata",
    "looks_damaged",
    "orbax_dtypes",
    "read_json",
    "scan",
    "step_record",
]

_RECORD_FILE = "metadata"  # the file Orbax's JSON handler writes in an item directory
_ARRAY_METADATA = "_METADATA"  # the file Orbax's pytree handler writes in an item directory
_STEP_NAME = re.compile(r"[0-9]+")


@dataclasses.dataclass(frozen=True)
class DirectoryView:
    """The steps in a directory and the damaged ones (``{step: (path, problem)}``)."""

    exists: bool
    steps: tuple[int, ...] = ()
    damaged: Mapping[int, tuple[str, str]] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "exists": self.exists,
            "steps": list(self.steps),
            "damaged": {str(s): d for s, d in self.damaged.items()},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DirectoryView:
        damaged = {int(s): (d[0], d[1]) for s, d in data["damaged"].items()}
        return cls(bool(data["exists"]), tuple(data["steps"]), damaged)

    @property
    def intact(self) -> list[int]:
        """The steps that are not damaged, ascending."""
        return [s for s in self.steps if s not in self.damaged]

    def corrupt_error(self, step: int) -> CheckpointCorruptError:
        path, problem = self.damaged[step]
        return CheckpointCorruptError(step, path, problem)


def scan(directory: epath.Path) -> DirectoryView:
    """Every step directory (Orbax's plain ``<step>`` names) and its damage, if any."""
    if not directory.is_dir():
        return DirectoryView(exists=False)
    steps = sorted(int(p.name) for p in directory.iterdir() if _STEP_NAME.fullmatch(p.name) and p.is_dir())
    damaged = {step: found for step in steps if (found := _damage(directory / str(step))) is not None}
    gone = {step for step in damaged if not (directory / str(step)).is_dir()}  # deleted while looked at: no damage
    return DirectoryView(
        True, tuple(s for s in steps if s not in gone), {s: d for s, d in damaged.items() if s not in gone}
    )


def _damage(step_dir: epath.Path) -> tuple[str, str] | None:
    """``(path, problem)`` for the first damage found in a step directory, or None."""
    record_dir = step_dir / METADATA_ITEM
    if not record_dir.exists():
        return None  # not an nnx_save step: foreign, refused on read
    record, problem = read_json(record_dir / _RECORD_FILE)
    if problem is not None:
        return str(record_dir / _RECORD_FILE), problem
    items = record.get("items") if isinstance(record, dict) else None
    for name in items if isinstance(items, list) else []:
        item_dir = step_dir / str(name)
        if not item_dir.is_dir():
            return str(item_dir), f"the directory of item {name!r}, named in the step's record, is missing"
        if not (item_dir / _ARRAY_METADATA).exists():
            return str(item_dir / _ARRAY_METADATA), f"Orbax's metadata file of item {name!r} is missing"
    dtypes = step_dir / DTYPES_ITEM / _RECORD_FILE
    if (step_dir / DTYPES_ITEM).exists():
        _, problem = read_json(dtypes)
        if problem is not None:
            return str(dtypes), problem
    return None


def read_json(path: epath.Path) -> tuple[Any, str | None]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None, "the file is missing"
    except OSError as error:
        return None, f"cannot be read ({type(error).__name__}: {error})"
    except UnicodeDecodeError as error:
        return None, f"not UTF-8 text ({error})"
    try:
        return strict_json(text), None
    except ValueError as error:  # not JSON, nested too deeply, a duplicate key
        return None, f"not valid JSON ({error}); {len(text)} characters"


_TS_FILE = re.compile(r'local file "([^"]+)"')
_TS_KEY = re.compile(r'Error reading "([^"]+)"')
_STATUS = re.compile(r"(DATA_LOSS|OUT_OF_RANGE|NOT_FOUND|INVALID_ARGUMENT|FAILED_PRECONDITION): ")


def looks_damaged(error: BaseException) -> bool:
    """True for a read failure that says the files are bad (tensorstore's status codes,
    an ``OSError``), not for a caller's mistake that Orbax reports while reading."""
    text = f"{error} {error.__cause__ or ''}"
    return isinstance(error, OSError) or bool(_STATUS.search(text))


def corrupt_from(step: int, step_dir: str, error: BaseException) -> CheckpointCorruptError:
    """A read failure of Orbax / tensorstore as a :class:`CheckpointCorruptError`
    naming the file (or item directory) and the array key tensorstore reported."""
    text = " ".join(f"{error} {error.__cause__ or ''}".split())
    where, key, status = _TS_FILE.search(text), _TS_KEY.search(text), _STATUS.search(text)
    detail = (text[status.start() :] if status else text).split(" [source locations")[0][:300]
    array = f" (array {key.group(1)!r})" if key else ""
    problem = f"an array file is truncated or unreadable{array}: {detail}"
    return CheckpointCorruptError(step, where.group(1) if where else step_dir, problem)


def _held_items(step_dir: epath.Path) -> set[str]:
    """The Orbax item names a step directory holds (its subdirectories)."""
    return {p.name for p in step_dir.iterdir() if p.is_dir()} if step_dir.is_dir() else set()


def load_metadata(directory: pathlib.Path, step: int) -> CheckpointMetadata:
    """The validated metadata record of a step (read as a file: no Orbax call, so no barrier)."""
    step_dir = epath.Path(str(directory / str(step)))
    held = _held_items(step_dir)
    if METADATA_ITEM not in held:
        raise UnsupportedCheckpointError(
            f"no nnx_save metadata record (Orbax items: {', '.join(sorted(held)) or 'none'})",
            step=step,
            directory=directory,
        )
    data = _read_record(directory, step, METADATA_ITEM)
    try:
        record = CheckpointMetadata.from_dict(data)
    except UnsupportedCheckpointError as error:
        raise UnsupportedCheckpointError(error.found, step=step, directory=directory) from None
    if record.step != step or not set(record.items) <= held:
        raise UnsupportedCheckpointError(
            f"a record for step {record.step} naming items {list(record.items)} "
            f"(Orbax items: {', '.join(sorted(held))})",
            step=step,
            directory=directory,
        )
    return record


def _read_record(directory: pathlib.Path, step: int, item: str) -> Any:
    """A JSON record of the step, read as a file (no Orbax call, so no barrier)."""
    path = epath.Path(str(directory / str(step))) / item / _RECORD_FILE
    data, problem = read_json(path)
    if problem is not None:
        raise CheckpointCorruptError(step, path, problem)
    return data


def step_record(
    directory: pathlib.Path, step: int, names: Sequence[str]
) -> tuple[dict[str, dict[Path, str]] | None, dict[str, Recorded] | None]:
    """The dtypes and the leaves the step's dtype record gives for ``names``; ``(None,
    None)`` for a step without one, ``leaves`` None for a record written without leaves."""
    if DTYPES_ITEM not in _held_items(epath.Path(str(directory / str(step)))):
        return None, None
    data = _read_record(directory, step, DTYPES_ITEM)
    try:
        dtypes, leaves = parse_dtype_record(data), parse_leaf_record(data)
        absent = sorted(set(names) - set(dtypes) | (set(names) - set(leaves) if leaves is not None else set()))
        if absent:
            raise UnsupportedCheckpointError(f"a dtype record without items {absent}")
    except UnsupportedCheckpointError as error:
        raise UnsupportedCheckpointError(error.found, step=step, directory=directory) from None
    return {n: dtypes[n] for n in names}, None if leaves is None else {n: leaves[n] for n in names}


def orbax_dtypes(stored: Mapping[str, Any]) -> dict[str, dict[Path, str]]:
    """The dtypes of Orbax's array metadata (for checkpoints without a dtype record)."""
    return {
        name: {path: spec.dtype for path, spec in _orbax.stored_specs(tree).items() if spec is not None}
        for name, tree in stored.items()
    }


@contextlib.contextmanager
def typed_failures(convert: Callable[[Exception], NnxSaveError | None]) -> Iterator[None]:
    """An Orbax failure as the error ``convert`` makes of it (``None``: raised as it is)."""
    try:
        yield
    except NnxSaveError:
        raise
    except Exception as error:
        typed = convert(error)
        if typed is None:
            raise
        raise typed from error
