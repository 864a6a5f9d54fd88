"""Load a file over HTTP into sharded arrays; report this process's pid (its
requests carry it in their User-Agent) and the library's byte counts.

args: {"jobs": [{"path": URL, "suite", "mesh": [..]}]}
"""

import os

import mp_boot

ctx = mp_boot.init()

import mp_common as c  # noqa: E402

ctx.write({"pid": os.getpid(), "jobs": c.run_load_jobs(ctx.args["jobs"])})
