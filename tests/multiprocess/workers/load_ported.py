"""Load a torch-layout checkpoint (``nn.Linear`` weights ``[out, in]``) through
``torch_linear`` rules into NNX kernels ``[in, out]`` on several meshes, with and
without shared reads; report per job the bytes this process read, needed and
received, and check every local shard against the torch weights.

args: {"path": the torch checkpoint, "torch": the weights as saved (.npz),
       "jobs": [{"name", "spec": kernel spec, "mesh": [..], "share": bool}],
       "fail": run the failure job (process 1's load refuses its own extra leaf)}
"""

import mp_boot

ctx = mp_boot.init()

import jax  # noqa: E402
import mp_common as c  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import nnx_save  # noqa: E402
from nnx_save.porting import Rules, torch_linear  # noqa: E402

weights = dict(np.load(ctx.args["torch"]))
LAYERS = sorted({k.split(".")[0] for k in weights})
RULES = Rules(*(torch_linear(n, n) for n in LAYERS))


def net(spec, bias_spec):
    kernel = nnx.with_partitioning(nnx.initializers.zeros, spec)  # zeros: a no-op load fails the checks
    bias = nnx.with_partitioning(nnx.initializers.zeros, bias_spec)

    class Net(nnx.Module):
        def __init__(self):
            for n in LAYERS:
                out, inp = weights[f"{n}.weight"].shape
                setattr(self, n, nnx.Linear(inp, out, kernel_init=kernel, bias_init=bias, rngs=nnx.Rngs(0)))

    return Net


def needed(model) -> int:
    """Bytes this process's devices need: each distinct local shard box once."""
    total = 0
    for _, v in nnx.to_flat_state(nnx.state(model)):
        arr = v.get_value()
        boxes = {tuple(s.indices(d)[:2] for s, d in zip(i, arr.shape, strict=True)) for i in _local(arr)}
        total += sum(int(np.prod([hi - lo for lo, hi in b])) * arr.dtype.itemsize for b in boxes)
    return total


def buffers(model) -> tuple[int, int]:
    """(host buffers, distinct boxes) over this process's shards: equal where every box
    that several local devices hold is one buffer (the CPU backend shares it)."""
    pointers = boxes = 0
    for _, v in nnx.to_flat_state(nnx.state(model)):
        arr = v.get_value()
        pointers += len({s.data.unsafe_buffer_pointer() for s in arr.addressable_shards})
        boxes += len({tuple(s.indices(d)[:2] for s, d in zip(i, arr.shape, strict=True)) for i in _local(arr)})
    return pointers, boxes


def _local(arr):
    return arr.sharding.addressable_devices_indices_map(arr.shape).values()


def check(model) -> int:
    checked = 0
    for n in LAYERS:
        layer = getattr(model, n)
        for got, want in (
            (layer.kernel.get_value(), weights[f"{n}.weight"].T),
            (layer.bias.get_value(), weights[f"{n}.bias"]),
        ):
            for shard in got.addressable_shards:
                assert np.asarray(shard.data).tobytes() == np.ascontiguousarray(want[shard.index]).tobytes(), n
                checked += 1
    return checked


def run(job):
    mesh = c.mesh(job["mesh"])
    spec, bias_spec = tuple(job["spec"]), tuple(job.get("bias_spec", ()))
    build = net(spec, bias_spec)

    def load():
        return nnx_save.load_model(
            build,
            ctx.args["path"],
            rules=RULES,
            mesh=mesh,
            strict=True,
            share_reads=job.get("share", False),
            max_over_read_ratio=job.get("ratio"),
        )

    load()  # warm: compile the reshard, first calls
    before = c.rchar()
    model, report = load()
    read = c.rchar() - before
    return {
        "name": job["name"],
        "rchar": read,
        "bytes_read": report.io.bytes_read,
        "bytes_received": report.io.bytes_received,
        "bytes_needed": report.io.bytes_needed,
        "needed": needed(model),
        "read_whole": report.io.read_whole,
        "checked": check(model),
        "buffers": buffers(model),
    }


def fail():
    """Process 1 asks for one more leaf, whose sharding jax refuses: it raises its
    own error, process 0 a SourceError naming it, neither blocks."""
    mesh = c.mesh([jax.device_count()])
    abstract = {"w": jax.ShapeDtypeStruct((64, 48), np.float32, sharding=c.sharding(mesh, ()))}
    if ctx.process_id == 1:
        abstract["odd"] = jax.ShapeDtypeStruct((3,), np.float32, sharding=c.sharding(mesh, ("x",)))
    try:
        nnx_save.load_file(ctx.args["plain"], abstract, share_reads=True, allow_unexpected=["odd"])
    except nnx_save.errors.NnxSaveError as e:
        return {"error": type(e).__name__, "message": str(e)}
    return {"error": None}


result = {"jobs": [run(job) for job in ctx.args["jobs"]]}
if ctx.args.get("fail"):
    result["fail"] = fail()
ctx.write(result)
