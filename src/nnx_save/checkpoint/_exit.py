"""No asynchronous step is lost when the process ends.

A store with a save in flight is registered here until the save settles. At interpreter
exit the registered stores are closed from a ``threading._register_atexit`` hook: those
run before the interpreter joins non-daemon threads and before ``concurrent.futures``
refuses new work, so Orbax's writer can still finish (an ``atexit`` hook runs too late).
``SIGTERM`` (one process, default handler in place) finishes them, then ends the process
by the signal. A save that cannot finish is named on stderr; the exit hook then exits 1.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
from typing import Any, Protocol

__all__ = ["finished", "on_sigterm", "pending"]


class _Settles(Protocol):
    """What the exit hook needs of a store."""

    def close(self) -> None: ...

    def _pending_description(self) -> str: ...


_lock = threading.Lock()
_stores: dict[int, _Settles] = {}  # id -> store with a save in flight (kept alive until settled)
_hooked = False
_sigterm_installed = False  # the handler is only ever installed over SIG_DFL, so SIG_DFL is what it replaced


def pending(store: _Settles) -> None:
    """``store`` has a save in flight: finish it before the process ends."""
    global _hooked
    with _lock:
        _stores[id(store)] = store
        if not _hooked:
            # Registered late (at the first asynchronous save), so it runs before the
            # hooks registered at import (concurrent.futures'): the latest runs first.
            with contextlib.suppress(RuntimeError):  # a save made while the interpreter already ends
                getattr(threading, "_register_atexit", atexit.register)(_at_exit)
            _hooked = True
    _install_sigterm()


def finished(store: _Settles) -> None:
    """``store`` has nothing in flight any more."""
    with _lock:
        _stores.pop(id(store), None)
        idle = not _stores
    if idle:
        _uninstall_sigterm()


def _settle_all() -> list[str]:
    """Finish every pending save; the descriptions of those that failed."""
    with _lock:
        stores = list(_stores.values())
    failures = []
    for store in stores:
        what = store._pending_description()
        try:
            store.close()
        except BaseException as error:  # reported below: nothing may stop the other stores
            failures.append(f"{what} was not committed ({type(error).__name__}: {error})")
        finished(store)
    return failures


def _report(failures: list[str]) -> None:
    for line in failures:
        sys.stderr.write(f"nnx_save: the process is ending and the asynchronous checkpoint {line}\n")
    sys.stderr.flush()


def _at_exit() -> None:
    failures = _settle_all()
    if failures:
        _report(failures)
        sys.stdout.flush()
        os._exit(1)  # the interpreter's own status would be 0: a lost step must not look like success


def _install_sigterm() -> None:
    global _sigterm_installed
    if _sigterm_installed or threading.current_thread() is not threading.main_thread() or not _one_process():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # else the caller's (or preemption) handler decides
        signal.signal(signal.SIGTERM, on_sigterm)
        _sigterm_installed = True


def _uninstall_sigterm() -> None:
    global _sigterm_installed
    if not _sigterm_installed or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is on_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _sigterm_installed = False


def on_sigterm(signum: int, frame: Any) -> None:
    failures = _settle_all()
    _report(failures)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.raise_signal(signal.SIGTERM)  # end as the signal would have, once the steps are on disk


def _one_process() -> bool:
    # In a multi-process run JAX's preemption service owns SIGTERM.
    jax = sys.modules.get("jax")
    return jax is None or jax.process_count() == 1


def _reset_in_child() -> None:
    """After ``fork`` the pending saves belong to the parent, which finishes them."""
    global _lock
    _lock = threading.Lock()
    _stores.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_in_child)
