"""The JSON records of a step (metadata, dtypes), read as files and validated."""

from __future__ import annotations

import pathlib
from collections.abc import Mapping
from typing import Any

from etils import epath

from ..errors import CheckpointCorruptError, UnsupportedCheckpointError
from . import _orbax
from ._format import DTYPES_ITEM, METADATA_ITEM
from ._health import held_items, read_json
from ._metadata import CheckpointMetadata
from ._tree import Path, parse_dtype_record

__all__ = ["load_metadata", "read_record", "saved_dtypes"]


def load_metadata(directory: pathlib.Path, step: int) -> CheckpointMetadata:
    """The validated metadata record of a step (read as a file: no Orbax call, so no barrier)."""
    step_dir = epath.Path(str(directory / str(step)))
    held = held_items(step_dir)
    if METADATA_ITEM not in held:
        raise UnsupportedCheckpointError(
            f"no nnx_save metadata record (Orbax items: {', '.join(sorted(held)) or 'none'})",
            step=step,
            directory=directory,
        )
    data = read_record(directory, step, METADATA_ITEM)
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


def read_record(directory: pathlib.Path, step: int, item: str) -> Any:
    """A JSON record of the step, read as a file (no Orbax call, so no barrier)."""
    path = epath.Path(str(directory / str(step))) / item / "metadata"
    data, problem = read_json(path)
    if problem is not None:
        raise CheckpointCorruptError(step, path, problem)
    return data


def saved_dtypes(directory: pathlib.Path, step: int, stored: Mapping[str, Any]) -> dict[str, dict[Path, str]]:
    """The dtype record, or (for checkpoints without one) Orbax's array metadata."""
    if DTYPES_ITEM in held_items(epath.Path(str(directory / str(step)))):
        try:
            record = parse_dtype_record(read_record(directory, step, DTYPES_ITEM))
        except UnsupportedCheckpointError as error:
            raise UnsupportedCheckpointError(error.found, step=step, directory=directory) from None
        absent = sorted(set(stored) - set(record))
        if absent:
            raise UnsupportedCheckpointError(f"a dtype record without items {absent}", step=step, directory=directory)
        return {name: record[name] for name in stored}
    return {
        name: {path: spec.dtype for path, spec in _orbax.stored_specs(tree).items() if spec is not None}
        for name, tree in stored.items()
    }
