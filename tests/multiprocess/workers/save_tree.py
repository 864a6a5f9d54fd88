"""Save the "mixed" tree from every process into one file, load it back on another
mesh, and check the refusals: headers that differ between processes, the
single-process writer given a cross-process array, a sharding with no local device.

Then run the load jobs (see ``mp_common.run_load_jobs``) and load without an
abstract tree (refused in a multi-process run).

args: {"path": file to write, "mesh": [a, b], "dir": a scratch directory, "jobs": [...],
       "pod": a directory for save_pod (optional)}
"""

import os

import mp_boot

ctx = mp_boot.init()

import jax  # noqa: E402
import mp_common as c  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import nnx_save  # noqa: E402
from nnx_save.bridges._leaves import leaf_entry  # noqa: E402
from nnx_save.io import _kv  # noqa: E402
from nnx_save.save._write import write_file  # noqa: E402

result = {}
mesh = c.mesh(ctx.args["mesh"])
tree = c.nest({**c.make_tree("mixed", mesh), **c.host_values()})
nnx_save.save_file(tree, ctx.args["path"], metadata={"made_by": "save_tree"})

# Load it back on a mesh of another shape (every tensor split differently).
abstract = c.nest({**c.abstract_tree("mixed", c.mesh([jax.device_count()])), **c.host_values()})
loaded, report = nnx_save.load_file(ctx.args["path"], abstract, return_report=True)
flat = c.flat(loaded)
result["checked_shards"] = c.check_tree("mixed", flat)
result["host_ok"] = bool(np.array_equal(flat["host_table"], c.host_values()["host_table"]))
result["clean"] = report.clean


def refused(fn):
    try:
        fn()
    except nnx_save.NnxSaveError as e:
        return f"{type(e).__name__}: {e}"
    return None


scratch = ctx.args["dir"]
other = os.path.join(scratch, "differs.safetensors")
result["differs"] = refused(lambda: nnx_save.save_file(tree, other, metadata={"pid": str(ctx.process_id)}))
# List the scratch directory only once every process has finished the refusal, and let
# none start its next step (which makes its own temporary file there) before every
# process has listed: without these barriers a listing could catch a peer's
# ``.local1.st.nnx_save-tmp-...`` from the step below.
multihost_utils.sync_global_devices("save_tree: differs refused")
result["differs_left"] = sorted(os.listdir(scratch))
multihost_utils.sync_global_devices("save_tree: differs listed")
entry = leaf_entry(("embed",), c.flat(tree)["embed"])
result["local_writer"] = refused(lambda: write_file(os.path.join(scratch, f"local{ctx.process_id}.st"), [entry]))
foreign = next(d for d in jax.devices() if d.process_index != ctx.process_id)
result["foreign"] = refused(
    lambda: nnx_save.load_file(
        ctx.args["path"],
        {"embed": jax.ShapeDtypeStruct((64, 32), np.float32, sharding=jax.sharding.SingleDeviceSharding(foreign))},
        allow_unexpected=["*"],
    )
)
result["no_abstract"] = refused(lambda: nnx_save.load_file(ctx.args["path"]))
# A save after refusals still works: the processes are still in step.
nnx_save.save_file({"after": c.flat(tree)["embed"]}, os.path.join(scratch, "after.safetensors"))
# Without jax's private key-value store the steps go through the public process_allgather.
kv_client, _kv.client = _kv.client, lambda where, error: None
fallback = os.path.join(scratch, "fallback.safetensors")
nnx_save.save_file(tree, fallback, metadata={"made_by": "save_tree"})
_kv.client = kv_client
with open(fallback, "rb") as a, open(ctx.args["path"], "rb") as b:
    result["fallback_identical"] = a.read() == b.read()
if ctx.args.get("pod"):  # the pod layout: one shard file per process, and a manifest
    nnx_save.save_pod(tree, ctx.args["pod"], metadata={"made_by": "save_tree"})
    result["pod_files"] = sorted(os.listdir(ctx.args["pod"]))
result["jobs"] = c.run_load_jobs(ctx.args.get("jobs", []))
ctx.write(result)
