"""The constants that define the on-disk layout of an nnx_save checkpoint step.

A step is an Orbax composite checkpoint: one Orbax item per stored item (a pytree under
the single node :data:`ROOT`, so a bare rng key is a valid item) plus the metadata and
dtype JSON records. Changing any name or record layout needs a new :data:`FORMAT_VERSION`;
a field added that older readers ignore and newer ones do without (the dtype record's
``leaves``) does not.
"""

from __future__ import annotations

from .._version import CHECKPOINT_FORMAT_NAME as FORMAT_NAME
from .._version import CHECKPOINT_FORMAT_VERSION as FORMAT_VERSION

__all__ = ["DTYPES_FORMAT", "DTYPES_ITEM", "FORMAT_NAME", "FORMAT_VERSION", "ITEM_NAMES", "METADATA_ITEM", "ROOT"]

DTYPES_FORMAT = "nnx_save.checkpoint.dtypes"

# The items a step may hold, in the order they are recorded.
ITEM_NAMES = ("model", "optimizer", "rng", "data_iterator", "extensions")

METADATA_ITEM = "nnx_save_metadata"
DTYPES_ITEM = "nnx_save_dtypes"

# Every stored pytree sits under this one key, so a bare array is a valid item.
ROOT = "item"
