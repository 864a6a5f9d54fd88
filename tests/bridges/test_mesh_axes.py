"""A mesh whose axis names differ from the model's partitioning: a typed error naming
each variable, its axes and the mesh's, whose advice, followed, loads."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from flax import nnx

import nnx_save
from nnx_save.errors import ShardingError

init = nnx.initializers.lecun_normal()


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.up = nnx.Linear(4, 8, kernel_init=nnx.with_partitioning(init, (None, "model")), rngs=rngs)
        self.down = nnx.Linear(8, 4, kernel_init=nnx.with_partitioning(init, ("model", "fsdp")), rngs=rngs)
        self.norm = nnx.LayerNorm(4, rngs=rngs)


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "m.safetensors"
    with jax.set_mesh(jax.make_mesh((2, 4), ("fsdp", "model"))):
        source = Model(nnx.Rngs(0))
        nnx_save.save_model(source, path)
    return path, source


def test_a_mesh_without_the_models_axes_is_a_sharding_error_naming_them(saved):
    path, source = saved
    mesh = jax.make_mesh((2, 4), ("data", "tensor"))
    message = (
        "the model's partitioning names mesh axes ['model', 'fsdp'] that the mesh lacks; the mesh has axes "
        "{'data': 2, 'tensor': 4}:\n"
        "  down/kernel: partitioned over ('model', 'fsdp')\n"
        "  up/kernel: partitioned over (None, 'model')\n"
        "build the mesh with the model's axis names (jax.make_mesh(shape, ('data', 'tensor', 'model', 'fsdp')), "
        "sizes 1 where an axis is not split) or partition the model over the mesh's axes"
    )
    with pytest.raises(ShardingError, match=re.escape(message)):
        nnx_save.load_model(lambda: Model(nnx.Rngs(1)), path, mesh=mesh)
    advised = jax.make_mesh((2, 4, 1, 1), ("data", "tensor", "model", "fsdp"))  # the advice, followed
    model, report = nnx_save.load_model(lambda: Model(nnx.Rngs(1)), path, mesh=advised, strict=True)
    assert report.clean
    np.testing.assert_array_equal(model.down.kernel[...], source.down.kernel[...])
    np.testing.assert_array_equal(model.up.kernel[...], source.up.kernel[...])
