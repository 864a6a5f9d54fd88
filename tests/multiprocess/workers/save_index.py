"""Save the "mixed" tree from every process as an HF multi-file checkpoint, twice
(the second save over the first), and load it back on another mesh.

args: {"dir": the checkpoint directory, "mesh": [a, b], "size": max_shard_size}
"""

import os

import mp_boot

ctx = mp_boot.init()

import jax  # noqa: E402
import mp_common as c  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import nnx_save  # noqa: E402

result = {}
directory, size = ctx.args["dir"], ctx.args["size"]
tree = c.nest({**c.make_tree("mixed", c.mesh(ctx.args["mesh"])), **c.host_values()})
for save in ("first", "second"):
    nnx_save.save_file(tree, directory, max_shard_size=size, metadata={"save": save})
    multihost_utils.sync_global_devices(f"save_index: {save} saved")  # the primary has removed what it replaced
    result[save] = sorted(os.listdir(directory))
    multihost_utils.sync_global_devices(f"save_index: {save} listed")
abstract = c.nest({**c.abstract_tree("mixed", c.mesh([jax.device_count()])), **c.host_values()})
result["checked_shards"] = c.check_tree("mixed", c.flat(nnx_save.load_file(directory, abstract)))
ctx.write(result)
