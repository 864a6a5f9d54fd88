"""How a save runs: one public, frozen :class:`SaveOptions`, validated when it is made."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from .._options import check
from ..errors import OptionError
from ..format._units import parse_size

__all__ = ["DEFAULT_SHARD_SIZE", "Layout", "SaveOptions"]

Layout = Literal["file", "index", "pod"]
DEFAULT_SHARD_SIZE = "5GB"
"""The largest file of an index layout whose ``max_shard_size`` is not given (transformers' default)."""


@dataclass(frozen=True)
class SaveOptions:
    """How a save runs: the settings of :func:`~nnx_save.save_file`,
    :func:`~nnx_save.save_model` and :func:`~nnx_save.save_pod`, each also a keyword of
    theirs that may set a field ``options=`` leaves at its default.

    Attributes:
        progress: progress on stderr: ``None`` a bar on a terminal above
            ``NNX_SAVE_PROGRESS_MIN_BYTES`` (256 MiB), nothing on a pipe; ``True`` a bar
            on a terminal, plain lines at a bounded rate elsewhere (a log); ``False`` never.
        blocking: ``False`` returns a :class:`~nnx_save.SaveHandle` once a host
            snapshot is taken (of this process's pieces, for ``save_pod``) and writes
            in the background: training on, or donating the arrays, is then safe
            (docs/async.md).
        max_shard_size: write a HuggingFace multi-file checkpoint (a directory with
            ``model.safetensors.index.json``) of files of at most this many bytes: an
            int or a size such as ``"5GB"`` or ``"200MiB"`` (``save_file`` and
            ``save_model``; ``save_pod`` refuses it). A shortcut for ``layout="index"``.
        layout: what a save writes: ``"file"`` (one ``.safetensors`` file),
            ``"index"`` (a HuggingFace multi-file checkpoint, files of at most
            ``max_shard_size``, else :data:`DEFAULT_SHARD_SIZE`) or ``"pod"`` (one shard file per
            process and a ``manifest.json``: what ``save_pod`` writes). ``None``, the
            default: ``"index"`` when ``max_shard_size`` is given, else ``"file"``
            (``save_pod`` always writes ``"pod"``).

    Raises:
        OptionError: a field out of range or of the wrong type (names it).

    Examples:
        >>> SaveOptions(blocking=False).blocking
        False
        >>> SaveOptions(layout="index").layout
        'index'
        >>> SaveOptions(max_shard_size="5 parsecs")
        Traceback (most recent call last):
        ...
        nnx_save.errors.OptionError: max_shard_size='5 parsecs': expected a positive number of bytes up to 2**62, an int or a size such as '5GB', '200MiB', '100KB'
    """

    progress: bool | None = None
    blocking: bool = True
    max_shard_size: int | str | None = None
    layout: Layout | None = None

    def __post_init__(self) -> None:
        progress = self.progress  # a bool, not 1 or 0 (== True, False)
        check(progress is None or isinstance(progress, bool), "progress", "None, True or False", progress)
        check(isinstance(self.blocking, bool), "blocking", "True or False", self.blocking)
        if self.max_shard_size is not None:
            parse_size(self.max_shard_size, "max_shard_size")  # an OptionError naming it
        check(self.layout in (None, "file", "index", "pod"), "layout", "None, 'file', 'index' or 'pod'", self.layout)
        if self.max_shard_size is not None and self.layout in ("file", "pod"):
            raise OptionError(
                f"layout={self.layout!r} writes no HuggingFace index, so max_shard_size cannot apply; give "
                "layout='index' (or no layout) with max_shard_size, or no max_shard_size",
                "max_shard_size",
            )

    def for_pod(self, writer: str) -> SaveOptions:
        """``self`` with ``layout="pod"``, for ``writer``: ``max_shard_size`` and another layout are refused, not ignored."""
        if self.max_shard_size is not None:
            raise OptionError(f"{writer}: max_shard_size is for save_model", "max_shard_size")
        if self.layout not in (None, "pod"):
            raise OptionError(f"{writer}: layout={self.layout!r} is for save_file and save_model", "layout")
        return dataclasses.replace(self, layout="pod")
