"""HuggingFace multi-file checkpoints: ``model-0000i-of-0000n.safetensors`` files
plus ``model.safetensors.index.json`` (``metadata.total_size`` and ``weight_map``).

Every file is first written complete and fsynced under a temporary name; only then
are they renamed into place, the index last. A failure while writing (a full disk,
an error in a value) leaves the previous checkpoint exactly as it was and no
temporary file. A crash during the final renames (no data is written then) can
leave some files new and some old; a reader never sees an index naming a file that
is not complete.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..errors import OptionError
from ..format import _dtypes
from ..save._write import Entry, _write_all, atomic_file, commit_staged, discard_staged, order_entries, write_file
from ._sources import INDEX_NAME

__all__ = ["shard_groups", "write_sharded"]


def _nbytes(e: Entry) -> int:
    n = 1
    for d in e.shape:
        n *= d
    return _dtypes.nbytes_for(_dtypes.DTYPES[e.code], n)


def shard_groups(entries: Sequence[Entry], max_shard_size: int) -> list[list[Entry]]:
    """Pack entries in order into groups of at most ``max_shard_size`` bytes (a
    tensor larger than the limit gets a file of its own, as transformers does)."""
    if max_shard_size <= 0:
        raise OptionError(f"max_shard_size must be positive, got {max_shard_size}", "max_shard_size")
    groups: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        n = _nbytes(e)
        if groups[-1] and size + n > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(e)
        size += n
    return groups


def write_sharded(
    directory: str | os.PathLike,
    entries: Sequence[Entry],
    metadata: Mapping[str, str] | None,
    max_shard_size: int,
    *,
    prefix: str = "model",
) -> Path:
    """Write ``entries`` as a HuggingFace multi-file checkpoint in ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    groups = shard_groups(order_entries(entries), max_shard_size)
    weight_map: dict[str, str] = {}
    staged: list = []
    try:
        for i, group in enumerate(groups, 1):
            name = f"{prefix}.safetensors" if len(groups) == 1 else f"{prefix}-{i:05d}-of-{len(groups):05d}.safetensors"
            write_file(directory / name, group, metadata, staged=staged)
            weight_map.update({e.key: name for e in group})
        index = {
            "metadata": {"total_size": sum(_nbytes(e) for e in entries)},
            "weight_map": dict(sorted(weight_map.items())),
        }
        with atomic_file(directory / f"{prefix}.safetensors.index.json", staged=staged) as fd:
            _write_all(fd, memoryview(json.dumps(index, indent=2).encode() + b"\n"))
    except BaseException:
        discard_staged(staged)
        raise
    commit_staged(staged)  # the index last
    return directory / INDEX_NAME
