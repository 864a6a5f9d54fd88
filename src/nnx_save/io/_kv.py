"""The one key-value protocol between the processes of a JAX job.

Multi-process saves (a file, an HF index, a pod), shared reads and the checkpoint
store's decisions post small strings under ``<key>/<process>`` in the JAX
coordination service's key-value store and wait, bounded by the caller's
``_config`` variable, for those they need (a device collective would block without
a timeout). Keys are deleted once every reader is done with them, so a job that
agrees on something every training step does not grow the store. jax has no public
handle on that store (``jax._src.distributed.global_state.client`` since jax 0.4):
a jax without it exchanges through the public ``process_allgather`` instead (a
device collective: no deadline, no keys).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import NnxSaveError

__all__ = ["Channel", "Unanswered", "allgather", "client"]


class Unanswered(Exception):
    """No answer for ``key``: processes ``late`` posted nothing within ``seconds``
    (``None``: through the public collective, which has no deadline), or
    ``late`` is ``None`` and the coordination service failed for ``reason``."""

    def __init__(self, key: str, late: list[int] | None, seconds: float | None, reason: str = "") -> None:
        self.late, self.seconds, self.reason = late, seconds, reason
        super().__init__(f"{key}: process(es) {late} posted nothing" if late is not None else reason)


def client(where: str, error: type[NnxSaveError]) -> Any:
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
    def open(cls, where: str, error: type[NnxSaveError]) -> Channel:
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
