"""The one key-value protocol between the processes of a JAX job.

Multi-process saves, shared reads and the checkpoint store post small strings under
``<key>/<process>`` in the coordination service's key-value store and wait for those
they need with a deadline (a device collective would block without one); keys are
deleted once every reader is done. jax has no public handle on that store: a jax
without ``jax._src.distributed.global_state.client`` falls back to the public
``process_allgather`` (no deadline, no keys). :class:`Sync` runs one save's or shared
load's steps over a :class:`Channel`.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .. import _config
from ..errors import NnxSaveError, SaveError

__all__ = ["TIMEOUT_ENV", "Channel", "StepResult", "Sync", "Unanswered", "allgather", "client"]

TIMEOUT_ENV = _config.COLLECTIVE_TIMEOUT_S.name
_SAVES = itertools.count()  # every process saves in the same order (SPMD), so ids agree
_INTACT = "the previous file, if any, is intact"


class Unanswered(Exception):
    """No answer for ``key``: processes ``late`` posted nothing within ``seconds``
    (``None``: through the public collective, which has no deadline), or
    ``late`` is ``None`` and the coordination service failed for ``reason``."""

    def __init__(self, key: str, late: list[int] | None, seconds: float | None, reason: str = "") -> None:
        self.late, self.seconds, self.reason = late, seconds, reason
        super().__init__(f"{key}: process(es) {late} posted nothing" if late is not None else reason)


def client(where: str, error: Callable[[str], NnxSaveError]) -> Any:
    """The coordination service's key-value client, or ``None`` when this jax has
    none where nnx_save looks; ``error`` (naming ``where``) when the job has several
    processes and no ``jax.distributed`` client."""
    import jax

    private: Any
    try:
        from jax._src import distributed as private
    except ImportError:
        private = None
    state = getattr(private, "global_state", None)
    if state is None or not hasattr(state, "client"):
        return None
    if state.client is None:
        raise error(
            f"{where}: {jax.process_count()} processes but no jax.distributed client; "
            "call jax.distributed.initialize() first"
        )
    return state.client


def allgather(value: str | None) -> dict[int, str]:
    """Every process's ``value`` (those that posted one) through jax's public
    ``process_allgather``: the channel when jax offers no key-value store. It is a
    device collective, so a peer that never arrives blocks instead of timing out."""
    from jax.experimental import multihost_utils

    raw = np.frombuffer((value or "").encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.array([raw.size, value is not None], np.int64)))
    padded = np.zeros(max(int(sizes[:, 0].max()), 1), np.uint8)
    padded[: raw.size] = raw
    rows = np.asarray(multihost_utils.process_allgather(padded))
    return {p: rows[p, : sizes[p, 0]].tobytes().decode() for p in range(len(sizes)) if sizes[p, 1]}


@dataclass(frozen=True)
class Channel:
    """This process (``pid`` of ``n``) on the key-value store (``client``; ``None``:
    the public collective)."""

    pid: int = 0
    n: int = 1
    client: Any = field(default=None, repr=False)

    @classmethod
    def open(cls, where: str, error: Callable[[str], NnxSaveError]) -> Channel:
        """The channel of this job's processes (one process: nothing is exchanged)."""
        import jax

        if jax.process_count() == 1:
            return cls()
        return cls(jax.process_index(), jax.process_count(), client(where, error))

    def gather(self, key: str, value: str | None, want: set[int], timeout: float) -> dict[int, str]:
        """Post ``value`` (unless ``None``) under ``key``; wait at most ``timeout``
        seconds for the values of processes ``want``, else raise :class:`Unanswered`."""
        if self.client is None:
            got = allgather(value)
            if not want <= set(got):
                raise Unanswered(key, sorted(want - set(got)), None)
            return {p: got[p] for p in sorted(want)}
        deadline, got = time.monotonic() + timeout, {}
        try:
            if value is not None:
                self.client.key_value_set(f"{key}/{self.pid}", value)
                got[self.pid] = value
            if len(want - set(got)) == 1:  # one poster (process 0's decision): no polling
                (p,) = want - set(got)
                got[p] = self.client.blocking_key_value_get(f"{key}/{p}", max(1, int(timeout * 1000)))
            delay = 0.002
            while not want <= set(got):
                posted = ((k.rsplit("/", 1)[1], v) for k, v in self.client.key_value_dir_get(f"{key}/"))
                got.update((int(p), v) for p, v in posted if p.isdigit())
                if want <= set(got) or time.monotonic() > deadline:
                    break
                time.sleep(delay)
                delay = min(delay * 2, 0.1)
        except Exception as e:  # jax raises its own error types
            if time.monotonic() < deadline:
                raise Unanswered(
                    key, None, timeout, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                ) from e
        if not want <= set(got):
            raise Unanswered(key, sorted(want - set(got)), timeout)
        return {p: got[p] for p in sorted(want)}

    def forget(self, key: str) -> None:
        """Delete every key under ``key`` (best effort): call it once every process is past them."""
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.key_value_delete(key)

    def read_once(self, key: str, readers: int) -> None:
        """Count this process as one of ``readers`` done with ``key``; the last one
        deletes it (the poster need not wait for anyone to clean up)."""
        if self.client is not None and self.client.key_value_increment(f"{key}/done", 1) >= readers:
            self.forget(key)


@dataclass(frozen=True)
class StepResult:
    """One process's result of one step, as the processes exchange it (a JSON object).

    ``value`` is the step's JSON result when ``ok``; ``error`` says what failed otherwise.

    Examples:
        >>> StepResult.decode(StepResult(True, {"w": "00ff"}).encode())
        StepResult(ok=True, value={'w': '00ff'}, error='')
        >>> StepResult.of(lambda: 1 // 0).error
        'ZeroDivisionError: integer division or modulo by zero'
    """

    ok: bool
    value: Any = None
    error: str = ""

    @classmethod
    def of(cls, work: Callable[[], Any]) -> StepResult:
        """Run ``work``: its result, or the error it raised (reported to every process)."""
        try:
            return cls(True, work())
        except Exception as e:  # raised on every process by Sync.step, not lost
            return cls(False, error=f"{type(e).__name__}: {e}")

    def encode(self) -> str:
        return json.dumps({"ok": self.ok, "value": self.value, "error": self.error})

    @classmethod
    def decode(cls, text: str) -> StepResult:
        obj = json.loads(text)
        return cls(bool(obj["ok"]), obj.get("value"), str(obj.get("error", "")))


@dataclass
class Sync:
    """The step protocol between the processes of one save (or shared load): each
    step, every process (or one) posts an :class:`StepResult`; all wait for them
    (bounded) and all raise the same :class:`SaveError` if any failed. With one
    process, steps exchange nothing."""

    path: Path
    kv: Channel = field(default_factory=Channel)
    prefix: str = ""
    save_id: int = 0
    what: str = "multi-process save"  # how failures name the save, and what they say survived
    intact: str = _INTACT

    pid: int = field(init=False)  # the channel's, read once: asked at every step
    n: int = field(init=False)

    def __post_init__(self) -> None:
        self.pid, self.n = self.kv.pid, self.kv.n

    @classmethod
    def open(cls, path: Path, what: str = "multi-process save", intact: str = _INTACT) -> Sync:
        """The protocol for one save at ``path`` by every process of the job."""
        kv = Channel.open(str(path), SaveError)
        if kv.n == 1:
            return cls(path, kv, what=what, intact=intact)
        save_id = next(_SAVES)
        return cls(path, kv, f"nnx_save/save/{save_id}", save_id, what, intact)

    def step(self, stage: str, mine: StepResult | None, only: int | None = None) -> dict[int, Any]:
        """Post this process's result of ``stage`` (``None``: nothing here, process
        ``only`` posts for all) and return every process's value; raise the same
        :class:`SaveError` on every process if any failed."""
        if self.n == 1:
            results = {0: mine} if mine is not None else {}
        else:
            raw = self.gather(stage, None if mine is None else mine.encode(), only)
            results = {p: StepResult.decode(v) for p, v in raw.items()}
        failures = {p: o.error for p, o in results.items() if not o.ok}
        if failures and only is not None:
            raise SaveError(f"{self.path}: {failures[only]}; {self.intact}", str(self.path))
        if failures:
            detail = "; ".join(f"process {p}: {msg}" for p, msg in failures.items())
            raise SaveError(f"{self.path}: the {self.what} failed ({detail}); {self.intact}", str(self.path))
        return {p: o.value for p, o in results.items()}

    def on_primary(self, stage: str, work: Callable[[], Any]) -> Any:
        """``work()`` on the primary; its result (or the same :class:`SaveError`) on
        every process. With one process, ``work()`` itself."""
        if self.n == 1:
            return work()
        return self.step(stage, StepResult.of(work) if self.pid == 0 else None, only=0)[0]

    def gather(self, stage: str, value: str | None, only: int | None = None) -> dict[int, str]:
        """Post ``value`` (unless ``None``) for ``stage``; wait (bounded) for every
        process's value, or only process ``only``'s."""
        want = set(range(self.n)) if only is None else {only}
        try:
            return self.kv.gather(f"{self.prefix}/{stage}", value, want, _config.COLLECTIVE_TIMEOUT_S.get())
        except Unanswered as e:
            default = self.what == "multi-process save"
            intact = "the previous file at the path, if any, is intact" if default else self.intact
            if e.late is None:
                raise SaveError(
                    f"{self.path}: lost the JAX coordination service during the {stage!r} step of the {self.what} "
                    f"({e.reason}); {intact}",
                    str(self.path),
                ) from e
            if e.seconds is None:
                raise SaveError(f"{self.path}: process(es) {e.late} posted nothing for the {stage!r} step") from e
            verb = "load" if "load" in self.what else "save"
            raise SaveError(
                f"{self.path}: process(es) {e.late} did not reach the {stage!r} step of the {self.what} "
                f"within {e.seconds:g} s ({TIMEOUT_ENV}); did one of them die or {verb} something else? "
                f"{intact.capitalize()}",
                str(self.path),
            ) from e

    def forget_previous(self) -> None:
        """Drop the keys of the previous save: every process has passed it by now."""
        if self.pid == 0 and self.save_id:
            self.kv.forget(f"nnx_save/save/{self.save_id - 1}/")
