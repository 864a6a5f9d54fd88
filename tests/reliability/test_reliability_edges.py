"""Inputs that could end in a foreign exception raise a typed NnxSaveError
naming the file, key or argument, before any data is read where the header tells:
odd temporary names and directory entries, JSON metadata nested absurdly deep, an
unknown PRNG implementation, a declared tensor larger than the memory limit, a dtype
the device cannot hold, a deleted jax array, a metric past float64."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _errors import raises_check
from _limits import address_space_over
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import nnx_save
from nnx_save.checkpoint import OrbaxCheckpointStore
from nnx_save.cli import main as cli_main
from nnx_save.errors import OptionError

DEEP = "[" * 200_000 + "]" * 200_000


def write_raw(path, header: dict, data: bytes = b"", size: int | None = None) -> None:
    """A safetensors file with exactly this header (and a sparse data section of ``size``)."""
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)
        if size is not None:
            f.truncate(8 + len(raw) + size)


def four_floats(path, metadata: dict[str, str]) -> None:
    entry = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
    write_raw(path, {"w": entry, "__metadata__": metadata}, np.arange(4, dtype=np.float32).tobytes())


# -------------------------------------------------------------- odd names beside the target


def temporary_name(target, monkeypatch) -> str:
    """The name a save of ``target`` gives its temporary,
    ``.<name>.nnx_save-tmp-<host>-<pid>-<random>`` (docs/reliability.md): seen as a save of
    the same name in a directory beside it renames it."""
    renamed: list[str] = []
    real = os.replace
    with monkeypatch.context() as spy:
        spy.setattr(
            os, "replace", lambda a, b, *args, **kw: renamed.append(os.path.basename(a)) or real(a, b, *args, **kw)
        )
        probe = target.parent / "probe"
        probe.mkdir()
        nnx_save.save_file({"w": np.zeros(1, np.float32)}, probe / target.name)
    shutil.rmtree(probe)
    (name,) = renamed
    return name


@pytest.mark.parametrize("pid", ["99999999999999999999999", "²", "-1", ""])
def test_a_stale_temporary_with_an_odd_pid_never_breaks_a_save(tmp_path, pid, monkeypatch):
    target = tmp_path / "w.safetensors"
    host = temporary_name(target, monkeypatch).rsplit("-", 2)[0]  # up to -<pid>-<random>
    odd = tmp_path / f"{host}-{pid}-abcd1234"
    odd.write_bytes(b"left over")
    nnx_save.save_file({"w": np.arange(3, dtype=np.float32)}, target)
    nnx_save.save_file({"w": np.arange(3, dtype=np.float32) + 1}, target)  # every later save too
    np.testing.assert_array_equal(nnx_save.load_file(target)["w"], np.arange(3, dtype=np.float32) + 1)
    assert odd.exists()  # not a name this module makes: kept


def test_a_directory_entry_named_superscript_two_does_not_break_load_file(tmp_path):
    nnx_save.save_file({"w": np.arange(3, dtype=np.float32)}, tmp_path / "model.safetensors")
    (tmp_path / "²").mkdir()
    (tmp_path / "³").write_text("")
    np.testing.assert_array_equal(nnx_save.load_file(tmp_path)["w"], np.arange(3, dtype=np.float32))


# -------------------------------------------------------------------- JSON metadata, deep


def test_checksums_nested_200000_deep_are_a_checksum_error(tmp_path, capsys):
    path = tmp_path / "deep.safetensors"
    four_floats(path, {"nnx_save.checksums": DEEP, "nnx_save.checksum_algorithm": "xxh3_64"})
    message = f"{path}: __metadata__['nnx_save.checksums'] is not valid JSON: nested too deeply"
    with pytest.raises(nnx_save.ChecksumError, match=re.escape(message)):
        nnx_save.load_file(path, verify=True)
    assert cli_main(["verify", str(path)]) == 1
    assert message in capsys.readouterr().out
    assert cli_main(["inspect", str(path)]) == 0
    assert "nnx_save.checksums: <malformed>" in capsys.readouterr().out


class _Scalar(nnx.Module):
    def __init__(self) -> None:
        self.w = nnx.Param(jnp.zeros(4))


def test_scalars_nested_200000_deep_are_a_metadata_error_in_load_model(tmp_path):
    path = tmp_path / "deep.safetensors"
    four_floats(path, {"nnx_save.scalars": DEEP})
    message = f"{path}: __metadata__['nnx_save.scalars'] is not valid JSON: nested too deeply"
    with raises_check("metadata", match=re.escape(message)):
        nnx_save.load_model(_Scalar, path)


class _Keyed(nnx.Module):
    def __init__(self) -> None:
        self.w = nnx.Param(jnp.zeros(4))
        self.k = nnx.RngKey(jax.random.key(0))


def test_an_unknown_rng_impl_is_a_metadata_error_naming_the_key(tmp_path):
    good, bad = tmp_path / "good.safetensors", tmp_path / "bad.safetensors"
    nnx_save.save_model(_Keyed(), good)
    raw = good.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    header["__metadata__"]["nnx_save.rng_impl"] = json.dumps({"k": "no_such_prng"})
    body = raw[8 + n :]
    write_raw(bad, header, body)
    message = f"{bad}: __metadata__['nnx_save.rng_impl'] names the PRNG implementation 'no_such_prng' for 'k'"
    with raises_check("metadata", match=re.escape(message)):
        nnx_save.load_model(_Keyed, bad)


# ------------------------------------------------------------ sizes, dtypes, deleted arrays


def test_a_64_gib_tensor_under_a_memory_limit_is_a_host_memory_error_naming_file_and_tensor(tmp_path):
    path = tmp_path / "huge.safetensors"
    n = 64 << 30
    write_raw(path, {"huge": {"dtype": "F32", "shape": [n // 4], "data_offsets": [0, n]}}, size=n)
    message = f"{path}: cannot allocate host memory for tensor 'huge' (64.0 GiB;"
    with address_space_over(2 << 30):  # the address space capped at its present size + 2 GiB
        with pytest.raises(nnx_save.HostMemoryError, match=re.escape(message)) as caught:
            nnx_save.load_file(path)
        with nnx_save.safe_open(path) as f, pytest.raises(nnx_save.HostMemoryError, match=re.escape(str(path))):
            f.get_slice("huge")[: n // 8]
    assert (caught.value.file, caught.value.key, caught.value.nbytes) == (str(path), "huge", n)
    assert isinstance(caught.value, MemoryError)


@pytest.mark.parametrize("dtype", [ml_dtypes.float6_e2m3fn, ml_dtypes.float6_e3m2fn])
def test_a_dtype_jax_cannot_hold_into_a_shape_dtype_struct_is_refused_before_reading(tmp_path, dtype):
    path = tmp_path / "f6.safetensors"
    values = np.arange(8, dtype=np.float32).astype(dtype)
    nnx_save.save_file({"w": values}, path)
    header = nnx_save.read_header(path)
    os.truncate(path, 0)  # from here any read of the tensor's bytes fails
    message = f"{path}: tensor 'w': jax on cpu cannot hold dtype {np.dtype(dtype)} (nothing was read)"
    with pytest.raises(nnx_save.DtypeMismatchError, match=re.escape(message)):
        nnx_save.load_file(header, abstract={"w": jax.ShapeDtypeStruct((8,), dtype)})
    with pytest.raises(nnx_save.errors.TruncatedFileError, match=re.escape("(was it truncated while loading?)")):
        nnx_save.load_file(header)  # a read is seen
    nnx_save.save_file({"w": values}, path)
    np.testing.assert_array_equal(nnx_save.load_file(path)["w"], values)  # onto the host it loads exactly


@pytest.mark.parametrize("blocking", [True, False])
def test_save_file_of_a_deleted_jax_array_names_the_key(tmp_path, blocking):
    gone = jnp.ones(4)
    gone.delete()
    message = "model/w: the jax array has been deleted (donated to a jitted call, or .delete()d)"
    with pytest.raises(nnx_save.UnsupportedValueError, match=re.escape(message)):
        nnx_save.save_file({"model": {"w": gone}}, tmp_path / "w.safetensors", blocking=blocking)
    assert not (tmp_path / "w.safetensors").exists()


def test_store_save_of_a_deleted_jax_array_names_the_leaf(tmp_path):
    gone = jnp.ones(4)
    gone.delete()
    with OrbaxCheckpointStore(tmp_path) as store:
        with pytest.raises(nnx_save.UnsupportedValueError, match=re.escape("model/w: the jax array has been deleted")):
            store.save(1, {"model": {"w": gone}})
        assert store.list_steps() == []


def test_a_metric_past_float64_is_an_option_error(tmp_path):
    with OrbaxCheckpointStore(tmp_path) as store:
        message = "metrics['loss'] = 1000000000000000000000000000000000000000 ... (401 characters) is too large"
        with pytest.raises(OptionError, match=re.escape(message)):
            store.save(1, {"model": {"w": jnp.ones(2)}}, metrics={"loss": 10**400})
        assert store.list_steps() == []


# -------------------------------------------------------------- any tensor name a file may hold

_KEYS = st.lists(
    st.one_of(st.sampled_from(["", "source:", "source:w", "w", "source:source:w"]), st.text(max_size=12)),
    min_size=1,
    max_size=5,
    unique=True,
).filter(lambda keys: "__metadata__" not in keys)


@settings(max_examples=30, deadline=None)
@given(keys=_KEYS)
def test_every_tensor_name_a_file_holds_loads_back(tmp_path_factory, keys):
    """Any name is a tensor name: ``""`` (a foreign file) or ``"source:w"`` (one save_file
    writes itself) must not be taken for the engine's own names of a transform's source
    or owner, read and then dropped with a bare KeyError."""
    path = tmp_path_factory.mktemp("keys") / "m.safetensors"
    header = {k: {"dtype": "F32", "shape": [2], "data_offsets": [8 * i, 8 * i + 8]} for i, k in enumerate(keys)}
    values = {k: np.array([i, -i], np.float32) for i, k in enumerate(keys)}
    write_raw(path, header, b"".join(values[k].tobytes() for k in keys))
    for loaded in (nnx_save.load_file(path), dict(nnx_save.iter_tensors(path))):
        assert sorted(loaded) == sorted(keys) and all(np.array_equal(loaded[k], values[k]) for k in keys)
