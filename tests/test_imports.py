"""The package's import graph: one way, no cycles (docs/design.md), and light to import.

The graph is read from the source with ``ast`` (every ``import`` statement, those
inside functions included), so an import moved into a function to dodge a cycle
still counts.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import nnx_save

PACKAGE = Path(nnx_save.__file__).parent


def _modules(root: Path) -> dict[str, Path]:
    out = {}
    for file in sorted(root.rglob("*.py")):
        parts = file.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = file
    return out


def _base(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module a ``from ... import`` statement imports from."""
    if not node.level:
        return node.module or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[: len(parts) - node.level + 1]
    return ".".join(parts + ([node.module] if node.module else []))


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The package module that defines ``name`` (itself, or the closest enclosing one)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _targets(node: ast.Import | ast.ImportFrom, module: str, modules: dict[str, Path], is_package: bool) -> set[str]:
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:  # `from . import _x` imports the submodule _x; `from ._x import f` imports _x
        base = _base(node, module, is_package)
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    return {owner for n in names if (owner := _owner(n, modules)) is not None and owner != module}


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """``{module: modules of the package it imports}``, from every import statement."""
    modules = _modules(root)
    graph: dict[str, set[str]] = {}
    for name, file in modules.items():
        graph[name] = set()
        for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"), str(file))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[name] |= _targets(node, name, modules, file.name == "__init__.py")
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_graph_reader_sees_function_local_imports_and_cycles(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from ._a import f as f\n")
    (pkg / "_a.py").write_text("def f():\n    from . import _b\n    return _b\n")
    (pkg / "_b.py").write_text("from ._c import g\n")
    (pkg / "_c.py").write_text("import pkg._a\n")
    (pkg / "_d.py").write_text("from . import _c\n")
    graph = import_graph(pkg)
    assert graph == {
        "pkg": {"pkg._a"},
        "pkg._a": {"pkg._b"},
        "pkg._b": {"pkg._c"},
        "pkg._c": {"pkg._a"},
        "pkg._d": {"pkg._c"},
    }
    assert cycles(graph) == [["pkg._a", "pkg._b", "pkg._c"]]


def test_the_package_has_no_import_cycle():
    found = cycles(import_graph())
    assert found == [], "import cycles (each line one strongly connected set of modules):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


# The layers, first to last (docs/design.md): a module imports only its own layer and
# earlier ones. errors, _config, _version, _options (the checks every option object
# shares) and _lazy_import (the packages' PEP 562 __getattr__) are the base every module
# may import. Porting rules are pure (errors and
# format only), so they sit low and the front door can type ``rules=``. _progress
# formats byte counts with format._units, so it sits after format. load and save are
# siblings: neither imports the other (SIBLINGS). Layouts sit above both: each format
# reads through the load engine and writes through the save machinery. conversion
# reads Orbax sources through checkpoint. The package top (the public API) sits with
# cli, which works on that API only.
LAYERS = (
    ("errors", "_config", "_version", "_options", "_lazy_import", "_frozen"),
    ("format",),
    ("porting",),
    ("io", "_progress"),
    ("load", "save"),
    ("layouts",),
    ("bridges",),
    ("checkpoint",),
    ("conversion",),
    ("", "cli", "__main__"),
)
SIBLINGS = (("load", "save"),)


def layer(module: str) -> int:
    """The index in :data:`LAYERS` of a module of the package (``nnx_save.io._kv`` -> 2)."""
    part = module.split(".")[1] if "." in module else ""
    (rank,) = [i for i, names in enumerate(LAYERS) if part in names]
    return rank


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``"a -> b"`` for each import of a later layer, sorted."""
    return sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets if layer(t) > layer(m))


def test_every_module_has_a_layer_and_imports_point_one_way():
    graph = import_graph()
    found = upward_imports(graph)
    assert found == [], "imports of a later layer (LAYERS, docs/design.md):\n" + "\n".join(found)


def sibling_imports(graph: dict[str, set[str]]) -> list[str]:
    """``"a -> b"`` for each import between two sibling packages (:data:`SIBLINGS`), sorted."""
    package = {m: m.split(".")[1] if "." in m else "" for m in graph}
    pairs = {frozenset(s) for s in SIBLINGS}
    return sorted(
        f"{m} -> {t}"
        for m, targets in graph.items()
        for t in targets
        if package[m] != package.get(t, "") and frozenset((package[m], package.get(t, ""))) in pairs
    )


def test_load_and_save_are_siblings_that_do_not_import_each_other(tmp_path):
    found = sibling_imports(import_graph())
    assert found == [], "imports between siblings (SIBLINGS):\n" + "\n".join(found)
    pkg = tmp_path / "nnx_save"
    for sub in ("load", "save"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "save" / "_w.py").write_text("from ..load import _plan\n")
    (pkg / "load" / "_plan.py").write_text("")
    assert sibling_imports(import_graph(pkg)) == ["nnx_save.save._w -> nnx_save.load._plan"]


def _package_of(module: str) -> str:
    """The subpackage a module belongs to (``nnx_save.io._kv`` -> ``io``); ``""`` for the top."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and not parts[1].startswith("_")) else ""


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_crossings(root: Path = PACKAGE) -> list[str]:
    """``"module: name from source"`` for each private name (``_x``, not a module, not a
    dunder) that a module takes from another package: imported (``from ..io._a import
    _f``) or read off an imported module (``_a._f``). Sorted."""
    modules = _modules(root)
    found = []
    for name, file in modules.items():
        tree = ast.parse(file.read_text(encoding="utf-8"), str(file))
        bound: dict[str, str] = {}  # local name -> the package module it is bound to
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = _base(node, name, file.name == "__init__.py")
            for a in node.names:
                full = f"{base}.{a.name}"
                if full in modules:
                    bound[a.asname or a.name] = full
                elif _private(a.name) and base in modules and _package_of(base) != _package_of(name):
                    found.append(f"{name}: {a.name} from {base}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
                source, attr = bound[node.value.id], node.attr
                crosses = _package_of(source) != _package_of(name)
                if _private(attr) and f"{source}.{attr}" not in modules and crosses:
                    found.append(f"{name}: {attr} from {source}")
    return sorted(set(found))


def test_no_private_name_is_used_across_packages(tmp_path):
    found = private_crossings()
    assert found == [], "private names used outside their package (make them public there):\n" + "\n".join(found)
    pkg = tmp_path / "nnx_save"
    for sub in ("io", "save"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "io" / "_a.py").write_text("def _f(): pass\ndef g(): pass\n")
    (pkg / "io" / "_b.py").write_text("from ._a import _f\n")  # same package: allowed
    (pkg / "save" / "_w.py").write_text("from ..io._a import _f, g\nfrom ..io import _a\n_a._f()\n_a.g()\n")
    assert private_crossings(pkg) == ["nnx_save.save._w: _f from nnx_save.io._a"]
    (pkg / "save" / "_w.py").write_text("from ..io import _a as a\na._f()\n")
    assert private_crossings(pkg) == ["nnx_save.save._w: _f from nnx_save.io._a"]


def test_the_layer_check_sees_a_lazy_upward_import(tmp_path):
    pkg = tmp_path / "nnx_save"
    (pkg / "io").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "io" / "__init__.py").write_text("")
    (pkg / "io" / "_x.py").write_text("def f():\n    from ..save import _write\n    return _write\n")
    (pkg / "save").mkdir()
    (pkg / "save" / "__init__.py").write_text("")
    (pkg / "save" / "_write.py").write_text("from ..io import _x\n")
    assert upward_imports(import_graph(pkg)) == ["nnx_save.io._x -> nnx_save.save._write"]


def _imports_after(code: str, *, full: bool = False) -> set[str]:
    """The top-level modules (``full``: all modules) a fresh interpreter has imported after running ``code``."""
    name = "m" if full else "m.split('.')[0]"
    probe = (
        f"{code}\nimport sys\nnames = sorted({{{name} for m in sys.modules}})\nimport json\nprint(json.dumps(names))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PACKAGE.parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return set(json.loads(done.stdout.splitlines()[-1]))


def test_import_and_read_header_import_neither_jax_nor_flax_nor_orbax(tmp_path):
    path = tmp_path / "w.safetensors"
    nnx_save.save_file({"w": np.arange(4, dtype=np.float32)}, path)
    loaded = _imports_after(f"import nnx_save\nassert nnx_save.read_header({str(path)!r})['w'].shape == (4,)")
    assert {"nnx_save", "numpy"} <= loaded
    assert loaded.isdisjoint({"jax", "jaxlib", "flax", "orbax", "torch"})


def test_a_small_safe_open_read_imports_no_subprocess_socket_or_engine(tmp_path):
    """``import nnx_save`` and a small slice through ``safe_open``: no module that only a
    save, an HTTP read or a large read needs (ctypes.util ran ldconfig in a subprocess
    at import; the engine brings its threads and planner)."""
    path = tmp_path / "w.safetensors"
    nnx_save.save_file({"w": np.arange(64, dtype=np.float32).reshape(8, 8)}, path)
    probe = f"import nnx_save\nwith nnx_save.safe_open({str(path)!r}, 'np') as f:\n    assert f.get_slice('w')[:, 2:3].shape == (8, 1)"
    loaded = _imports_after(probe, full=True)
    assert {"nnx_save.bridges._lazy", "nnx_save.load._direct"} <= loaded
    heavy = {"subprocess", "ctypes.util", "socket", "secrets", "random", "nnx_save.load._engine", "concurrent.futures"}
    heavy |= {"json", "threading"}  # a header is parsed by json's C scanner alone; locks come from _thread
    # the records on the path are written out (nnx_save._frozen), and the descriptor limit is read by sysconf
    heavy |= {"dataclasses", "resource"}
    heavy |= {"nnx_save.format._formats"}  # the other formats' sniffers: only for a file refused as safetensors
    heavy |= {"nnx_save.porting", "nnx_save.load._report"}  # the rule kinds and the load report: on first use
    # the engine's records and options, the storage layer and the layouts' writers: a
    # local header and a direct read need none of them (each costs an import, most a dataclass)
    heavy |= {"nnx_save.load._pieces", "nnx_save.load._target", "nnx_save.load._options", "nnx_save._config"}
    heavy |= {"nnx_save.io._storage", "nnx_save.layouts._file", "nnx_save.layouts._layout"}
    assert loaded & heavy == set()


def test_a_numpy_safe_open_imports_no_framework(tmp_path):
    """``import nnx_save`` and a ``framework="numpy"`` handle (a small slice, a whole
    tensor) import neither jax, flax, orbax, transformers nor torch (a fresh process
    pays only for what it uses)."""
    path = tmp_path / "w.safetensors"
    nnx_save.save_file({"w": np.arange(64, dtype=np.float32).reshape(8, 8)}, path)
    probe = (
        f"import nnx_save\nwith nnx_save.safe_open({str(path)!r}, 'numpy') as f:\n"
        "    assert f.get_slice('w')[:, 2:3].shape == (8, 1) and f.get_tensor('w').shape == (8, 8)"
    )
    loaded = _imports_after(probe)
    assert "nnx_save" in loaded
    assert loaded & {"jax", "jaxlib", "flax", "orbax", "transformers", "torch"} == set()


def test_the_nnx_bridge_is_imported_on_first_use():
    loaded = _imports_after("import nnx_save\nnnx_save.load_model, nnx_save.save_pod")
    assert {"jax", "flax"} <= loaded and "orbax" not in loaded
    assert {"load_model", "save_model", "save_pod"} <= set(dir(nnx_save))
    with pytest.raises(AttributeError, match=re.escape("module 'nnx_save' has no attribute 'save_sharded'")):
        nnx_save.save_sharded  # noqa: B018 (the pod save is save_pod)


def test_only_the_named_modules_import_flax_and_orbax():
    """Orbax only inside checkpoint/, flax only in the NNX bridges (docs/design.md)."""
    importers: dict[str, set[str]] = {"flax": set(), "orbax": set()}
    for name, file in _modules(PACKAGE).items():
        for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            for dep in importers:
                if any(n == dep or n.startswith(dep + ".") for n in names):
                    importers[dep].add(name)
    assert importers["flax"] == {"nnx_save.bridges._nnx", "nnx_save.checkpoint._nnx"}
    assert {m.rpartition(".")[0] for m in importers["orbax"]} == {"nnx_save.checkpoint"}
