"""Porting rules inside the engine: a :class:`~nnx_save.porting.Rules` mapping turns
file keys into model paths (load) or model paths into file keys (export); how ported
tensors are read and written sharded: docs/porting.md and docs/multihost.md.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..format import _dtypes
from ..format._boxes import Box, of_index
from ..layouts._registry import read_header
from ..load._source import Header
from ..load._target import Target
from ..porting import Rules
from ..save._entry import Entry, spans_processes
from ..save._stage import BoxedValue

__all__ = ["export_entries", "load_targets_for"]


def load_targets_for(
    rules: Rules, header: Header, targets: Sequence[Target], strict: bool = False
) -> tuple[list[Target], frozenset[str], dict[str, tuple[str, ...]]]:
    """Rewrite model targets to read through ``rules``; also the keys rules ignore, and
    each file key's model paths (to name what an unexpected key became). The table's
    problems are refused under ``strict`` (the load's or the table's), else warned,
    before anything is read."""
    mapping = rules.mapping(header)
    mapping.check(strict or rules.strict, stacklevel=4)
    out = []
    for t in targets:
        a = mapping.assignments.get(t.path)
        if a is None or a.transform is None:
            out.append(dataclasses.replace(t, sources=() if a is None else a.sources))
        else:
            out.append(dataclasses.replace(t, sources=a.sources, transform=a.transform, source_shape=tuple(a.shape)))
    return out, frozenset(mapping.unused), dict(mapping.landed)


def export_entries(rules: Rules, entries: Sequence[Entry]) -> list[Entry]:
    """The entries under their exported names and layouts (values made lazily): a renamed
    one keeps its value and shards, a transformed one becomes a :class:`BoxedValue`.

    An export table with a ``source`` file reproduces it: the file's own tensors for
    what the model does not hold (read lazily from it), and every file tensor the export
    does not write copied unchanged."""
    by_key = {e.key: e for e in entries}
    original = None if rules.source is None else read_header(rules.source)
    mapping = rules.mapping({e.key: (e.shape, _dtypes.DTYPES[e.code].numpy) for e in entries}, against=original)
    mapping.check(rules.strict, stacklevel=4)
    kept = _Original(rules.source)
    out = []
    for name, a in mapping.assignments.items():
        code = _dtypes.to_code(a.dtype, name).code
        if a.transform is None and by_key[a.sources[0]].code == code:
            out.append(dataclasses.replace(by_key[a.sources[0]], key=name))  # its value and array, as they are
            continue
        sources = [by_key[k].value for k in a.sources]
        whole = functools.partial(_whole, a, sources, kept)
        spanning = any(spans_processes(by_key[k].array) for k in a.sources)
        boxes = functools.partial(_gathered, a, sources, kept) if a.against else functools.partial(_boxes, a, sources)
        out.append(Entry(name, code, tuple(a.shape), BoxedValue(whole, boxes, spanning)))
    for key in mapping.passed:
        info = original.tensors[key]  # type: ignore[union-attr]  # passed keys come from it
        out.append(Entry(key, info.dtype.code, tuple(info.shape), functools.partial(kept.get, key)))
    return out


class _Original:
    """The source file's tensors, read one at a time when the writer asks (export
    against the source)."""

    def __init__(self, source: str | None) -> None:
        self.source = source

    def get(self, key: str) -> np.ndarray:
        from ._lazy import safe_open

        assert self.source is not None, "a tensor of the source asked with no source"
        with safe_open(self.source, "np") as f:
            return np.asarray(f.get_tensor(key))

    def arrays(self, keys: Sequence[str]) -> dict[str, np.ndarray]:
        return {k: self.get(k) for k in keys}


def _whole(a: Any, sources: Sequence[Any], kept: _Original) -> np.ndarray:
    return a.materialize({k: v() for k, v in zip(a.sources, sources, strict=True)}, kept.arrays(a.against))


def _boxes(a: Any, sources: Sequence[Any]) -> list[tuple[Box, np.ndarray]]:
    """This process's parts of ``a``'s file tensor: the image of each replica-0 shard it
    holds. Without a box map for some shard of the job, the sources are gathered; every
    process decides the same, from the global shardings."""
    arrays: list[Any] = [getattr(v, "array", None) for v in sources]
    mapped = a.transform is not None and all(spans_processes(x) for x in arrays)
    if not mapped or not all(_maps(a, i, x) for i, x in enumerate(arrays)):
        return _gathered(a, sources, _Original(None))
    parts = []
    for i, array in enumerate(arrays):
        for shard in array.addressable_shards:
            if shard.replica_id == 0:
                moved = a.transform.image(i, of_index(shard.index, array.shape), np.asarray(shard.data))
                assert moved is not None, "image of a box _maps accepted"
                parts.extend(moved)
    return parts


def _maps(a: Any, i: int, array: Any) -> bool:
    """Whether every shard of source ``i`` (on any process) has an image (checked on
    placeholders that take no memory)."""
    boxes = {of_index(index, array.shape) for index in array.sharding.devices_indices_map(array.shape).values()}
    blank = np.zeros((), array.dtype)
    return all(a.transform.image(i, b, np.broadcast_to(blank, [hi - lo for lo, hi in b])) is not None for b in boxes)


def _gathered(a: Any, sources: Sequence[Any], kept: _Original) -> list[tuple[Box, np.ndarray]]:
    """The whole file tensor on the primary (every process takes part in the gathers)."""
    import jax
    from jax.experimental import multihost_utils

    arrays = {}
    for k, v in zip(a.sources, sources, strict=True):
        array = getattr(v, "array", None)
        arrays[k] = np.asarray(multihost_utils.process_allgather(array, tiled=True)) if spans_processes(array) else v()
    if jax.process_index() != 0:
        return []
    return [(tuple((0, d) for d in a.shape), a.materialize(arrays, kept.arrays(a.against)))]
