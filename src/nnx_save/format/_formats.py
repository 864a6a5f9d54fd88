"""Telling a safetensors file from the checkpoints users mistake for one.

A PyTorch ``.bin`` / ``.pt`` read as safetensors makes its first eight bytes a
header size of ~5.8e17 and fails with a number that explains nothing. These checks
look at magic bytes and directory entries only (nothing is ever unpickled, no zip
member is read) and name what the file is and the command that converts it.

Pure: no jax, no numpy; :mod:`nnx_save.layouts._registry` calls them before parsing a header.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator

from ..errors import NotSafetensorsError

__all__ = [
    "composite_advice",
    "foreign_directory",
    "foreign_file",
    "refuse_directory",
    "refuse_file",
    "step_items",
    "torchscript_markers",
    "zip_members",
]

ZIP_MAGIC = b"PK\x03\x04"
_PICKLE_PROTOCOLS = range(2, 6)  # \x80 then the protocol byte; protocols 2-5 are what torch.save writes
# A file or directory one of these names, found in a directory, makes it an Orbax checkpoint.
_ASCII_DIGITS = re.compile(r"[0-9]+")
_ORBAX_MARKERS = ("_CHECKPOINT_METADATA", "_METADATA", "manifest.ocdbt", "_sharding")
_TENSORSTORE_MARKERS = (".zarray", "zarr.json", ".zgroup")
_EOCD_SEARCH = 22 + 65535  # a zip's end record, then at most a 64 KiB comment
_CD_MAX = 1 << 26  # bytes of central directory read to list an archive's members


def _quote(word: str) -> str:
    """``word`` quoted for a shell (shlex, imported by the messages that suggest a command)."""
    import shlex

    return shlex.quote(word)


def _zip_first_member(read: Callable[[int, int], bytes]) -> str:
    """The first member's name of a zip archive (local file header: name length at
    byte 26, name from byte 30), or ``""`` when it cannot be read."""
    head = read(30, 0)
    if len(head) < 30:
        return ""
    n = int.from_bytes(head[26:28], "little")
    return read(min(n, 512), 30).decode("utf-8", "replace")


def _u(raw: bytes, at: int, n: int) -> int:
    return int.from_bytes(raw[at : at + n], "little")


def _central_directory(read: Callable[[int, int], bytes], size: int) -> tuple[int, int] | None:
    """(offset, size) of a zip's central directory, from its end record (zip64 too)."""
    tail_at = max(0, size - _EOCD_SEARCH)
    tail = read(size - tail_at, tail_at)
    end = tail.rfind(b"PK\x05\x06")
    if end < 0 or len(tail) - end < 22:
        return None
    cd_size, cd_at = _u(tail, end + 12, 4), _u(tail, end + 16, 4)
    if 0xFFFFFFFF in (cd_size, cd_at) and end >= 20 and tail[end - 20 : end - 16] == b"PK\x06\x07":
        at = _u(tail, end - 12, 8)  # where the zip64 end record is, as the locator says: foreign bytes
        if at > size - 56:
            return None
        record = read(56, at)
        if len(record) < 56 or not record.startswith(b"PK\x06\x06"):
            return None
        cd_size, cd_at = _u(record, 40, 8), _u(record, 48, 8)
    if cd_at > size or cd_size > size - cd_at:  # a directory outside the file: not one to read
        return None
    return cd_at, cd_size


def zip_members(read: Callable[[int, int], bytes], size: int) -> Iterator[str]:
    """Member names of a zip archive of ``size`` bytes, from its central directory
    (names only: no member is read); nothing when the directory cannot be read."""
    where = _central_directory(read, size)
    if where is None or where[1] > _CD_MAX:
        return
    raw = read(where[1], where[0])
    at = 0
    while at + 46 <= len(raw) and raw.startswith(b"PK\x01\x02", at):
        n, m, k = _u(raw, at + 28, 2), _u(raw, at + 30, 2), _u(raw, at + 32, 2)
        yield raw[at + 46 : at + 46 + n].decode("utf-8", "replace")
        at += 46 + n + m + k


def _torchscript_markers(names: Iterator[str]) -> tuple[str, ...] | None:
    for name in names:
        parts = name.split("/")
        if len(parts) >= 3 and parts[1] == "code":
            return (f"{parts[0]}/code/", f"{parts[0]}/constants.pkl")
        if len(parts) == 2 and parts[1] == "constants.pkl":
            return (name,)
    return None


def torchscript_markers(read: Callable[[int, int], bytes], size: int | None) -> tuple[str, ...] | None:
    """The members that mark a zip archive as ``torch.jit.save`` writes it (its
    ``code/`` directory, ``constants.pkl``), or ``None`` for any other archive.

    With the file's ``size`` the central directory's names decide. Without it only
    the first member can be read (torch writes sizes after each member's data):
    ``torch.jit.save`` writes its tensors' storages first (``ts/data/0``), where
    ``torch.save`` always starts with ``data.pkl``."""
    if size is not None:
        return _torchscript_markers(zip_members(read, size))
    parts = _zip_first_member(read).split("/")
    if len(parts) == 3 and parts[1] == "data" and parts[2].isdecimal():
        return (f"tensor storages ({parts[0]}/data/{parts[2]}) before {parts[0]}/data.pkl",)
    return None


_JSON_LEAD = 64  # bytes after the size prefix searched for a header's "{" (JSON's whitespace first)


def foreign_file(prefix: bytes, read: Callable[[int, int], bytes], size: int | None = None) -> str | None:
    """What a file is when its first bytes say it is not safetensors, else ``None``.

    A header size can begin with the same bytes as a pickle (640 is ``80 02 00 ..``)
    or a zip (a 67 MB header), so a file whose bytes from 8 open a JSON object (after
    JSON's whitespace, which a header may begin with) is never called foreign.

    Args:
        prefix: the file's first (up to) 8 bytes.
        read: ``read(size, offset) -> bytes`` for more of the file (zip member names).
        size: the file's size, when known: a zip's central directory is then read
            to tell a TorchScript archive from a ``torch.save`` one by every name.

    Examples:
        >>> foreign_file(b"\\x80\\x02\\x8a\\nl\\xfc\\x9cF", lambda n, o: b"") is not None
        True
        >>> foreign_file(b"\\x10\\x00\\x00\\x00\\x00\\x00\\x00\\x00", lambda n, o: b"") is None
        True
        >>> foreign_file(b"\\x80\\x02" + bytes(6), lambda n, o: b"  \\n {"[:n]) is None  # a 640-byte header
        True
    """
    zipped = prefix.startswith(ZIP_MAGIC)
    pickled = len(prefix) >= 2 and prefix[0] == 0x80 and prefix[1] in _PICKLE_PROTOCOLS
    if not (zipped or pickled) or read(_JSON_LEAD, 8).lstrip(b" \t\n\r")[:1] == b"{":
        return None  # a header size only looking like a magic
    if zipped:
        script = torchscript_markers(read, size)
        if script is not None:
            return f"a TorchScript archive (torch.jit.save: {', '.join(script)})"
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
    items = step_items(path)
    if items:
        return f"an Orbax checkpoint step (items: {', '.join(items)})"
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


def step_items(path: str | os.PathLike) -> list[str]:
    """The array items of an Orbax composite checkpoint (a store step: a
    ``_CHECKPOINT_METADATA`` beside one directory per item, each with its own
    ``_METADATA``), ``model`` first; ``[]`` for any other directory."""
    names = os.listdir(path)
    if "_CHECKPOINT_METADATA" not in names or "_METADATA" in names:
        return []
    items = [n for n in names if os.path.isfile(os.path.join(path, n, "_METADATA"))]
    return sorted(items, key=lambda n: (n != "model", n))


def _convert_item(step: str) -> str:
    items = step_items(step)
    item = items[0] if items else "ITEM"
    return f"nnx-save convert {_quote(os.path.join(step, item))} {_quote(item + '.safetensors')}"


def composite_advice(path: str | os.PathLike) -> str | None:
    """For a store step or a store's root (Orbax composites: one checkpoint per
    item), what it is and the command that converts one item; else ``None``."""
    name = os.fspath(path)
    what = foreign_directory(name)
    if what is None or not ("steps" in what or "checkpoint step" in what):
        return None
    return f"this is {what}; {_remedy(name, what)}"


def _remedy(path: str, what: str) -> str:
    if "steps" in what:
        latest = what.split("(latest ")[1].split(")")[0]
        return f"convert one item of a step: {_convert_item(os.path.join(path, latest))}"
    if "checkpoint step" in what:
        return f"convert one item of it: {_convert_item(path)}"
    if "TensorStore" in what:
        return (
            "open it with tensorstore, or save its parent Orbax checkpoint as safetensors "
            f"(nnx-save convert ORBAX_DIR {_quote(_stem(path) + '.safetensors')})"
        )
    if "TorchScript" in what:
        return (
            "convert its parameters and buffers (none of its code runs): "
            f"nnx-save convert {_quote(path)} {_quote(_stem(path) + '.safetensors')}"
        )
    return f"convert it first: nnx-save convert {_quote(path)} {_quote(_stem(path) + '.safetensors')}"


def _stem(path: str) -> str:
    base = os.path.basename(os.path.normpath(path)) or "model"
    return os.path.splitext(base)[0] or "model"


def refuse_file(name: str, prefix: bytes, read: Callable[[int, int], bytes], size: int | None = None) -> None:
    """Raise :class:`NotSafetensorsError` when ``prefix`` marks another format
    (``size``: the file's, when known, as :func:`foreign_file` takes it)."""
    what = foreign_file(prefix, read, size)
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
