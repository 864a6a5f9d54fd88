"""An HF multi-file checkpoint (``max_shard_size``) written by two processes together:
each file is one collective file, the index is committed once by the primary."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

import nnx_save

pytestmark = pytest.mark.multiprocess


@pytest.mark.slow  # two JAX processes
def test_two_processes_write_one_hf_index_and_resave_it(files, run_workers, tmp_path):
    directory = tmp_path / "ck"
    workers = run_workers("save_index.py", 2, 4, {"dir": str(directory), "mesh": [2, 4], "size": "4KiB"})
    first, second = workers[0].result["first"], workers[0].result["second"]
    assert all(w.result["first"] == first and w.result["second"] == second for w in workers)
    assert "model.safetensors.index.json" in first and len(first) >= 3, first
    assert all(re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", n) for n in first if n.endswith(".safetensors"))
    assert set(first).isdisjoint(set(second) - {"model.safetensors.index.json"})  # fresh names, old ones removed
    assert all(w.result["checked_shards"] > 0 for w in workers)
    loaded, single = nnx_save.load_file(directory), nnx_save.load_file(files["single"])
    assert sorted(loaded) == sorted(single)
    for key, value in single.items():
        np.testing.assert_array_equal(loaded[key], value, err_msg=key)
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == sorted(n for n in second if n != "model.safetensors.index.json")
    assert nnx_save.read_header(directory).metadata["save"] == "second"
    assert not [n for n in os.listdir(directory) if "nnx_save-tmp" in n]
