"""Every public call answers success or an NnxSaveError.

The surface is drawn from the package itself: ``nnx_save.__all__``, the public
submodules ``nnx_save.checkpoint`` and ``nnx_save.porting``, a store's methods, and the
CLI's subcommands. Each entry point is called with every value of a hostile menu (wrong
types, huge and negative numbers, NUL bytes, over-long names, missing / dangling /
foreign / unwritable paths, directories, JSON and text files, a file where a directory
is wanted, URLs with query strings to a closed port on 127.0.0.1, and the other entry
points' valid arguments: swapped positions) in each of its first positional places and
in its numeric and path keywords; hypothesis then draws whole argument lists from the
same menu (derandomized). Each call must

- return, or raise a subclass of :class:`nnx_save.errors.NnxSaveError` (the CLI: exit
  status 0, 1 or 2 and one ``nnx-save: error:`` line, never a traceback),
- within :data:`TIME_BOUND_S` (an alarm) and an address space capped for the module,
- and, when it refuses, leave the files under its scratch directory as they were.

``test_the_surface_is_the_package_s`` fails when a public name joins the package without
joining :data:`ENTRIES`; ``test_pairs_covered`` states how many (entry point, menu value)
pairs the sweep covers.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import signal
import socket
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
from _limits import address_space_over
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import nnx_save
import nnx_save.checkpoint as ckpt
import nnx_save.porting as porting
from nnx_save.cli import main as cli_main
from nnx_save.errors import NnxSaveError

TIME_BOUND_S = 20
MEMORY_SLACK = 3 << 30


class Hang(BaseException):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise Hang(f"no answer within {TIME_BOUND_S} s")


@pytest.fixture(scope="module", autouse=True)
def bounded_memory() -> Iterator[None]:
    with address_space_over(MEMORY_SLACK):
        yield


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed once this returns: connections are refused


PORT = _closed_port()


# ------------------------------------------------------------------------------ the menu


class _Linear(nnx.Module):
    def __init__(self) -> None:
        self.w = nnx.Param(jnp.ones((2, 3)))


def _files(d: Path) -> dict[str, Any]:
    """The scratch directory's fixtures, made fresh for every call."""
    valid = d / "valid.safetensors"
    nnx_save.save_file({"w": np.ones((2, 3), np.float32)}, valid)
    (d / "dir").mkdir()
    (d / "data.json").write_text('{"weight_map": {"w": "valid.safetensors"}, "a": [1, 2]}')
    (d / "notes.txt").write_text("not a checkpoint\n")
    (d / "foreign.bin").write_bytes(b"PK\x03\x04" + bytes(60))
    (d / "dangling").symlink_to("nowhere")  # relative: each copy dangles on its own
    return {"valid": valid}


MENU: dict[str, Callable[[Path], Any]] = {
    "None": lambda d: None,
    "True": lambda d: True,
    "-1": lambda d: -1,
    "0": lambda d: 0,
    "2**64": lambda d: 2**64,
    "10**400": lambda d: 10**400,
    "nan": lambda d: float("nan"),
    "-inf": lambda d: float("-inf"),
    "'9'*400": lambda d: "9" * 400,
    "''": lambda d: "",
    "NUL": lambda d: str(d / "a\x00b.safetensors"),
    "over-long name": lambda d: str(d / ("x" * 300 + ".safetensors")),
    "bytes": lambda d: b"\xff\xfe",
    "[]": lambda d: [],
    "{}": lambda d: {},
    "object()": lambda d: object(),
    "missing path": lambda d: d / "missing.safetensors",
    "dangling link": lambda d: d / "dangling",
    "directory": lambda d: d / "dir",
    "JSON file": lambda d: d / "data.json",
    "text file": lambda d: str(d / "notes.txt"),
    "foreign zip": lambda d: d / "foreign.bin",
    "under a file": lambda d: d / "notes.txt" / "x.safetensors",
    "unwritable": lambda d: "/proc/nnx_save_contract/x.safetensors",
    "valid file": lambda d: d / "valid.safetensors",
    "URL with query": lambda d: f"http://127.0.0.1:{PORT}/model.safetensors?token=x&v=1",
    "a dict of arrays": lambda d: {"w": np.ones((2, 3), np.float32)},
    "a model": lambda d: _Linear(),
    "a builder": lambda d: _Linear,
    "a list of paths": lambda d: [d / "valid.safetensors", d / "missing.safetensors"],
}


# ------------------------------------------------------------------------- the entry points


def _store(method: str) -> Callable[..., Any]:
    def call(d: Path, *args: Any, **kwargs: Any) -> Any:
        with ckpt.OrbaxCheckpointStore(d / "store", max_to_keep=None) as store:
            return getattr(store, method)(*args, **kwargs)

    return call


def _plain(fn: Callable[..., Any]) -> Callable[..., Any]:
    return lambda d, *args, **kwargs: fn(*args, **kwargs)


def _consumed(fn: Callable[..., Any]) -> Callable[..., Any]:
    return lambda d, *args, **kwargs: list(fn(*args, **kwargs))


def _handle(d: Path, *args: Any, **kwargs: Any) -> Any:
    with nnx_save.safe_open(*args, **kwargs) as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (the safe_open API)


def _cli(command: str) -> Callable[..., Any]:
    def call(d: Path, *args: Any, **kwargs: Any) -> Any:
        argv = [command, *(os.fspath(a) if isinstance(a, os.PathLike) else str(a) for a in args)]
        for k, v in kwargs.items():
            argv += [f"--{k.replace('_', '-')}", str(v)]
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli_main(argv)
            except SystemExit as e:  # argparse refused an argument (after its error line), as a script exits
                code = e.code
        assert code in (0, 1, 2), (argv, code)
        assert "Traceback" not in err.getvalue(), err.getvalue()
        if code == 2:  # one error line (a path given may itself hold a newline)
            assert err.getvalue().count("nnx-save: error: ") == 1, err.getvalue()
        return code

    return call


def _out(name: str) -> Callable[[Path], Any]:
    return lambda d: d / name


_VALID = MENU["valid file"]
_TREE = MENU["a dict of arrays"]
# name -> (call(scratch, *args, **kwargs), valid positional args, keywords to draw)
ENTRIES: dict[str, tuple[Callable[..., Any], tuple[Callable[[Path], Any], ...], tuple[str, ...]]] = {
    "save_file": (_plain(nnx_save.save_file), (_TREE, _out("o.safetensors")), ("max_shard_size", "metadata")),
    "load_file": (_plain(nnx_save.load_file), (_VALID,), ("num_threads", "max_inflight_bytes")),
    "save_model": (_plain(nnx_save.save_model), (MENU["a model"], _out("m.safetensors")), ("max_shard_size",)),
    "load_model": (_plain(nnx_save.load_model), (MENU["a builder"], _VALID), ("num_threads",)),
    "save_pod": (_plain(nnx_save.save_pod), (_TREE, _out("pod")), ("metadata",)),
    "safe_open": (_handle, (_VALID,), ("framework", "backend", "max_inflight_bytes", "num_threads")),
    "iter_tensors": (_consumed(nnx_save.iter_tensors), (_VALID,), ("max_batch_bytes", "num_threads", "dtype")),
    "read_header": (_plain(nnx_save.read_header), (_VALID,), ()),
    "convert": (_plain(nnx_save.convert), (_VALID, _out("c.safetensors")), ("max_shard_size", "key")),
    "wait_for_saves": (_plain(nnx_save.wait_for_saves), (), ("timeout",)),
    "LoadOptions": (_plain(nnx_save.LoadOptions), (), ("max_inflight_bytes", "num_threads", "read_chunk_bytes")),
    "SaveOptions": (_plain(nnx_save.SaveOptions), (), ("max_shard_size", "progress", "blocking")),
    "SaveHandle": (_plain(nnx_save.SaveHandle), (_out("h.safetensors"),), ()),
    "OrbaxCheckpointStore": (_plain(ckpt.OrbaxCheckpointStore), (_out("store"),), ("max_to_keep",)),
    "store.save": (_store("save"), (lambda d: 1, lambda d: {"model": {"w": jnp.ones(2)}}), ("metrics",)),
    "store.restore": (_store("restore"), (lambda d: 1,), ()),
    "store.delete": (_store("delete"), (lambda d: 1,), ()),
    "resolve_checkpoint_dir": (_plain(ckpt.resolve_checkpoint_dir), (_out("ck"),), ("run_dir",)),
    "restore_into": (_plain(ckpt.restore_into), (MENU["a model"], lambda d: {"w": jnp.ones((2, 3))}), ()),
    "Retention": (_plain(ckpt.Retention), (), ("latest", "best", "metric", "every", "newer_than")),
    "porting.rename": (_plain(porting.rename), (lambda d: r"a\.(\d+)", lambda d: r"b/\1"), ()),
    "porting.split": (_plain(porting.split), (lambda d: "qkv", lambda d: ("q", "k")), ("sizes",)),
    "porting.concat": (_plain(porting.concat), (lambda d: ("a", "b"), lambda d: "ab"), ("sizes",)),
    "porting.stack": (_plain(porting.stack), (lambda d: r"h\.(\d+)\.w", lambda d: "w"), ()),
    "porting.unstack": (_plain(porting.unstack), (lambda d: "w", lambda d: r"h/\1/w"), ()),
    "porting.add": (_plain(porting.add), (lambda d: ("a", "b"), lambda d: "ab"), ("into",)),
    "porting.tie": (_plain(porting.tie), (lambda d: "a", lambda d: "b"), ()),
    "porting.ignore": (_plain(porting.ignore), (lambda d: "a",), ()),
    "porting.transpose": (_plain(porting.transpose), (lambda d: "a", lambda d: (1, 0)), ()),
    "porting.reshape": (_plain(porting.reshape), (lambda d: "a", lambda d: (2, 3)), ("source_shape",)),
    "porting.torch_linear": (_plain(porting.torch_linear), (lambda d: "fc", lambda d: "fc"), ()),
    "porting.torch_conv": (_plain(porting.torch_conv), (lambda d: "c", lambda d: "c"), ("spatial_dims",)),
    "porting.torch_conv_axes": (_plain(porting.torch_conv_axes), (lambda d: 2,), ()),
    "porting.torch_lstm": (_plain(porting.torch_lstm), (lambda d: "l", lambda d: "l"), ("layer", "cell")),
    "porting.torch_embedding": (_plain(porting.torch_embedding), (lambda d: "e", lambda d: "e"), ()),
    "porting.torch_layer_norm": (_plain(porting.torch_layer_norm), (lambda d: "n", lambda d: "n"), ()),
    "porting.torch_rms_norm": (_plain(porting.torch_rms_norm), (lambda d: "n", lambda d: "n"), ()),
    "porting.torch_batch_norm": (_plain(porting.torch_batch_norm), (lambda d: "n", lambda d: "n"), ()),
    "porting.torch_conv_transpose": (
        _plain(porting.torch_conv_transpose),
        (lambda d: "c", lambda d: "c"),
        ("spatial_dims",),
    ),
    "porting.torch_group_norm": (_plain(porting.torch_group_norm), (lambda d: "n", lambda d: "n"), ()),
    "porting.torch_gru": (_plain(porting.torch_gru), (lambda d: "g", lambda d: "g"), ("layer", "layers")),
    "porting.torch_weight_norm": (_plain(porting.torch_weight_norm), (lambda d: "h", lambda d: "h"), ("dim", "names")),
    "porting.weight_norm": (_plain(porting.weight_norm), (lambda d: "h", lambda d: "h/kernel"), ("dim", "names")),
    "porting.compute": (
        lambda d, patterns, target, fn, inverse=lambda w: w, **kw: porting.compute(
            patterns, target, fn, inverse=inverse, **kw
        ),
        (lambda d: ("a", "b"), lambda d: "ab", lambda d: lambda a, b: a + b),
        ("inverse", "tolerance"),
    ),
    "porting.hf_conv1d": (_plain(porting.hf_conv1d), (lambda d: "c", lambda d: "c"), ()),
    "porting.shapes_of": (_plain(porting.shapes_of), (_TREE,), ()),
    "porting.Rules": (_plain(porting.Rules), (lambda d: porting.rename("a", "b"),), ("direction",)),
    "cli inspect": (_cli("inspect"), (_VALID,), ()),
    "cli verify": (_cli("verify"), (_VALID,), ()),
    "cli diff": (_cli("diff"), (_VALID, _VALID), ()),
    "cli convert": (_cli("convert"), (_VALID, _out("cli.safetensors")), ("max_shard_size",)),
}


# ------------------------------------------------------------------------------ the contract


def _tree(d: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``d`` with its kind and size (a file's bytes: its size and mtime)."""
    out = {}
    for root, dirs, files in os.walk(d):
        for name in dirs + files:
            st = os.lstat(os.path.join(root, name))
            out[os.path.relpath(os.path.join(root, name), d)] = (
                st.st_mode,
                st.st_size,
                st.st_mtime_ns * (name in files),
            )
    return out


COVERED: set[tuple[str, str]] = set()


PURE = (*tuple(name for name in ENTRIES if name.startswith("porting.")), "LoadOptions", "SaveOptions", "Retention")
_SHARED: list[Path] = []  # the fixtures pure entry points see (they touch no file)


def _scratch(entry: str) -> Path:
    """A fresh copy of the fixtures (made once, copied without fsync) for an entry point
    that may touch files; one shared directory for the pure ones."""
    if not _SHARED:
        _SHARED.append(Path(tempfile.mkdtemp(prefix="contract-fixtures-")))
        _files(_SHARED[0])
    if entry in PURE:
        return _SHARED[0]
    d = Path(tempfile.mkdtemp(prefix="contract-")) / "d"
    shutil.copytree(_SHARED[0], d, symlinks=True)
    return d


def holds(entry: str, args: tuple[Any, ...], keywords: dict[str, Any], labels: tuple[str, ...]) -> None:
    """Call ``entry`` in a fresh scratch directory: success, or a typed refusal that
    changed no file there."""
    call, _, _ = ENTRIES[entry]
    d = _scratch(entry)
    try:
        values = [a(d) for a in args]
        kw = {k: v(d) for k, v in keywords.items()}
        before, cwd = _tree(d), os.getcwd()
        previous = signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(TIME_BOUND_S)
        try:
            os.chdir(d)  # a relative path ("0", "None" given to the CLI) lands in the scratch directory
            with warnings.catch_warnings():  # the contract is about what is raised; warnings are the caller's
                warnings.simplefilter("ignore")
                call(d, *values, **kw)
        except NnxSaveError:
            assert _tree(d) == before, f"{entry}{labels}: a refusal changed files"
        except Exception as e:
            raise AssertionError(f"{entry}{labels}: {type(e).__name__}: {e}") from e
        finally:
            os.chdir(cwd)
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)
        COVERED.update((entry, label) for label in labels if label in MENU)
    finally:
        if entry not in PURE:
            nnx_save.wait_for_saves()
            shutil.rmtree(d.parent, ignore_errors=True)


def _sweep(entry: str) -> Iterator[tuple[tuple[Any, ...], dict[str, Any], str]]:
    """Each menu value in each positional place (the others valid), then in each keyword."""
    _, valid, keywords = ENTRIES[entry]
    for label, value in MENU.items():
        for i in range(max(len(valid), 1)):
            args = (*valid[:i], value, *valid[i + 1 :])
            yield args, {}, label
        for k in keywords:
            yield valid, {k: value}, label


@pytest.mark.parametrize("entry", ENTRIES)
def test_every_entry_point_with_every_menu_value(entry):
    """Every value of the menu, in every argument position of ``entry``: the pairs are
    counted per entry (each test may run in another xdist worker), 45 x 30 in all."""
    for args, keywords, label in _sweep(entry):
        holds(entry, args, keywords, (label,))
    missed = sorted(set(MENU) - {v for e, v in COVERED if e == entry})
    assert missed == [], f"{entry}: menu values the sweep never passed: {missed}"


@settings(max_examples=50, deadline=None, derandomize=True)
@given(st.sampled_from(sorted(ENTRIES)), st.data())
def test_drawn_argument_lists(entry, data):
    """Whole argument lists drawn from the menu: several hostile values at once."""
    _, valid, keywords = ENTRIES[entry]
    labels = data.draw(st.lists(st.sampled_from(sorted(MENU)), min_size=len(valid), max_size=len(valid)))
    chosen = data.draw(st.lists(st.sampled_from(keywords), max_size=len(keywords), unique=True)) if keywords else []
    names = data.draw(st.lists(st.sampled_from(sorted(MENU)), min_size=len(chosen), max_size=len(chosen)))
    holds(
        entry,
        tuple(MENU[x] for x in labels),
        {k: MENU[x] for k, x in zip(chosen, names, strict=True)},
        (*labels, *names),
    )


def test_the_surface_is_the_package_s():
    """A public name added to the package must join ENTRIES (classes of errors and plain
    data records aside)."""

    def public(module: Any, prefix: str = "") -> set[str]:
        names = getattr(module, "__all__", None) or [n for n in dir(module) if not n.startswith("_")]
        out = set()
        for n in names:
            obj = getattr(module, n)
            if not callable(obj) or getattr(obj, "__module__", "") == "typing":
                continue  # a type alias (porting's RuleKind: a Literal) is no entry point
            if isinstance(obj, type) and (issubclass(obj, (BaseException, tuple)) or (n[0].isupper() and prefix)):
                continue  # errors, warnings; the submodules' record classes (rules as data, reports)
            if callable(obj) and not isinstance(obj, type(os)):
                out.add(prefix + n)
        return out

    surface = public(nnx_save) | public(ckpt) | public(porting, "porting.")
    records = {
        "LoadReport",
        "Header",
        "Checkpoint",
        "CheckpointMetadata",
        "Producer",
        "WriteRefusal",
        "CheckpointStore",
    }
    untested = surface - set(ENTRIES) - records - {"porting.coverage"}  # records the library returns
    assert untested == set(), untested
