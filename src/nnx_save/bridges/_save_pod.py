"""``save_pod``: a pytree or an NNX model, flattened into entries for the pod writer."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .._options import DEFAULT, merge, path_arg
from ..layouts import _registry
from ..layouts._pod import MANIFEST
from ..save._background import SaveHandle
from ..save._entry import Entry
from ..save._options import SaveOptions
from . import _nnx
from ._leaves import check_metadata, tree_entries

__all__ = ["save_pod"]


def save_pod(
    tree_or_model: Any,
    directory: str | os.PathLike,
    *,
    metadata: Mapping[str, str] | None = None,
    filter: Any = ...,
    progress: bool | None = DEFAULT,
    blocking: bool = DEFAULT,
    options: SaveOptions | None = None,
) -> Path | SaveHandle:
    """Save a pytree of arrays or an NNX model as a pod directory: one shard file per
    process and a ``manifest.json``.

    Call it on every process with the same tree. Each writes only the boxes its devices
    hold (nothing is gathered); the manifest is written last, atomically, so a crash
    leaves the previous save readable. Any loader reads it on any process layout.

    Args:
        tree_or_model: a pytree of jax / numpy arrays, or an NNX object.
        directory: the pod directory (created if needed; must be shared by all processes).
        metadata: string -> string pairs for the manifest and every shard file.
        filter: an NNX filter, for a model (``nnx.Param``: parameters only).
        progress: a progress bar on stderr.
        blocking: ``False`` writes in the background and returns a :class:`SaveHandle`.
        options: a :class:`SaveOptions` (it explains the two keywords above, its shortcuts).

    Returns:
        The path of ``manifest.json`` (``blocking=False``: a :class:`SaveHandle`
        whose ``result()`` is the directory).

    Raises:
        SaveError: a process failed or did not arrive in time; the previous pod
            directory content is intact.
        DirectoryLockedError: another save (or store) is writing ``directory``, named with
            its host and process; raised on every process of the job, nothing was written.
        OptionError: an option out of range, ``max_shard_size``, or a setting given
            both as a keyword and in ``options`` (names it).

    Examples:
        >>> import numpy as np, nnx_save, tempfile
        >>> d = tempfile.mkdtemp()
        >>> _ = nnx_save.save_pod({"w": np.arange(4, dtype=np.float32)}, d)
        >>> nnx_save.load_file(d)["w"]
        array([0., 1., 2., 3.], dtype=float32)
    """
    how = merge(SaveOptions, options, "save_pod", locals()).for_pod("save_pod writes a pod")  # locals() first
    directory = path_arg(directory, "directory", "save_pod")
    _registry.POD.check_target(directory)  # a URL is no directory: Path() would make "http:/host/..." below
    entries, meta = _entries(tree_or_model, metadata, filter)
    handle = _registry.run_save(directory, entries, _registry.plan_save(meta, how))
    return Path(directory) / MANIFEST if handle is None else handle


def _entries(tree_or_model: Any, metadata: Mapping[str, str] | None, filter: Any) -> tuple[list[Entry], dict]:
    if _nnx.is_model(tree_or_model):
        entries, rng, scalars = _nnx.model_entries(tree_or_model, filter)
        return entries, _nnx.model_metadata(metadata, rng, scalars)
    check_metadata(metadata)
    return tree_entries(tree_or_model), dict(metadata or {})
