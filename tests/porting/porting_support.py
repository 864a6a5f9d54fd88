"""Helpers for the porting tests: HF checkpoints built offline, NNX models filled
from a mapping without ever running their random initialisation.

``fill`` stands in for ``nnx_save.load_model(builder, path, rules=RULES)`` until the
loader's rules bridge lands: it builds the model abstractly (``nnx.eval_shape``), so
a param the mapping does not fill has no value at all and the test fails.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from flax import nnx

SHARD_BYTES = 20_000  # small enough that every tiny model spans several files


def path_key(path: tuple) -> str:
    """An NNX state path joined with ``/`` (list indices in decimal)."""
    return "/".join(str(p) for p in path)


def abstract(builder: Callable[[], nnx.Module]) -> nnx.Module:
    """The model's structure, shapes and dtypes, with no values computed."""
    return nnx.eval_shape(builder)


def model_shapes(model: nnx.Module) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """``{path: (shape, dtype)}`` of every variable (abstract or concrete)."""
    return {path_key(p): (tuple(v.shape), np.dtype(v.dtype)) for p, v in nnx.to_flat_state(nnx.state(model))}


def fill(model: nnx.Module, values: Mapping[str, np.ndarray]) -> nnx.Module:
    """A concrete model from ``model``'s structure and exactly ``values`` (all or error)."""
    graphdef, state = nnx.split(model)
    flat = list(nnx.to_flat_state(state))
    keys = {path_key(p) for p, _ in flat}
    assert keys == set(values), f"missing {sorted(keys - set(values))}, extra {sorted(set(values) - keys)}"
    updates = []
    for path, var in flat:
        value = values[path_key(path)]
        assert value.shape == tuple(var.shape) and value.dtype == var.dtype, (path, value.shape, var.shape)
        updates.append((path, var.replace(jnp.asarray(value))))
    return nnx.merge(graphdef, nnx.from_flat_state(updates))


def model_arrays(model: nnx.Module) -> dict[str, np.ndarray]:
    """``{path: np.ndarray}`` of every variable of a concrete model."""
    return {path_key(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}


def save_hf(model, root: Path) -> dict[str, Path]:
    """``save_pretrained`` twice: one file, and several files with an index."""
    single, sharded = root / "single", root / "sharded"
    model.save_pretrained(single, safe_serialization=True)
    model.save_pretrained(sharded, safe_serialization=True, max_shard_size=SHARD_BYTES)
    assert (single / "model.safetensors").is_file()
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    return {"single": single, "sharded": sharded}


def read_checkpoint(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint file or HF directory, by file key.

    Read with the official ``safetensors`` reader, so that these tests do not depend
    on nnx_save's own reader (its tests cover it).
    """
    if path.is_file():
        return safetensors.numpy.load_file(path)
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return safetensors.numpy.load_file(path / "model.safetensors")
    weight_map = json.loads(index.read_text())["weight_map"]
    out: dict[str, np.ndarray] = {}
    for name in sorted(set(weight_map.values())):
        out.update(safetensors.numpy.load_file(path / name))
    assert sorted(out) == sorted(weight_map)
    return out


def max_abs_diff(ours: np.ndarray, theirs: np.ndarray) -> tuple[float, float]:
    """``(max |ours - theirs|, max |theirs|)``."""
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    return float(np.max(np.abs(ours - theirs))), float(np.max(np.abs(theirs)))
