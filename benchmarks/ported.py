"""Ported loads: a HuggingFace ``LlamaForCausalLM`` into ``examples/models/llama.py``'s
NNX Llama, nnx_save against the ports users write by hand.

The checkpoint is made offline with ``transformers`` (random init, ``save_pretrained``,
fp32, four files; ``--size-gb`` sets its size, 0.8 GB by default) under ``--dir`` and
kept. Each phase runs in a FRESH PROCESS with the page cache warm (the parent reads
every file first); the phases are interleaved round by round (``--repeat``) and each
row shows the median wall time with its spread (min-max), CPU seconds, and the peak
RSS the phase added over the checkpoint's size (``_common.Phase``). Each worker first
touches and frees 3x the checkpoint (``--prefault``, as ``benchmarks/load.py`` does:
on this VM the host backs fresh guest memory lazily, a cost no loader controls).

Phases:

- ``nnx_save``: ``load_model(builder, dir, rules=RULES)``: ``RULES`` transpose every
  kernel (torch ``Linear`` (out, in) -> NNX (in, out)).
- ``host_T``: what tunix / bonsai-style ports do: ``safetensors.safe_open`` each file
  (numpy), ``.T`` on the host (``np.ascontiguousarray``), ``jax.device_put`` to the
  target sharding, merged into ``nnx.eval_shape``'s abstract model.
- ``device_T``: the same with the transpose on the devices: ``jax.device_put`` of
  the weight (sharded as its transpose will be), then a jitted ``.T`` with the
  target's ``out_shardings``.
- ``read_once``: the read floor: ``nnx_save.load_file`` of each file as stored (no
  model, no transpose), onto one device.
- ``eval_shape``: ``nnx.eval_shape`` of the builder alone (every port pays it).

Layouts: ``1dev`` (one CPU device) and ``last`` (8 CPU devices, every parameter
sharded on its last dimension where that divides by 8, else replicated; the builder
declares it as ``out_sharding`` metadata, as ``nnx.with_partitioning`` does). After the
clock stops, every model phase checks some kernels against the file and every
parameter's sharding against the layout (a fast wrong answer, or a replicated one,
cannot win). The targets print PASS / FAIL with their numbers.

On a shared 2-core VM single runs vary by 2x: compare medians over ``--repeat`` runs.

    python benchmarks/ported.py --repeat 5            # the table
    python benchmarks/ported.py --smoke               # a small checkpoint, every row once
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

import numpy as np
from _common import Phase, add_ratios, page_cache_note, print_results, run_fresh, warm, worker_main

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PHASES = ("nnx_save", "host_T", "device_T", "read_once", "eval_shape")
LAYOUTS = ("1dev", "last")
LABELS = {
    "nnx_save": "nnx_save load_model(rules=)",
    "host_T": "safe_open + host .T + device_put",
    "device_T": "device_put + jitted .T",
    "read_once": "read once (load_file)",
    "eval_shape": "eval_shape alone",
}


# ----------------------------------------------------------------------------- checkpoint


def llama_sizes(size_gb: float) -> dict:
    """A ``LlamaConfig``'s sizes for an fp32 checkpoint of about ``size_gb`` GB."""
    if size_gb >= 0.2:
        d, f, vocab, heads, kv = 1024, 2816, 32000, 16, 4
    else:
        d, f, vocab, heads, kv = 128, 352, 4096, 4, 2
    per_layer = 2 * d * d + 2 * d * (d * kv // heads) + 3 * d * f + 2 * d
    layers = max(1, round((size_gb * 1e9 / 4 - 2 * vocab * d - d) / per_layer))
    return {
        "vocab_size": vocab,
        "hidden_size": d,
        "intermediate_size": f,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
    }


def ensure_checkpoint(directory: Path, size_gb: float) -> Path:
    """The HF checkpoint of this size under ``directory``, made once (four files)."""
    path = directory / f"llama_{size_gb:g}gb"
    if (path / "model.safetensors.index.json").exists():
        return path
    import torch
    import transformers

    torch.manual_seed(0)
    sizes = llama_sizes(size_gb)
    cfg = transformers.LlamaConfig(**sizes, tie_word_embeddings=False, torch_dtype="float32")
    model = transformers.LlamaForCausalLM(cfg)
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    quarter = int(nbytes * 0.28) // 1000  # four files: save_pretrained fills each up to the cap, tensor by tensor
    model.save_pretrained(path, safe_serialization=True, max_shard_size=f"{quarter}KB")
    return path


def _files(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def _nbytes(path: Path) -> int:
    return sum(f.stat().st_size for f in _files(path))


# ----------------------------------------------------------------------------- workers


def _setup(args: argparse.Namespace):
    """jax, the model's builder and config, the mesh (or None) and a spec per param shape."""
    import jax

    sys.path.insert(0, str(ROOT))
    from flax import nnx

    from examples.models.llama import Llama, LlamaConfig

    assert len(jax.devices()) == args.devices, jax.devices()
    hf = json.loads((Path(args.path) / "config.json").read_text())
    names = llama_sizes(0).keys()
    cfg = LlamaConfig(**{n: hf[n] for n in names}, rms_norm_eps=hf["rms_norm_eps"], rope_theta=10000.0)
    auto = (jax.sharding.AxisType.Auto,)
    mesh = jax.make_mesh((8,), ("x",), axis_types=auto) if args.layout == "last" else None

    def spec(shape: tuple[int, ...]):
        if mesh is None:
            return jax.sharding.SingleDeviceSharding(jax.devices()[0])
        last = "x" if shape and shape[-1] % 8 == 0 else None
        return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*(None,) * (len(shape) - 1), last))

    def builder():
        model = Llama(cfg, rngs=nnx.Rngs(0))
        if mesh is not None:  # the layout's shardings, as annotations (nnx.with_partitioning) give them
            for _, v in nnx.iter_graph(model):
                if isinstance(v, nnx.Param):
                    v.set_metadata(out_sharding=tuple(spec(v.get_value().shape).spec))
        return model

    jax.block_until_ready(jax.device_put(np.zeros(8, np.float32), jax.devices()[0]))  # the backend is up
    return jax, nnx, builder, mesh, spec


_HF = [  # HF key -> (NNX path, transposed): the hand-written port's own table
    (r"model\.embed_tokens\.weight", "embed/embedding", False),
    (r"model\.layers\.(\d+)\.self_attn\.([qkvo])_proj\.weight", r"layers/\1/attn/\2/kernel", True),
    (r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", r"layers/\1/mlp/\2/kernel", True),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", r"layers/\1/attn_norm/scale", False),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", r"layers/\1/mlp_norm/scale", False),
    (r"model\.norm\.weight", "norm/scale", False),
    (r"lm_head\.weight", "lm_head/kernel", True),
]


def _hf_path(key: str) -> tuple[str, bool]:
    for pattern, path, transposed in _HF:
        if re.fullmatch(pattern, key):
            return re.sub(pattern, path, key), transposed
    raise KeyError(key)


def _by_hand(args: argparse.Namespace, jax, nnx, builder, spec, on_device: bool):
    """A hand-written port: every file's tensors, transposed, onto the target shardings."""
    from safetensors import safe_open

    graphdef, state = nnx.split(nnx.eval_shape(builder))
    flat = dict(nnx.to_flat_state(state))
    transpose = {}
    for file in _files(Path(args.path)):
        with safe_open(str(file), "numpy") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open handles are not mappings
                path, transposed = _hf_path(key)
                at = tuple(int(p) if p.isdigit() else p for p in path.split("/"))
                target = spec(flat[at].get_value().shape)
                x = f.get_tensor(key)
                if transposed and on_device:
                    source = spec(x.shape[::-1])
                    if isinstance(source, jax.sharding.NamedSharding):  # sharded as its transpose will be
                        source = jax.sharding.NamedSharding(source.mesh, jax.sharding.PartitionSpec(*source.spec[::-1]))
                    key_t = (x.shape, target)
                    if key_t not in transpose:
                        transpose[key_t] = jax.jit(lambda a: a.T, out_shardings=target)
                    value = transpose[key_t](jax.device_put(x, source))
                else:
                    value = jax.device_put(np.ascontiguousarray(x.T) if transposed else x, target)
                flat[at].set_value(value)
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    jax.block_until_ready(nnx.state(model))
    return model


def _check(model, args: argparse.Namespace, nnx, spec) -> None:
    """Some kernels against the file, and every parameter's sharding against the layout:
    a fast wrong answer (or one on other shardings) cannot win."""
    from safetensors import safe_open

    state = dict(nnx.to_flat_state(nnx.state(model)))
    for at, variable in state.items():
        value = variable.get_value()
        want = spec(value.shape)
        assert value.sharding.is_equivalent_to(want, value.ndim), (at, value.sharding, want)
    seen = 0
    for file in _files(Path(args.path)):
        with safe_open(str(file), "numpy") as f:
            for key in list(f.keys())[:4]:
                path, transposed = _hf_path(key)
                at = tuple(int(p) if p.isdigit() else p for p in path.split("/"))
                x = f.get_tensor(key)
                got = np.asarray(state[at].get_value())
                assert np.array_equal(got, x.T if transposed else x), key
                seen += 1
    assert seen, "nothing checked"


def worker(args: argparse.Namespace) -> dict:
    jax, nnx, builder, mesh, spec = _setup(args)
    import nnx_save
    from examples.models.llama import RULES

    if args.prefault > 0:  # load.py's --prefault: the VM's lazy backing of fresh memory, untimed
        buf = np.ones(int(args.prefault * _nbytes(Path(args.path))), np.uint8)
        del buf

    with Phase() as phase:
        if args.worker == "nnx_save":
            model = nnx_save.load_model(builder, args.path, rules=RULES, mesh=mesh, strict=True, stream=False)[0]
            jax.block_until_ready(nnx.state(model))
        elif args.worker in ("host_T", "device_T"):
            model = _by_hand(args, jax, nnx, builder, spec, on_device=args.worker == "device_T")
        elif args.worker == "read_once":
            model = None
            arrays = [nnx_save.load_file(str(f)) for f in _files(Path(args.path))]
            jax.block_until_ready(arrays)
        else:
            model = nnx.eval_shape(builder)
    if model is not None and args.worker != "eval_shape":
        _check(model, args, nnx, spec)
    return phase.result()


def _worker_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--path")
    p.add_argument("--layout", choices=LAYOUTS)
    p.add_argument("--devices", type=int)
    p.add_argument("--prefault", type=float, default=3.0)


# ----------------------------------------------------------------------------- table


def summarise(phase: str, layout: str, runs: list[dict], nbytes: int) -> dict:
    """A row: the median wall time with its spread, median CPU and peak RSS / checkpoint."""
    row = {"phase": LABELS[phase], "key": phase, "layout": layout, "runs": len(runs)}
    bad = [r for r in runs if "error" in r]
    if bad:
        return {**row, "error": bad[0]["error"]}
    walls = sorted(r["seconds"] for r in runs)
    return {
        **row,
        "median": statistics.median(walls),
        "spread": f"({walls[0]:.3f}-{walls[-1]:.3f})",
        "cpu": statistics.median(r["user_s"] + r["sys_s"] for r in runs),
        "rss": statistics.median(r["peak_above_kb"] for r in runs) * 1024 / nbytes,
    }


COLUMNS = [
    ("layout", "layout", ""),
    ("phase", "phase", ""),
    ("median", "median s", ".3f"),
    ("spread", "(min-max)", ""),
    ("cpu", "cpu s", ".2f"),
    ("rss", "peak RSS / checkpoint", ".2f"),
    ("vs", "t / t(nnx_save)", ".2f"),
]


def targets(rows: list[dict]) -> list[str]:
    """The targets at medians: <= 0.8x the best hand-written port, <= 1.25x
    (read once + eval_shape), peak RSS <= 1.05x the checkpoint; per layout."""
    lines = []
    for layout in LAYOUTS:
        got = {r["key"]: r for r in rows if r["layout"] == layout and "median" in r}
        ours = got.get("nnx_save")
        if ours is None:
            continue
        hand = [got[k]["median"] for k in ("host_T", "device_T") if k in got]
        if hand:
            x = ours["median"] / min(hand)
            lines.append(f"{layout}: {x:.2f}x the best hand-written port (<= 0.8): {'PASS' if x <= 0.8 else 'FAIL'}")
        if "read_once" in got and "eval_shape" in got:
            x = ours["median"] / (got["read_once"]["median"] + got["eval_shape"]["median"])
            lines.append(f"{layout}: {x:.2f}x read once + eval_shape (<= 1.25): {'PASS' if x <= 1.25 else 'FAIL'}")
        ok = ours["rss"] <= 1.05
        lines.append(f"{layout}: peak RSS {ours['rss']:.2f}x the checkpoint (<= 1.05): {'PASS' if ok else 'FAIL'}")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gb", type=float, default=0.8, help="fp32 checkpoint size (default 0.8)")
    p.add_argument("--dir", default="/tmp/nnx_save_bench", help="where the checkpoint is made and kept")
    p.add_argument("--repeat", type=int, default=3, help="fresh processes per row, interleaved")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--phases", default=",".join(PHASES))
    p.add_argument(
        "--prefault",
        type=float,
        default=3.0,
        help="touch and free this many checkpoint sizes of memory before the clock (as benchmarks/load.py)",
    )
    p.add_argument("--smoke", action="store_true", help="a 0.01 GB checkpoint, every row once")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()
    if args.smoke:
        args.size_gb, args.repeat = 0.01, 1
    path = ensure_checkpoint(Path(args.dir), args.size_gb)
    nbytes = _nbytes(path)
    print(page_cache_note(args.dir), file=sys.stderr)
    rows = []
    for layout in args.layouts.split(","):
        devices = 1 if layout == "1dev" else 8
        runs: dict[str, list[dict]] = {ph: [] for ph in args.phases.split(",")}
        for _ in range(args.repeat):  # round robin: background load hits every phase alike
            for phase in runs:
                for f in _files(path):
                    warm(f)
                extra = [
                    "--path",
                    str(path),
                    "--layout",
                    layout,
                    "--devices",
                    str(devices),
                    "--prefault",
                    str(args.prefault),
                ]
                runs[phase].append(run_fresh(__file__, phase, extra, devices=devices))
        group = [summarise(ph, layout, r, nbytes) for ph, r in runs.items()]
        ours = next((r for r in group if r["key"] == "nnx_save" and "median" in r), None)
        rows += add_ratios(group, "median", ours)
    print(f"{len(_files(path))} files, {nbytes / 1e9:.2f} GB fp32 (HF LlamaForCausalLM, save_pretrained)")
    print(f"median over {args.repeat} interleaved fresh-process runs per row, (min-max) the spread")
    print_results(rows, COLUMNS, targets(rows), args.json)


if __name__ == "__main__":
    if worker_main(dict.fromkeys(PHASES, worker), _worker_args):
        sys.exit()
    main()
