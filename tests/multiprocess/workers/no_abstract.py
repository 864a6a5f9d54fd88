"""load_file without an abstract tree in a multi-process run must refuse.

args: {"path": a safetensors file}
"""

import mp_boot

ctx = mp_boot.init()

import nnx_save  # noqa: E402

try:
    nnx_save.load_file(ctx.args["path"])
    error = None
except nnx_save.NnxSaveError as e:
    error = str(e)
ctx.write({"error": error})
