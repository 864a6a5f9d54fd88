"""Weights files written to a location that takes whole objects (an object store:
``s3://``, ``gs://``, ``az://`` through obstore's multipart uploads, ``memory://`` and the
other fsspec schemes through fsspec; :meth:`~nnx_save.io._storage.Location.upload`).

An object cannot be rewritten in place once streamed, but the header records every
tensor's checksum, so the save makes two passes, one tensor in host memory at a time:
the first hashes, the second streams header and tensors into the upload, hashing
again. The location makes it visible under its name only when complete and both
passes agree, so a failed save never leaves a partial object there.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from .. import _progress
from ..errors import SaveError
from ..format import _checksum
from ..format._header import encode_header
from ..io._storage import Location
from ._entry import Entry, check_storable, host_bytes, order_entries

__all__ = ["write_remote"]


def write_remote(
    location: Location,
    name: str,
    entries: Sequence[Entry],
    metadata: Mapping[str, str] | None,
    progress: bool | None = None,
) -> None:
    """Write ``entries`` as one safetensors object ``name`` of ``location``, committed only
    when complete; ``progress`` as in :func:`nnx_save._progress.bar`, moved per 8 MiB sent.

    Raises:
        SaveError: fsspec or its implementation for the scheme is missing, the
            filesystem cannot write, several JAX processes save to one URL, a
            tensor changed between the two passes, or the upload failed; nothing
            is left under ``url`` (a previous object there is intact).
    """
    location.prepare(name)
    url = str(location.member(name))
    entries = order_entries(entries)
    first = _checksum.Digests([e.key for e in entries])
    for e in entries:
        value = e.value()
        if e.code == "BOOL":  # the second pass must give these bytes: checked once
            check_storable(e.key, value)
        first.update(e.key, host_bytes(value, e.code))
    head, offsets = encode_header([(e.key, e.code, e.shape) for e in entries], first.metadata(metadata))

    def stream(f: Any) -> None:
        """The object, hashed again as it is written: a tensor changed since is refused."""
        second = _checksum.Digests([e.key for e in entries])
        f.write(head)
        bar = _progress.bar(f"saving {name}", offsets[-1][1] if offsets else 0, len(entries), progress)
        try:
            for e, (begin, end) in zip(entries, offsets, strict=True):
                data = host_bytes(e.value(), e.code)
                if len(data) != end - begin:
                    raise SaveError(
                        f"{url}: tensor {e.key!r} gave {len(data)} bytes, its header says {end - begin}", url, e.key
                    )
                second.update(e.key, data)
                for piece in _pieces(memoryview(data).cast("B")):
                    f.write(piece)
                    bar.update(len(piece))
                bar.update(items=1)
                del data
        finally:
            bar.close()
        if second.values != first.values:
            changed = sorted(k for k in first.values if first.values[k] != second.values[k])
            raise SaveError(f"{url}: tensors {changed} changed while they were saved; nothing was saved", url)

    location.upload(name, stream)


def _pieces(data: memoryview, size: int = 8 << 20) -> Iterator[memoryview]:
    """``data`` in views of at most ``size`` bytes: the bar moves as a large tensor uploads."""
    for at in range(0, len(data), size):
        yield data[at : at + size]
