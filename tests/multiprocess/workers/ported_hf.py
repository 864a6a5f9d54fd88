"""Load HuggingFace checkpoints (written by transformers) through the example
models' porting rules on several meshes, then export them back collectively.

Per job: the bytes this process read, needed (its devices' distinct shard boxes),
received from peers, and every local shard checked against a single-process load
(``expected``: a .npz of the state, by path). Per save: the bytes this process
wrote (``wchar``) of a ported export (``rules=RULES.inverse()``) saved by every
process into one file; the parent compares that file with transformers' tensors.

args: {"models": [{"family", "config": LlamaConfig / GPT2Config fields, "path",
        "expected", "save": the export to write, "save_from": the job whose model it saves,
        "jobs": the job names to run (default all)}], "jobs": [{"name", "layout", "share", "ratio"}],
       "fallback": a file for an export that has no box map (optional)}
"""

import functools
import sys
from pathlib import Path

import mp_boot

ctx = mp_boot.init()
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository's examples/

import jax  # noqa: E402
import mp_common as c  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import nnx_save  # noqa: E402
from examples.models import gpt2, llama  # noqa: E402

FAMILIES = {
    "llama": (llama.Llama, llama.LlamaConfig, llama.RULES),
    "gpt2": (gpt2.GPT2, gpt2.GPT2Config, gpt2.RULES),
    "scanned_llama": (llama.ScannedLlama, llama.LlamaConfig, llama.SCANNED_RULES),
}
ROW_PARALLEL = ("attn/o/kernel", "mlp/down/kernel", "attn/proj/kernel", "mlp/proj/kernel")


def spec(layout: str, path: str, shape: tuple[int, ...]) -> tuple:
    """The partition spec of one parameter under ``layout`` (replicated where no dimension divides)."""
    n = jax.device_count()
    if layout == "fsdp":  # every parameter on its first dimension
        want: tuple = ("x",)
    elif layout == "tp":  # Megatron: column-parallel projections on out, row-parallel on in, embeddings on vocab
        kernel, lead = path.endswith("kernel"), (None,) * (len(shape) - 2)  # a scanned model's layer axis
        want = ("x", None) if path.endswith(ROW_PARALLEL) or (not kernel and len(shape) == 2) else (None, "x")
        want = (*lead, *want) if kernel else want
        if len(shape) == 1:
            want = ("x",) if path.endswith("bias") and "proj" not in path else ()
    elif layout == "mixed":  # (data, model): kernels and embeddings on both dimensions
        want = ("a", "b") if len(shape) == 2 else ()
    else:
        want = ()
    sizes = {"x": n, "a": 2, "b": n // 2}
    return want if all(a is None or shape[d] % sizes[a] == 0 for d, a in enumerate(want)) else ()


def model_on(family: str, config: dict, layout: str):
    """The model with zeros (a no-op load fails the checks) under ``layout``'s shardings."""
    cls, cfg_cls, _ = FAMILIES[family]
    mesh = c.mesh([jax.device_count()] if layout in ("fsdp", "tp", "replicated") else [2, jax.device_count() // 2])
    model = nnx.eval_shape(lambda: cls(cfg_cls(**config), rngs=nnx.Rngs(0)))
    for path, v in nnx.to_flat_state(nnx.state(model)):
        key, like = "/".join(map(str, path)), v.get_value()
        sharding = c.sharding(mesh, spec(layout, key, tuple(like.shape)))
        v.set_value(jax.jit(functools.partial(jax.numpy.zeros, like.shape, like.dtype), out_shardings=sharding)())
    return model


def needed(model) -> int:
    """Bytes this process's devices need: each distinct local shard box once."""
    total = 0
    for _, v in nnx.to_flat_state(nnx.state(model)):
        arr = v.get_value()
        local = arr.sharding.addressable_devices_indices_map(arr.shape).values()
        boxes = {tuple(s.indices(d)[:2] for s, d in zip(i, arr.shape, strict=True)) for i in local}
        total += sum(int(np.prod([hi - lo for lo, hi in b])) * arr.dtype.itemsize for b in boxes)
    return total


def check(model, expected) -> int:
    """Every local shard equals the single-process load's, bit for bit."""
    checked = 0
    for path, v in nnx.to_flat_state(nnx.state(model)):
        want = expected["/".join(map(str, path))]
        for shard in v.get_value().addressable_shards:
            assert np.asarray(shard.data).tobytes() == np.ascontiguousarray(want[shard.index]).tobytes(), path
            checked += 1
    return checked


def counter(name: str) -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(f"{name}:"))


def run(m: dict, job: dict) -> tuple[dict, object]:
    expected = dict(np.load(m["expected"]))
    rules = FAMILIES[m["family"]][2]

    model, report = nnx_save.load_model(  # the library's counts need no warm-up (no rchar here)
        model_on(m["family"], m["config"], job["layout"]),
        m["path"],
        rules=rules,
        strict=True,
        share_reads=job["share"],
        max_over_read_ratio=job.get("ratio"),
    )
    out = {
        "name": f"{m['family']}/{job['name']}",
        "bytes_read": report.io.bytes_read,
        "bytes_received": report.io.bytes_received,
        "bytes_needed": report.io.bytes_needed,
        "needed": needed(model),
        "read_whole": report.io.read_whole,
        "checked": check(model, expected),
    }
    return out, model


def save(m: dict, model) -> dict:
    """A ported export of ``model`` written by every process into one file."""
    before = counter("wchar")
    nnx_save.save_model(model, m["save"], rules=FAMILIES[m["family"]][2].inverse())
    return {"name": m["family"], "written": counter("wchar") - before}


def fallback(path: str) -> dict:
    """An export whose transform has no box map for these shards (a (4, 16) kernel split
    on its columns, flattened): every process takes part, the primary writes it whole."""
    from nnx_save.porting import Rules, reshape

    sharding = c.sharding(c.mesh([jax.device_count()]), (None, "x"))
    value = jax.make_array_from_callback((4, 16), sharding, lambda i: np.arange(64, dtype=np.float32).reshape(4, 16)[i])

    class Flat(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(value)

    nnx_save.save_model(Flat(), path, rules=Rules(reshape("w", (4, 16), source_shape=(64,))).inverse())
    return {"saved": path}


result: dict = {"jobs": [], "saves": []}
for m in ctx.args["models"]:
    for job in (j for j in ctx.args["jobs"] if j["name"] in m.get("jobs", [j["name"]])):
        found, model = run(m, job)
        result["jobs"].append(found)
        if job["name"] == m["save_from"]:
            result["saves"].append(save(m, model))
        del model
if ctx.args.get("fallback"):
    result["fallback"] = fallback(ctx.args["fallback"])
ctx.write(result)
