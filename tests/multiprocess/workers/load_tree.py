"""Load files into sharded arrays, check every local shard, and report the bytes
this process read: the library's count and the kernel's (``/proc/self/io`` rchar).

args: {"jobs": [{"path", "suite", "mesh": [..], "ratio": float | null, "host": bool}]}
"""

import mp_boot

ctx = mp_boot.init()

import numpy as np  # noqa: E402

import mp_common as c  # noqa: E402
import nnx_save  # noqa: E402

results = []
for job in ctx.args["jobs"]:
    mesh = c.mesh(job["mesh"])
    abstract = c.nest({**c.abstract_tree(job["suite"], mesh), **(c.host_values() if job.get("host") else {})})

    def load():
        return nnx_save.load_file(job["path"], abstract, max_over_read_ratio=job.get("ratio"), return_report=True)

    load()  # warm: imports and first-call work read files too; measure the second load
    before = mp_boot.rchar()
    tree, report = load()
    rchar = mp_boot.rchar() - before
    flat = c.flat(tree)
    checked = c.check_tree(job["suite"], flat)
    if job.get("host"):
        assert np.array_equal(flat["host_table"], c.host_values()["host_table"])
    results.append({"rchar": rchar, "bytes_read": report.io.bytes_read, "bytes_needed": report.io.bytes_needed,
                    "requests": report.io.requests, "checked": checked, "clean": report.clean})
ctx.write({"jobs": results})
