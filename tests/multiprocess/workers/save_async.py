"""Asynchronous single-file saves from every process: the "mixed" tree saved with
``blocking=False``, then every array donated to a jitted step that overwrites it,
then a second asynchronous save of the new values, then a blocking one.

A pod directory (``save_pod(..., blocking=False)``) of the same tree is saved
between the first save and the donation.

args: {"path": first file, "path2": second file, "path3": third (blocking), "pod": a directory,
       "mesh": [a, b]}
"""

import mp_boot

ctx = mp_boot.init()

import jax  # noqa: E402
import mp_common as c  # noqa: E402

import nnx_save  # noqa: E402

mesh = c.mesh(ctx.args["mesh"])
arrays = c.make_tree("mixed", mesh)
first = nnx_save.save_file(
    c.nest({**arrays, **c.host_values()}), ctx.args["path"], metadata={"made_by": "save_tree"}, blocking=False
)
pod = nnx_save.save_pod(c.nest({**arrays, **c.host_values()}), ctx.args["pod"], blocking=False)
step = jax.jit(lambda t: jax.tree.map(lambda a: a * 0 + 1, t), donate_argnums=0)
ones = step(arrays)
second = nnx_save.save_file(c.nest(ones), ctx.args["path2"], blocking=False)
nnx_save.save_file(c.nest(ones), ctx.args["path3"])  # waits for both asynchronous saves first
ctx.write(
    {
        "first": str(first.result()),
        "second": str(second.result()),
        "pod": str(pod.result()),
        "first_done_at_blocking": True,
    }
)
