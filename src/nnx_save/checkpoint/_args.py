"""Validation of the store's arguments: steps, items, metadata fields, restore names."""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import CheckpointItemError, OptionError
from ._format import ITEM_NAMES
from ._metadata import CheckpointMetadata, Producer, check_extra, check_metrics, is_int, library_versions, utc_now
from ._tree import check_item

__all__ = ["check_items", "check_step", "new_metadata", "restore_names"]


def check_step(step: Any) -> int:
    """A step as an int in ``[0, 2**63)`` (Orbax and its metadata count steps in int64)."""
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise OptionError(f"step must be a non-negative int, got {step!r}")
    if int(step) >= 2**63:
        raise OptionError(f"step must be below 2**63 (Orbax counts steps in int64), got {step!r}")
    return int(step)


def check_items(items: Mapping[str, Any]) -> tuple[str, ...]:
    """The item names in canonical order, after validating every leaf."""
    if not isinstance(items, Mapping) or not items:
        raise OptionError(f"items must be a non-empty mapping of {', '.join(ITEM_NAMES)}, got {items!r}")
    for name, tree in items.items():
        check_item(name, tree)
    return tuple(name for name in ITEM_NAMES if name in items)


def new_metadata(
    step: int,
    names: tuple[str, ...],
    epoch: int | None,
    metrics: Mapping[str, Any] | None,
    producer: Producer | None,
    extra: Mapping[str, Any] | None,
) -> CheckpointMetadata:
    if epoch is not None and not is_int(epoch):
        raise OptionError(f"epoch must be a non-negative int or None, got {epoch!r}")
    if producer is not None and not isinstance(producer, Producer):
        raise OptionError(f"producer must be a Producer(name, version) or None, got {producer!r}")
    return CheckpointMetadata(
        step=step,
        items=names,
        epoch=epoch,
        metrics=check_metrics(metrics),
        extra=check_extra(extra),
        producer=producer,
        library_versions=library_versions(),
        created_at=utc_now(),
    )


def restore_names(metadata: CheckpointMetadata, templates: Mapping[str, Any], items: Iterable[str] | None) -> list[str]:
    wanted = list(metadata.items if items is None else items)
    for name in [*wanted, *templates]:
        if name not in ITEM_NAMES:
            raise OptionError(f"unknown item name {name!r}; expected one of {', '.join(ITEM_NAMES)}")
    unused = sorted(set(templates) - set(wanted))
    if unused:
        raise OptionError(f"templates given for {unused}, which items={wanted} does not restore")
    absent = [name for name in wanted if name not in metadata.items]
    if absent:
        raise CheckpointItemError(metadata.step, absent, metadata.items)
    return [name for name in metadata.items if name in wanted]
