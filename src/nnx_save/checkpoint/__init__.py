"""Training checkpoints: a step-addressed store over Orbax (the only Orbax user in nnx_save).

See ``docs/checkpoints.md``. The common case::

    store = OrbaxCheckpointStore(resolve_checkpoint_dir(None, run_dir), max_to_keep=3)
    store.save(step, {"model": nnx.state(model), "optimizer": nnx.state(optimizer), "rng": key})
    ckpt = store.restore(store.latest_step(), templates={"model": nnx.state(model), ...})
    restore_into(model, ckpt.items["model"])
"""

from ..errors import CheckpointCorruptError as CheckpointCorruptError
from ..errors import CheckpointDamageWarning as CheckpointDamageWarning
from ..errors import CheckpointDtypeMismatchError as CheckpointDtypeMismatchError
from ..errors import CheckpointError as CheckpointError
from ..errors import CheckpointNotFoundError as CheckpointNotFoundError
from ..errors import CheckpointNotWrittenError as CheckpointNotWrittenError
from ..errors import CheckpointUsageError as CheckpointUsageError
from ..errors import CheckpointWriteError as CheckpointWriteError
from ..errors import DtypeMismatch as DtypeMismatch
from ..errors import UnsupportedCheckpointError as UnsupportedCheckpointError
from ..errors import WriteRefusal as WriteRefusal
from ._directory import resolve_checkpoint_dir as resolve_checkpoint_dir
from ._format import FORMAT_NAME as FORMAT_NAME
from ._format import FORMAT_VERSION as FORMAT_VERSION
from ._format import ITEM_NAMES as ITEM_NAMES
from ._metadata import CheckpointMetadata as CheckpointMetadata
from ._metadata import Producer as Producer
from ._nnx import restore_into as restore_into
from ._retention import Retention as Retention
from ._store import OrbaxCheckpointStore as OrbaxCheckpointStore
from ._types import Checkpoint as Checkpoint
from ._types import CheckpointStore as CheckpointStore
