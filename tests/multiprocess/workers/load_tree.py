"""Load files into sharded arrays on every process; report bytes read per process.

args: {"jobs": [{"path", "suite", "mesh": [..], "ratio": float | null, "host": bool}]}
"""

import mp_boot

ctx = mp_boot.init()

import mp_common as c  # noqa: E402

ctx.write({"jobs": c.run_load_jobs(ctx.args["jobs"])})
