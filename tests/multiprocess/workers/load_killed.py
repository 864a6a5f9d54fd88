"""A shared-read load during which one process is killed (SIGKILL) as it starts
reading its part: the survivors report the error they got and how long it took.

args: {"path": the file, "victim": process id}
"""

import os
import signal
import time

import mp_boot

ctx = mp_boot.init()

import jax  # noqa: E402
import mp_common as c  # noqa: E402
import numpy as np  # noqa: E402

import nnx_save  # noqa: E402
from nnx_save.load import _engine  # noqa: E402

if ctx.process_id == ctx.args["victim"]:

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    _engine.Engine.run = die

mesh = c.mesh([jax.device_count()])
abstract = {"w": jax.ShapeDtypeStruct((64, 48), np.float32, sharding=c.sharding(mesh, ()))}
t0 = time.monotonic()
try:
    nnx_save.load_file(ctx.args["path"], abstract, share_reads=True, allow_unexpected=["odd"])
    error = None
except nnx_save.errors.NnxSaveError as e:
    error = {"type": type(e).__name__, "message": str(e)}
ctx.write({"error": error, "seconds": time.monotonic() - t0})
# Skip jax.distributed's exit-time shutdown barrier: with a peer dead it only waits
# for the heartbeat timeout, and this test is about the load's own error.
os._exit(0)
