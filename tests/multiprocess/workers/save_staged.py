"""A multi-process save with the device -> host copies forced on the CPU backend
(``NNX_SAVE_FORCE_HOST_STAGING`` and a small ``NNX_SAVE_SAVE_INFLIGHT_BYTES`` in the
environment): each process counts the copies it made of its own shards.

args: {"path": file to write, "mesh": [a, b]}
"""

import mp_boot

ctx = mp_boot.init()

import mp_common as c  # noqa: E402

import nnx_save  # noqa: E402
from nnx_save.save import _stage  # noqa: E402

copies: list[int] = []
real_copy = _stage._copy_shard


def counted(data, wanted):
    copies.append(int(data.nbytes))
    return real_copy(data, wanted)


_stage._copy_shard = counted
tree = c.nest({**c.make_tree("mixed", c.mesh(ctx.args["mesh"])), **c.host_values()})
nnx_save.save_file(tree, ctx.args["path"], metadata={"made_by": "save_tree"})
ctx.write({"copies": len(copies), "copied_bytes": sum(copies)})
