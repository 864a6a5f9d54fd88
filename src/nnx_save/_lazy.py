"""A lazy handle on a checkpoint, as safetensors users know it: :func:`safe_open`
and :func:`iter_tensors`.

Nothing is read when the handle opens but the headers. ``get_slice(key)[a:b, :, c]``
turns the index into a box of the tensor and asks the loading engine for that box
alone (a host target with ``box=``): the engine's planner cuts it into byte runs and
its readers read exactly those, from a file, an HF index directory, a list, a pod
directory or a URL alike. Steps and negative steps read the bounding box and are
applied in memory; integer indices drop their dimension, as in numpy.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from .errors import NnxSaveError, SliceError, short_repr
from .layouts._sources import Header, read_header, reader_factory
from .load._engine import load_targets
from .load._options import LoadOptions
from .load._report import IOStats
from .load._target import Target

__all__ = ["LazyCheckpoint", "TensorSlice", "iter_tensors", "safe_open"]

PathLike = str | os.PathLike
Box = tuple[tuple[int, int], ...]
_FRAMEWORKS = ("np", "numpy")


def _dim_index(index: Any, size: int, dim: int, key: str) -> tuple[tuple[int, int], Any]:
    """``((start, stop), what to apply to the read box)`` for one dimension."""
    if isinstance(index, slice):
        start, stop, step = index.indices(size)
        count = len(range(start, stop, step))
        if count == 0:
            return (0, 0), slice(None)
        last = start + (count - 1) * step
        lo, hi = (start, last + 1) if step > 0 else (last, start + 1)
        return (lo, hi), slice(None) if step == 1 else slice(start - lo, None, step)
    if isinstance(index, (int, np.integer)) and not isinstance(index, bool):
        i = int(index) + size if index < 0 else int(index)
        if not 0 <= i < size:
            raise SliceError(f"{key}: index {int(index)} is out of range for dimension {dim} of size {size}")
        return (i, i + 1), 0
    raise SliceError(
        f"{key}: dimension {dim}: expected an int or a slice, found {type(index).__name__} {short_repr(index, 40)}; "
        "read the tensor (get_tensor) for fancy indexing"
    )


def slice_box(index: Any, shape: Sequence[int], key: str = "tensor") -> tuple[Box, tuple[Any, ...]]:
    """The box ``index`` touches in a tensor of ``shape``, and the index that takes the
    result out of that box (steps, dropped dimensions).

    Examples:
        >>> slice_box((slice(1, 3), Ellipsis, -1), (4, 5, 6))
        (((1, 3), (0, 5), (5, 6)), (slice(None, None, None), slice(None, None, None), 0))
    """
    items = index if isinstance(index, tuple) else (index,)
    if sum(i is Ellipsis for i in items) > 1:
        raise SliceError(f"{key}: an index can hold only one Ellipsis (...)")
    if Ellipsis in [i for i in items if i is Ellipsis]:
        at = next(n for n, i in enumerate(items) if i is Ellipsis)
        items = items[:at] + (slice(None),) * (len(shape) - len(items) + 1) + items[at + 1 :]
    if len(items) > len(shape):
        raise SliceError(f"{key}: {len(items)} indices for a tensor of {len(shape)} dimensions, shape {tuple(shape)}")
    items = items + (slice(None),) * (len(shape) - len(items))
    pairs = [_dim_index(i, d, n, key) for n, (i, d) in enumerate(zip(items, shape, strict=True))]
    return tuple(b for b, _ in pairs), tuple(p for _, p in pairs)


class TensorSlice:
    """``f.get_slice(key)``: shape and dtype without reading; ``[...]`` reads the box."""

    def __init__(self, handle: LazyCheckpoint, key: str) -> None:
        self._handle, self._key = handle, key
        self._info = handle.header.tensors[key]

    def get_shape(self) -> list[int]:
        return list(self._info.shape)

    def get_dtype(self) -> str:
        """The safetensors dtype code (``"F32"``, ``"BF16"``, ...)."""
        return self._info.dtype.code

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._info.shape)

    @property
    def dtype(self) -> np.dtype:
        return self._info.dtype.numpy

    def __len__(self) -> int:
        if not self._info.shape:
            raise TypeError(f"{self._key}: len() of a 0-d tensor")
        return self._info.shape[0]

    def __getitem__(self, index: Any) -> np.ndarray:
        box, post = slice_box(index, self._info.shape, self._key)
        block = self._handle._read(self._key, box)
        if all(p == slice(None) for p in post):
            return block
        return np.array(block[post])  # a contiguous copy; 0-d stays an array


class LazyCheckpoint:
    """An open checkpoint: headers read, tensors read on demand (see :func:`safe_open`)."""

    def __init__(
        self,
        source: PathLike | Sequence[PathLike] | Header,
        framework: str = "np",
        *,
        max_over_read_ratio: float | None = 1.0,
        max_inflight_bytes: int = 1 << 30,
        num_threads: int | None = None,
    ) -> None:
        if framework not in _FRAMEWORKS:
            raise NnxSaveError(
                f"safe_open: framework {framework!r}: this handle gives numpy arrays ('np'); "
                "use jax.device_put on them, or load_file / load_model for sharded jax arrays"
            )
        # built here so that a bad setting is refused where it is given, not at the first read
        self._options = LoadOptions(
            max_over_read_ratio=max_over_read_ratio, max_inflight_bytes=max_inflight_bytes, num_threads=num_threads
        )
        self._header: Header | None = read_header(source)
        self._owned = self._header is not source
        self.io = IOStats()  # every read through this handle, summed

    @property
    def header(self) -> Header:
        if self._header is None:
            raise NnxSaveError("the checkpoint handle is closed")
        return self._header

    def __enter__(self) -> LazyCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Let go of the headers and close the files they keep open (those of a
        :class:`Header` passed in stay open: its owner closes them)."""
        if self._header is not None and self._owned:
            self._header.close()
        self._header = None

    def keys(self) -> list[str]:
        """Every tensor's name, sorted (as ``safetensors.safe_open`` lists them)."""
        return sorted(self.header.tensors)

    def metadata(self) -> dict[str, str]:
        """The checkpoint's ``__metadata__`` (for several files: the index's over the first file's)."""
        return dict(self.header.metadata)

    def _info(self, key: str):
        try:
            return self.header.tensors[key]
        except KeyError:
            near = sorted(k for k in self.header.tensors if key.split(".")[-1] in k)[:5]
            raise SliceError(f"{key!r}: no such tensor in the checkpoint; similar: {near}") from None

    def get_slice(self, key: str) -> TensorSlice:
        """A view of tensor ``key`` whose ``[...]`` reads only the bytes that index needs."""
        self._info(key)
        return TensorSlice(self, key)

    def get_tensor(self, key: str) -> np.ndarray:
        """Tensor ``key``, read whole."""
        info = self._info(key)
        return self._read(key, tuple((0, d) for d in info.shape))

    def _read(self, key: str, box: Box, dtype: Any = None) -> np.ndarray:
        info = self._info(key)
        want = info.dtype.numpy if dtype is None else np.dtype(dtype)
        if any(hi <= lo for lo, hi in box):  # nothing to read
            return np.empty(tuple(hi - lo for lo, hi in box), want)
        return self._load([Target(key, tuple(info.shape), want, None, (key,), box=box)])[key]

    def _load(self, targets: list[Target]) -> dict[str, np.ndarray]:
        header = self.header
        values, report = load_targets(
            header,
            targets,
            self._options,
            ignore_unexpected=frozenset(header.tensors),  # a handle reads what it is asked for, nothing is "unexpected"
            open_reader=reader_factory(header),
            warn=False,
        )
        _add_io(self.io, report.io)
        return values


def _add_io(total: IOStats, io: IOStats) -> None:
    for name in ("bytes_read", "bytes_needed", "requests", "files", "retries"):
        setattr(total, name, getattr(total, name) + getattr(io, name))
    for name in ("plan_seconds", "read_seconds", "assemble_seconds"):
        setattr(total, name, getattr(total, name) + getattr(io, name))
    total.max_inflight_bytes = max(total.max_inflight_bytes, io.max_inflight_bytes)


def safe_open(
    source: PathLike | Sequence[PathLike] | Header,
    framework: str = "np",
    *,
    max_over_read_ratio: float | None = 1.0,
    max_inflight_bytes: int = 1 << 30,
    num_threads: int | None = None,
) -> LazyCheckpoint:
    """Open a checkpoint lazily, like ``safetensors.safe_open``: only headers are read.

    Args:
        source: a ``.safetensors`` file, an HF index directory, a directory or list
            of files, a pod directory (:func:`save_pod`), or an ``http(s)://`` URL.
        framework: ``"np"`` (numpy arrays; the only one).
        max_over_read_ratio: the engine's cap on bytes read / bytes needed when it
            merges reads; 1.0 reads the bytes a slice needs, plus the gaps under a
            page (4 KiB) between them that the engine always reads through rather
            than pay another request. Over HTTP a larger ratio or ``None`` trades
            bytes for fewer requests.
        max_inflight_bytes, num_threads: the engine's budget and readers.

    Returns:
        A :class:`LazyCheckpoint` with ``keys()``, ``metadata()``, ``get_tensor(key)``
        and ``get_slice(key)[...]``; ``.io`` sums what its reads cost.

    Raises:
        HeaderError: a malformed checkpoint (nothing is read past the headers).
        SliceError: an unknown key, or an index that is not ints and slices.
        OptionError: a setting out of range (names it), before anything is read.

    Examples:
        >>> import numpy as np, nnx_save, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
        >>> nnx_save.save_file({"w": np.arange(24, dtype=np.float32).reshape(2, 3, 4)}, path)
        >>> with nnx_save.safe_open(path) as f:
        ...     print(f.keys(), f.get_slice("w")[1, :, 1:3].tolist(), f.io.bytes_needed)
        ['w'] [[13.0, 14.0], [17.0, 18.0], [21.0, 22.0]] 24
    """
    return LazyCheckpoint(
        source,
        framework,
        max_over_read_ratio=max_over_read_ratio,
        max_inflight_bytes=max_inflight_bytes,
        num_threads=num_threads,
    )


def _batches(header: Header, keys: Iterable[str], max_batch_bytes: int) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for key in keys:
        n = header.tensors[key].nbytes
        if batch and size + n > max_batch_bytes:
            yield batch
            batch, size = [], 0
        batch.append(key)
        size += n
    if batch:
        yield batch


def iter_tensors(
    source: PathLike | Sequence[PathLike] | Header,
    keys: Iterable[str] | None = None,
    *,
    dtype: Any = None,
    max_batch_bytes: int = 256 << 20,
    num_threads: int | None = None,
) -> Iterator[tuple[str, np.ndarray]]:
    """Stream ``(key, array)`` pairs one tensor at a time, with bounded host memory.

    Tensors are read in batches of at most ``max_batch_bytes`` (a larger tensor alone)
    in file order, so memory held by the iterator stays under one batch plus what the
    caller keeps; convert or quantize each array as it comes.

    Args:
        source: as :func:`safe_open`.
        keys: the tensors to read, in this order (default: all, in file order).
        dtype: cast each tensor to this dtype on the host while loading.
        max_batch_bytes: the most tensor bytes read ahead at once.
        num_threads: the engine's concurrent readers.

    Raises:
        SliceError: a key the checkpoint does not hold (before anything is read).

    Examples:
        >>> import numpy as np, nnx_save, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
        >>> nnx_save.save_file({"a": np.ones(2, np.float32), "b": np.zeros(3, np.float32)}, path)
        >>> [(k, v.dtype.name, v.shape) for k, v in nnx_save.iter_tensors(path, dtype=np.float16)]
        [('a', 'float16', (2,)), ('b', 'float16', (3,))]
    """
    handle = LazyCheckpoint(source, num_threads=num_threads, max_inflight_bytes=max(max_batch_bytes, 1))
    header = handle.header
    if keys is None:
        order = sorted(header.tensors.values(), key=lambda t: (t.file, t.begin))
        names = [t.name for t in order]
    else:
        names = list(keys)
        for key in names:
            handle._info(key)
    for batch in _batches(header, names, max_batch_bytes):
        targets = []
        for key in dict.fromkeys(batch):  # a key asked for twice is read once
            info = header.tensors[key]
            want = info.dtype.numpy if dtype is None else np.dtype(dtype)
            targets.append(Target(key, tuple(info.shape), want, None, (key,)))
        values = handle._load(targets)
        for key in batch:
            yield key, values[key]
        del values  # the batch is released before the next one is read
