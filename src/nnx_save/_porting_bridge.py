"""Porting rules inside the engine: a :class:`~nnx_save.porting.Rules` mapping turns
file keys into model paths (load) or model paths into file keys (export).

An assignment that only renames reads its tensor straight from the file, sharded.
One with a transform (a transpose, split, concatenation, stack, unstack or reshape)
carries it to the engine, which asks it, for each box of the target this process
needs, which boxes of which source tensors feed it, and reads only those
(:mod:`nnx_save.load._boxed`); a transform with no per-box map for a box (a reshape
across a sharded dimension) reads its sources whole, and the report lists it in
``report.io.read_whole``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from .format import _dtypes
from .layouts._sources import Header
from .load._target import Target
from .save._write import Entry

__all__ = ["export_entries", "load_targets_for"]


def load_targets_for(
    rules: Any, header: Header, targets: Sequence[Target]
) -> tuple[list[Target], frozenset[str], dict[str, tuple[str, ...]]]:
    """Rewrite model targets to read through ``rules``; also the keys rules ignore, and
    each file key's model paths (to name what an unexpected key became)."""
    mapping = rules.mapping({k: (t.shape, t.dtype.numpy) for k, t in header.tensors.items()})
    out = []
    for t in targets:
        a = mapping.assignments.get(t.path)
        if a is None:
            out.append(dataclasses.replace(t, sources=()))
        elif a.transform is None:
            out.append(dataclasses.replace(t, sources=a.sources))
        else:
            out.append(dataclasses.replace(t, sources=a.sources, transform=a.transform, source_shape=tuple(a.shape)))
    return out, frozenset(mapping.unused), dict(mapping.landed)


def export_entries(rules: Any, entries: Sequence[Entry]) -> list[Entry]:
    """The entries under their exported names and layouts (values made lazily)."""
    by_key = {e.key: e for e in entries}
    mapping = rules.mapping({e.key: (e.shape, _dtypes.DTYPES[e.code].numpy) for e in entries})
    out = []
    for name, a in mapping.assignments.items():

        def value(a=a):
            return a.materialize({k: by_key[k].value() for k in a.sources})

        out.append(Entry(name, _dtypes.to_code(a.dtype, name).code, tuple(a.shape), value))
    return out
