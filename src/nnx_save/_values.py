"""The host-value type every writer hands around (bottom of the import graph: numpy only).

A writer :class:`~nnx_save._write.Entry` carries a callable giving its host value.
:class:`HostValue` is that callable when the value came from an array: it keeps the
array, so a multi-process writer can write only this process's shards of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ._errors import SaveError

__all__ = ["HostValue", "spans_processes"]


def spans_processes(value: Any) -> bool:
    """A jax.Array with shards on devices of other processes."""
    return not isinstance(value, np.ndarray) and not getattr(value, "is_fully_addressable", True)


@dataclass(frozen=True)
class HostValue:
    """An entry's value callable that keeps the array it came from.

    The single-process writer calls it to get the whole host value; the collective
    writer reads ``array`` to write only this process's shards.

    Examples:
        >>> HostValue(np.arange(3))()
        array([0, 1, 2])
    """

    array: Any

    def __call__(self) -> np.ndarray:
        if isinstance(self.array, np.ndarray):
            return self.array
        if spans_processes(self.array) and not self.array.is_fully_replicated:
            raise SaveError(
                f"an array of shape {tuple(self.array.shape)} with sharding {self.array.sharding} spans "
                f"{len({d.process_index for d in self.array.sharding.device_set})} processes; this process holds "
                "only its shards, and writing them alone would save a partial tensor. Save it with save_file / "
                "save_model called on every process (one file), or gather it first"
            )
        return np.asarray(self.array)
