"""One contract over the whole public surface, against one corpus of hostile inputs.

Every public entry point (``read_header``, ``load_file``, ``load_model``,
``safe_open`` / ``get_slice`` / ``iter_tensors``, ``save_file``, ``save_model``,
``save_pod``, ``convert``, every CLI command, the store's ``save`` / ``restore`` /
``list_steps``) given a hostile input either

- raises a typed :class:`~nnx_save.NnxSaveError` whose message names the file, key
  or argument at fault, or
- returns exactly the data (checked against an independent decoder of the bytes, or
  against the values saved),

within a time bound (an alarm) and a memory bound (the address space is capped for
the whole module, so nothing may allocate in proportion to a size a file declares).
The CLI's contract is its own: exit status 0, 1 or 2, and on 2 one
``nnx-save: error: ...`` line, never a traceback.

Headers and metadata are generated (hypothesis, derandomized, few examples); directory
entries, store directories, odd values and dtypes jax lacks are a fixed corpus.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _limits import address_space_over
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import nnx_save
from nnx_save.checkpoint import CheckpointDamageWarning, OrbaxCheckpointStore
from nnx_save.cli import main as cli_main

TIME_BOUND_S = 20  # per call: a hang fails the contract
MEMORY_SLACK = 3 << 30  # address space allowed beyond what the process holds at the start

# An independent decoder: the format's plain dtypes as numpy reads them.
PLAIN = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U64": np.uint64,
    "U32": np.uint32,
    "U16": np.uint16,
    "U8": np.uint8,
    "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "C64": np.complex64,
}
SIZES = {code: np.dtype(t).itemsize for code, t in PLAIN.items()}
KNOWN = {*PLAIN, "F4", "F6_E2M3", "F6_E3M2", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ"}


class Hang(BaseException):
    """A call ran past the time bound (a BaseException, so no handler swallows it)."""


def _alarm(signum: int, frame: Any) -> None:
    raise Hang(f"no answer within {TIME_BOUND_S} s")


@pytest.fixture(scope="module", autouse=True)
def bounded_memory() -> Iterator[None]:
    """Cap the address space for the whole module: a loader that allocates what a
    header declares (64 GiB, 10^12 elements) fails the contract or raises typed."""
    with address_space_over(MEMORY_SLACK):
        yield


def holds(call: Callable[[], Any], *names: str) -> Any:
    """Run ``call`` under the contract: its value, or ``None`` after a typed error
    whose message names one of ``names``. Anything else fails the test."""
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(TIME_BOUND_S)
    try:
        return call()
    except nnx_save.NnxSaveError as error:
        text = str(error)
        assert any(n in text for n in names), f"{type(error).__name__} names none of {names}: {text}"
        return None
    except FileNotFoundError as error:  # the one builtin the readers document: a path that does not exist
        assert any(n in str(error.filename) for n in names), f"FileNotFoundError names none of {names}: {error}"
        return None
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def cli(*argv: str | os.PathLike[str]) -> tuple[int, str]:
    """Run one CLI command in-process; the contract: 0, 1 or 2, and on 2 one error line."""
    out, err = io.StringIO(), io.StringIO()
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(TIME_BOUND_S)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli_main([str(a) for a in argv])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert code in (0, 1, 2), (argv, code)
    if code == 2:
        lines = err.getvalue().splitlines()
        assert lines and lines[-1].startswith("nnx-save: error: "), err.getvalue()
        assert "Traceback" not in err.getvalue()
    return code, out.getvalue()


# ------------------------------------------------------------------------ decoding by hand


def write_raw(path: Path, header: Any, data: bytes, *, size: int | None = None) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)
        if size is not None:
            f.truncate(8 + len(raw) + size)
    return path


INVALID = "invalid"  # the reference decoder's verdict on a file that breaks the format


def decode(path: Path) -> dict[str, np.ndarray] | str | None:
    """The tensors of a file decoded without the library: ``INVALID`` when the file
    breaks the format (then no reader may return data), ``None`` when a tensor has a
    dtype this decoder does not know (only typed-or-data is checked then)."""
    if path.stat().st_size > 1 << 26:
        return None  # the sparse 64 GiB file: only typed-or-data
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0] if len(raw) >= 8 else 0
    try:
        entries = {k: e for k, e in json.loads(raw[8 : 8 + n]).items() if k != "__metadata__"}
    except ValueError:  # not a JSON header at all
        return INVALID
    if any(e["dtype"] not in PLAIN for e in entries.values()):
        return INVALID if any(e["dtype"] not in KNOWN for e in entries.values()) else None
    out, spans = {}, []
    for key, entry in entries.items():
        (begin, end), shape = entry["data_offsets"], entry["shape"]
        if any(d < 0 for d in shape) or end - begin != int(np.prod(shape, dtype=object)) * SIZES[entry["dtype"]]:
            return INVALID
        if begin < 0 or end > len(raw) - 8 - n:
            return INVALID
        spans.append((begin, end))
        out[key] = np.frombuffer(raw[8 + n + begin : 8 + n + end], PLAIN[entry["dtype"]]).reshape(shape)
    at = 0
    for begin, end in sorted(spans):
        if begin != at:
            return INVALID
        at = end
    return out if at == len(raw) - 8 - n else INVALID


def check(got: dict[str, Any] | None, want: dict[str, np.ndarray] | str | None) -> None:
    """A reader's answer against the reference: data only for a valid file, and exact."""
    if got is None or want is None:
        return
    assert want != INVALID, f"a reader returned data for a file that breaks the format: {sorted(got)}"
    same(got, want)  # type: ignore[arg-type]


def same(got: dict[str, Any], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        have = np.asarray(got[key])
        assert (have.dtype, have.shape) == (value.dtype, value.shape), key
        np.testing.assert_array_equal(_bytes(have), _bytes(value), err_msg=key)  # bit-exact, NaNs too


def _bytes(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


# --------------------------------------------------------------------------- the surface


def _linear() -> nnx.Module:
    return nnx.Linear(2, 3, rngs=nnx.Rngs(0))


def read_surface(path: Path, tmp: Path) -> None:
    """Every reading entry point on one source; each answer checked by the contract."""
    where = (str(path), path.name)
    want = decode(path) if path.is_file() else None
    header = holds(lambda: nnx_save.read_header(path), *where)
    for verify in (False, True):
        check(holds(lambda verify=verify: nnx_save.load_file(path, verify=verify), *where), want)
    holds(lambda: nnx_save.load_model(_linear, path, strict=True), *where)
    if header is not None:
        holds(lambda: _every_slice(path), *where)
        check(holds(lambda: dict(nnx_save.iter_tensors(path)), *where), want)
    for command in (["inspect"], ["inspect", "--json"], ["verify"], ["diff", path]):
        cli(*command[:1], path, *command[1:])
    out = tmp / "converted.safetensors"
    if holds(lambda: nnx_save.convert(path, out), *where) is not None:
        check(nnx_save.load_file(out), want)
    cli("convert", path, tmp / "converted-cli.safetensors")


def _every_slice(path: Path) -> None:
    with nnx_save.safe_open(path) as f:
        for key in f.keys():  # noqa: SIM118 (the safe_open API)
            whole = f.get_tensor(key)
            part = f.get_slice(key)[:1] if whole.ndim else f.get_slice(key)[()]
            np.testing.assert_array_equal(np.asarray(part), np.asarray(whole[:1] if whole.ndim else whole))


# --------------------------------------------------------------- generated headers, metadata

DEPTHS = st.sampled_from([1, 3, 50, 5_000, 200_000])
JSON_TEXT = st.one_of(
    DEPTHS.map(lambda d: "[" * d + "]" * d),
    DEPTHS.map(lambda d: '{"a":' * d + "1" + "}" * d),
    st.sampled_from(["", "{", "not json", "null", "[]", '{"w": 5}', '{"w": "threefry2x32"}', '{"w": "no_prng"}']),
    st.sampled_from(['{"w": "' + "0" * 16 + '"}', '{"w": "zz"}', '{"a": 1, "a": 2}', "1" * 5000]),
)
METADATA = st.dictionaries(
    st.sampled_from(
        ["format", "nnx_save.checksums", "nnx_save.checksum_algorithm", "nnx_save.scalars", "nnx_save.rng_impl", "x"]
    ),
    JSON_TEXT,
    max_size=3,
)
DTYPE = st.sampled_from([*PLAIN, "F4", "F6_E2M3", "F8_E8M0", "bogus", "f32", ""])
SHAPE = st.lists(st.sampled_from([0, 1, 2, 3, -1, 2**31, 2**62]), max_size=3)


@st.composite
def hostile_file(draw: st.DrawFn) -> tuple[dict[str, Any], bytes]:
    """A header (mostly consistent, sometimes not) with metadata, and its data."""
    header: dict[str, Any] = {}
    at = 0
    for key in draw(st.lists(st.sampled_from(["w", "b", "a/b", "weight", "__x"]), max_size=3, unique=True)):
        code, shape = draw(DTYPE), draw(SHAPE)
        numel = int(np.prod(shape)) if all(d >= 0 for d in shape) else 1
        size = numel * SIZES.get(code, 1) if numel < 1 << 16 else 8
        offsets = draw(st.sampled_from([[at, at + size], [at, at + size + 1], [0, size], [at + size, at]]))
        header[key] = {"dtype": code, "shape": shape, "data_offsets": offsets}
        at = max(at, *offsets)
    if draw(st.booleans()):
        header["__metadata__"] = draw(METADATA)
    data = draw(st.sampled_from([bytes(range(256)) * (at // 256 + 1), b""]))[: draw(st.sampled_from([at, at - 1]))]
    return header, data


@settings(max_examples=60)
@given(hostile_file())
def test_generated_headers_and_metadata_through_every_reader(tmp_path_factory, case):
    header, data = case
    tmp = tmp_path_factory.mktemp("gen")
    read_surface(write_raw(tmp / "model.safetensors", header, data), tmp)


# -------------------------------------------------------------------------- a fixed corpus


def _valid(directory: Path) -> Path:
    path = directory / "model.safetensors"
    nnx_save.save_file({"kernel": np.arange(6, dtype=np.float32).reshape(2, 3), "bias": np.ones(3, np.float32)}, path)
    return path


def _huge(directory: Path) -> Path:
    n = 64 << 30
    return write_raw(directory / "huge.safetensors", {"w": {"dtype": "F32", "shape": [n // 4], "data_offsets": [0, n]}},
                     b"", size=n)  # fmt: skip


def _f6(directory: Path) -> Path:
    path = directory / "f6.safetensors"
    nnx_save.save_file({"w": np.arange(8, dtype=np.float32).astype(ml_dtypes.float6_e2m3fn)}, path)
    return path


def _odd_entries(directory: Path) -> Path:
    _valid(directory)
    (directory / "²").mkdir()
    (directory / "loop").symlink_to(directory / "loop")
    (directory / "dangling.safetensors").symlink_to(directory / "nowhere")
    return directory


def _index_outside(directory: Path) -> Path:
    _valid(directory)
    index = {"metadata": {}, "weight_map": {"kernel": "../model.safetensors", "bias": "model.safetensors"}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory


def _index_deep(directory: Path) -> Path:
    _valid(directory)
    (directory / "model.safetensors.index.json").write_text("[" * 200_000 + "]" * 200_000)
    return directory


def _not_safetensors(directory: Path) -> Path:
    path = directory / "model.safetensors"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    return path


def _directory_as_file(directory: Path) -> Path:
    (directory / "model.safetensors").mkdir()
    return directory / "model.safetensors"


CORPUS = {
    "valid": _valid,
    "64 GiB declared": _huge,
    "F6 (jax on cpu lacks it)": _f6,
    "odd directory entries": _odd_entries,
    "index pointing outside": _index_outside,
    "index nested 200000 deep": _index_deep,
    "a zip, not safetensors": _not_safetensors,
    "a directory named .safetensors": _directory_as_file,
}


@pytest.mark.parametrize("name", CORPUS)
def test_fixed_corpus_through_every_reader(tmp_path, name):
    (tmp_path / "in").mkdir()
    read_surface(CORPUS[name](tmp_path / "in"), tmp_path)


def test_a_dtype_jax_lacks_into_a_device_template_is_typed(tmp_path):
    path = _f6(tmp_path)
    template = {"w": jax.ShapeDtypeStruct((8,), ml_dtypes.float6_e2m3fn)}
    assert holds(lambda: nnx_save.load_file(path, abstract=template), str(path)) is None


TORCH_FILES: dict[str, Callable[[], Any]] = {  # sparse and meta tensors: tests/cli/test_cli.py (convert)
    "bf16, int8, bool": lambda: {"a": _torch().arange(4, dtype=_torch().bfloat16), "b": _torch().tensor([1, -2],
                                 dtype=_torch().int8), "c": _torch().tensor([True, False])},
    "views sharing storage": lambda: (lambda t: {"whole": t, "row": t[1], "col": t[:, 2], "t": t.T})(
        _torch().arange(12.0).reshape(3, 4)),
    "a value that is not a tensor": lambda: {"w": _torch().ones(2), "step": 7},
    "a nested training checkpoint": lambda: {"model": {"w": _torch().ones(2)}, "optimizer": {"lr": 0.1}},
    "an empty state dict": lambda: {},
    "not a dict": lambda: [_torch().ones(2)],
}  # fmt: skip


def _torch() -> Any:
    return pytest.importorskip("torch")


@pytest.mark.parametrize("name", TORCH_FILES)
def test_convert_of_odd_torch_files_is_typed_or_exact(tmp_path, name):
    torch, state = _torch(), TORCH_FILES[name]()
    source, out = tmp_path / "pytorch_model.bin", tmp_path / "model.safetensors"
    torch.save(state, source)
    cli("convert", source, tmp_path / "cli.safetensors")
    if holds(lambda: nnx_save.convert(source, out), str(source), "step", "model", "optimizer") is None:
        return
    loaded = nnx_save.load_file(out)
    assert sorted(loaded) == sorted(state)
    for key, tensor in state.items():
        want = tensor.float().numpy() if tensor.dtype == torch.bfloat16 else tensor.numpy()
        got = loaded[key].astype(np.float32) if tensor.dtype == torch.bfloat16 else loaded[key]
        np.testing.assert_array_equal(got, want, err_msg=key)


# ----------------------------------------------------------------------- writing odd values


def _deleted() -> jax.Array:
    gone = jnp.ones(3)
    gone.delete()
    return gone


ODD_TREES: dict[str, Callable[[], Any]] = {
    "a deleted jax array": lambda: {"w": _deleted()},
    "a string leaf": lambda: {"w": "text"},
    "an object array": lambda: {"w": np.array([object()], dtype=object)},
    "None": lambda: {"w": None},
    "a slash in a key": lambda: {"a/b": np.ones(2, np.float32)},
    "int and str keys that collide": lambda: {1: np.ones(2, np.float32), "1": np.zeros(2, np.float32)},
    "a typed PRNG key": lambda: {"w": jax.random.key(0)},
    "F6": lambda: {"w": np.arange(4, dtype=np.float32).astype(ml_dtypes.float6_e2m3fn)},
    "big-endian": lambda: {"w": np.arange(4, dtype=">f4")},
    "non-contiguous": lambda: {"w": np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2]},
    "0-d and empty": lambda: {"s": np.float64(2.5), "e": np.zeros((0, 3), np.float32)},
    "uint64 extremes": lambda: {"w": np.array([0, 2**64 - 1], np.uint64)},
    "complex": lambda: {"w": np.array([1 + 2j, -3j], np.complex64)},
}


def _keys(tree: Any) -> tuple[str, ...]:
    return (*(str(k) for k in tree), "<root>")


@pytest.mark.parametrize("blocking", [True, False])
@pytest.mark.parametrize("name", ODD_TREES)
def test_save_file_of_odd_values_is_typed_or_exact(tmp_path, name, blocking):
    tree, path = ODD_TREES[name](), tmp_path / "out.safetensors"

    def save() -> Any:
        handle = nnx_save.save_file(tree, path, blocking=blocking)
        return handle.result() if handle is not None else path

    if holds(save, str(path), *_keys(tree)) is None:
        assert not path.exists()
        return
    loaded = nnx_save.load_file(path)
    for key, value in tree.items():
        want = np.asarray(value)
        assert loaded[str(key)].dtype == want.dtype.newbyteorder("=") and loaded[str(key)].shape == want.shape
        np.testing.assert_array_equal(loaded[str(key)], want)


@pytest.mark.parametrize("name", ["a deleted jax array", "F6", "uint64 extremes", "a string leaf"])
def test_save_pod_of_odd_values_is_typed_or_exact(tmp_path, name):
    tree = ODD_TREES[name]()
    if holds(lambda: nnx_save.save_pod(tree, tmp_path / "pod"), str(tmp_path / "pod"), *_keys(tree)) is None:
        return
    loaded = nnx_save.load_file(tmp_path / "pod")
    for key, value in tree.items():
        np.testing.assert_array_equal(loaded[key], np.asarray(value))


class _Odd(nnx.Module):
    def __init__(self, value: Any) -> None:
        self.w = nnx.Param(jnp.ones(2))
        self.odd = nnx.Variable(value)


@pytest.mark.parametrize("value", [_deleted, lambda: "text", lambda: 2**70, lambda: None, lambda: 2.5])
def test_save_model_of_odd_variables_is_typed_or_exact(tmp_path, value):
    model, path = _Odd(value()), tmp_path / "m.safetensors"
    if holds(lambda: nnx_save.save_model(model, path), str(path), "odd") is None:
        return
    back = nnx_save.load_model(lambda: _Odd(0.0 if isinstance(model.odd.get_value(), float) else 0), path)[0]
    assert back.odd.get_value() == model.odd.get_value()


# ------------------------------------------------------------------------------ the store


def _step(directory: Path, step: int = 1) -> None:
    with OrbaxCheckpointStore(directory, max_to_keep=None) as store:
        store.save(step, {"model": {"w": jnp.arange(3.0)}, "extensions": {"lr": 0.5}}, metrics={"loss": 1.0})


def _overwrite(path: Path, text: str) -> None:
    path.write_text(text)


STORE_DIRS: dict[str, Callable[[Path], None]] = {
    "a step named ²": lambda d: (_step(d), (d / "²").mkdir()),
    "a step that is a file": lambda d: (_step(d), (d / "2").write_text("x")),
    "a symlinked step": lambda d: (_step(d / "other"), _step(d), (d / "5").symlink_to(d / "other" / "1")),
    "a store record nested deep": lambda d: (_step(d), _overwrite(d / "_nnx_save_store.json", "[" * 200_000)),
    "a store record not JSON": lambda d: (_step(d), _overwrite(d / "_nnx_save_store.json", "\xff{")),
    "a step record nested deep": lambda d: (
        _step(d),
        _overwrite(d / "1" / "nnx_save_metadata" / "metadata", "[" * 200_000),
    ),
    "a dtype record of bytes": lambda d: (
        _step(d),
        (d / "1" / "nnx_save_dtypes" / "metadata").write_bytes(b"\xff\xfe"),
    ),
    "the store path is a file": lambda d: (d.rmdir(), d.write_text("x")),
}


@pytest.mark.parametrize("name", STORE_DIRS)
def test_the_store_over_hostile_directories_is_typed_or_exact(tmp_path, name):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    STORE_DIRS[name](directory)
    where = (str(directory),)
    store = holds(lambda: OrbaxCheckpointStore(directory), *where)
    if store is None:
        return
    damaged = name in ("a step record nested deep", "a dtype record of bytes")
    with (
        pytest.warns(CheckpointDamageWarning, match=re.escape(str(directory))) if damaged else contextlib.nullcontext()
    ):
        steps = holds(store.list_steps, *where)
    holds(store.damaged_steps, *where)
    for step in steps or []:
        ckpt = holds(lambda step=step: store.restore(step), *where)
        if ckpt is not None:
            np.testing.assert_array_equal(ckpt.items["model"]["w"], np.arange(3.0))
            assert ckpt.items["extensions"] == {"lr": 0.5}
    holds(lambda: store.save(100, {"model": {"w": jnp.arange(4.0)}}), *where)
    holds(store.close, *where)


BAD_SAVES: dict[str, tuple[dict[str, Any], str]] = {
    "step -1": ({"step": -1}, "step"),
    "step True": ({"step": True}, "step"),
    "step 2**70": ({"step": 2**70}, "step"),
    "no items": ({"items": {}}, "items"),
    "an unknown item": ({"items": {"weights": {"w": jnp.ones(2)}}}, "weights"),
    "a metric past float64": ({"metrics": {"loss": 10**400}}, "loss"),
    "a metric that is a string": ({"metrics": {"loss": "low"}}, "loss"),
    "extra that is not JSON": ({"extra": {"cfg": object()}}, "cfg"),
    "extra with NaN": ({"extra": {"lr": float("nan")}}, "lr"),
    "a deleted leaf": ({"items": {"model": {"w": _deleted()}}}, "model/w"),
    "an int past int64": ({"items": {"extensions": {"n": 2**64}}}, "extensions/n"),
}


@pytest.mark.parametrize("name", BAD_SAVES)
def test_store_save_with_hostile_arguments_is_typed_and_changes_nothing(tmp_path, name):
    changes, names = BAD_SAVES[name]
    args = {"step": 2, "items": {"model": {"w": jnp.ones(2)}}, **changes}
    with OrbaxCheckpointStore(tmp_path, max_to_keep=None) as store:
        store.save(1, {"model": {"w": jnp.ones(2)}})
        step, items = args.pop("step"), args.pop("items")
        assert holds(lambda: store.save(step, items, **args), names) is None
        assert store.list_steps() == [1]


@pytest.mark.parametrize(
    "template",
    [{"lr": "x"}, {"lr": 1}, {"lr": jnp.zeros(3)}, {"lr": jax.ShapeDtypeStruct((2,), jnp.float32)}, {"other": 0.5}],
)
def test_store_restore_through_hostile_templates_is_typed_or_exact(tmp_path, template):
    _step(tmp_path)
    with OrbaxCheckpointStore(tmp_path) as store:
        ckpt = holds(lambda: store.restore(1, templates={"extensions": template}), "extensions/lr", "extensions/other")
    assert ckpt is None or ckpt.items["extensions"] == {"lr": 0.5}


EXERCISED = {
    "read_header", "load_file", "load_model", "safe_open", "iter_tensors", "save_file", "save_model", "save_pod",
    "convert",
}  # fmt: skip
TAKES_NO_INPUT = {"wait_for_saves"}


def test_every_public_function_is_under_the_contract():
    """A new public entry point must join this module's corpus."""
    public = {n for n in dir(nnx_save) if n[0].islower() and not n.startswith("_") and callable(getattr(nnx_save, n))}
    assert public - EXERCISED - TAKES_NO_INPUT == set()
