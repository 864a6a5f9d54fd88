"""A HuggingFace PyTorch checkpoint in several files (``pytorch_model-0000i-of-0000n.bin``
named by ``pytorch_model.bin.index.json``, what older hub repositories ship) as entries
for the writer, read one tensor at a time.

Each shard is opened with ``torch.load(weights_only=True, mmap=True)``: its tensors map
the file rather than fill memory, and at most two shards are open at a time (the writer
asks for tensors in its own order, so a shard is reopened when its turn comes again, which
costs its pickle, not its data). Host memory stays near the pages of two mapped shards,
whatever the checkpoint's size. A shard in torch's legacy (non-zip) format cannot be
mapped; it is loaded whole.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import threading
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConvertError, HeaderError
from ..format import _dtypes
from ..format._torch import torch_to_numpy
from ..save._entry import Entry

__all__ = ["INDEX_NAME", "copy_companions", "entries", "is_torch_index", "shard_bytes"]

INDEX_NAME = "pytorch_model.bin.index.json"
OPEN_SHARDS = 2  # shards mapped at once: one per file the writer fills at a time
_MAX_INDEX_BYTES = 1 << 26  # an index names each tensor once: tens of MB at most for the largest models


def is_torch_index(path: Path) -> bool:
    """True for a directory holding ``pytorch_model.bin.index.json``."""
    return path.is_dir() and (path / INDEX_NAME).is_file()


def _weight_map(directory: Path) -> dict[str, str]:
    """The index's ``{tensor: shard file name}``, validated: every file a plain name in
    the directory, present."""
    index = directory / INDEX_NAME
    if index.stat().st_size > _MAX_INDEX_BYTES:
        raise HeaderError(f"{index}: {index.stat().st_size} bytes, more than an index holds", check="index")
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HeaderError(f"{index}: not valid JSON ({e})", check="index") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise HeaderError(f"{index}: no weight_map of tensor name -> file name", check="index")
    for name in sorted(set(weight_map.values())):
        if os.path.basename(name) != name or name in (".", ".."):
            raise HeaderError(f"{index}: the weight_map names {name!r}, not a file of {directory}", check="index")
        if not (directory / name).is_file():
            raise ConvertError(f"{index}: names {name}, which {directory} does not hold")
    return weight_map


class _Shards:
    """The open shards, at most :data:`OPEN_SHARDS` (the writer fills two files at a time,
    from two threads): their tensors by name, mapped from the files."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.open: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
        self.lock = threading.Lock()

    def tensor(self, file: str, key: str) -> np.ndarray:
        with self.lock:  # one shard opened at a time; the numpy view keeps its tensor alive after eviction
            if file not in self.open:
                while len(self.open) >= OPEN_SHARDS:
                    self.open.popitem(last=False)  # the least recently used shard's mapping goes first
                self.open[file] = _load(self.directory / file)
            self.open.move_to_end(file)
            tensor = self.open[file][key]
        return torch_to_numpy(tensor, key, self.directory / file)

    def close(self) -> None:
        with self.lock:
            self.open.clear()


def _torch() -> Any:
    """torch, which only a conversion of PyTorch files needs (it is no dependency of nnx_save)."""
    try:
        import torch
    except ImportError:
        raise ConvertError(
            "converting PyTorch .bin files needs torch: pip install torch (the CPU build will do)"
        ) from None
    return torch


def _load(path: Path) -> dict[str, Any]:
    """A shard's state dict of tensors (mapped when the file is a zip archive)."""
    torch = _torch()

    with warnings.catch_warnings():  # torch's own notices (TypedStorage, sparse "beta"), not the user's concern
        warnings.simplefilter("ignore", UserWarning)
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise ConvertError(f"{path}: not a PyTorch state dict that loads with weights_only=True: {e}") from None
            state = torch.load(path, map_location="cpu", weights_only=True)  # the legacy format: no mapping
        except Exception as e:  # torch raises UnpicklingError, ... for unsafe or bad files
            raise ConvertError(f"{path}: not a PyTorch state dict that loads with weights_only=True: {e}") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConvertError(f"{path}: a shard of {INDEX_NAME} must be a flat state dict of tensors")
    return state


def entries(directory: Path) -> tuple[list[Entry], _Shards]:
    """One entry per tensor of the index (shape and dtype from each shard's pickle,
    data read when the writer asks), and the shards' holder (close it when done)."""
    torch = _torch()
    weight_map = _weight_map(directory)
    shards = _Shards(directory)
    out = []
    for file in sorted(set(weight_map.values())):
        state = _load(directory / file)
        named = sorted(k for k, f in weight_map.items() if f == file)
        absent, unnamed = sorted(set(named) - set(state)), sorted(set(state) - set(named))
        if absent or unnamed:
            parts = [f"the index puts {absent[:5]} there, which it does not hold"] if absent else []
            parts += [f"it holds {unnamed[:5]}, which the index does not put there"] if unnamed else []
            raise ConvertError(f"{directory / INDEX_NAME} and {file} disagree: {'; '.join(parts)}")
        for key in named:
            t = state[key]
            empty = torch_to_numpy(torch.empty(0, dtype=t.dtype), key, directory / file)
            code = _dtypes.to_code(empty.dtype, key).code
            out.append(Entry(key, code, tuple(t.shape), functools.partial(shards.tensor, file, key)))
        del state
    return out, shards


def shard_bytes(directory: Path) -> int:
    """The bytes of the largest shard file: the size a conversion keeps by default."""
    return max(os.path.getsize(directory / f) for f in set(_weight_map(directory).values()))


_WEIGHTS = (".bin", ".safetensors", ".pt", ".pth", ".msgpack", ".h5", ".ckpt", ".npz")


def copy_companions(source: Path, out: Path) -> list[str]:
    """Copy the source directory's other regular files (``config.json``,
    ``generation_config.json``, tokenizer files) into ``out`` beside the converted
    weights, never over a file ``out`` holds; weight files, indexes and links are left.
    Returns the names copied."""
    import shutil

    copied = []
    for entry in sorted(os.scandir(source), key=lambda e: e.name):
        name = entry.name
        if entry.is_symlink() or not entry.is_file() or name.startswith(".") or name.endswith(".index.json"):
            continue
        if name.endswith(_WEIGHTS) or (out / name).exists():
            continue
        shutil.copyfile(entry.path, out / f".{name}.part")
        os.replace(out / f".{name}.part", out / name)
        copied.append(name)
    return copied
