"""Weights files written to an object store through fsspec (any fsspec filesystem that
can write: ``s3://``, ``gs://``, ``memory://`` ...).

An object cannot be rewritten in place once streamed, but the header records every
tensor's checksum, so the save makes two passes, one tensor in host memory at a time:
the first hashes, the second streams header and tensors into a temporary object beside
the destination, hashing again. It is moved under its final name only when complete
and both passes agree, so a failed save never leaves a partial object there.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..errors import SaveError
from ..format import _checksum
from ..format._header import encode_header
from ..io._write import TMP_MARKER
from ._entry import Entry, check_storable, host_bytes, order_entries

__all__ = ["filesystem", "put", "write_remote"]


def write_remote(url: str, entries: Sequence[Entry], metadata: Mapping[str, str] | None) -> None:
    """Write ``entries`` as one safetensors object at ``url``, committed only when complete.

    Raises:
        SaveError: fsspec or its implementation for the scheme is missing, the
            filesystem cannot write, several JAX processes save to one URL, a
            tensor changed between the two passes, or the upload failed; nothing
            is left under ``url`` (a previous object there is intact).
    """
    fs = filesystem(url)
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
        for e, (begin, end) in zip(entries, offsets, strict=True):
            data = host_bytes(e.value(), e.code)
            if len(data) != end - begin:
                raise SaveError(
                    f"{url}: tensor {e.key!r} gave {len(data)} bytes, its header says {end - begin}", url, e.key
                )
            second.update(e.key, data)
            f.write(data)
            del data
        if second.values != first.values:
            changed = sorted(k for k in first.values if first.values[k] != second.values[k])
            raise SaveError(f"{url}: tensors {changed} changed while they were saved; nothing was saved", url)

    put(fs, url, stream)


def put(fs: Any, url: str, write: Callable[[Any], None]) -> None:
    """``write(f)`` into a temporary object beside ``url``, moved under ``url`` only
    once complete; on any failure the temporary object is removed.

    Raises:
        SaveError: ``write`` or the upload failed (naming ``url``); a previous object
            there is intact.
    """
    temp = f"{url}{TMP_MARKER}{uuid.uuid4().hex[:12]}"
    try:
        with fs.open(temp, "wb") as f:
            write(f)
        fs.mv(temp, url)
    except BaseException as error:
        with contextlib.suppress(Exception):
            fs.rm(temp)
        if isinstance(error, SaveError) or not isinstance(error, Exception):
            raise
        raise SaveError(
            f"{url}: the upload failed ({type(error).__name__}: {error}); nothing was saved", url
        ) from error


def filesystem(url: str) -> Any:
    """The fsspec filesystem for ``url``'s scheme, after the checks that need no I/O."""
    import jax

    if jax.process_count() > 1:
        raise SaveError(
            f"{url}: saving to a URL from {jax.process_count()} processes is not supported (each would upload the "
            "object); save from one process, or save to a shared filesystem path",
            url,
        )
    try:
        import fsspec
    except ImportError:
        raise SaveError(f"{url}: writing to a URL needs fsspec: pip install 'nnx_save[remote]'", url) from None
    protocol = url.split("://", 1)[0]
    if protocol in ("http", "https"):
        raise SaveError(f"{url}: an HTTP URL cannot be written to; give an object-store URL (s3://, gs:// ...)", url)
    try:
        fs = fsspec.filesystem(protocol)
    except (ImportError, ValueError) as error:
        raise SaveError(f"{url}: no fsspec filesystem for {protocol!r} ({error})", url) from None
    if getattr(fs, "read_only", False):
        raise SaveError(f"{url}: fsspec's {protocol!r} filesystem cannot write", url)
    return fs
