"""Where a run's checkpoints live (pure path logic): a local directory, or a ``gs://`` /
``s3://`` URL kept as given (never a local directory named ``gs:``); other schemes are refused."""

from __future__ import annotations

import os
import pathlib
import re
import urllib.parse
from typing import Any

from etils import epath

from .._options import path_arg
from ..errors import OptionError
from ._errors import CheckpointUsageError

__all__ = ["CLOUD_SCHEMES", "resolve_checkpoint_dir", "store_location"]

# Schemes both Orbax's paths (etils epath) and its array writer (tensorstore) handle.
CLOUD_SCHEMES = ("gs", "s3")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")

Location = pathlib.Path | Any  # a local path, or an etils epath for a URL (untyped)


def _text(name: str, value: str | os.PathLike[str]) -> str:
    if isinstance(value, str) and not value.strip():
        raise OptionError(f"{name} is empty ({value!r}); give a directory path")
    text = path_arg(value, name, "the checkpoint store")
    if not text.strip():
        raise OptionError(f"{name} is empty ({text!r}); give a directory path")
    return text


def store_location(name: str, value: str | os.PathLike[str]) -> Location:
    """A local absolute path (``file://`` URLs too), or the URL unchanged (an etils ``epath.Path``).

    Examples:
        >>> str(store_location("directory", "gs://bucket/run"))
        'gs://bucket/run'
        >>> store_location("directory", "file:///data/run")
        PosixPath('/data/run')
    """
    text = _text(name, value)
    match = _SCHEME.match(text)
    if match is None:
        return pathlib.Path(text).absolute()
    scheme = match.group(1).lower()
    if scheme == "file":
        parsed = urllib.parse.urlparse(text)
        if parsed.netloc not in ("", "localhost"):
            raise CheckpointUsageError.for_directory(
                text, f"a file:// URL on host {parsed.netloc!r}; use file:///absolute/path"
            )
        return pathlib.Path(urllib.parse.unquote(parsed.path)).absolute()
    if scheme not in CLOUD_SCHEMES:
        raise CheckpointUsageError.for_directory(text, f"the URL scheme {scheme!r}")
    return epath.Path(text)


def resolve_checkpoint_dir(
    checkpoint_dir: str | os.PathLike[str] | None, run_dir: str | os.PathLike[str] | None = None
) -> Location:
    """Pick a run's checkpoint directory without creating it: an explicit ``checkpoint_dir``
    wins, else ``run_dir / "checkpoints"``; relative paths against the working directory.

    Args:
        checkpoint_dir: The directory asked for explicitly, or None.
        run_dir: The run's output directory, or None.

    Returns:
        An absolute path, which may not exist yet, or the URL.

    Raises:
        ValueError: Neither is given, or the one used is empty or whitespace.
        CheckpointUsageError: A URL scheme Orbax cannot write to.

    Examples:
        >>> resolve_checkpoint_dir(None, "/runs/exp1")
        PosixPath('/runs/exp1/checkpoints')
        >>> resolve_checkpoint_dir("/data/ckpt", "/runs/exp1")
        PosixPath('/data/ckpt')
        >>> str(resolve_checkpoint_dir(None, "gs://bucket/exp1"))
        'gs://bucket/exp1/checkpoints'
    """
    if checkpoint_dir is not None:
        return store_location("checkpoint_dir", checkpoint_dir)
    if run_dir is not None:
        return store_location("run_dir", run_dir) / "checkpoints"
    raise OptionError("no checkpoint directory: pass checkpoint_dir, or run_dir to use run_dir/checkpoints")
