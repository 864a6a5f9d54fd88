"""The package version and the checkpoint store's format version, in a module that imports
nothing (so any module can say them, errors.py included)."""

__version__ = "0.1.0"

# The record format of nnx_save.checkpoint steps (re-exported there as FORMAT_NAME / FORMAT_VERSION).
CHECKPOINT_FORMAT_NAME = "nnx_save.checkpoint"
CHECKPOINT_FORMAT_VERSION = 1
