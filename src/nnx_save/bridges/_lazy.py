"""A lazy handle on a checkpoint, as safetensors users know it: :func:`safe_open`
and :func:`iter_tensors` (docs/lazy.md). A small slice of a local file is read straight
into the result (:mod:`nnx_save.load._direct`: ``preadv``, or runs far apart gathered
from a map the process never loads from, so a file truncated under the handle is a typed
error, never SIGBUS); anything larger, remote, or in a pod's pieces asks the loading
engine for the slice's box.
"""

from __future__ import annotations

import importlib
import math
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .._options import check, is_int, path_arg
from ..errors import NotSafetensorsError, SafetensorError, SliceError, SourceNotFoundError
from ..format._dtypes import DTYPES
from ..format._header import TensorInfo
from ..layouts._local import read_local, spelled_as_path
from ..load._direct import DIRECT_MAX_BYTES, DirectFiles, one_run, quick_run
from ..load._slices import Box, compat, normalize_index, plain, slice_box
from ..load._source import Header, in_batches

if TYPE_CHECKING:
    from ..io._reader import Reader
    from ..io._storage import Where
    from ..load._options import LoadOptions
    from ..load._report import IOStats
    from ..load._target import Target

__all__ = ["LazyCheckpoint", "TensorSlice", "iter_tensors", "safe_open"]

_FRAMEWORKS = {"np": "numpy", "numpy": "numpy", "flax": "jax", "jax": "jax", "pt": "torch", "torch": "torch"}
_BACKENDS = ("mmap", "pread")


def _refuse(message: str) -> SafetensorError:
    return compat(SafetensorError)(message)


def _framework(framework: str, device: Any):
    """``(name, convert)``: ``convert(array, code)`` gives the framework's tensor on
    ``device``. jax and torch are imported here, only when asked for."""
    name = _FRAMEWORKS.get(framework) if isinstance(framework, str) else None
    if name is None:
        raise _refuse(
            f"safe_open: framework {framework!r} is not supported: use 'np' / 'numpy', 'flax' / 'jax' or 'pt' / 'torch'"
        )
    if name == "numpy":
        if device != "cpu":
            raise _refuse(f"safe_open: device {device!r} is not supported for framework numpy (only 'cpu')")
        return name, None
    if name == "jax":
        return name, _jax_converter(device)
    return name, _torch_converter(device)


def _jax_converter(device: Any):
    jax = importlib.import_module("jax")
    if isinstance(device, str):
        platform, _, n = device.partition(":")
        try:
            device = jax.devices({"cuda": "gpu", "rocm": "gpu"}.get(platform, platform))[int(n or 0)]
        except (RuntimeError, IndexError, ValueError) as e:
            raise _refuse(f"safe_open: device {device!r} is not available to jax ({e})") from None
    if not isinstance(device, jax.Device):
        raise _refuse(f"safe_open: device {device!r} for framework jax: expected 'cpu', 'gpu:N' or a jax.Device")
    return lambda array, code: jax.device_put(array, device)


def _torch_converter(device: Any):
    torch = importlib.import_module("torch")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise _refuse(f"safe_open: device {device!r} is invalid for framework torch ({e})") from None

    def convert(array: np.ndarray, code: str):
        row = DTYPES[code]  # torch names its dtypes as numpy and ml_dtypes do; it packs no sub-byte ones
        dtype = getattr(torch, row.numpy.name, None) if row.byte_aligned else None
        if dtype is None:
            raise _refuse(f"safe_open: dtype {code} has no torch dtype in torch {torch.__version__}")
        try:
            tensor = torch.from_numpy(array)
        except TypeError:  # bfloat16, float8 (ml_dtypes types torch does not know): reinterpret the bytes
            tensor = torch.from_numpy(array.reshape(-1).view(np.uint8)).view(dtype).reshape(array.shape)
        return tensor if device.type == "cpu" else tensor.to(device)

    return convert


class _Counts:
    """A handle's read counts until someone asks for them as :class:`IOStats` (whose
    module, with the load report's, is imported then, or by the engine's first read)."""

    __slots__ = ("bytes_needed", "bytes_read", "files", "requests")

    def __init__(self) -> None:
        self.bytes_read = self.bytes_needed = self.requests = self.files = 0


class _Open:
    """What an open handle reads through; slices keep it, so they still read after
    ``close()`` (as in safetensors)."""

    def __init__(self, header: Header, backend: str, options: LoadOptions | None, convert) -> None:
        self.header, self._options, self.convert = header, options, convert
        local = header.placement.local_files() if backend == "mmap" else None
        self.direct = DirectFiles(local) if local is not None else None
        self.counts: _Counts | IOStats = _Counts()  # every read through this handle, summed
        self.files: set[str] = set()
        self.runs: dict[str, tuple[bool, bool]] = {}  # tensor name -> (read directly, one run at a time)

    @property
    def options(self) -> LoadOptions:
        """The engine's options: the defaults made on first use (with the configuration's
        modules), so a small read never imports them."""
        if self._options is None:
            from ..load._options import LoadOptions

            self._options = LoadOptions(max_over_read_ratio=1.0, max_inflight_bytes=1 << 30, num_threads=None)
        return self._options

    @property
    def io(self) -> IOStats:
        """The counts as :class:`IOStats` (made on first use; the counts go on there)."""
        from ..load._report import IOStats

        counts = self.counts
        if isinstance(counts, IOStats):
            return counts
        self.counts = IOStats(
            bytes_read=counts.bytes_read, bytes_needed=counts.bytes_needed, requests=counts.requests, files=counts.files
        )
        return self.counts

    def direct_ok(self, info: TensorInfo) -> tuple[bool, bool]:
        """Whether ``info``'s slices may be read directly (:mod:`nnx_save.load._direct`:
        a local file, whole bytes), and whether one run of it may be read as is (not
        BOOL, whose bytes are checked against the slice's box)."""
        ok = self.runs.get(info.name)
        if ok is None:
            direct = self.direct is not None and info.dtype.byte_aligned
            direct = direct and not self.header.placement.is_remote(info.file)
            ok = self.runs[info.name] = (direct, direct and info.dtype.code != "BOOL")
        return ok

    def read_run(self, info: TensorInfo, first: int, shape: list[int]) -> np.ndarray:
        """Elements ``first`` onward of ``info``, one contiguous run filling ``shape``
        (at most :data:`DIRECT_MAX_BYTES`), read with one call."""
        out = self.direct.read_run(info, first, shape)  # type: ignore[union-attr]
        self._count(info, out.nbytes, out.nbytes, 1)
        return out

    def read(self, info: TensorInfo, items: tuple[int | slice, ...]) -> np.ndarray:
        """``tensor[items]`` (a normalized index) as a fresh numpy array."""
        direct = self.direct
        ok, runs = self.direct_ok(info)
        if direct is None or not ok:
            return self.read_box(info, *slice_box(items, info.shape, info.name))
        run = one_run(items, info.shape) if runs else None
        if run is not None and math.prod(run[1]) * info.dtype.itemsize <= DIRECT_MAX_BYTES:
            return self.read_run(info, *run)  # an element, rows: one preadv, no planning
        planned = direct.plan(info, items)
        if planned is None:  # empty, large or scattered: the engine
            return self.read_box(info, *slice_box(items, info.shape, info.name))
        out = direct.read(info, planned)
        self._count(info, len(planned[2]) * planned[3], out.nbytes, len(planned[2]))
        return out

    def _count(self, info: TensorInfo, read: int, needed: int, requests: int) -> None:
        io = self.counts
        io.bytes_read += read
        io.bytes_needed += needed
        io.requests += requests
        if info.file not in self.files:
            self.files.add(info.file)
            io.files = len(self.files)

    def read_box(self, info: TensorInfo, box: Box, post: tuple[Any, ...]) -> np.ndarray:
        if any(hi <= lo for lo, hi in box):  # nothing to read
            block = np.empty(tuple(max(hi - lo, 0) for lo, hi in box), info.dtype.numpy)
        else:
            from ..load._target import Target  # the engine's types, imported by the first read that needs it

            target = Target(info.name, tuple(info.shape), info.dtype.numpy, None, (info.name,), box=box)
            block = self.load([target])[info.name]
        if all(p == slice(None) for p in post):
            return block
        return np.array(block[post])  # a contiguous copy; 0-d stays an array

    def load(self, targets: list[Target]) -> dict[str, np.ndarray]:
        from ..load._engine import load_targets  # its threads and planner, imported by the first large read

        values, report = load_targets(
            self.header,
            targets,
            self.options,
            ignore_unexpected=frozenset(self.header.tensors),  # a handle reads what it is asked for
            open_reader=reader_factory(self.header),
            warn=False,
        )
        self.io.add(report.io)
        self.files.update(report.io.over_read_by_file)
        self.io.files = len(self.files)
        return values


class TensorSlice:
    """``f.get_slice(key)``: shape and dtype without reading; ``[...]`` reads the slice."""

    def __init__(self, state: _Open, info: TensorInfo) -> None:
        self._state, self._info = state, info

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
            raise TypeError(f"{self._info.name}: len() of a 0-d tensor")
        return self._info.shape[0]

    def __getitem__(self, index: Any) -> Any:
        info, state = self._info, self._state
        run = quick_run(index, info.shape) if state.direct_ok(info)[1] else None
        if run is not None and math.prod(run[1]) * info.dtype.itemsize <= DIRECT_MAX_BYTES:
            array = state.read_run(info, *run)  # the commonest indices, checked and read in one go
            return array if state.convert is None else state.convert(array, info.dtype.code)
        items = plain(index, info.shape)  # the common index, without a call through normalize_index
        if items is None:
            items = normalize_index(index, info.shape, info.name)
        if items is None:  # [[]]: no rows, as safetensors gives
            array = np.empty((0, *info.shape[1:]), info.dtype.numpy)
        else:
            array = self._state.read(info, items)
        convert = self._state.convert
        return array if convert is None else convert(array, info.dtype.code)


class LazyCheckpoint:
    """An open checkpoint: headers read, tensors read on demand (see :func:`safe_open`)."""

    def __init__(self, state: _Open, framework: str, source: str, owned: bool) -> None:
        self.framework = framework
        self._source = source
        self._owned = owned  # a Header passed in is closed by its owner
        self._state: _Open | None = state
        self._counted = state  # counts slices taken after close() too

    @property
    def io(self) -> IOStats:
        """Bytes read and needed, requests and distinct files of every read so far."""
        return self._counted.io

    @property
    def _open(self) -> _Open:
        if self._state is None:
            raise _refuse(f"File is closed: {self._source} (this safe_open handle was closed; open it again)")
        return self._state

    @property
    def header(self) -> Header:
        return self._open.header

    def __enter__(self) -> LazyCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the files the headers keep open (a :class:`Header` passed in: its owner
        does) and unmap the files' maps. Slices taken before still read, as in
        safetensors (reopening by name, mapping again)."""
        if self._state is not None:
            if self._owned:
                self._state.header.close()
            if self._state.direct is not None:
                self._state.direct.close()
        self._state = None

    def keys(self) -> list[str]:
        """Every tensor's name, sorted (as ``safetensors.safe_open`` lists them)."""
        return sorted(self.header.tensors)

    def offset_keys(self) -> list[str]:
        """Every tensor's name in storage order: by file, then by byte offset."""
        header = self.header
        order = {fh.file: n for n, fh in enumerate(header.files)}
        return sorted(header.tensors, key=lambda k: (order.get(header.tensors[k].file, -1), header.tensors[k].begin, k))

    def metadata(self) -> dict[str, str] | None:
        """The checkpoint's metadata, ``None`` when it has none (as safetensors): of several
        files, the entries all share, with the index's over them (the others:
        :meth:`file_metadata`)."""
        header = self.header
        if header.kind not in ("index", "directory", "list") or len(header.files) < 2:
            return dict(header.metadata) or None
        first, rest = header.files[0].metadata, [fh.metadata for fh in header.files[1:]]
        shared = {k: v for k, v in first.items() if all(m.get(k) == v for m in rest)}
        from_index = {k: v for k, v in header.metadata.items() if first.get(k) != v}
        return {**shared, **from_index} or None

    def file_metadata(self) -> dict[str, dict[str, str]]:
        """Each file's own ``__metadata__``, by file."""
        return {fh.file: dict(fh.metadata) for fh in self.header.files}

    def _info(self, key: str) -> TensorInfo:
        tensors = self.header.tensors
        found = tensors.get(key) if isinstance(key, str) else None
        if found is None:
            if not isinstance(key, str):
                raise TypeError(f"safe_open: a tensor name is a str, found {type(key).__name__} {key!r}")
            near = sorted(k for k in tensors if key.split(".")[-1] in k)[:5]
            raise compat(SliceError)(
                f"{key!r}: no such tensor in the checkpoint (File does not contain tensor {key}: {self._source}); "
                f"similar: {near}"
            )
        return found

    def get_slice(self, key: str) -> TensorSlice:
        """A view of tensor ``key`` whose ``[...]`` reads only the bytes that index needs."""
        state = self._state
        info = state.header.tensors.get(key) if state is not None and type(key) is str else None
        if state is None or info is None:  # closed, or no such key: the errors below say so
            return TensorSlice(self._open, self._info(key))
        return TensorSlice(state, info)

    def get_tensor(self, key: str) -> Any:
        """Tensor ``key``, read whole, in the handle's framework."""
        info = self._info(key)
        state = self._open
        array = state.read(info, tuple(slice(0, d, 1) for d in info.shape))
        return array if state.convert is None else state.convert(array, info.dtype.code)

    def get_tensors(self) -> dict[str, Any]:
        """Every tensor, read whole, by name in storage order (:meth:`offset_keys`)."""
        return {key: self.get_tensor(key) for key in self.offset_keys()}


_DEFAULTS = (1.0, 1 << 30, None)


def _options(ratio: float | None, inflight: int, threads: int | None) -> LoadOptions | None:
    """The engine's options, validated; ``None`` for the defaults (types are compared too:
    ``True == 1.0``), which the first read that needs the engine makes (:attr:`_Open.options`)."""
    given = (ratio, inflight, threads)
    if given == _DEFAULTS and tuple(map(type, given)) == (float, int, type(None)):
        return None
    from ..load._options import LoadOptions  # with the configuration's variables, as the engine's

    return LoadOptions(max_over_read_ratio=ratio, max_inflight_bytes=inflight, num_threads=threads)


def _where(source: Any) -> str:
    if isinstance(source, Header):
        return source.files[0].file if len(source.files) == 1 else f"{len(source.files)} files"
    if isinstance(source, (list, tuple)):
        return f"{len(source)} files"
    return os.fspath(source)


def _read_header(source: Where | Sequence[Where] | Header) -> Header:
    """The headers; a missing path raises safetensors' ``FileNotFoundError`` text. A
    local file is read without the registry (and the other layouts' modules): any other
    source, a missing path or a file that is not safetensors (an index) go through it."""
    try:
        local = _read_local(source)
        if local is not None:
            return local
        from ..layouts._registry import read_header

        return read_header(source)
    except FileNotFoundError:
        from ..io._storage import is_url

        if isinstance(source, (str, os.PathLike)) and not is_url(os.fspath(source)) and not os.path.lexists(source):
            raise SourceNotFoundError(f"No such file or directory: {os.fspath(source)}", os.fspath(source)) from None
        raise


def reader_factory(header: Header) -> Callable[[str], Reader]:
    """``open_reader(file)`` for the engine, of the header's own (pinned) files (the
    registry's, without importing it)."""
    return header.placement.open_reader


def _read_local(source: object) -> Header | None:
    """The header of ``source`` when it is a path to a local safetensors file, else None."""
    if not isinstance(source, (str, os.PathLike)):
        return None
    name = path_arg(source, "source", "read_header")  # refused as the registry refuses it
    if not spelled_as_path(name):  # never a URL: "scheme://" has a "//"
        return None
    try:
        return read_local(name)
    except (FileNotFoundError, NotSafetensorsError):  # the registry reads it again and says what it is
        return None


def safe_open(
    filename: Where | Sequence[Where] | Header,
    framework: str = "np",
    device: Any = "cpu",
    *,
    backend: str = "mmap",
    max_over_read_ratio: float | None = 1.0,
    max_inflight_bytes: int = 1 << 30,
    num_threads: int | None = None,
) -> LazyCheckpoint:
    """Open a checkpoint lazily, as ``safetensors.safe_open`` does: only headers are read.

    A drop-in for it (same arguments, methods, slicing rules and errors); docs/lazy.md
    lists where it does more and where it deliberately differs.

    Args:
        filename: a ``.safetensors`` file, an HF index directory, a directory or list
            of files, a pod directory (:func:`save_pod`), or an ``http(s)://`` URL.
        framework: ``"np"`` / ``"numpy"``, ``"flax"`` / ``"jax"`` (arrays on ``device``)
            or ``"pt"`` / ``"torch"`` (torch is imported only then).
        device: ``"cpu"``; for jax also ``"gpu:N"``, ``"tpu:N"`` or a ``jax.Device``;
            for torch anything ``torch.device`` takes.
        backend: ``"mmap"`` (the name safetensors uses): small slices of local files are
            read straight into the result, without the engine: a contiguous run with one
            positioned read, runs far apart copied out of a private map of the file whose
            SIGBUS is caught (a file truncated meanwhile is a typed error, never a signal);
            ``"pread"``: every read goes through the engine's readers.
        max_over_read_ratio: the engine's cap on bytes read / bytes needed when it
            merges reads; over HTTP a larger one or ``None`` means fewer requests.
        max_inflight_bytes: the engine's budget (:class:`LoadOptions`).
        num_threads: the engine's concurrent readers.

    Returns:
        A :class:`LazyCheckpoint` (the methods of safetensors' handle; ``.io`` sums what
        its reads cost).

    Raises:
        SourceNotFoundError: no such file or directory (a ``FileNotFoundError``).
        HeaderError: a malformed checkpoint (nothing is read past the headers).
        SafetensorError: an unknown framework, device or backend; later, an unknown
            key or a closed handle.
        SliceError: an index safetensors refuses too (a ``SafetensorError``).
        OptionError: a setting out of range (names it), before anything is read.

    Examples:
        >>> import numpy as np, nnx_save, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
        >>> nnx_save.save_file({"w": np.arange(24, dtype=np.float32).reshape(2, 3, 4)}, path)
        >>> with nnx_save.safe_open(path, framework="np") as f:
        ...     print(f.keys(), f.get_slice("w")[1, :, 1:3].tolist(), f.io.bytes_needed)
        ['w'] [[13.0, 14.0], [17.0, 18.0], [21.0, 22.0]] 24
    """
    if backend not in _BACKENDS:
        raise _refuse(f"safe_open: backend {backend!r} is invalid (expected one of: 'mmap', 'pread')")
    name, convert = _framework(framework, device)
    options = _options(max_over_read_ratio, max_inflight_bytes, num_threads)
    header = _read_header(filename)  # first: it refuses what is not a source
    source = _where(filename)
    return LazyCheckpoint(_Open(header, backend, options, convert), name, source, header is not filename)


def iter_tensors(
    source: Where | Sequence[Where] | Header,
    keys: Iterable[str] | None = None,
    *,
    dtype: Any = None,
    max_batch_bytes: int = 256 << 20,
    num_threads: int | None = None,
) -> Iterator[tuple[str, np.ndarray]]:
    """Stream ``(key, array)`` pairs one tensor at a time, with bounded host memory: one
    batch of at most ``max_batch_bytes`` (a larger tensor alone) plus what the caller keeps.

    Args:
        source: as :func:`safe_open`.
        keys: the tensors to read, in this order (default: all, in storage order, as
            :meth:`LazyCheckpoint.offset_keys` lists them).
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
    check(is_int(max_batch_bytes, 1), "max_batch_bytes", "a positive int (bytes) up to 2**62", max_batch_bytes)
    cast = _dtype(dtype)
    with safe_open(source, num_threads=num_threads, max_inflight_bytes=max_batch_bytes) as handle:
        yield from _stream(handle, _keys(keys), cast, max_batch_bytes)


def _dtype(dtype: Any) -> np.dtype | None:
    """``dtype`` as a numpy dtype of numbers (an OptionError naming it otherwise)."""
    if dtype is None:
        return None
    try:
        out = np.dtype(dtype)
    except (TypeError, ValueError, SyntaxError):  # numpy parses strings: "[]" is a SyntaxError
        out = None
    check(out is not None and out.kind in "biufcV" and out.itemsize > 0, "dtype", "a numeric numpy dtype", dtype)
    return out


def _keys(keys: Any) -> list[str] | None:
    """``keys`` as a list of names; a str or anything but an iterable of str is refused."""
    if keys is None:
        return None
    ok = not isinstance(keys, (str, bytes)) and isinstance(keys, Iterable)
    names = list(keys) if ok else []
    check(ok and all(isinstance(k, str) for k in names), "keys", "None or an iterable of tensor names (str)", keys)
    return names


def _stream(
    handle: LazyCheckpoint, keys: Iterable[str] | None, dtype: Any, max_batch_bytes: int
) -> Iterator[tuple[str, np.ndarray]]:
    from ..load._target import Target

    tensors = handle.header.tensors
    names = handle.offset_keys() if keys is None else [handle._info(key).name for key in keys]
    cast = dtype
    for batch in in_batches(handle.header, names, max_batch_bytes):
        targets = [
            Target(key, tuple(tensors[key].shape), tensors[key].dtype.numpy if cast is None else cast, None, (key,))
            for key in dict.fromkeys(batch)  # a key asked for twice is read once
        ]
        values = handle._open.load(targets)
        for key in batch:
            yield key, values[key]
        del values  # the batch is released before the next one is read
