"""The checkpoint store's errors, for its modules: defined, and documented, in the public
:mod:`nnx_save.errors`; ``nnx_save.checkpoint`` re-exports them under the same names.
"""

from __future__ import annotations

from ..errors import CheckpointCorruptError as CheckpointCorruptError
from ..errors import CheckpointDamageWarning as CheckpointDamageWarning
from ..errors import CheckpointDirectoryError as CheckpointDirectoryError
from ..errors import CheckpointDtypeMismatchError as CheckpointDtypeMismatchError
from ..errors import CheckpointError as CheckpointError
from ..errors import CheckpointItemError as CheckpointItemError
from ..errors import CheckpointNotFoundError as CheckpointNotFoundError
from ..errors import CheckpointNotWrittenError as CheckpointNotWrittenError
from ..errors import CheckpointRetentionError as CheckpointRetentionError
from ..errors import CheckpointSyncError as CheckpointSyncError
from ..errors import CheckpointTemplateError as CheckpointTemplateError
from ..errors import CheckpointWriteError as CheckpointWriteError
from ..errors import DtypeMismatch as DtypeMismatch
from ..errors import UnsupportedCheckpointError as UnsupportedCheckpointError
from ..errors import WriteRefusal as WriteRefusal

__all__ = [
    "CheckpointCorruptError",
    "CheckpointDamageWarning",
    "CheckpointDirectoryError",
    "CheckpointDtypeMismatchError",
    "CheckpointError",
    "CheckpointItemError",
    "CheckpointNotFoundError",
    "CheckpointNotWrittenError",
    "CheckpointRetentionError",
    "CheckpointSyncError",
    "CheckpointTemplateError",
    "CheckpointWriteError",
    "DtypeMismatch",
    "UnsupportedCheckpointError",
    "WriteRefusal",
]
