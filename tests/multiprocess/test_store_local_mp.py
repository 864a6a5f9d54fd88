"""The training store on 2 real JAX processes with host-local values: what
``save_model`` accepts, the store accepts too (written once, restored everywhere)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.multiprocess


def test_rng_keys_dropout_rngs_and_a_model_built_without_a_mesh(run_workers, tmp_path):
    """A bare typed key, an ``nnx.Dropout``'s rng stream and a model whose arrays sit
    on each process's first device: saved on two processes, restored into a poisoned
    model on its own devices and as stored, the same on every process, with nothing
    printed on the way out."""
    workers = run_workers("store_local.py", 2, 4, {"dir": str(tmp_path / "s")}, timeout=180)
    for w in workers:
        r = w.result
        assert r["restored"] == r["saved"] == workers[0].result["saved"]
        assert r["saved"]["['drop']['rngs']['count'].value"] == 1  # the stream was advanced before the save
        assert r["key"] == r["key_saved"] == [0, 42] and r["key_impl"] == "threefry2x32"
        assert r["later_key"] == [0, 43] and r["steps"] == [1, 2]
        assert r["stored_kernel"] == r["saved"]["['linear']['kernel'].value"]
        assert r["on_template_device"]
        for noise in ("Event loop is closed", "Traceback", "Exception ignored", "Error"):
            assert noise not in w.output, w.output[-3000:]
    assert sorted(p.name for p in (tmp_path / "s").iterdir() if not p.name.startswith("_")) == ["1", "2"]
