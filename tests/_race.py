"""A writer saving versions 2, 3, 4 ... of one checkpoint in a loop, and readers that
check every read is one whole version: the harness of tests/layouts/test_layout_races.py.

Version ``k`` holds ``t0`` .. ``t3`` with every element ``k`` and ``pad`` with every
element ``-k``; ``pad`` comes first in a file and its size alternates, so a header of
one version read over the bytes of the next moves every offset and shows as wrong
values. A read is judged by its values alone (:func:`judge`): they must all be of one
version ``k``, and a reader's versions never go back.

Run as a script, this module is the writer process: it reads one race per line on
stdin (``layout<TAB>target<TAB>stop file``), saves the first version, prints ``ready``,
saves versions until the stop file exists and prints ``done <last version>``; one
process (one JAX import) serves every race of a test module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

import nnx_save

FIRST = 2  # the writer's first version
KEYS = ("t0", "t1", "t2", "t3")
PART_A = ("pad", "t0", "t1")  # the directory layout's a.safetensors; the rest is b.safetensors
SHARD_BYTES = 256  # an index of one file per tensor
OVERWRITTEN = 3  # the store saves every third step again, over itself


def version(k: int) -> dict[str, np.ndarray]:
    """Version ``k``: ``t0`` .. ``t3`` every element ``k``, ``pad`` (16 or 80 elements) ``-k``."""
    return {
        "pad": np.full(16 if k % 2 else 80, -k, np.float32),
        "t0": np.full(64, k, np.float32),
        "t1": np.full((8, 8), k, np.float32),
        "t2": np.full(64, k, np.int32),
        "t3": np.full((4, 16), k, np.int32),
    }


# --------------------------------------------------------------------------- the writer


@contextlib.contextmanager
def saver(layout: str, target: Any) -> Iterator[Callable[[int], None]]:
    """``save(k)``: version ``k`` written at ``target`` as ``layout`` does (``memory``: the
    state dict ``target`` updated at once; ``store``: step ``k``, three kept, every
    :data:`OVERWRITTEN` th step saved again over itself)."""
    if layout == "store":
        from nnx_save.checkpoint import OrbaxCheckpointStore

        with OrbaxCheckpointStore(target, max_to_keep=3) as store:

            def save_step(k: int) -> None:
                store.save(k, {"model": version(k)})
                if k % OVERWRITTEN == 0:
                    store.save(k, {"model": version(k)}, overwrite=True)

            yield save_step
        return

    def save(k: int) -> None:
        tree = version(k)
        if layout == "file":
            nnx_save.save_file(tree, target)
        elif layout == "index":
            nnx_save.save_file(tree, target, max_shard_size=SHARD_BYTES)
        elif layout == "directory":  # two files, one after the other: no record says they go together
            Path(target).mkdir(exist_ok=True)
            nnx_save.save_file({key: tree[key] for key in PART_A}, Path(target) / "a.safetensors")
            nnx_save.save_file({key: v for key, v in tree.items() if key not in PART_A}, Path(target) / "b.safetensors")
        elif layout == "pod":
            nnx_save.save_pod(tree, target)
        else:
            target.update(tree)  # one C call: no reader sees half of it
            time.sleep(0.0005)  # the readers run between two updates

    yield save


def write(layout: str, target: Any, stopped: Callable[[], bool], ready: Callable[[], None]) -> int:
    """Save versions from :data:`FIRST` on (``ready()`` once the first is saved) until
    ``stopped()``; the last version saved."""
    k = FIRST
    with saver(layout, target) as save:
        save(k)
        ready()
        while not stopped():
            k += 1
            save(k)
    return k


def serve() -> None:
    """The writer process: one race per line of stdin."""
    for line in sys.stdin:
        layout, target, stop = line.rstrip("\n").split("\t")
        try:
            last = write(layout, target, Path(stop).exists, lambda: print("ready", flush=True))
        except Exception as e:
            print(f"error {type(e).__name__}: {e}".replace("\n", " "), flush=True)
            continue
        print(f"done {last}", flush=True)


# --------------------------------------------------------------------------- the readers


Read = Callable[[], tuple[dict[str, Any], int | None]]
"""One read: the arrays it returned, and the step a store says they are (else ``None``)."""


class Mixed(AssertionError):
    """A read whose values are not one version."""


def judge(layout: str, reader: str, got: dict[str, Any], claimed: int | None) -> int:
    """The version a read returned (``claimed``: the step a store says it read).

    Raises:
        Mixed: the values are not all of one version (for the directory layout, whose two
            files are saved one after the other: not of a state the directory held).
    """
    if reader == "latest_step":
        if not isinstance(claimed, int) or claimed < FIRST:
            raise Mixed(f"latest_step() gave {claimed!r}")
        return claimed
    try:
        k = int(np.asarray(got["t0"]).flat[0]) if claimed is None else claimed
        of = dict.fromkeys(version(k), k)
        if layout == "directory":  # a.safetensors is saved first: b's version is a's or the one before
            b = int(np.asarray(got["t2"]).flat[0])
            if b not in (k, k - 1):
                raise Mixed(
                    f"a.safetensors of version {k} with b.safetensors of version {b}: the directory never held both"
                )
            of.update((key, b) for key in of if key not in PART_A)
        want = {key: version(v)[key] for key, v in of.items() if reader != "load_model" or key in KEYS}
        if reader == "safe_open":
            want = {key: w[1:] for key, w in want.items()}
        arrays = {key: np.asarray(v) for key, v in got.items()}
    except Mixed:
        raise
    except Exception as e:
        raise Mixed(f"unreadable values ({type(e).__name__}: {e}): {summary(got)}") from None
    same = set(arrays) == set(want) and all(
        arrays[key].dtype == w.dtype and arrays[key].shape == w.shape and np.array_equal(arrays[key], w)
        for key, w in want.items()
    )
    if not same:
        raise Mixed(f"not one version (read as {k}): {summary(got)}")
    return k


def summary(got: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, v in sorted(got.items()):
        a = np.asarray(v)
        out[key] = (a.dtype.str, a.shape, np.unique(a)[:4].tolist())
    return out


@dataclasses.dataclass
class Outcome:
    """What one reader saw during a race."""

    versions: list[int] = dataclasses.field(default_factory=list)
    changed: int = 0  # SourceChangedError: load again
    not_found: int = 0  # SourceNotFoundError, CheckpointNotFoundError
    problems: list[str] = dataclasses.field(default_factory=list)
    slowest: float = 0.0

    def raced(self) -> bool:
        """Whether the reader read several versions (the writer saved while it read)."""
        return len(self.versions) >= 3 and len(set(self.versions)) >= 2

    def add(self, layout: str, reader: str, read: Read) -> None:
        from nnx_save.checkpoint import CheckpointNotFoundError

        t0 = time.monotonic()
        try:
            got, claimed = read()
        except nnx_save.SourceChangedError:
            self.changed += 1
            return
        except (nnx_save.SourceNotFoundError, CheckpointNotFoundError):
            self.not_found += 1
            return
        except Exception as e:
            self.problems.append(f"{type(e).__module__}.{type(e).__name__}: {e}")
            return
        finally:
            self.slowest = max(self.slowest, time.monotonic() - t0)
        try:
            k = judge(layout, reader, got, claimed)
        except Mixed as e:
            self.problems.append(f"mixed: {e}")
            return
        if self.versions and went_back(layout, self.versions[-1], k):
            self.problems.append(f"went back: version {k} after {self.versions[-1]}")
        self.versions.append(k)


def went_back(layout: str, before: int, k: int) -> bool:
    """Whether reading version ``k`` after ``before`` is going back in time. A store's
    readers do not list a step while it is saved again over itself (it is set aside until
    its replacement is committed: docs/reliability.md), so meanwhile they see the steps
    before it: one step back from the latest (``before``) or, reading the step before the
    latest, from that one."""
    overwritten = before % OVERWRITTEN == 0 or (before + 1) % OVERWRITTEN == 0
    return k < before and not (layout == "store" and k == before - 1 and overwritten)


@dataclasses.dataclass
class Race:
    """What a race gave: each reader's outcome, the last version written, and what
    Python reported as ignored meanwhile (an exception in a callback, a ``__del__``)."""

    outcomes: dict[str, Outcome]
    last: int
    unraisable: list[str]


@contextlib.contextmanager
def ignored() -> Iterator[list[str]]:
    """The exceptions Python reports as ignored (``sys.unraisablehook``) in the block, as text."""
    caught: list[str] = []
    before = sys.unraisablehook
    sys.unraisablehook = lambda u: caught.append(f"{u.err_msg or 'Exception ignored in'} {u.object!r}: {u.exc_value!r}")
    try:
        yield caught
    finally:
        sys.unraisablehook = before


def race(
    layout: str,
    readers: dict[str, Callable[[], contextlib.AbstractContextManager[Read]]],
    start_writer: Callable[[], Callable[[], int]],
    seconds: float,
    longest: float = 15.0,
    hang: float = 60.0,
) -> Race:
    """Run every reader in a thread of its own while the writer saves: ``seconds``, and on
    until every reader :meth:`~Outcome.raced` (``longest`` at most). ``readers[name]()``
    opens a reader's read (in its thread: a store per reader); ``start_writer()`` starts
    the writer, returns once its first version is saved, and gives what stops it and
    returns its last version.

    Raises:
        AssertionError: a reader still running ``hang`` seconds after the writer stopped.
    """
    stop = threading.Event()
    outcomes = {name: Outcome() for name in readers}

    def loop(name: str) -> None:
        try:
            with readers[name]() as read:
                while not stop.is_set():
                    outcomes[name].add(layout, name, read)
        except Exception as e:  # opening or closing the reader
            outcomes[name].problems.append(f"{type(e).__module__}.{type(e).__name__}: {e}")

    stop_writer = start_writer()
    threads = [threading.Thread(target=loop, args=(name,), daemon=True) for name in readers]
    with ignored() as unraisable:
        for t in threads:
            t.start()
        started = time.monotonic()
        try:
            while (elapsed := time.monotonic() - started) < longest:
                if elapsed >= seconds and all(o.raced() for o in outcomes.values()):
                    break
                time.sleep(0.02)
        finally:
            try:
                last = stop_writer()
            finally:
                stop.set()
                for t in threads:
                    t.join(hang)
        stuck = [name for name, t in zip(readers, threads, strict=True) if t.is_alive()]
        assert not stuck, f"{stuck} still reading {hang} s after the writer stopped (a hang)"
        time.sleep(0.2)  # what a read left running ends
    return Race(outcomes, last, unraisable)


if __name__ == "__main__":
    serve()
