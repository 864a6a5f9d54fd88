"""No code execution path: nothing nnx_save loads goes through pickle.

Two proofs:

- **The source tree**: no module of ``src/nnx_save`` imports ``pickle`` (or
  ``cPickle``, ``dill``, ``cloudpickle``, ``joblib``, ``shelve``, ``marshal``), calls
  ``pickle.load(s)``, ``numpy.load``, ``eval`` or ``exec``; the one ``torch.load``
  (the CLI's ``convert``) passes ``weights_only=True``. Read from the syntax tree,
  so docstrings that mention pickle do not count.
- **At run time**: a fresh process replaces every pickle entry point
  (``pickle.load``, ``pickle.loads``, ``pickle.Unpickler`` and their ``_pickle``
  twins) and ``numpy.load`` with recorders before anything is imported, then loads
  every kind of source: a file (``load_file``, ``read_header``), a HuggingFace
  index directory (``load_file``, ``load_model``), a remote file and index over
  HTTP (a local range-serving server), an NNX model from a file and a builder, and
  an ``OrbaxCheckpointStore`` restore (with and without templates). None of the
  recorders may fire during the loads, and torch is never imported.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

import nnx_save
from nnx_save.checkpoint import OrbaxCheckpointStore

SRC = Path(nnx_save.__file__).parent
FORBIDDEN_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node, ast.unparse(node.func)


def test_the_source_tree_has_no_pickle_path():
    problems, torch_loads = [], []
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 20
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        where = path.relative_to(SRC.parent)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                problems += [
                    f"{where}:{node.lineno} imports {a.name}"
                    for a in node.names
                    if a.name.split(".")[0] in FORBIDDEN_MODULES
                ]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FORBIDDEN_MODULES:
                problems.append(f"{where}:{node.lineno} imports from {node.module}")
        for node, name in _calls(tree):
            if name in ("eval", "exec", "np.load", "numpy.load", "pickle.load", "pickle.loads") or name.endswith(
                ("Unpickler", ".load_pickle")
            ):
                problems.append(f"{where}:{node.lineno} calls {name}")
            elif name == "torch.load":
                safe = any(
                    k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                    for k in node.keywords
                )
                torch_loads.append((str(where), safe))
    assert problems == []
    # convert (a PyTorch file, an HF directory of .bin shards): tensors only, never objects
    assert {where for where, _ in torch_loads} == {
        "nnx_save/conversion/_convert.py",
        "nnx_save/conversion/_torch_index.py",
    }
    assert all(safe for _, safe in torch_loads), torch_loads


_AUDIT = textwrap.dedent(
    r"""
    import sys, json, traceback
    fired, phase = [], ["import"]

    def recorder(name, real):
        def call(*args, **kwargs):
            fired.append((phase[0], name, "".join(traceback.format_stack(limit=8))))
            if phase[0] == "load":
                raise RuntimeError(f"{name} called while loading")
            return real(*args, **kwargs)
        return call

    import pickle, _pickle
    for module in (pickle, _pickle):
        for name in ("load", "loads", "Unpickler"):
            setattr(module, name, recorder(f"{module.__name__}.{name}", getattr(module, name)))
    import numpy
    real_np_load = numpy.load
    numpy.load = recorder("numpy.load", real_np_load)

    import http.server, threading, os
    from flax import nnx
    import nnx_save
    from nnx_save.checkpoint import OrbaxCheckpointStore

    root = sys.argv[1]

    class Ranges(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            path = os.path.join(root, self.path.lstrip("/"))
            if not os.path.isfile(path):
                self.send_error(404)
                return
            data = open(path, "rb").read()
            begin, end = (int(x) for x in self.headers["Range"].split("=")[1].split("-"))
            end = min(end, len(data) - 1)
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {begin}-{end}/{len(data)}")
            self.send_header("Content-Length", str(end - begin + 1))
            self.send_header("ETag", '"v1"')
            self.end_headers()
            self.wfile.write(data[begin:end + 1])

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ranges)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"

    def builder():
        return nnx.Sequential(nnx.Linear(8, 16, rngs=nnx.Rngs(5)), nnx.Linear(16, 4, rngs=nnx.Rngs(6)))

    loaded = {}
    phase[0] = "load"
    loaded["file"] = sorted(nnx_save.load_file(os.path.join(root, "tree.safetensors"), verify=True))
    loaded["header"] = sorted(nnx_save.read_header(os.path.join(root, "tree.safetensors")))
    loaded["index load_file"] = sorted(nnx_save.load_file(os.path.join(root, "sharded")))
    loaded["index load_model"] = nnx_save.load_model(builder, os.path.join(root, "sharded"), strict=True)[1].loaded
    loaded["model file"] = nnx_save.load_model(builder, os.path.join(root, "model.safetensors"), strict=True)[1].loaded
    loaded["model instance"] = nnx_save.load_model(builder(), os.path.join(root, "model.safetensors"))[1].loaded
    loaded["remote file"] = sorted(nnx_save.load_file(url + "/tree.safetensors"))
    loaded["remote index"] = nnx_save.load_model(builder, url + "/sharded/model.safetensors.index.json")[1].loaded
    with OrbaxCheckpointStore(os.path.join(root, "store")) as store:
        ckpt = store.restore(3)
        loaded["store"] = sorted(ckpt.items["model"])
        loaded["store templates"] = sorted(store.restore(3, templates={"model": dict(ckpt.items["model"])}).items["model"])
        loaded["store metadata"] = store.read_metadata(3).step
    phase[0] = "done"
    server.shutdown()
    print(json.dumps({"loaded": loaded, "fired": [f for f in fired if f[0] == "load"],
                      "fired_at_import": sorted({f[1] for f in fired if f[0] == "import"}),
                      "torch": "torch" in sys.modules}, default=str))
    """
)


@pytest.mark.slow  # ~17 s: a fresh process importing jax, flax and orbax, and an HTTP server
def test_loading_every_kind_of_source_never_unpickles(tmp_path):
    model = nnx.Sequential(nnx.Linear(8, 16, rngs=nnx.Rngs(0)), nnx.Linear(16, 4, rngs=nnx.Rngs(1)))
    nnx_save.save_file(
        {"w": np.arange(6, dtype=np.float32), "i": np.ones((2, 2), np.int64)}, tmp_path / "tree.safetensors"
    )
    nnx_save.save_model(model, tmp_path / "model.safetensors")
    nnx_save.save_model(model, tmp_path / "sharded", max_shard_size=300)
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    with OrbaxCheckpointStore(tmp_path / "store") as store:
        store.save(3, {"model": {"w": np.arange(4, dtype=np.float32), "step": 7}}, metrics={"loss": 0.5})
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    done = subprocess.run([sys.executable, "-c", _AUDIT, str(tmp_path)], capture_output=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-4000:]
    out = json.loads(done.stdout.decode().strip().splitlines()[-1])
    assert out["fired"] == [], out["fired"]
    assert out["torch"] is False
    params = ["layers/0/bias", "layers/0/kernel", "layers/1/bias", "layers/1/kernel"]
    assert out["loaded"] == {
        "file": ["i", "w"],
        "header": ["i", "w"],
        "index load_file": params,
        "index load_model": params,
        "model file": params,
        "model instance": params,
        "remote file": ["i", "w"],
        "remote index": params,
        "store": ["step", "w"],
        "store templates": ["step", "w"],
        "store metadata": 3,
    }
