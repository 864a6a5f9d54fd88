"""Tree key paths <-> flat file keys: the one path formatter.

A path is a tuple of ``str`` and ``int`` segments; the file key joins them with
``/`` and writes ints in decimal. The int/str rule: ``0`` and ``"0"`` make the same
key, so lookups match a model's ``nnx.List`` index against a file written by a tool
that stored it as a string. A name that contains ``/``, is empty, or collides with
another after this rule is refused, because it could not be read back to one place.

The tuple rule: a dict key that is a tuple of ``str`` / ``int`` (nested tuples too), as
flax keeps them (``nnx.WeightNorm``'s ``scales[('kernel',)]``, ``nnx.SpectralNorm``'s
``batch_stats[('kernel', 'sigma')]``), is written as its Python literal, ``repr(key)``:
``wn/scales/('kernel',)``. A name spelled exactly like a tuple's literal and the tuple
make the same key, as ``"0"`` and ``0`` do, so two such paths in one tree are refused.

jax key entries (``DictKey``, ``SequenceKey``, ``GetAttrKey``, ``FlattenedIndexKey``)
are accepted by duck typing, so this module imports neither jax nor flax.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

from ..errors import KeyPathError

__all__ = ["Segment", "check_unique", "format_path", "names_to_keys", "segment", "to_key", "to_keys"]

Segment = str | int | tuple
_TUPLE_DEPTH = 4  # nesting a tuple key may have (flax's are flat)
_STR = frozenset({str})
_STR_INT = frozenset({str, int})  # not bool: a bool segment is refused, by to_key


def segment(entry: object, where: Sequence[object] = ()) -> Segment:
    """One path segment from a jax key entry, a str or an int."""
    if type(entry) is str or type(entry) is int:  # the common case, asked per leaf (not bool: refused below)
        return entry
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr) and not isinstance(entry, (str, int)):
            entry = getattr(entry, attr)
            break
    if isinstance(entry, tuple) and _tuple_key(entry):
        return entry
    if isinstance(entry, bool) or not isinstance(entry, (str, int)):
        raise KeyPathError(
            f"{format_path([*where, entry])}: key {entry!r} of type {type(entry).__name__} "
            "cannot be a file key; use str or int keys (or tuples of them)",
            format_path([*where, entry]),
        )
    return entry


def _tuple_key(entry: tuple, depth: int = 0) -> bool:
    """Whether ``entry`` is a tuple of ``str`` / ``int`` (or such tuples, nested at most
    ``_TUPLE_DEPTH`` deep): a key the tuple rule writes as its literal."""
    if depth >= _TUPLE_DEPTH:
        return False
    return all((type(e) is str or type(e) is int) or (type(e) is tuple and _tuple_key(e, depth + 1)) for e in entry)


def format_path(path: Iterable[object]) -> str:
    """The human-readable (and file-key) form of a path, for messages."""
    return "/".join(str(p) for p in path)


def to_key(path: Sequence[object]) -> str:
    """Join a path into a file key, refusing segments that cannot round-trip.

    Examples:
        >>> to_key(("blocks", 0, "attn", "kernel"))
        'blocks/0/attn/kernel'
        >>> to_key(("blocks", "0")) == to_key(("blocks", 0)), to_key(("blocks", "007"))
        (True, 'blocks/007')
        >>> to_key(("wn", "scales", ("kernel",)))
        "wn/scales/('kernel',)"
        >>> to_key(("a", "b/c"))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        nnx_save.errors.KeyPathError: a/'b/c': name contains /; file keys join names with '/' so ...
    """
    parts = []
    for i, entry in enumerate(path):
        seg = segment(entry, path[:i])
        text = repr(seg) if isinstance(seg, tuple) else str(seg)
        if isinstance(seg, int) and seg < 0:
            raise KeyPathError(f"{format_path(path)}: negative index {seg} cannot be a file key", format_path(path))
        if "/" in text or text == "":
            raise KeyPathError(
                f"{format_path(path[:i])}{'/' if i else ''}{text!r}: "
                f"{'empty name' if text == '' else 'name contains /'}; file keys join names with '/' "
                "so this one could not be read back to the same place. Rename the attribute or key.",
                format_path(path),
            )
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise KeyPathError(
                    f"{format_path(path)}: name {text!r} is not valid Unicode (a lone surrogate); "
                    "file keys are UTF-8 text. Rename the attribute or key.",
                    format_path(path),
                ) from None
        parts.append(text)
    return "/".join(parts)


def to_keys(paths: Iterable[Sequence[object]]) -> list[str]:
    """:func:`to_key` of each path, in one call: paths of plain segments (non-empty
    names without ``/``, non-negative ints) joined and checked all at once, at C speed
    (a load of a hundred thousand leaves asks this); any other, or a refusal, the
    segment by segment way, which raises what :func:`to_key` raises.

    Examples:
        >>> to_keys([("a", 0, "w"), ("b",)])
        ['a/0/w', 'b']
    """
    paths = paths if isinstance(paths, list) else list(paths)
    keys = _plain_keys(paths)
    return [to_key(p) for p in paths] if keys is None else keys


def _plain_keys(paths: list[Sequence[object]]) -> list[str] | None:
    """The keys of ``paths`` if every segment is a name or a non-negative int and every
    key is Unicode text with one ``/`` between segments (no name holds one, none is
    empty), else ``None``."""
    if not paths:
        return []
    segments = list(itertools.chain.from_iterable(paths))
    kinds = set(map(type, segments))
    if kinds <= _STR:
        keys = list(map("/".join, paths))  # type: ignore[arg-type]  # every segment a str, checked above
    elif kinds <= _STR_INT and min(s for s in segments if type(s) is int) >= 0:
        keys = ["/".join(map(str, p)) for p in paths]
    else:
        return None
    return keys if min(map(len, paths)) and _joined_plainly(keys, segments) else None


def _joined_plainly(keys: Sequence[object], segments: Sequence[object]) -> bool:
    """Whether ``keys``, joined from ``segments`` (each a name or an int, every key of
    at least one), are Unicode text with one ``/`` between segments: no name holds one,
    none is empty."""
    if "" in segments:
        return False
    text = "".join(keys)  # type: ignore[arg-type]  # names, or keys joined of them
    if text.count("/") != len(segments) - len(keys):  # a name holds a '/'
        return False
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: to_key names it
            return False
    return True


def names_to_keys(names: Sequence[object]) -> list[str]:
    """:func:`to_keys` of one-segment paths ``[(name,) ...]``, given as the names (a
    flat mapping's keys): plain names are their own keys, checked at once.

    Examples:
        >>> names_to_keys(["a", "b"]), names_to_keys([0, "w"])
        (['a', 'b'], ['0', 'w'])
    """
    if set(map(type, names)) <= _STR and _joined_plainly(names, names):
        return list(names)  # type: ignore[arg-type]
    return to_keys([(n,) for n in names])


def check_unique(paths: Iterable[Sequence[object]]) -> dict[str, tuple[object, ...]]:
    """Map each path to its key, refusing two paths that make the same key."""
    paths = list(paths)
    seen: dict[str, tuple[object, ...]] = dict(zip(to_keys(paths), map(tuple, paths), strict=True))
    if len(seen) == len(paths):
        return seen
    seen = {}
    for path in paths:
        key = to_key(path)
        if key in seen:
            raise KeyPathError(
                f"{key}: paths {seen[key]!r} and {tuple(path)!r} both make the file key {key!r} "
                "(int and str keys such as 0 and '0' write the same name); rename one of them",
                key,
            )
        seen[key] = tuple(path)
    return seen
