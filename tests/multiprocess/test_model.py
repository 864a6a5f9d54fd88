"""save_model / load_model of a sharded NNX model across 2 processes."""

from __future__ import annotations

import jax
import mp_common as c
import pytest

import nnx_save

pytestmark = pytest.mark.multiprocess


def test_sharded_model_round_trip_on_two_processes(run_workers, tmp_path):
    path = tmp_path / "lm.safetensors"
    workers = run_workers("save_model.py", 2, 4, {"path": str(path), "pod": str(tmp_path / "pod")})
    for w in workers:
        r = w.result
        assert r["clean"] and r["tied"] and r["dtype"] == "bfloat16"
        assert r["split"] == [
            "blocks/0/down/kernel",
            "blocks/0/up/bias",
            "blocks/0/up/kernel",
            "blocks/1/down/kernel",
            "blocks/1/up/bias",
            "blocks/1/up/kernel",
            "embed/embedding",
        ]
        assert r["checked"] >= 7 * 4
        # the pod layout on the same process layout: each process reads its own shard file only
        assert r["pod_checked"] == r["checked"] and r["pod_tied"]
        assert len(r["pod_files"]) == 1 and r["pod_files"][0].startswith(f"shard_{w.process_id:05d}-of-00002.")
    single = tmp_path / "single.safetensors"
    assert jax.device_count() == 8
    nnx_save.save_model(c.build_lm(0, c.model_mesh()), single)
    assert path.read_bytes() == single.read_bytes()  # the same bytes as one process with 8 devices
    keys = set(nnx_save.read_header(path))
    assert "embed/embedding" in keys and "head/embedding" not in keys and "blocks/1/up/kernel" in keys
