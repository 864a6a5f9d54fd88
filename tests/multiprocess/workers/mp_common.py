"""Trees, meshes and checks shared by the workers and the tests (one definition of
every value, so a worker can check its shards without reading the file)."""

from __future__ import annotations

import math
import os
from typing import Any

import ml_dtypes
import numpy as np

P_ALL = ("a", "b")  # a mesh axis tuple spanning every device of an (a, b) mesh

# name -> (shape, dtype, spec on an ("a", "b") mesh, spec on an ("x",) mesh over all devices)
MIXED: dict[str, tuple[tuple[int, ...], Any, tuple, tuple]] = {
    "embed": ((64, 32), np.float32, (P_ALL, None), (None, "x")),  # dim 0 over every device
    "layers/0/kernel": ((16, 48), ml_dtypes.bfloat16, (None, P_ALL), ("x", None)),  # last dim over every device
    "layers/1/kernel": ((32, 24), np.float32, ("a", "b"), (None, "x")),  # both dims
    "layers/1/bias": ((24,), np.float32, ("b",), ("x",)),  # split inside a process, replicated across
    "norm": ((8, 8), np.float32, (), ("x", None)),  # replicated
    "step": ((), np.int32, (), ()),  # a replicated scalar
    "ids": ((8, 6), np.int8, ("b", None), (None, None)),
}
HOST = {"host_table": ((5, 3), np.int64)}  # numpy leaves: every process holds them whole

ROWS = {f"rows/{i}": ((512, 512), np.float32, (P_ALL, None), ("x", None)) for i in range(4)}  # 4 MiB, dim 0
WIDE = {f"wide/{i}": ((64, 4096), np.float32, (None, P_ALL), (None, "x")) for i in range(4)}  # 4 MiB, last dim
SUITES = {"mixed": MIXED, "rows": ROWS, "wide": WIDE}


def value(name: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A deterministic array, exact in every dtype used here, different per name."""
    seed = sum(name.encode()) % 97
    base = (np.arange(math.prod(shape), dtype=np.int64) * 7 + seed) % 251 - 125
    return base.reshape(shape).astype(dtype)


def host_values() -> dict[str, np.ndarray]:
    return {k: value(k, s, d) for k, (s, d) in HOST.items()}


def mesh(shape: list[int]):
    import jax

    names = ("x",) if len(shape) == 1 else ("a", "b")
    return jax.make_mesh(tuple(shape), names, axis_types=(jax.sharding.AxisType.Explicit,) * len(shape))


def sharding(mesh_, spec: tuple):
    import jax

    return jax.sharding.NamedSharding(mesh_, jax.sharding.PartitionSpec(*spec))


def spec_of(entry: tuple, mesh_) -> tuple:
    return entry[2] if mesh_.axis_names == ("a", "b") else entry[3]


def make_tree(suite: str, mesh_) -> dict[str, Any]:
    """The suite's arrays, sharded on ``mesh_``, built by every process from the callback."""
    import jax

    tree = {}
    for name, entry in SUITES[suite].items():
        shape, dtype = entry[0], entry[1]
        full = value(name, shape, dtype)
        tree[name] = jax.make_array_from_callback(
            shape, sharding(mesh_, spec_of(entry, mesh_)), lambda index, full=full: full[index]
        )
    return tree


def abstract_tree(suite: str, mesh_) -> dict[str, Any]:
    import jax

    return {
        name: jax.ShapeDtypeStruct(e[0], e[1], sharding=sharding(mesh_, spec_of(e, mesh_)))
        for name, e in SUITES[suite].items()
    }


def check_tree(suite: str, tree: dict[str, Any], expected_spec_of=None) -> int:
    """Compare every addressable shard with the expected values; the shards checked."""
    checked = 0
    for name, entry in SUITES[suite].items():
        arr = tree[name]
        full = value(name, entry[0], entry[1])
        assert arr.shape == full.shape and arr.dtype == full.dtype, (name, arr.shape, arr.dtype)
        for shard in arr.addressable_shards:
            got = np.asarray(shard.data)
            if not np.array_equal(got, full[shard.index]):
                raise AssertionError(f"{name}: shard {shard.index} on {shard.device} differs")
            checked += 1
    return checked


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"a/b": x}`` -> ``{"a": {"b": x}}`` (a tree whose file keys are the flat names)."""
    tree: dict[str, Any] = {}
    for key, leaf in flat.items():
        *parents, last = key.split("/")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = leaf
    return tree


def flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out


def rchar() -> int:
    """Bytes this process has read through read(2)-like calls (``/proc/self/io``)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise RuntimeError("no rchar in /proc/self/io")


def run_load_jobs(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Load each job's file into sharded arrays, check every local shard, and
    report the bytes this process read: the library's count and the kernel's.

    A job: ``{"path", "suite", "mesh": [..], "ratio": float | None, "host": bool,
    "share": share_reads (default None: automatic)}``.
    """
    import nnx_save

    results = []
    for job in jobs:
        abstract = nest(
            {**abstract_tree(job["suite"], mesh(job["mesh"])), **(host_values() if job.get("host") else {})}
        )

        def load(job=job, abstract=abstract):
            return nnx_save.load_file(
                job["path"],
                abstract,
                max_over_read_ratio=job.get("ratio"),
                share_reads=job.get("share"),
                return_report=True,
            )

        load()  # warm: imports and first calls read files too; measure the second load
        before = rchar()
        tree, report = load()
        read = rchar() - before
        loaded = flat(tree)
        checked = check_tree(job["suite"], loaded)
        if job.get("host"):
            assert np.array_equal(loaded["host_table"], host_values()["host_table"])
        results.append(
            {
                "rchar": read,
                "bytes_read": report.io.bytes_read,
                "bytes_needed": report.io.bytes_needed,
                "bytes_received": report.io.bytes_received,
                "requests": report.io.requests,
                "checked": checked,
                "clean": report.clean,
                "files": sorted(os.path.basename(f) for f in report.io.over_read_by_file),
            }
        )
    return results


def lm_class():
    """A small sharded language model: a tied embedding, an ``nnx.List`` of blocks,
    bf16 parameters, an f32 norm, a Python scalar and an rng stream."""
    import jax.numpy as jnp
    from flax import nnx

    col = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
    row = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("model", None))
    vec = nnx.with_partitioning(nnx.initializers.normal(1.0), ("model",))
    emb = nnx.with_partitioning(nnx.initializers.normal(1.0), ("model", None))

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.up = nnx.Linear(32, 64, param_dtype=jnp.bfloat16, kernel_init=col, bias_init=vec, rngs=rngs)
            self.down = nnx.Linear(64, 32, param_dtype=jnp.bfloat16, kernel_init=row, use_bias=False, rngs=rngs)

    class LM(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.embed = nnx.Embed(64, 32, param_dtype=jnp.bfloat16, embedding_init=emb, rngs=rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(2)])
            self.norm = nnx.LayerNorm(32, rngs=rngs)
            self.head = self.embed  # tied: one variable, saved once
            self.step = nnx.Variable(0)
            self.noise = nnx.Rngs(dropout=3)

    return LM


def model_mesh():
    import jax

    return jax.make_mesh((jax.device_count(),), ("model",), axis_types=(jax.sharding.AxisType.Explicit,))


def build_lm(seed: int, mesh_):
    import jax
    from flax import nnx

    with jax.set_mesh(mesh_):
        model = lm_class()(nnx.Rngs(seed))
    model.step.set_value(41)
    return model
