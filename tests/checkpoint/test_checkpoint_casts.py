"""One vocabulary for dtype casts across load and store: the load warning says a cast
is lossless and names ``allow_casts``; the store's restore takes the same option
(``"lossless"`` or path patterns), its refusals name it, and ``cast_dtypes=True``
(documented) still accepts every cast."""

from __future__ import annotations

import re
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nnx_save
from nnx_save.checkpoint import CheckpointDtypeMismatchError, OrbaxCheckpointStore
from nnx_save.errors import OptionError


def test_a_lossless_load_warning_says_so_and_names_the_option(tmp_path):
    path = tmp_path / "bf16.safetensors"
    nnx_save.save_file({"kernel": np.ones((2, 3), "bfloat16"), "bias": np.zeros(3, "bfloat16")}, path)
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    with pytest.warns(nnx_save.LoadWarning) as record:
        nnx_save.load_model(model, path)
    text = str(record[0].message)
    assert 'To accept the dtype casts without a warning: allow_casts="lossless" (every cast here is lossless' in text
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, report = nnx_save.load_model(model, path, allow_casts="lossless")  # the option named: no warning
    assert report.clean and len(report.allowed_casts) == 2


@pytest.fixture
def store(tmp_path):
    with OrbaxCheckpointStore(tmp_path) as s:
        s.save(1, {"model": {"w": jnp.arange(4, dtype=jnp.bfloat16), "v": jnp.arange(3.0)}})
        yield s


def test_the_store_takes_allow_casts_lossless(store):
    template = {"model": {"w": jnp.zeros(4, jnp.float32), "v": jnp.zeros(3, jnp.float32)}}
    with pytest.raises(CheckpointDtypeMismatchError, match=re.escape('Pass allow_casts="lossless" to accept them')):
        store.restore(1, templates=template)
    ckpt = store.restore(1, templates=template, allow_casts="lossless")
    assert ckpt.items["model"]["w"].dtype == jnp.float32
    np.testing.assert_array_equal(ckpt.items["model"]["w"], np.arange(4.0))
    assert [str(c) for c in ckpt.report.dtype_casts] == ["model/w: bfloat16 in the file -> float32 in the model"]


def test_a_lossy_cast_needs_its_path(store):
    template = {"model": {"w": jnp.zeros(4, jnp.bfloat16), "v": jnp.zeros(3, jnp.float16)}}
    lossy = "Pass allow_casts=['model/v'] to accept them (LOSSY casts"
    with pytest.raises(CheckpointDtypeMismatchError, match=re.escape(lossy)):
        store.restore(1, templates=template, allow_casts="lossless")  # lossless does not cover it
    ckpt = store.restore(1, templates=template, allow_casts=["model/v"])
    assert ckpt.items["model"]["v"].dtype == jnp.float16
    assert store.restore(1, templates=template, cast_dtypes=True).items["model"]["v"].dtype == jnp.float16
    with pytest.raises(OptionError, match=re.escape('allow_casts takes "lossless" or a list of item/leaf path')):
        store.restore(1, templates=template, allow_casts="all")
