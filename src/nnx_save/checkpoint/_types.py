"""The store's contract: :class:`CheckpointStore` and the :class:`Checkpoint` it restores."""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Mapping
from typing import Any, Literal, Protocol, Self, TypedDict, Unpack, runtime_checkable

from ..load._report import LoadReport
from ._metadata import CheckpointMetadata, Producer

__all__ = ["Checkpoint", "CheckpointStore", "SaveRecord"]


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """One restored step.

    Attributes:
        step: The step.
        items: The restored items by name, in the order they were recorded.
        metadata: The step's metadata record.
        path: The step's directory.
        report: What the templated items' restore found: loaded, missing,
            unexpected, shape mismatches and dtype casts, by ``item/leaf`` path
            (the report ``load_model`` gives).
    """

    step: int
    items: Mapping[str, Any]
    metadata: CheckpointMetadata
    path: pathlib.Path
    report: LoadReport = dataclasses.field(default_factory=LoadReport)


class SaveRecord(TypedDict, total=False):
    """The keyword arguments of ``save`` that go into the step's metadata record."""

    epoch: int | None
    metrics: Mapping[str, Any] | None
    producer: Producer | None
    extra: Mapping[str, Any] | None


@runtime_checkable
class CheckpointStore(Protocol):
    """A step-addressed store of training state; see :class:`OrbaxCheckpointStore`."""

    def save(
        self,
        step: int,
        items: Mapping[str, Any],
        *,
        overwrite: bool = False,
        blocking: bool = True,
        force: bool = False,
        **record: Unpack[SaveRecord],
    ) -> pathlib.Path | None: ...

    def restore(
        self, step: int | None = None, *, templates: Mapping[str, Any] | None = None, cast_dtypes: bool = False
    ) -> Checkpoint: ...

    def read_metadata(self, step: int) -> CheckpointMetadata: ...

    def list_steps(self) -> list[int]: ...

    def latest_step(self) -> int | None: ...

    def best_step(self, metric: str | None = None, *, mode: Literal["min", "max"] | None = None) -> int | None: ...

    def delete(self, step: int) -> None: ...

    def close(self) -> None: ...

    def __enter__(self) -> Self: ...

    def __exit__(self, *exc: object) -> None: ...
