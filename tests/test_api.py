"""The public surface: ``__all__`` is the API (star-import, help(), docs/api.md agree),
every error and warning lives in ``nnx_save.errors``, and options are typed data."""

from __future__ import annotations

import ast
import builtins
import json
import os
import pydoc
import re
import subprocess
import sys
import typing
from pathlib import Path

import jax
import numpy as np
import pytest

import nnx_save
from nnx_save import errors
from nnx_save.checkpoint import _errors as ckpt_errors
from nnx_save.errors import NnxSaveError, OptionError
from nnx_save.porting import _errors as porting_errors

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "nnx_save"


def test_star_import_binds_exactly_all():
    namespace: dict = {}
    exec("from nnx_save import *", namespace)
    assert sorted(set(namespace) - {"__builtins__"}) == sorted(nnx_save.__all__)
    assert {"load_file", "save_model", "LoadOptions", "SaveOptions", "NnxSaveError"} <= set(namespace)
    assert 20 <= len(nnx_save.__all__) <= 30 and len(set(nnx_save.__all__)) == len(nnx_save.__all__)


def test_all_is_the_docs_api_page():
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    received = text[text.index("## Types you receive") : text.index("## Errors")]
    listed = re.findall(r"^\| `(\w+)` \|", text.replace(received, ""), re.M)
    assert sorted(listed) == sorted(nnx_save.__all__)


def test_help_shows_the_api_and_nothing_else():
    text = pydoc.render_doc(nnx_save, renderer=pydoc.plaintext)
    functions = text.split("\nFUNCTIONS\n")[1].split("\nDATA\n")[0]
    shown = {n for n in re.findall(r"^    (\w+)\(", functions, re.M) if not n.startswith("__")}
    assert shown == {n for n in nnx_save.__all__ if n[0].islower() and n != "errors"}
    classes = text.split("\nCLASSES\n")[1].split("\nFUNCTIONS\n")[0]
    for name in ("LoadOptions", "SaveOptions", "LoadReport", "SaveHandle", "NnxSaveError"):
        assert f"class {name}" in classes
    assert "importlib" not in text and "TYPE_CHECKING" not in text


def test_dir_lists_exactly_the_documented_names():
    """``dir(nnx_save)``: the API, the types it hands back (docs/api.md) and the errors and
    warnings (docs/errors.md), each reachable; no subpackage, no helper."""
    api = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    received = api[api.index("## Types you receive") : api.index("## Errors")]
    documented = set(re.findall(r"^\| `(\w+)` \|", received, re.M)) | set(nnx_save.__all__) | {"__version__"}
    shown = set(dir(nnx_save))
    thrown = {n for n in shown - documented if issubclass(getattr(nnx_save, n), (nnx_save.NnxSaveError, Warning))}
    assert shown - thrown == documented
    errors_page = (ROOT / "docs" / "errors.md").read_text(encoding="utf-8")
    assert [n for n in sorted(thrown) if f"{n}" not in errors_page] == []
    for name in shown:
        getattr(nnx_save, name)


def test_the_surface_itself_pulls_no_jax():
    """``__all__``, ``dir()``, the options and the errors are there without jax; the
    functions import it on first use (``from nnx_save import *`` binds them, so it does)."""
    code = "import nnx_save\nnnx_save.__all__, dir(nnx_save), nnx_save.LoadOptions(), nnx_save.SaveOptions()\n"
    code += "import nnx_save.checkpoint\nnnx_save.errors.ConfigError, nnx_save.checkpoint.CheckpointError, nnx_save.RemoteError\n"
    probe = code + "import sys, json\nprint(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC.parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert set(json.loads(done.stdout.splitlines()[-1])).isdisjoint({"jax", "jaxlib", "flax", "orbax"})


def _classes_defined(file: Path) -> list[tuple[str, list[str]]]:
    tree = ast.parse(file.read_text(encoding="utf-8"))
    return [(n.name, [ast.unparse(b) for b in n.bases]) for n in tree.body if isinstance(n, ast.ClassDef)]


# Exceptions that never leave the package: control flow between its own parts.
INTERNAL_SIGNALS = {
    "load/_execute.py: Cancelled",  # stops a load's other reads once one failed; the failure is raised
    "io/_kv.py: Unanswered",  # a wait with no answer: Sync and the store's agree raise their typed errors from it
}


# Where errors live: the shared ones in errors.py, the store's and porting's beside their code.
ERROR_MODULES = {"errors.py": errors, "checkpoint/_errors.py": ckpt_errors, "porting/_errors.py": porting_errors}


def test_every_error_and_warning_is_defined_in_an_errors_module():
    elsewhere = []
    for file in SRC.rglob("*.py"):
        where_module = file.relative_to(SRC).as_posix()
        for name, bases in _classes_defined(file):
            is_error = any(b.endswith(("Error", "Warning", "Exception")) for b in bases)
            where = f"{where_module}: {name}"
            if where_module in ERROR_MODULES:
                assert name in ERROR_MODULES[where_module].__all__ or name.startswith("_"), where
            elif is_error and not name.startswith("_") and where not in INTERNAL_SIGNALS:
                elsewhere.append(where)
    assert elsewhere == []


def _public_errors() -> list[type]:
    names = [(m, n) for m in ERROR_MODULES.values() for n in m.__all__]
    return [
        getattr(m, n) for m, n in names if isinstance(getattr(m, n), type) and issubclass(getattr(m, n), BaseException)
    ]


def test_every_public_error_is_an_nnx_save_error_and_documented():
    page = (ROOT / "docs" / "errors.md").read_text(encoding="utf-8")
    exceptions = _public_errors()
    assert 30 <= len(exceptions) <= 40  # a class only where callers handle it differently
    modules = {m.__name__ for m in ERROR_MODULES.values()}
    for cls in exceptions:
        assert issubclass(cls, (NnxSaveError, errors.NnxSaveWarning)), cls
        assert cls.__module__ in modules and cls.__doc__, cls
        assert cls.__name__ in page, cls
    assert nnx_save.RemoteError is errors.RemoteError  # drawn in docs/errors.md, and reachable


def test_checkpoint_and_porting_export_their_errors():
    import nnx_save.checkpoint
    import nnx_save.porting

    for module, home in ((nnx_save.checkpoint, ckpt_errors), (nnx_save.porting, porting_errors)):
        names = [n for n, v in vars(module).items() if isinstance(v, type) and issubclass(v, (Exception, Warning))]
        exported = [
            n
            for n in home.__all__
            if isinstance(getattr(home, n), type) and issubclass(getattr(home, n), Warning | Exception)
        ]
        assert sorted(names) == sorted(exported), module
        assert all(getattr(module, n) is getattr(home, n) for n in names), module
    with pytest.raises(
        ckpt_errors.CheckpointNotFoundError, match=re.escape("no checkpoint at step 3 in d (steps held: 1)")
    ):
        raise nnx_save.checkpoint.CheckpointNotFoundError(3, "d", [1])
    with pytest.raises(
        ckpt_errors.UnsupportedCheckpointError, match=re.escape("reads format 'nnx_save.checkpoint' up to")
    ):
        raise ckpt_errors.UnsupportedCheckpointError("format version 7")


# --- options ---------------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "w.safetensors"
    nnx_save.save_file({"w": np.arange(4, dtype=np.float32)}, path)
    return path


def test_options_and_keywords_load_the_same(saved):
    opts = nnx_save.LoadOptions(num_threads=1, verify=True, progress=False)
    tree, report = nnx_save.load_file(saved, options=opts, return_report=True)
    assert report.verified == ["w"] and tree["w"].tolist() == [0, 1, 2, 3]
    tree, report = nnx_save.load_file(saved, options=opts, max_inflight_bytes=1 << 20, return_report=True)
    assert report.verified == ["w"] and report.io.max_inflight_bytes <= 1 << 20


def test_a_setting_given_twice_is_refused_naming_it(saved, tmp_path):
    opts = nnx_save.LoadOptions(verify=True, num_threads=2)
    with pytest.raises(OptionError, match=re.escape("load_file: verify given both as a keyword and in options=")) as e:
        nnx_save.load_file(saved, options=opts, verify=False)
    assert e.value.argument == "verify" and isinstance(e.value, ValueError)
    with pytest.raises(OptionError, match=re.escape("save_file: progress given both as a keyword and in options=")):
        nnx_save.save_file(
            {"w": np.ones(2)}, tmp_path / "x.safetensors", progress=True, options=nnx_save.SaveOptions(progress=False)
        )
    assert not (tmp_path / "x.safetensors").exists()
    with pytest.raises(OptionError, match=re.escape("load_file: options must be a LoadOptions, got SaveOptions")):
        nnx_save.load_file(saved, options=nnx_save.SaveOptions())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_threads": 0}, "num_threads must be 1 to 4096, got 0"),
        ({"read_chunk_bytes": -1}, "read_chunk_bytes must be a positive int (bytes), got -1"),
        ({"max_over_read_ratio": 0.5}, "max_over_read_ratio must be >= 1.0, got 0.5"),
        ({"verify": "yes"}, "verify must be True or False, got 'yes'"),
        ({"staging": "fast"}, "staging must be one of ('auto', 'pinned', 'pageable'), got 'fast'"),
        ({"stream": 1}, "stream must be None, True or False, got 1"),  # 1 == True, yet not a bool
        ({"progress": 0}, "progress must be None, True or False, got 0"),
    ],
)
def test_bad_load_options_are_typed_errors_naming_the_argument(saved, kwargs, message):
    with pytest.raises(OptionError, match=re.escape(message)) as e:
        nnx_save.load_file(saved, **kwargs)
    assert e.value.argument == next(iter(kwargs))
    with pytest.raises(OptionError, match=re.escape(message)):
        nnx_save.LoadOptions(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"progress": 1}, "progress must be None, True or False, got 1"),  # 1 == True, yet not a bool
        ({"blocking": 0}, "blocking must be True or False, got 0"),
    ],
)
def test_bad_save_options_are_typed_errors_naming_the_argument(tmp_path, kwargs, message):
    with pytest.raises(OptionError, match=re.escape(message)) as e:
        nnx_save.save_file({"w": np.ones(2)}, tmp_path / "x.safetensors", **kwargs)
    assert e.value.argument == next(iter(kwargs))
    assert not (tmp_path / "x.safetensors").exists()
    with pytest.raises(OptionError, match=re.escape(message)):
        nnx_save.SaveOptions(**kwargs)


def test_the_load_shortcuts_are_every_option_the_functions_take_and_no_other(saved):
    """load_file and load_model take the LoadOptions fields as keywords (one TypedDict,
    ``**keywords: Unpack[LoadKeywords]``); a misspelt one is a TypeError, as for any Python function."""

    from flax import nnx

    import nnx_save.porting

    for function in (nnx_save.load_file, nnx_save.load_model):  # Rules: load_model's, imported for typing only
        hints = typing.get_type_hints(function, localns={"Rules": nnx_save.porting.Rules})
        (keywords,) = typing.get_args(hints["keywords"])
        assert set(keywords.__annotations__) < set(nnx_save.LoadOptions.__dataclass_fields__), function
    with pytest.raises(TypeError, match=re.escape("load_file() got an unexpected keyword argument 'verfy'")):
        nnx_save.load_file(saved, verfy=True)
    with pytest.raises(TypeError, match=re.escape("load_model() got an unexpected keyword argument 'threads'")):
        nnx_save.load_model(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), saved, threads=2)


def test_bad_save_options_are_typed_errors_and_write_nothing(tmp_path):
    with pytest.raises(OptionError, match=re.escape("max_shard_size=0: expected a positive number of bytes")):
        nnx_save.SaveOptions(max_shard_size=0)
    with pytest.raises(OptionError, match=re.escape("max_shard_size='5 parsecs': expected a positive number")):
        nnx_save.save_file({"w": np.ones(2)}, tmp_path / "w", options=nnx_save.SaveOptions(max_shard_size="5 parsecs"))
    with pytest.raises(OptionError, match=re.escape("blocking must be True or False, got 'no'")):
        nnx_save.save_file({"w": np.ones(2)}, tmp_path / "w.safetensors", blocking="no")
    assert os.listdir(tmp_path) == []


def test_save_pod_takes_options(tmp_path):
    handle = nnx_save.save_pod({"w": np.arange(4.0)}, tmp_path / "pod", options=nnx_save.SaveOptions(blocking=False))
    assert isinstance(handle, nnx_save.SaveHandle)
    handle.result()
    assert nnx_save.load_file(tmp_path / "pod")["w"].tolist() == [0, 1, 2, 3]
    with pytest.raises(OptionError, match=re.escape("save_pod writes a pod: max_shard_size is for save_model")):
        nnx_save.save_pod({"w": np.ones(2)}, tmp_path / "p2", options=nnx_save.SaveOptions(max_shard_size=8))
    with pytest.raises(OptionError, match=re.escape("save_pod: blocking given both as a keyword and in options=")):
        nnx_save.save_pod(
            {"w": np.ones(2)}, tmp_path / "p3", blocking=True, options=nnx_save.SaveOptions(blocking=False)
        )
    assert not (tmp_path / "p2").exists() and not (tmp_path / "p3").exists()


def test_save_options_reach_the_writers(tmp_path):
    from flax import nnx

    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    nnx_save.save_model(model, tmp_path / "hf", options=nnx_save.SaveOptions(max_shard_size=16, progress=False))
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    tree = {"a": np.arange(8.0), "b": np.ones(8)}
    nnx_save.save_file(tree, tmp_path / "tree", options=nnx_save.SaveOptions(max_shard_size="64B"))
    assert len(list((tmp_path / "tree").glob("*.safetensors"))) == 2
    assert nnx_save.load_file(tmp_path / "tree")["a"].tolist() == list(range(8))
    handle = nnx_save.save_file(
        {"w": np.ones(2)}, tmp_path / "w.safetensors", options=nnx_save.SaveOptions(blocking=False)
    )
    assert isinstance(handle, nnx_save.SaveHandle) and handle.result() == tmp_path / "w.safetensors"


def test_load_model_takes_options(tmp_path):
    from flax import nnx

    path = tmp_path / "m.safetensors"
    nnx_save.save_model(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), path)
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(1))
    nnx.update(model, jax.tree.map(lambda x: x * 0 + 7, nnx.state(model)))  # poisoned: a no-op load would keep 7s
    model, report = nnx_save.load_model(model, path, options=nnx_save.LoadOptions(verify=True))
    assert not (model.kernel.get_value() == 7).any()
    assert sorted(report.verified) == ["bias", "kernel"]
    with pytest.raises(OptionError, match=re.escape("load_model: verify given both")):
        nnx_save.load_model(model, path, verify=False, options=nnx_save.LoadOptions(verify=True))


def test_store_arguments_are_typed_errors():
    from nnx_save.checkpoint import Retention

    with pytest.raises(OptionError, match=re.escape("Retention.mode must be 'min' or 'max', got 'mid'")):
        Retention(best=1, metric="loss", mode="mid")


def test_a_bad_shard_size_for_convert_is_a_typed_error(saved, tmp_path):
    with pytest.raises(OptionError, match=re.escape("max_shard_size=0: expected a positive number of bytes")):
        nnx_save.convert(saved, tmp_path / "split", max_shard_size=0)


def test_safe_open_refuses_a_bad_setting_when_opened(saved):
    with pytest.raises(OptionError, match=re.escape("num_threads must be 1 to 4096, got 0")):
        nnx_save.safe_open(saved, num_threads=0)  # before: a ValueError at the first read
    with pytest.raises(OptionError, match=re.escape("max_over_read_ratio must be >= 1.0, got 0.5")):
        nnx_save.safe_open(saved, max_over_read_ratio=0.5)


def _documented_errors() -> tuple[str, set[str], set[str]]:
    """docs/errors.md, the error and warning names it writes in backticks, and those it
    places under ``nnx_save.checkpoint`` / ``nnx_save.porting`` (their sections, or the
    tree's ``checkpoint.`` / ``porting.`` entries)."""
    page = (ROOT / "docs" / "errors.md").read_text(encoding="utf-8")
    named = set(re.findall(r"\b([A-Z]\w*(?:Error|Warning))\b", page)) - set(dir(builtins))
    sections = re.split(r"^## ", page, flags=re.M)
    elsewhere = "".join(s for s in sections if s.startswith(("Training checkpoints", "Porting")))
    placed = set(re.findall(r"`([A-Z]\w*(?:Error|Warning))`", elsewhere))
    placed |= set(re.findall(r"(?:checkpoint|porting)\.([A-Z]\w*(?:Error|Warning))", page))
    return page, named, placed


def test_every_name_docs_errors_writes_resolves():
    """Generated from docs/errors.md: each class it names is in ``nnx_save.errors``; the
    page says every one is reachable as ``nnx_save.X`` except the checkpoint and porting
    ones, which are the same classes in ``nnx_save.checkpoint`` / ``nnx_save.porting``;
    each dotted ``nnx_save.a.b`` it writes resolves."""
    import nnx_save.checkpoint
    import nnx_save.porting

    page, named, placed = _documented_errors()
    assert len(named) >= 30 and {"DirectoryLockedError", "SafetensorError", "SourceNotFoundError"} <= named
    unresolved = []
    for name in sorted(named):
        cls = next((getattr(m, name) for m in ERROR_MODULES.values() if name in m.__all__), None)
        homes = [nnx_save.checkpoint, nnx_save.porting] if name in placed else [nnx_save]
        if not isinstance(cls, type) or not any(getattr(home, name, None) is cls for home in homes):
            unresolved.append(name)
    assert unresolved == []
    for dotted in sorted(set(re.findall(r"`(nnx_save(?:\.\w+)+)", page)) - {"nnx_save.X"}):
        if dotted.endswith(".X"):  # the page's placeholder: "nnx_save.checkpoint.X"
            dotted = dotted[:-2]
        value = nnx_save
        for part in dotted.split(".")[1:]:
            value = getattr(value, part)  # raises naming the part that does not resolve
