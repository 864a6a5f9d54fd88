"""A pod reads each checkpoint byte once: a torch-layout checkpoint ported through
``torch_linear`` rules reads only each process's shards (a transposed read of a
shard is the shard of the transposed tensor), and replicated tensors loaded with
``share_reads=True`` are read once across the processes and shared over gloo.

One launch of 2 processes x 4 devices runs every job (starting JAX dominates), one of
4 x 2 a tensor-parallel port and shared replicated reads."""

from __future__ import annotations

import numpy as np
import pytest
from mp_harness import launch

pytestmark = pytest.mark.multiprocess

# nn.Linear(in, out).weight is [out, in]; rows of 2048+ floats, so that a process's half of a row (what an FSDP
# kernel split takes) is at least a page: runs closer than a page are always read through (the planner's rule)
LAYERS = {"fc0": (256, 2048), "fc1": (512, 4096), "fc2": (64, 2048)}
JOBS = [
    {"name": "tensor_parallel", "mesh": [8], "spec": [None, "x"], "bias_spec": ["x"]},
    # kernel rows are weight columns: strided runs, read exactly under ratio 1.0 (the automatic ratio reads
    # through the gaps, as it does for the same pattern in a native file)
    {"name": "fsdp", "mesh": [8], "spec": ["x", None], "ratio": 1.0},
    {"name": "mixed", "mesh": [2, 4], "spec": ["a", "b"], "bias_spec": ["b"]},
    {"name": "replicated", "mesh": [8], "spec": []},
    {"name": "replicated_shared", "mesh": [8], "spec": [], "share": True},
    {"name": "inner_split_shared", "mesh": [2, 4], "spec": ["b", None], "share": True},
    {"name": "tensor_parallel_shared", "mesh": [8], "spec": [None, "x"], "bias_spec": ["x"], "share": True},
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The torch checkpoint (written by torch), its weights as numpy, and a plain file."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("ported")
    torch.manual_seed(0)
    state = {}
    for name, (out, inp) in LAYERS.items():
        layer = torch.nn.Linear(inp, out)
        state |= {f"{name}.{k}": v.detach().contiguous() for k, v in layer.state_dict().items()}
    save_file(state, str(d / "model.safetensors"))
    np.savez(d / "torch.npz", **{k: v.numpy() for k, v in state.items()})
    plain = d / "plain.safetensors"
    save_file({"w": torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48), "odd": torch.ones(3)}, str(plain))
    args = {"path": str(d / "model.safetensors"), "torch": str(d / "torch.npz"), "plain": str(plain)}
    return d, args, sum(v.numel() * 4 for v in state.values())


@pytest.fixture(scope="module")
def ported(checkpoint):
    """2 processes x 4 devices: every job, and the failure."""
    d, args, file_bytes = checkpoint
    env = {"NNX_SAVE_COLLECTIVE_TIMEOUT_S": "20"}
    return launch("load_ported.py", 2, 4, d / "two", {**args, "jobs": JOBS, "fail": True}, env=env), file_bytes


@pytest.fixture(scope="module")
def ported_four(checkpoint):
    """4 processes x 2 devices: a tensor-parallel port and shared replicated reads."""
    d, args, file_bytes = checkpoint
    jobs = [j for j in JOBS if j["name"] in ("tensor_parallel", "replicated_shared")]
    return launch("load_ported.py", 4, 2, d / "four", {**args, "jobs": jobs}), file_bytes


def test_four_processes_read_a_quarter_each_and_the_checkpoint_once(ported_four):
    workers, file_bytes = ported_four
    for job in _jobs(workers, "tensor_parallel"):
        assert job["checked"] > 0 and job["needed"] <= 0.26 * file_bytes
        assert job["bytes_read"] <= 1.05 * job["needed"], job
    shared = _jobs(workers, "replicated_shared")
    assert sum(j["bytes_read"] for j in shared) <= 1.05 * file_bytes, shared
    for job in shared:
        assert job["checked"] > 0 and job["bytes_needed"] + job["bytes_received"] == file_bytes, job


def _jobs(workers, name):
    return [next(j for j in w.result["jobs"] if j["name"] == name) for w in workers]


@pytest.mark.parametrize("name", ["tensor_parallel", "fsdp", "mixed"])
def test_a_sharded_port_reads_what_each_process_needs(ported, name):
    workers, file_bytes = ported
    for job in _jobs(workers, name):
        assert job["checked"] > 0 and job["read_whole"] == []
        assert job["needed"] <= 0.55 * file_bytes  # each process needs about half
        assert job["bytes_read"] <= 1.05 * job["needed"], job
        if name == "fsdp":
            assert job["bytes_read"] == job["needed"]
        assert job["rchar"] <= 1.05 * job["needed"] + 64 * 1024, job  # the kernel's count agrees (plus headers)


def test_replicated_tensors_are_read_by_every_process_without_share_reads(ported):
    workers, file_bytes = ported
    for job in _jobs(workers, "replicated"):
        assert job["bytes_read"] == file_bytes and job["bytes_received"] == 0


@pytest.mark.parametrize("name", ["replicated_shared", "inner_split_shared"])
def test_shared_reads_read_each_byte_once_per_pod(ported, name):
    workers, file_bytes = ported
    jobs = _jobs(workers, name)
    assert sum(j["bytes_read"] for j in jobs) <= 1.05 * file_bytes, jobs
    assert sum(j["rchar"] for j in jobs) <= 1.05 * file_bytes + 2 * 64 * 1024, jobs
    for job in jobs:
        assert job["checked"] > 0 and job["needed"] == file_bytes  # each process holds everything
        assert job["bytes_needed"] + job["bytes_received"] == file_bytes, job  # the rest came from its peer
        assert job["bytes_read"] <= 1.05 * job["bytes_needed"], job


@pytest.mark.parametrize("name", ["replicated", "replicated_shared", "inner_split_shared"])
def test_each_box_several_local_devices_hold_is_one_host_buffer(ported, name):
    """On the CPU backend a reshard of the shared reads would leave one buffer per local
    device (4x the replicated bytes here); the arrays adopt one, as a plain load's do."""
    workers, _ = ported
    for job in _jobs(workers, name):
        buffers, boxes = job["buffers"]
        assert buffers == boxes, job


def test_shared_reads_change_nothing_where_no_byte_is_needed_twice(ported):
    workers, _ = ported
    for job, alone in zip(_jobs(workers, "tensor_parallel_shared"), _jobs(workers, "tensor_parallel"), strict=True):
        assert job["bytes_received"] == 0 and job["bytes_read"] == alone["bytes_read"] and job["checked"]


def test_a_failure_on_one_process_raises_on_every_process(ported):
    workers, _ = ported
    own, peer = workers[1].result["fail"], workers[0].result["fail"]
    assert own["error"] == "ShardingError" and "odd" in own["message"]
    assert peer["error"] == "SourceError", peer
    assert "process 1: ShardingError" in peer["message"] and "nothing was loaded" in peer["message"]
