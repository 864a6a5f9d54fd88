"""End-to-end demo: save an NNX model, load it back (in place, through a builder,
and sharded over 8 simulated devices), with what each step did.

Run with `make demo` (or `python examples/demo.py`).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
from flax import nnx

import nnx_save


class Block(nnx.Module):
    def __init__(self, dim: int, *, rngs: nnx.Rngs) -> None:
        shard_cols = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
        shard_rows = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("model", None))
        self.up = nnx.Linear(dim, 4 * dim, kernel_init=shard_cols, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, kernel_init=shard_rows, rngs=rngs)
        self.norm = nnx.LayerNorm(dim, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.down(nnx.gelu(self.up(self.norm(x))))


class TinyNet(nnx.Module):
    def __init__(self, dim: int = 256, depth: int = 4, *, rngs: nnx.Rngs) -> None:
        self.blocks = nnx.List([Block(dim, rngs=rngs) for _ in range(depth)])
        self.head = nnx.Linear(dim, 10, rngs=rngs)
        self.steps = nnx.Variable(0)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def step(title: str) -> None:
    print(f"\n== {title}")


def main() -> int:
    workdir = Path(tempfile.mkdtemp(prefix="nnx_save_demo_"))
    path = workdir / "tiny.safetensors"
    x = np.random.default_rng(0).standard_normal((2, 256), np.float32)

    auto = (jax.sharding.AxisType.Auto,)
    one_device = jax.make_mesh((1,), ("model",), axis_types=auto, devices=jax.devices()[:1])
    eight_devices = jax.make_mesh((8,), ("model",), axis_types=auto)

    step("1. save an NNX model (nnx.List of blocks, a step counter, an rng stream)")
    with jax.set_mesh(one_device):
        model = TinyNet(rngs=nnx.Rngs(0, dropout=1))
    model.steps.set_value(1234)
    t = time.perf_counter()
    nnx_save.save_model(model, path, metadata={"note": "demo"})
    header = nnx_save.read_header(path)
    print(f"wrote {path.name}: {len(header)} tensors, {header.nbytes / 1e6:.2f} MB in {time.perf_counter() - t:.3f}s")
    for name in list(header)[:4]:
        info = header[name]
        print(f"  {name:28s} {info.dtype.code:5s} {info.shape!s:12s} bytes [{info.begin}, {info.end})")
    print("  ...")

    step("2. load into a builder: the random model is never built")
    restored, report = nnx_save.load_model(
        lambda: TinyNet(rngs=nnx.Rngs(42, dropout=7)), path, mesh=one_device, strict=True
    )
    with jax.set_mesh(one_device):
        same = np.array_equal(restored(x), model(x))
    print(report.summary())
    print(
        f"logits identical: {same}; steps = {restored.steps.get_value()!r} ({type(restored.steps.get_value()).__name__})"
    )
    print(
        f"same dropout stream: {np.array_equal(jax.random.key_data(restored.dropout.rngs()), jax.random.key_data(model.dropout.rngs()))}"
    )

    step("3. a mismatch is never silent: load into a model with a new head")

    class NewHead(TinyNet):
        def __init__(self, *, rngs: nnx.Rngs) -> None:
            super().__init__(rngs=rngs)
            self.head = nnx.Linear(256, 3, rngs=rngs)

    try:
        nnx_save.load_model(lambda: NewHead(rngs=nnx.Rngs(0)), path, mesh=one_device, strict=True)
    except nnx_save.LoadError as e:
        print(str(e).splitlines()[0])
        print("  " + "\n  ".join(str(e).splitlines()[1:3]))

    step("4. load sharded over 8 simulated devices: each device gets only its slice")
    sharded, report = nnx_save.load_model(lambda: TinyNet(rngs=nnx.Rngs(0)), path, mesh=eight_devices, strict=True)
    kernel = sharded.blocks[0].up.kernel.get_value()
    print(
        f"blocks/0/up/kernel: {kernel.shape} spread over {len(kernel.sharding.device_set)} devices, "
        f"shard shape {kernel.addressable_shards[0].data.shape}"
    )
    print(f"values equal: {np.array_equal(np.asarray(kernel), np.asarray(model.blocks[0].up.kernel.get_value()))}")
    print(f"I/O: {report.io}")

    for extra in ("train_resume.py",):
        script = Path(__file__).with_name(extra)
        if script.exists():
            step(f"5. {extra}")
            import runpy

            runpy.run_path(str(script), run_name="__main__")
    print(f"\ndemo finished; files in {workdir}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
