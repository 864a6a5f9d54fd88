"""The cyclic garbage collector held off while the store builds or reads its records.

A save's guards and dtype record, and a restore's records and plans, allocate tens of
thousands of small lists, tuples and dicts for a train state of a few thousand leaves.
None of them forms a cycle, yet each 700 allocations start a collection, and every tenth
of those a deeper one that walks what jax, flax and Orbax keep alive: profiled, those
collections cost the store more wall time than the work itself. Held off for those
stretches only (milliseconds), the collector runs once after, as it would have; Orbax's
own work runs with the collector as the caller left it.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["collector_paused"]


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Hold off automatic collection inside the block; a collector the caller disabled
    stays disabled. (The switch is process-wide: a thread allocating meanwhile is not
    collected until the block ends, as under ``gc.disable()``.)

    Examples:
        >>> import gc
        >>> with collector_paused():
        ...     print(gc.isenabled())
        False
        >>> gc.isenabled()
        True
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
