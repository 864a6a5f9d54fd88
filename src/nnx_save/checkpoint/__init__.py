"""Training checkpoints: a step-addressed store over Orbax (the only Orbax user in nnx_save).

See ``docs/checkpoints.md``. The common case::

    store = OrbaxCheckpointStore(resolve_checkpoint_dir(None, run_dir), max_to_keep=3)
    store.save(step, {"model": nnx.state(model), "optimizer": nnx.state(optimizer), "rng": key})
    ckpt = store.restore(store.latest_step(), templates={"model": nnx.state(model), ...})
    restore_into(model, ckpt.items["model"])


The errors and the format constants import with the package; the store, its records and
``restore_into`` on first use (PEP 562), so catching ``nnx_save.checkpoint.CheckpointError``
imports neither jax nor Orbax.
"""

import typing as _typing

from .._lazy_import import lazy_getattr as _lazy_getattr
from ._errors import CheckpointCorruptError as CheckpointCorruptError
from ._errors import CheckpointDamageWarning as CheckpointDamageWarning
from ._errors import CheckpointDtypeMismatchError as CheckpointDtypeMismatchError
from ._errors import CheckpointError as CheckpointError
from ._errors import CheckpointNotFoundError as CheckpointNotFoundError
from ._errors import CheckpointNotWrittenError as CheckpointNotWrittenError
from ._errors import CheckpointUsageError as CheckpointUsageError
from ._errors import CheckpointWriteError as CheckpointWriteError
from ._errors import DtypeMismatch as DtypeMismatch
from ._errors import UnsupportedCheckpointError as UnsupportedCheckpointError
from ._errors import WriteRefusal as WriteRefusal
from ._format import FORMAT_NAME as FORMAT_NAME
from ._format import FORMAT_VERSION as FORMAT_VERSION
from ._format import ITEM_NAMES as ITEM_NAMES

if _typing.TYPE_CHECKING:
    from ._metadata import CheckpointMetadata as CheckpointMetadata
    from ._metadata import Producer as Producer
    from ._nnx import restore_into as restore_into
    from ._retention import Retention as Retention
    from ._store import OrbaxCheckpointStore as OrbaxCheckpointStore
    from ._store_location import resolve_checkpoint_dir as resolve_checkpoint_dir
    from ._types import Checkpoint as Checkpoint
    from ._types import CheckpointStore as CheckpointStore

_LAZY = {
    "resolve_checkpoint_dir": "._store_location",
    "CheckpointMetadata": "._metadata",
    "Producer": "._metadata",
    "restore_into": "._nnx",
    "Retention": "._retention",
    "OrbaxCheckpointStore": "._store",
    "Checkpoint": "._types",
    "CheckpointStore": "._types",
}

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "ITEM_NAMES",
    "Checkpoint",
    "CheckpointCorruptError",
    "CheckpointDamageWarning",
    "CheckpointDtypeMismatchError",
    "CheckpointError",
    "CheckpointMetadata",
    "CheckpointNotFoundError",
    "CheckpointNotWrittenError",
    "CheckpointStore",
    "CheckpointUsageError",
    "CheckpointWriteError",
    "DtypeMismatch",
    "OrbaxCheckpointStore",
    "Producer",
    "Retention",
    "UnsupportedCheckpointError",
    "WriteRefusal",
    "resolve_checkpoint_dir",
    "restore_into",
]


__getattr__ = _lazy_getattr(__name__, _LAZY)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
