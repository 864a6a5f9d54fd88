"""A multi-process save during which one process is killed (SIGKILL).

The victim kills itself when it starts writing its shards, after the processes
agreed on the header and the primary created the temporary file. The survivors
report the error they got and how long it took.

args: {"path": file to save over, "victim": process id}
"""

import os
import signal
import time

import mp_boot

ctx = mp_boot.init()

import mp_common as c  # noqa: E402

import nnx_save  # noqa: E402
from nnx_save.save import _collective  # noqa: E402

if ctx.process_id == ctx.args["victim"]:

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    _collective._write_shards = die

tree = c.nest(c.make_tree("mixed", c.mesh([ctx.num_processes, 1])))
t0 = time.monotonic()
try:
    nnx_save.save_file(tree, ctx.args["path"])
    error = None
except nnx_save.SaveError as e:
    error = str(e)
ctx.write({"error": error, "seconds": time.monotonic() - t0})
if ctx.process_id == 0:  # the coordination service lives here: stay until the others have reported
    others = [ctx.out / f"result_{p}.json" for p in range(ctx.num_processes) if p not in (0, ctx.args["victim"])]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(f.exists() for f in others):
        time.sleep(0.05)
# Skip jax.distributed's exit-time shutdown barrier: with a peer dead it only waits
# for the heartbeat timeout, and this test is about the save's own error.
os._exit(0)
