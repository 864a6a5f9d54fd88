"""Telling a safetensors file from the checkpoints users mistake for one.

A PyTorch ``.bin`` / ``.pt`` read as safetensors makes its first eight bytes a
header size of ~5.8e17 and fails with a number that explains nothing. These checks
look at magic bytes and directory entries only (nothing is ever unpickled, no zip
member is read) and name what the file is and the command that converts it.

Pure: no jax, no numpy; :mod:`nnx_save.layouts._sources` calls them before parsing a header.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Callable

from ..errors import NotSafetensorsError

__all__ = ["foreign_directory", "foreign_file", "refuse_directory", "refuse_file"]

ZIP_MAGIC = b"PK\x03\x04"
_PICKLE_PROTOCOLS = range(2, 6)  # \x80 then the protocol byte; protocols 2-5 are what torch.save writes
# A file or directory one of these names, found in a directory, makes it an Orbax checkpoint.
_ASCII_DIGITS = re.compile(r"[0-9]+")
_ORBAX_MARKERS = ("_CHECKPOINT_METADATA", "_METADATA", "manifest.ocdbt", "_sharding")
_TENSORSTORE_MARKERS = (".zarray", "zarr.json", ".zgroup")


def _zip_first_member(read: Callable[[int, int], bytes]) -> str:
    """The first member's name of a zip archive (local file header: name length at
    byte 26, name from byte 30), or ``""`` when it cannot be read."""
    head = read(30, 0)
    if len(head) < 30:
        return ""
    n = int.from_bytes(head[26:28], "little")
    return read(min(n, 512), 30).decode("utf-8", "replace")


def foreign_file(prefix: bytes, read: Callable[[int, int], bytes]) -> str | None:
    """What a file is when its first bytes say it is not safetensors, else ``None``.

    A header size can begin with the same bytes as a pickle (640 is ``80 02 00 ..``)
    or a zip (a 67 MB header), so a file whose byte 8 opens a JSON object is never
    called foreign.

    Args:
        prefix: the file's first (up to) 8 bytes.
        read: ``read(size, offset) -> bytes`` for more of the file (zip member names).

    Examples:
        >>> foreign_file(b"\\x80\\x02\\x8a\\nl\\xfc\\x9cF", lambda n, o: b"") is not None
        True
        >>> foreign_file(b"\\x10\\x00\\x00\\x00\\x00\\x00\\x00\\x00", lambda n, o: b"") is None
        True
    """
    zipped = prefix.startswith(ZIP_MAGIC)
    pickled = len(prefix) >= 2 and prefix[0] == 0x80 and prefix[1] in _PICKLE_PROTOCOLS
    if not (zipped or pickled) or read(1, 8) == b"{":  # a header size only looking like a magic
        return None
    if zipped:
        member = _zip_first_member(read)
        if member.rsplit("/", 1)[-1] == "data.pkl":  # torch.save: "<stem>/data.pkl" comes first
            return f"a PyTorch checkpoint (torch.save zip archive, {member})"
        if member.endswith(".npy"):
            return f"a numpy .npz archive (first member {member!r})"
        return f"a zip archive (first member {member!r}), the format torch.save writes"
    return f"a Python pickle (protocol {prefix[1]}: the legacy torch.save format)"


def foreign_directory(path: str | os.PathLike) -> str | None:
    """What a directory is when it is an Orbax / TensorStore checkpoint, else ``None``."""
    names = set(os.listdir(path))
    for marker in _ORBAX_MARKERS:
        if marker in names:
            return f"an Orbax checkpoint directory (it holds {marker})"
    if any(n.startswith("ocdbt.process_") for n in names):
        return "an Orbax checkpoint directory (it holds ocdbt.process_* files)"
    for marker in _TENSORSTORE_MARKERS:
        if marker in names:
            return f"a TensorStore / zarr array directory (it holds {marker})"
    steps = sorted((n for n in names if _ASCII_DIGITS.fullmatch(n)), key=int)  # not isdigit(): "²" is a digit
    for step in steps[-1:]:  # a step store: numbered step directories, each an Orbax checkpoint
        inner = os.path.join(path, step)
        if os.path.isdir(inner) and (
            foreign_directory(inner)
            or any(
                foreign_directory(os.path.join(inner, n))
                for n in os.listdir(inner)
                if os.path.isdir(os.path.join(inner, n))
            )
        ):
            return f"a directory of Orbax checkpoint steps (latest {step}); open it with nnx_save.checkpoint"
    return None


def _remedy(path: str, what: str) -> str:
    if "steps" in what:
        return f"convert one step's item: nnx-save convert {shlex.quote(os.path.join(path, 'STEP', 'ITEM'))} out.safetensors"
    if "TensorStore" in what:
        return (
            "open it with tensorstore, or save its parent Orbax checkpoint as safetensors "
            f"(nnx-save convert ORBAX_DIR {shlex.quote(_stem(path) + '.safetensors')})"
        )
    if "npz" in what:
        return "load it with numpy.load(..., allow_pickle=False) and save it with nnx_save.save_file"
    return f"convert it first: nnx-save convert {shlex.quote(path)} {shlex.quote(_stem(path) + '.safetensors')}"


def _stem(path: str) -> str:
    base = os.path.basename(os.path.normpath(path)) or "model"
    return os.path.splitext(base)[0] or "model"


def refuse_file(name: str, prefix: bytes, read: Callable[[int, int], bytes]) -> None:
    """Raise :class:`NotSafetensorsError` when ``prefix`` marks another format."""
    what = foreign_file(prefix, read)
    if what is not None:
        raise NotSafetensorsError(
            f"{name}: this is {what}, not a safetensors file (told by its first bytes; nothing was unpickled); "
            f"{_remedy(name, what)}",
            what,
        )


def refuse_directory(path: str | os.PathLike) -> None:
    """Raise :class:`NotSafetensorsError` when ``path`` is an Orbax / TensorStore directory."""
    what = foreign_directory(path)
    if what is not None:
        name = os.fspath(path)
        raise NotSafetensorsError(f"{name}: this is {what}, not a safetensors checkpoint; {_remedy(name, what)}", what)
