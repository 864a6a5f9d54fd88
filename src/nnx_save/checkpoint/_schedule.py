"""When to save: an interval in steps and/or seconds, and preemption.

A preemption makes the next step due: with one process a ``SIGTERM`` handler (installed
by the first ``due`` call) records it; with several, JAX's ``reached_preemption_sync_point``
names one step for all. A seconds interval is measured on process 0 and shared.

The handler chains: it is installed on top of whatever handler is there and calls it
(a default action, ``SIG_DFL`` or the exit hook's "finish and end", is what the handler
replaces, so it is not called). Every open schedule of the process is told by one
handler; when the last one closes, the handler that was there before is put back, only
if ours is still the installed one (a handler installed later on top stays).
"""

from __future__ import annotations

import dataclasses
import signal
import threading
import time
from typing import Any

import jax
from jax.experimental import multihost_utils

from ..errors import OptionError
from . import _exit
from ._agree import agree
from ._metadata import is_int, is_number

__all__ = ["SaveSchedule"]


@dataclasses.dataclass
class SaveSchedule:
    """Save intervals and the preemption state of one store (due: divisible by
    ``every_steps``, or ``every_seconds`` after the last save; with neither, always).

    Examples:
        >>> schedule = SaveSchedule(every_steps=100)
        >>> [schedule.due(s) for s in (99, 100, 150)]
        [False, True, False]
        >>> schedule.close()
    """

    every_steps: int | None = None
    every_seconds: float | None = None
    preempted_at: int | None = None
    _last_save: float = dataclasses.field(default_factory=time.monotonic)
    _sigterm: bool = False
    _installed: bool = False
    _decided: tuple[int, bool] | None = None  # the last (step, due) of due(): what save() reuses

    def __post_init__(self) -> None:
        steps, seconds = self.every_steps, self.every_seconds
        if steps is not None and not is_int(steps, 1):
            raise OptionError(f"save_interval_steps must be an int >= 1 or None, got {steps!r}")
        if seconds is not None and not (is_number(seconds) and seconds > 0):
            raise OptionError(f"save_interval_seconds must be a positive number or None, got {seconds!r}")

    def due(self, step: int) -> bool:
        """Whether ``step`` should be saved: preemption first, then the intervals."""
        self._decided = (step, self._due(step))
        return self._decided[1]

    def _due(self, step: int) -> bool:
        if self._preempted(step):
            self.preempted_at = step if self.preempted_at is None else self.preempted_at
            return True
        if self.every_steps is None and self.every_seconds is None:
            return True
        if self.every_steps is not None and step % self.every_steps == 0:
            return True
        return self.every_seconds is not None and self._seconds_passed()

    def lets_save(self, step: int) -> bool:
        """Whether a save of ``step`` goes ahead: always without intervals, else as
        :meth:`due` answered for this step (asked now if it was not), the same on every
        process. Once per step: the preemption sync point is consulted once.

        Examples:
            >>> schedule = SaveSchedule(every_steps=5)
            >>> [s for s in range(1, 12) if schedule.lets_save(s)]
            [5, 10]
            >>> schedule.close()
        """
        if self.every_steps is None and self.every_seconds is None:
            return True
        decided = self._decided
        return decided[1] if decided is not None and decided[0] == step else self.due(step)

    def saved(self) -> None:
        """A step was saved: the seconds interval starts again."""
        self._last_save = time.monotonic()

    @property
    def preemption_requested(self) -> bool:
        """True once a preemption was seen (SIGTERM, or JAX's preemption sync point)."""
        return self.preempted_at is not None or self._sigterm

    def _seconds_passed(self) -> bool:
        every = self.every_seconds
        return bool(agree("save_interval_seconds", lambda: time.monotonic() - self._last_save >= (every or 0)))

    def _preempted(self, step: int) -> bool:
        if jax.process_count() > 1:
            try:
                return bool(multihost_utils.reached_preemption_sync_point(step))
            except RuntimeError:  # the preemption service is off (jax_enable_preemption_service)
                return False
        self._install()
        return self._sigterm

    def _install(self) -> None:
        if self._installed:
            return
        _open[id(self)] = self
        self._installed = True
        if threading.current_thread() is threading.main_thread() and not isinstance(
            signal.getsignal(signal.SIGTERM), _Chained
        ):
            signal.signal(signal.SIGTERM, _Chained(signal.getsignal(signal.SIGTERM)))

    def close(self) -> None:
        """Stop listening for ``SIGTERM``; the last open schedule puts back the handler
        that was there before, if ours is still the installed one."""
        if not self._installed:
            return
        self._installed = False
        _open.pop(id(self), None)
        if _open or threading.current_thread() is not threading.main_thread():
            return
        current = signal.getsignal(signal.SIGTERM)
        while isinstance(current, _Chained):  # unwind only our own handlers, from the top
            signal.signal(signal.SIGTERM, current.previous)
            current = current.previous


_open: dict[int, SaveSchedule] = {}  # the schedules a SIGTERM must reach, by id


@dataclasses.dataclass(frozen=True)
class _Chained:
    """The ``SIGTERM`` handler: every open schedule sees the preemption, then the handler
    it was installed over runs (unless that one would end the process)."""

    previous: Any

    def __call__(self, signum: int, frame: Any) -> None:
        for schedule in list(_open.values()):
            schedule._sigterm = True  # the loop saves at its next due() check, then stops
        if callable(self.previous) and self.previous is not _exit.on_sigterm:
            self.previous(signum, frame)
