"""nnx_save: safe, exact and fast saving and loading of JAX / Flax NNX state."""

from ._errors import NnxSaveError as NnxSaveError
from ._errors import HeaderError as HeaderError

__version__ = "0.1.0"
