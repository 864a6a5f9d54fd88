"""``nnx-save convert`` / ``nnx_save.convert`` of the sources users bring that are not
plain state dicts: TorchScript archives (read as data, never run), items of an
``OrbaxCheckpointStore`` step (loadable by ``load_model`` exactly), and torch tensors
without a dense form (refused by key)."""

import _pickle
import os
import pickle
import re
import warnings
import zipfile

import numpy as np
import optax
import pytest
from _nnx_helpers import assert_differs, assert_same_state, poison, snapshot
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import nnx_save
from nnx_save.checkpoint import OrbaxCheckpointStore
from nnx_save.cli import main


def cli(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------------ TorchScript


def _scripted(path):
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = torch.nn.Sequential(
                torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4, bias=False)
            )
            self.norm = torch.nn.BatchNorm1d(4)  # buffers, num_batches_tracked an int64 0-d tensor
            self.scale = torch.nn.Parameter(torch.randn(2, 3).to(torch.bfloat16))
            self.register_buffer("table", torch.arange(12.0).reshape(3, 4).t())  # a strided view of its storage
            self.register_buffer("ids", torch.arange(5, dtype=torch.int64))
            self.cache = torch.zeros(2)  # a tensor attribute, neither parameter nor buffer: not in state_dict

        def forward(self, x):
            return self.norm(self.encoder(x)) + self.cache.sum()

    torch.manual_seed(0)
    net = Net()
    net.norm.running_mean.uniform_()
    net.norm.num_batches_tracked += 7
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.script is deprecated, still what users have
        torch.jit.script(net).save(str(path))
        return torch.jit.load(str(path)).state_dict()  # the reference (this test trusts its own file)


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    path = tmp_path_factory.mktemp("ts") / "net.pt"
    return path, _scripted(path)


def _refuse_running(monkeypatch):
    """Make every torch entry point that would run or unpickle the archive fail."""
    import torch

    def refuse(*args, **kwargs):
        raise AssertionError("convert must not load the archive through torch")

    for owner, name in ((torch.jit, "load"), (torch, "load"), (torch._C, "import_ir_module")):
        monkeypatch.setattr(owner, name, refuse)
    for owner in (pickle, _pickle):
        for name in ("load", "loads", "Unpickler"):
            monkeypatch.setattr(owner, name, refuse)


def test_torchscript_inspect_advice_converts_parameters_and_buffers_without_running_it(
    capsys, scripted, tmp_path, monkeypatch
):
    import torch

    src, reference = scripted
    code, _, err = cli(capsys, "inspect", src)
    command = f"nnx-save convert {src} net.safetensors"
    assert code == 2 and err.startswith(f"nnx-save: error: {src}: this is a TorchScript archive (torch.jit.save")
    assert err.endswith(f"convert its parameters and buffers (none of its code runs): {command}\n")
    with pytest.raises(nnx_save.NotSafetensorsError, match=re.escape(f"{src}: this is a TorchScript archive")) as e:
        nnx_save.load_file(src)
    assert e.value.format == "a TorchScript archive (torch.jit.save: net/code/, net/constants.pkl)"  # by every name
    _refuse_running(monkeypatch)
    monkeypatch.chdir(tmp_path)
    code, text, err = cli(capsys, *command.split()[1:])  # the command inspect gave, as given
    assert (code, err) == (0, "") and text == f"convert: {src} -> net.safetensors: {len(reference)} tensors\n"
    loaded = nnx_save.load_file(tmp_path / "net.safetensors", verify=True)
    assert sorted(loaded) == sorted(reference) and "cache" not in loaded
    for key, tensor in reference.items():
        bf16 = str(tensor.dtype) == "torch.bfloat16"  # numpy has no bfloat16: compare the bits
        expected = tensor.view(torch.int16).numpy() if bf16 else tensor.numpy()
        got = loaded[key].view(np.int16) if bf16 else loaded[key]
        assert got.dtype == expected.dtype and got.shape == expected.shape, key
        np.testing.assert_array_equal(got, expected, err_msg=key)
    assert str(loaded["scale"].dtype) == "bfloat16" and int(loaded["norm.num_batches_tracked"]) == 7


def test_torchscript_without_tensors_is_told_by_its_member_names(capsys, tmp_path):
    # With no tensor storages the first member is data.pkl, as torch.save writes: only the central
    # directory's names (code/, constants.pkl) tell the two apart, so the header read passes the size.
    import torch

    class Plain(torch.nn.Module):
        def forward(self, x):
            return x + 1

    src = tmp_path / "plain.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.script is deprecated, still what users have
        torch.jit.script(Plain()).save(str(src))
    assert zipfile.ZipFile(src).namelist()[0] == "plain/data.pkl"  # what made the first-member guess wrong
    code, _, err = cli(capsys, "inspect", src)
    what = "a TorchScript archive (torch.jit.save: plain/code/, plain/constants.pkl)"
    assert code == 2 and err.startswith(f"nnx-save: error: {src}: this is {what}, not a safetensors file")
    assert err.endswith(
        f"convert its parameters and buffers (none of its code runs): nnx-save convert {src} plain.safetensors\n"
    )
    for read in (nnx_save.read_header, nnx_save.load_file, nnx_save.safe_open):
        with pytest.raises(nnx_save.NotSafetensorsError, match=re.escape(f"{src}: this is {what}")) as e:
            read(src)
        assert e.value.format == what


def test_torchscript_through_the_python_api_sharded(scripted, tmp_path):
    src, reference = scripted
    done = nnx_save.convert(src, tmp_path / "split", max_shard_size=64)
    assert done.tensors == len(reference) and len(done.files) > 1
    np.testing.assert_array_equal(nnx_save.load_file(tmp_path / "split")["table"], reference["table"].numpy())


def _archive(path, data_pkl, code="class Net(Module):\n  __parameters__ = []\n  __buffers__ = []\n"):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("net/data.pkl", data_pkl)
        z.writestr("net/code/__torch__.py", code)
        z.writestr("net/constants.pkl", b"\x80\x02).")
        z.writestr("net/version", b"3\n")


def test_torchscript_code_in_the_pickle_is_never_run(capsys, tmp_path):
    marker = tmp_path / "ran"
    # os.system("touch <marker>"): what an unpickler would run on load
    payload = f"touch {marker}".encode()
    data = b"\x80\x02cos\nsystem\nX" + len(payload).to_bytes(4, "little") + payload + b"\x85R."
    _archive(tmp_path / "evil.pt", data)
    code, _, err = cli(capsys, "convert", tmp_path / "evil.pt", tmp_path / "o.safetensors")
    assert code == 2 and err == (
        f"nnx-save: error: {tmp_path / 'evil.pt'}: <root>: not a TorchScript module object in data.pkl\n"
    )
    assert not marker.exists() and not (tmp_path / "o.safetensors").exists()
    # an opcode that builds no data (INST calls a class by name) is refused with its offset
    _archive(tmp_path / "inst.pt", b"\x80\x02(ios\nsystem\n.")
    with pytest.raises(nnx_save.ConvertError, match=re.escape("byte 3: opcode b'i' is not one a data-only reader")):
        nnx_save.convert(tmp_path / "inst.pt", tmp_path / "o.safetensors")


def test_torchscript_tensor_outside_its_storage_is_refused(tmp_path):
    # a module whose one buffer claims elements 1 and 2 of a 2-element storage
    storage = b"(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x02tQ"
    tensor = b"ctorch._utils\n_rebuild_tensor_v2\n(" + storage + b"K\x01K\x02\x85K\x01\x85\x89)tR"
    data = b"\x80\x02c__torch__\nNet\n)\x81}(X\x01\x00\x00\x00b" + tensor + b"ub."
    _archive(tmp_path / "bad.pt", data, 'class Net(Module):\n  __parameters__ = []\n  __buffers__ = ["b", ]\n')
    with zipfile.ZipFile(tmp_path / "bad.pt", "a") as z:
        z.writestr("net/data/0", np.zeros(2, np.float32).tobytes())
    with pytest.raises(
        nnx_save.ConvertError,
        match=re.escape("b: shape [2], strides [1] at offset 1 reach element 2 of a storage of 2"),
    ):
        nnx_save.convert(tmp_path / "bad.pt", tmp_path / "o.safetensors")
    assert not (tmp_path / "o.safetensors").exists()


def test_torchscript_quantized_tensor_is_refused_with_the_recipe(tmp_path):
    quantized = b"ctorch._utils\n_rebuild_qtensor\n)R"
    data = b"\x80\x02c__torch__\nNet\n)\x81}(X\x01\x00\x00\x00w" + quantized + b"ub."
    _archive(tmp_path / "q.pt", data, 'class Net(Module):\n  __parameters__ = ["w", ]\n  __buffers__ = []\n')
    src = tmp_path / "q.pt"
    with pytest.raises(nnx_save.ConvertError) as e:
        nnx_save.convert(src, tmp_path / "o.safetensors")
    assert str(e.value) == (
        f"{src}: w: stored as torch._utils._rebuild_qtensor, not a plain dense tensor; if you trust its code, save "
        f"a state dict of dense tensors in torch: torch.save(torch.jit.load({str(src)!r}).state_dict(), "
        "'q.state_dict.pt') (dequantize() / to_dense() what is not), then: nnx-save convert q.state_dict.pt "
        "q.safetensors"
    )


def test_mutated_torchscript_archives_fail_typed(scripted, tmp_path):
    """Random bytes of data.pkl changed (the zip rebuilt around them, CRCs valid) or of
    the archive itself: every conversion either succeeds or raises NnxSaveError."""
    src, _ = scripted
    with zipfile.ZipFile(src) as z:
        members = {info.filename: z.read(info) for info in z.infolist()}
    pkl = next(n for n in members if n.endswith("/data.pkl"))
    raw = src.read_bytes()
    rng = np.random.default_rng(0)
    outcomes = {"converted": 0, "refused": 0}
    for i in range(150):
        path = tmp_path / f"m{i}.pt"
        if i % 3:
            data = bytearray(members[pkl])
            for at in rng.integers(0, len(data), size=int(rng.integers(1, 4))):
                data[at] = int(rng.integers(0, 256))
            with zipfile.ZipFile(path, "w") as z:
                for name, body in members.items():
                    z.writestr(name, bytes(data) if name == pkl else body)
        else:
            data = bytearray(raw)
            data[int(rng.integers(0, len(data)))] ^= 0xFF
            path.write_bytes(bytes(data))
        try:
            nnx_save.convert(path, tmp_path / "o.safetensors")
            outcomes["converted"] += 1
        except nnx_save.NnxSaveError:
            outcomes["refused"] += 1
    assert outcomes["refused"] > 50 and sum(outcomes.values()) == 150


# ------------------------------------------------------------------- Orbax store items


class _Net(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(3, 4, rngs=rngs), nnx.Linear(4, 2, rngs=rngs)])
        self.drop = nnx.Dropout(0.1, rngs=rngs)  # holds a typed rng key and a count
        self.seen = nnx.Variable(3)  # a Python int


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("store")
    model = _Net(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    with OrbaxCheckpointStore(root / "ckpt") as s:
        s.save(1, {"model": nnx.state(model), "optimizer": nnx.state(optimizer), "data_iterator": {"pos": 64}})
    return root, snapshot(model), snapshot(optimizer)


def test_store_step_item_converts_to_a_file_load_model_loads_strictly(capsys, store, tmp_path, monkeypatch):
    root, expected, _ = store
    monkeypatch.chdir(root)
    code, _, err = cli(capsys, "inspect", "ckpt/1")
    command = "nnx-save convert ckpt/1/model model.safetensors"
    assert code == 2 and err == (
        "nnx-save: error: ckpt/1: this is an Orbax checkpoint step (items: model, data_iterator, optimizer), not a "
        f"safetensors checkpoint; convert one item of it: {command}\n"
    )
    for verb in ("inspect", "convert"):  # the store's root: both name its latest step's item
        code, _, err = cli(capsys, verb, "ckpt", *(["root.safetensors"] if verb == "convert" else []))
        assert code == 2 and err.endswith(f"convert one item of a step: {command}\n")
    code, _, err = cli(capsys, "convert", "ckpt/1", "whole.safetensors")  # a step: convert gives the same advice
    assert (
        code == 2 and err.endswith(f"convert one item of it: {command}\n") and not os.path.exists("whole.safetensors")
    )
    code, text, err = cli(capsys, *command.split()[1:])  # a relative item path, as inspect gives it
    assert (code, err) == (0, "") and text == "convert: ckpt/1/model -> model.safetensors: 7 tensors\n"
    assert "layers/0/kernel" in nnx_save.read_header("model.safetensors")
    model = poison(_Net(nnx.Rngs(5)))
    assert_differs(snapshot(model), expected)
    nnx_save.load_model(model, "model.safetensors", strict=True)
    assert_same_state(snapshot(model), expected)  # typed rng key, its count and the Python int included


def test_plain_orbax_checkpoint_of_an_nnx_state_loads_strictly(tmp_path):
    import orbax.checkpoint as ocp

    model = _Net(nnx.Rngs(1))
    expected = snapshot(model)
    checkpointer = ocp.StandardCheckpointer()  # the Flax NNX guide's way to checkpoint a model
    checkpointer.save(tmp_path / "ckpt", nnx.state(model))
    checkpointer.wait_until_finished()
    checkpointer.close()
    nnx_save.convert(tmp_path / "ckpt", tmp_path / "m.safetensors")
    target = poison(_Net(nnx.Rngs(5)))
    nnx_save.load_model(target, tmp_path / "m.safetensors", strict=True)
    assert_same_state(snapshot(target), expected)


def test_damaged_orbax_directory_is_an_error_naming_it(capsys, tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "_METADATA").write_text("")  # truncated to nothing
    code, _, err = cli(capsys, "convert", tmp_path / "ckpt", tmp_path / "o.safetensors")
    assert code == 2 and err.startswith(
        f"nnx-save: error: {tmp_path / 'ckpt'}: Orbax cannot restore this checkpoint (JSONDecodeError: "
    )
    assert not (tmp_path / "o.safetensors").exists()


def test_store_optimizer_item_through_the_python_api(store, tmp_path):
    root, _, expected = store
    done = nnx_save.convert(root / "ckpt" / "1" / "optimizer", tmp_path / "opt.safetensors")
    assert done.tensors == len(expected)
    model = _Net(nnx.Rngs(5))
    optimizer = poison(nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param))
    assert_differs(snapshot(optimizer), expected)
    nnx_save.load_model(optimizer, tmp_path / "opt.safetensors", strict=True)
    assert_same_state(snapshot(optimizer), expected)


# ------------------------------------------------------------- torch tensors without data


@pytest.mark.parametrize(
    ("tensor", "what"),
    [
        ("sparse", "enc.w: a sparse_coo tensor; make it dense in torch first (tensor.to_dense())"),
        ("meta", "enc.w: a meta tensor (shape [2, 3], torch.float32: no data, only a shape), nothing to convert"),
        ("nested", "enc.w: a nested (ragged) tensor; unbind it in torch first (tensor.unbind())"),
    ],
)
def test_convert_refuses_sparse_and_meta_tensors_by_key(capsys, tmp_path, tensor, what):
    import torch

    if tensor == "nested":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch: nested tensors are a prototype
            value = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    else:
        value = torch.ones(2, 3).to_sparse() if tensor == "sparse" else torch.empty(2, 3, device="meta")
    src = tmp_path / "sd.pt"
    torch.save({"enc": {"w": value}, "b": torch.ones(1)}, src)
    code, out, err = cli(capsys, "convert", src, tmp_path / "o.safetensors")
    assert (code, out) == (2, "")
    assert err == f"nnx-save: error: {src}: {what}; convert takes dense tensors with data\n"
    assert not (tmp_path / "o.safetensors").exists()


def test_convert_resolves_lazy_conj_and_neg_bits(tmp_path):
    import torch

    src = tmp_path / "lazy.pt"
    conj, neg = torch.tensor([1 + 2j, 3 - 1j]).conj(), torch.tensor([1 + 2j, 3 - 1j]).conj().imag
    assert conj.is_conj() and neg.is_neg()
    torch.save({"conj": conj, "neg": neg}, src)  # views with torch's lazy conj / neg bit set
    nnx_save.convert(src, tmp_path / "o.safetensors")
    loaded = nnx_save.load_file(tmp_path / "o.safetensors")
    np.testing.assert_array_equal(loaded["conj"], np.array([1 - 2j, 3 + 1j], np.complex64))
    np.testing.assert_array_equal(loaded["neg"], np.array([-2.0, 1.0], np.float32))


# --------------------------------------------------------------------------- numpy archives, bare tensors


@pytest.mark.parametrize("save", [np.savez, np.savez_compressed])
def test_npz_archive_that_inspect_names_converts(capsys, tmp_path, save):
    """``convert arrays.npz`` converts what ``inspect`` names a numpy archive, every array
    by name (torch's reader would fail with ``[enforce fail at inline_container.cc:180]``)."""
    arrays = {
        "layers/0/kernel": np.arange(12, dtype=np.float32).reshape(3, 4),
        "step": np.array(7, np.int64),
        "mask": np.array([True, False]),
        "empty": np.zeros((0, 2), np.float16),
    }
    save(tmp_path / "arrays.npz", **arrays)
    code, _, err = cli(capsys, "inspect", tmp_path / "arrays.npz")
    wanted = f"convert it first: nnx-save convert {tmp_path / 'arrays.npz'} arrays.safetensors"
    assert code == 2 and "a numpy .npz archive" in err and wanted in err
    code, _, err = cli(capsys, "convert", tmp_path / "arrays.npz", tmp_path / "arrays.safetensors")
    assert code == 0, err
    loaded = nnx_save.load_file(tmp_path / "arrays.safetensors", verify=True)
    assert sorted(loaded) == sorted(arrays)
    for k, v in arrays.items():
        assert loaded[k].dtype == v.dtype and loaded[k].shape == v.shape and loaded[k].tobytes() == v.tobytes(), k


def test_npz_with_an_object_array_is_refused_unpickled(tmp_path):
    np.savez(tmp_path / "o.npz", w=np.ones(2, np.float32), bad=np.array([{"a": 1}], dtype=object))
    with pytest.raises(
        nnx_save.ConvertError, match=re.escape(f"{tmp_path / 'o.npz'}: bad: numpy dtype object is not a number type")
    ):
        nnx_save.convert(tmp_path / "o.npz", tmp_path / "o.safetensors")
    assert not (tmp_path / "o.safetensors").exists()


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    dtype=st.sampled_from(["<f4", ">f4", "<i2", ">f8", "|u1", "<c8", "|b1"]),
    shape=st.lists(st.integers(0, 4), max_size=3),
    fortran=st.booleans(),
    compressed=st.booleans(),
)
def test_every_numeric_npz_member_converts_to_its_exact_values(tmp_path_factory, dtype, shape, fortran, compressed):
    """The .npz reader reads each member's declared bytes itself (no np.load): byte order,
    Fortran order, empty shapes and compression all come back as numpy holds them."""
    tmp = tmp_path_factory.mktemp("npz")
    a = np.arange(int(np.prod(shape)), dtype=np.int64).astype(dtype).reshape(shape, order="F" if fortran else "C")
    (np.savez_compressed if compressed else np.savez)(tmp / "a.npz", a=a)
    nnx_save.convert(tmp / "a.npz", tmp / "a.safetensors")
    got = nnx_save.load_file(tmp / "a.safetensors")["a"]
    assert got.shape == a.shape and np.array_equal(np.asarray(got), a)


def test_bare_torch_tensor_converts_under_the_files_name(tmp_path):
    """A ``torch.save``'d bare tensor became a tensor named ``""``."""
    torch = pytest.importorskip("torch")
    tensor = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    torch.save(tensor, tmp_path / "embedding.pt")
    done = nnx_save.convert(tmp_path / "embedding.pt", tmp_path / "embedding.safetensors")
    loaded = nnx_save.load_file(tmp_path / "embedding.safetensors")
    assert done.tensors == 1 and list(loaded) == ["embedding"]
    np.testing.assert_array_equal(loaded["embedding"], tensor.numpy())
