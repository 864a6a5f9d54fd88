"""Reading a whole Orbax checkpoint as host arrays, for conversion to safetensors."""

from __future__ import annotations

import os
import warnings

import jax
import numpy as np
import orbax.checkpoint as ocp

__all__ = ["orbax_arrays"]


def orbax_arrays(path: str | os.PathLike) -> list[tuple[str, np.ndarray]]:
    """Every array of an Orbax PyTree checkpoint directory, as host numpy arrays keyed
    with their tree paths joined with ``/`` (what ``nnx_save.convert`` writes; two
    paths can join to one key, which the caller refuses)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # orbax warns that no target sharding was given: host arrays are wanted
        tree = ocp.PyTreeCheckpointer().restore(path)
    out = []
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        key = "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in keypath)
        out.append((key, np.asarray(leaf)))
    return out
