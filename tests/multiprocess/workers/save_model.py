"""save_model / load_model of a sharded NNX model from every process.

Saves the model built from seed 0, then loads the file into a builder (seed 1, so
every value must come from the file) on the same mesh, and checks every local
shard, the tied embedding, the scalar and the rng stream.

args: {"path": file to write, "pod": a directory for save_pod (optional)}
"""

import os

import mp_boot

ctx = mp_boot.init()

import jax  # noqa: E402
import mp_common as c  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import nnx_save  # noqa: E402

mesh = c.model_mesh()
source = c.build_lm(0, mesh)
nnx_save.save_model(source, ctx.args["path"])
LM = c.lm_class()
loaded, report = nnx_save.load_model(lambda: LM(nnx.Rngs(1)), ctx.args["path"], mesh=mesh, strict=True)


def compare(loaded, source) -> tuple[int, list[str]]:
    """Every local shard of ``loaded`` equals ``source``'s on the same device."""
    expected = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(source))}
    checked, split = 0, []
    for path, variable in nnx.to_flat_state(nnx.state(loaded)):
        got, want = variable.get_value(), expected[path]
        if isinstance(got, int):
            assert got == want == 41, (path, got, want)
            continue
        if jax.dtypes.issubdtype(got.dtype, jax.dtypes.prng_key):
            got, want = jax.random.key_data(got), jax.random.key_data(want)
        assert got.dtype == want.dtype and got.shape == want.shape, path
        assert got.sharding.is_equivalent_to(want.sharding, got.ndim), (path, got.sharding, want.sharding)
        if not got.is_fully_replicated:
            split.append("/".join(map(str, path)))
        mine = {s.device: np.asarray(s.data) for s in want.addressable_shards}
        for shard in got.addressable_shards:
            assert np.asarray(shard.data).tobytes() == mine[shard.device].tobytes(), (path, shard.device)
            checked += 1
    return checked, sorted(split)


checked, split = compare(loaded, source)
result = {
    "clean": report.clean,
    "checked": checked,
    "split": split,
    "tied": loaded.head is loaded.embed,
    "dtype": str(loaded.blocks[1].up.kernel.get_value().dtype),
}
if ctx.args.get("pod"):  # the pod layout, loaded back on the same process layout
    nnx_save.save_pod(source, ctx.args["pod"])
    loaded, report = nnx_save.load_model(lambda: LM(nnx.Rngs(2)), ctx.args["pod"], mesh=mesh, strict=True)
    result["pod_checked"], _ = compare(loaded, source)
    result["pod_files"] = sorted(os.path.basename(f) for f in report.io.over_read_by_file)
    result["pod_tied"] = loaded.head is loaded.embed
ctx.write(result)
