"""A job of several processes and the writer lock: every process of the job
is refused alike where another writer holds the directory, and the job's own saves,
process 0 holding the lock for all, are never refused by its peers.

args: {"held": a directory another process is writing, "free": a directory for the
       job's own saves, "mesh": [a, b]}
"""

import os

import mp_boot

ctx = mp_boot.init()

import jax  # noqa: E402
import mp_common as c  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import nnx_save  # noqa: E402

SAVES = {
    "pod": nnx_save.save_pod,
    "index": lambda tree, d: nnx_save.save_file(tree, d, max_shard_size="4KiB"),
}

result = {"refused": {}, "listed": {}}
tree = c.nest({**c.make_tree("mixed", c.mesh(ctx.args["mesh"])), **c.host_values()})
for name, save in SAVES.items():
    try:
        save(tree, ctx.args["held"])
        result["refused"][name] = None
    except nnx_save.NnxSaveError as e:
        result["refused"][name] = {"type": type(e).__name__, "message": str(e), "holder": getattr(e, "holder", None)}
    multihost_utils.sync_global_devices(f"save_locked: {name} refused")
for name, save in SAVES.items():
    directory = os.path.join(ctx.args["free"], name)
    for _ in range(2):  # the second save over the first: the lock is free again after each
        save(tree, directory)
        multihost_utils.sync_global_devices(f"save_locked: {name} saved")  # process 0 has let go
        result["listed"].setdefault(name, []).append(sorted(os.listdir(directory)))
        multihost_utils.sync_global_devices(f"save_locked: {name} listed")
    abstract = c.nest({**c.abstract_tree("mixed", c.mesh([jax.device_count()])), **c.host_values()})
    result.setdefault("checked", {})[name] = c.check_tree("mixed", c.flat(nnx_save.load_file(directory, abstract)))
ctx.write(result)
