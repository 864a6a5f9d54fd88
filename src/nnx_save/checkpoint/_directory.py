"""Where a run's checkpoints live. Pure path logic: nothing is created here."""

from __future__ import annotations

import os
import pathlib

__all__ = ["absolute_dir", "resolve_checkpoint_dir"]


def absolute_dir(name: str, value: str | os.PathLike[str]) -> pathlib.Path:
    """``value`` as an absolute path (relative to the working directory).

    Raises:
        ValueError: ``value`` is empty or only whitespace.
        TypeError: ``value`` is not a str or ``os.PathLike[str]``.
    """
    text = os.fspath(value)
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a str or os.PathLike[str], got {type(value).__name__}")
    if not text.strip():
        raise ValueError(f"{name} is empty ({text!r}); give a directory path")
    return pathlib.Path(text).absolute()


def resolve_checkpoint_dir(
    checkpoint_dir: str | os.PathLike[str] | None, run_dir: str | os.PathLike[str] | None = None
) -> pathlib.Path:
    """Pick a run's checkpoint directory without creating it.

    An explicit ``checkpoint_dir`` wins; otherwise ``run_dir / "checkpoints"``.
    Relative paths are taken against the current working directory.

    Args:
        checkpoint_dir: The directory asked for explicitly, or None.
        run_dir: The run's output directory, or None.

    Returns:
        An absolute path, which may not exist yet.

    Raises:
        ValueError: Neither is given, or the one used is empty or whitespace.

    Examples:
        >>> resolve_checkpoint_dir(None, "/runs/exp1")
        PosixPath('/runs/exp1/checkpoints')
        >>> resolve_checkpoint_dir("/data/ckpt", "/runs/exp1")
        PosixPath('/data/ckpt')
    """
    if checkpoint_dir is not None:
        return absolute_dir("checkpoint_dir", checkpoint_dir)
    if run_dir is not None:
        return absolute_dir("run_dir", run_dir) / "checkpoints"
    raise ValueError("no checkpoint directory: pass checkpoint_dir, or run_dir to use run_dir/checkpoints")
