"""The parameters and buffers of a TorchScript archive, read as data without running it.

``data.pkl`` goes through the data-only opcode reader (nothing imported or called), the
parameter and buffer names come from the class definitions in ``code/`` (parsed with
:mod:`ast`, never executed); keys are the ``state_dict()`` names (docs/cli.md tells more).
"""

from __future__ import annotations

import ast
import math
import shlex
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConvertError
from ._dtypes import DTYPES
from ._torch_pickle import Call, Global, PersistentId, read_data_pickle

__all__ = ["Archive", "TensorRecord"]

_REBUILD = Global("torch._utils", "_rebuild_tensor_v2")
_PARAMETER = Global("torch._utils", "_rebuild_parameter")
_MAX_PICKLE = 1 << 26  # bytes of data.pkl: module structure, never tensor data (its reader bounds the rest)
# Bytes of one code/ file, and of all of them: ast.parse takes ~30 bytes of memory per byte of
# source, so these keep a hostile archive's code well under 1 GiB and a few seconds
_MAX_CODE = 1 << 22
_MAX_CODE_TOTAL = 1 << 24
# What zipfile raises on a damaged or unsupported archive (bad CRC, truncation, encryption, methods)
_ZIP_ERRORS = (
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    OSError,
    EOFError,
    NotImplementedError,
    RuntimeError,
    ValueError,
)
_MAX_DEPTH = 200  # nested modules


# torch's storage classes (``torch.FloatStorage``, ...) and the safetensors dtype codes of their elements
_STORAGE_CODES = {
    "Float": "F32",
    "Double": "F64",
    "Half": "F16",
    "BFloat16": "BF16",
    "Long": "I64",
    "Int": "I32",
    "Short": "I16",
    "Char": "I8",
    "Byte": "U8",
    "Bool": "BOOL",
    "UInt16": "U16",
    "UInt32": "U32",
    "UInt64": "U64",
    "ComplexFloat": "C64",
    "Float8_e4m3fn": "F8_E4M3",
    "Float8_e5m2": "F8_E5M2",
    "Float8_e4m3fnuz": "F8_E4M3FNUZ",
    "Float8_e5m2fnuz": "F8_E5M2FNUZ",
}
_STORAGE_DTYPES = {f"{name}Storage": DTYPES[code].numpy for name, code in _STORAGE_CODES.items()}


@dataclass(frozen=True)
class TensorRecord:
    """Where one tensor's elements are: a storage member, element offset, shape, strides."""

    key: str
    member: str
    dtype: np.dtype
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_numel: int


class Archive:
    """An open TorchScript archive; :meth:`tensors` lists its state, :meth:`read` reads one.

    Raises:
        ConvertError: not a readable TorchScript archive, or a value that is not a
            plain tensor (quantized, sparse, ...), named by its key.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.zip = zipfile.ZipFile(path)
        except _ZIP_ERRORS as e:
            raise ConvertError(f"{path}: not a readable zip archive ({e})") from None
        try:
            names = self.zip.namelist()
            roots = [n[: -len("data.pkl")] for n in names if n.count("/") == 1 and n.endswith("/data.pkl")]
            if len(roots) != 1:
                raise ConvertError(f"{path}: a TorchScript archive holds one <name>/data.pkl; found {len(roots)}")
            self.root = roots[0]
            self._classes = _declared_state(self, names)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.zip.close()

    def _member(self, name: str, limit: int) -> bytes:
        try:
            info = self.zip.getinfo(self.root + name)
        except KeyError:
            raise ConvertError(f"{self.path}: the archive has no {self.root + name}") from None
        if info.file_size > limit:
            raise ConvertError(f"{self.path}: {info.filename} is {info.file_size} bytes; at most {limit} expected")
        try:
            return self.zip.read(info)
        except (*_ZIP_ERRORS, zlib.error) as e:
            raise ConvertError(f"{self.path}: {info.filename} cannot be read ({e})") from None

    def tensors(self) -> list[TensorRecord]:
        """Every parameter and buffer, in ``state_dict()`` order."""
        order = self._member("byteorder", 16).strip() if self.root + "byteorder" in self.zip.namelist() else b"little"
        if order != b"little":
            raise ConvertError(f"{self.path}: tensors stored {order.decode(errors='replace')}-endian; little expected")
        root = read_data_pickle(self._member("data.pkl", _MAX_PICKLE), f"{self.path}:{self.root}data.pkl")
        out = list(_module_tensors(self, root, "", 0))
        if not out:
            raise ConvertError(
                f"{self.path}: the TorchScript module has no parameters or buffers (a frozen module keeps "
                "its weights as constants of its code, which are not converted)"
            )
        return out

    def read(self, record: TensorRecord) -> np.ndarray:
        """One tensor's elements, as a C-contiguous array of its dtype."""
        size = record.storage_numel * record.dtype.itemsize
        raw = self._member(record.member, size)
        if len(raw) != size:
            raise ConvertError(
                f"{self.path}: {record.key}: storage {self.root}{record.member} holds {len(raw)} bytes, "
                f"{size} expected ({record.storage_numel} x {record.dtype})"
            )
        flat = np.frombuffer(raw, record.dtype)
        if 0 in record.shape:
            return np.zeros(record.shape, record.dtype)
        strides = tuple(s * record.dtype.itemsize for s in record.stride)
        view = np.lib.stride_tricks.as_strided(flat[record.offset :], record.shape, strides, writeable=False)
        return np.ascontiguousarray(view)


def _declared_state(archive: Archive, names: list[str]) -> dict[str, list[str]]:
    """``{qualified class name: its parameter names, then its buffer names}`` from
    the class definitions in ``code/`` (parsed, not executed)."""
    out: dict[str, list[str]] = {}
    code = archive.root + "code/"
    files = [archive.zip.getinfo(n) for n in names if n.startswith(code) and n.endswith(".py")]
    total = sum(info.file_size for info in files)
    if total > _MAX_CODE_TOTAL:
        raise ConvertError(
            f"{archive.path}: {code} holds {total} bytes of code; at most {_MAX_CODE_TOTAL} are parsed "
            "(a limit of this reader: module definitions are far smaller)"
        )
    for info in files:
        name = info.filename
        module = name[len(code) : -len(".py")].replace("/", ".")
        text = archive._member(name[len(archive.root) :], _MAX_CODE).decode("utf-8", "replace")
        try:
            tree = ast.parse(text, name)
        except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
            raise ConvertError(f"{archive.path}: {name} is not readable TorchScript code ({e})") from None
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                out[f"{module}.{node.name}"] = _declared(node, "__parameters__") + _declared(node, "__buffers__")
    return out


def _declared(node: ast.ClassDef, attribute: str) -> list[str]:
    for statement in node.body:
        if (
            isinstance(statement, ast.Assign)
            and [getattr(t, "id", None) for t in statement.targets] == [attribute]
            and isinstance(statement.value, ast.List)
        ):
            return [e.value for e in statement.value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def _is_module(value: Any) -> bool:
    return isinstance(value, Call) and isinstance(value.func, Global) and value.func.module.startswith("__torch__")


def _module_tensors(archive: Archive, module: Any, prefix: str, depth: int) -> Iterator[TensorRecord]:
    """A module's parameters and buffers, then its submodules', as ``state_dict`` walks them."""
    where = prefix.rstrip(".") or "<root>"
    if not _is_module(module) or not isinstance(module.state, dict):
        raise ConvertError(f"{archive.path}: {where}: not a TorchScript module object in data.pkl")
    if depth > _MAX_DEPTH:
        raise ConvertError(f"{archive.path}: {where}: modules nested deeper than {_MAX_DEPTH}")
    cls = str(module.func)
    if cls not in archive._classes:
        raise ConvertError(
            f"{archive.path}: {where}: class {cls} has no definition in {archive.root}code/ to tell its "
            f"parameters and buffers from other attributes; {_recipe(archive.path)}"
        )
    declared = archive._classes[cls]
    for name in declared:
        value = module.state.get(name)
        if value is not None:  # a parameter declared None (bias=False) is not in state_dict either
            yield _record(archive, prefix + name, value)
    for name, value in module.state.items():
        if name not in declared and _is_module(value):
            yield from _module_tensors(archive, value, f"{prefix}{name}.", depth + 1)


def _recipe(path: Path) -> str:
    """What to run instead, in torch, when the archive's code is trusted."""
    state = shlex.quote(path.stem + ".state_dict.pt")
    return (
        f"if you trust its code, save a state dict of dense tensors in torch: "
        f"torch.save(torch.jit.load({str(path)!r}).state_dict(), {state!r}) (dequantize() / to_dense() "
        f"what is not), then: nnx-save convert {state} {shlex.quote(path.stem + '.safetensors')}"
    )


def _record(archive: Archive, key: str, value: Any) -> TensorRecord:
    if isinstance(value, Call) and value.func == _PARAMETER and value.args:
        value = value.args[0]
    if not (isinstance(value, Call) and value.func == _REBUILD and len(value.args) >= 4):
        func = value.func if isinstance(value, Call) else None
        what = func if isinstance(func, Global) else type(func if isinstance(value, Call) else value).__name__
        raise ConvertError(
            f"{archive.path}: {key}: stored as {what}, not a plain dense tensor; {_recipe(archive.path)}"
        )
    storage, offset, shape, stride = value.args[:4]
    fields = _storage_fields(archive, key, storage)
    tuples = isinstance(shape, tuple) and isinstance(stride, tuple) and len(shape) == len(stride)
    if not (tuples and _ints(offset, *shape, *stride)):
        raise ConvertError(f"{archive.path}: {key}: a malformed tensor record in data.pkl")
    dtype = _STORAGE_DTYPES.get(fields[1].name)
    if dtype is None:
        raise ConvertError(f"{archive.path}: {key}: storage type {fields[1]} has no safetensors dtype here")
    record = TensorRecord(key, f"data/{fields[2]}", dtype, offset, shape, stride, fields[4])
    _check_extent(archive, record)
    return record


def _storage_fields(archive: Archive, key: str, storage: Any) -> tuple:
    """``("storage", type, key, location, numel)`` of a tensor's persistent id, checked."""
    fields = storage.value if isinstance(storage, PersistentId) else None
    if not (
        isinstance(fields, tuple)
        and len(fields) >= 5
        and isinstance(fields[1], Global)
        and isinstance(fields[2], str)
        and _ints(fields[4])
    ):
        raise ConvertError(f"{archive.path}: {key}: a malformed storage record in data.pkl")
    return fields


def _ints(*values: Any) -> bool:
    return all(type(v) is int and v >= 0 for v in values)


def _check_extent(archive: Archive, r: TensorRecord) -> None:
    """The elements a tensor's view reaches must lie inside its storage."""
    if 0 in r.shape:
        return
    last = r.offset + sum((n - 1) * s for n, s in zip(r.shape, r.stride, strict=True))
    if math.prod(r.shape) > r.storage_numel:  # an expanded view: refused rather than materialised unbounded
        raise ConvertError(
            f"{archive.path}: {r.key}: shape {list(r.shape)} has more elements than its storage of "
            f"{r.storage_numel} (strides {list(r.stride)}); {_recipe(archive.path)}"
        )
    if last >= r.storage_numel:
        raise ConvertError(
            f"{archive.path}: {r.key}: shape {list(r.shape)}, strides {list(r.stride)} at offset {r.offset} "
            f"reach element {last} of a storage of {r.storage_numel}"
        )
