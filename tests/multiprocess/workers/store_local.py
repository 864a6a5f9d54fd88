"""The training store on every process with host-local values: a model built
without a mesh (its arrays on each process's first device), its ``nnx.Dropout``
rngs, and a bare typed PRNG key.

args: {"dir": a fresh directory}. Saves step 1 on every process, restores it into
a poisoned model (templated) and as stored (no template), and reports what each
process got back.
"""

import mp_boot

ctx = mp_boot.init()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from nnx_save.checkpoint import OrbaxCheckpointStore  # noqa: E402


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(4, 3, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)


def digest(model: Model) -> dict:
    state = nnx.state(model)
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        out[jax.tree_util.keystr(path)] = np.asarray(leaf).tolist()
    return out


def poison(model: Model) -> None:
    for _, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        variable.set_value(jnp.full_like(variable.get_value(), 7.0))
    model.drop.rngs.key.set_value(jax.random.key(999))
    model.drop.rngs.count.set_value(jnp.uint32(123))


source = Model(nnx.Rngs(0, dropout=1))
source.drop(jnp.ones((2, 3)), rngs=None)  # advances the dropout stream's count
key = jax.random.key(42)
with OrbaxCheckpointStore(ctx.args["dir"]) as store:
    store.save(1, {"model": nnx.state(source), "rng": key}, metrics={"loss": 0.5})
    store.save(2, {"rng": jax.random.key(43)}, blocking=False)  # in the background, landed by the next read
    target = Model(nnx.Rngs(5, dropout=6))
    poison(target)
    ckpt = store.restore(1, templates={"model": nnx.state(target), "rng": jax.random.key(0)})
    nnx.update(target, ckpt.items["model"])
    as_stored = store.restore(1)
    later = store.restore(2, templates={"rng": jax.random.key(0)})
    kernel = target.linear.kernel.get_value()
    steps = store.list_steps()
ctx.write(
    {
        "saved": digest(source),
        "restored": digest(target),
        "key": np.asarray(jax.random.key_data(ckpt.items["rng"])).tolist(),
        "key_saved": np.asarray(jax.random.key_data(key)).tolist(),
        "key_impl": str(jax.random.key_impl(ckpt.items["rng"])),
        "later_key": np.asarray(jax.random.key_data(later.items["rng"])).tolist(),
        "steps": steps,
        "on_template_device": kernel.sharding == nnx.state(Model(nnx.Rngs(0))).linear.kernel.get_value().sharding,
        "stored_kernel": np.asarray(as_stored.items["model"]["linear"]["kernel"]["value"]).tolist(),
    }
)
