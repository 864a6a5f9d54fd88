"""The writer lock when its file is removed as it is let go: a writer
that opened the file just before its holder removed it must not hold a lock nobody else
sees (the inode check), and any number of writers racing keep one holder at a time."""

from __future__ import annotations

import os
import random
import re
import threading
from pathlib import Path

import pytest

from nnx_save.errors import DirectoryLockedError, SaveError
from nnx_save.io import _lock
from nnx_save.io._lock import WriterLock, holder_of


def test_a_writer_that_opened_the_removed_file_locks_the_new_one(tmp_path, monkeypatch):
    first = WriterLock.acquire(tmp_path, "the first", remove=True)
    real_open, opened = _lock._open, []

    def open_then_first_lets_go(directory: Path, path: Path) -> int:
        fd = real_open(directory, path)
        if not opened:  # the first writer removes the file this descriptor is of, then closes it
            opened.append(fd)
            first.release()
        return fd

    monkeypatch.setattr(_lock, "_open", open_then_first_lets_go)
    second = WriterLock.acquire(tmp_path, "the second", remove=True)
    monkeypatch.undo()
    named = holder_of(tmp_path)  # the file at the path names it: it locked that one, not the removed one
    assert opened and named is not None and named.what == "the second"
    refusal = f"{tmp_path} is being written by the second in process {os.getpid()} on host "
    with pytest.raises(DirectoryLockedError, match=re.escape(refusal)):
        WriterLock.acquire(tmp_path, "a third")  # without the check, it would write beside the second
    second.release()
    assert os.listdir(tmp_path) == []


def test_racing_writers_hold_the_lock_one_at_a_time(tmp_path):
    """Six threads (each its own open file, so flock tells them apart), removing and
    keeping writers mixed, take and let go of one directory's lock for a while: never
    two inside, the file at the path always names the one inside, every refusal names a
    holder, and the last one out leaves no holder."""
    inside, most, taken, refused, guard = [0], [0], [0], [0], threading.Lock()
    failures: list[BaseException] = []

    def writer(seed: int) -> None:
        draw = random.Random(seed)
        try:
            for _ in range(300):
                try:
                    lock = WriterLock.acquire(tmp_path, f"writer {seed}", remove=draw.random() < 0.8)
                except DirectoryLockedError as error:
                    assert error.holder  # a named holder, or "another process (not yet named)"
                    with guard:
                        refused[0] += 1
                    continue
                with guard:
                    inside[0] += 1
                    most[0], taken[0] = max(most[0], inside[0]), taken[0] + 1
                named = holder_of(tmp_path)  # the file at the path names this writer, not an unlinked one
                assert named is not None and named.what == f"writer {seed}", (seed, named)
                with guard:
                    inside[0] -= 1
                lock.release()
        except BaseException as error:  # raised in the test below
            failures.append(error)

    threads = [threading.Thread(target=writer, args=(seed,)) for seed in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures
    assert most[0] == 1 and taken[0] > 0 and taken[0] + refused[0] == 6 * 300
    assert holder_of(tmp_path) is None


def _hard_link(lock: Path, victim: Path) -> None:
    victim.write_text("precious\n")
    os.link(victim, lock)


def _fifo(lock: Path, victim: Path) -> None:
    os.mkfifo(lock)


@pytest.mark.parametrize(
    ("make", "what"), [(_hard_link, "a hard link to another file (2 links)"), (_fifo, "not a regular file")]
)
@pytest.mark.parametrize("writer", ["index", "pod", "store"])
def test_a_lock_file_that_is_a_hard_link_or_a_fifo_is_refused_untouched(tmp_path, make, what, writer):
    """The writer writes its holder record only into a lock file of its own: one
    hard-linked to another file would have that file's content replaced (and a store then
    empty it); a FIFO would raise a bare OSError (EINVAL)."""
    import numpy as np

    import nnx_save

    directory, victim = tmp_path / "ckpt", tmp_path / "victim.txt"
    directory.mkdir()
    make(directory / _lock.LOCK_NAME, victim)
    refusal = f"{directory / _lock.LOCK_NAME}: the writer's lock file is {what}; nothing was written"
    with pytest.raises(nnx_save.NnxSaveError, match=re.escape(refusal)):
        if writer == "index":
            nnx_save.save_file({"a": np.zeros(64, np.float32)}, directory, max_shard_size=128)
        elif writer == "pod":
            nnx_save.save_pod({"a": np.zeros(64, np.float32)}, directory)
        else:
            import jax.numpy as jnp

            from nnx_save.checkpoint import OrbaxCheckpointStore

            with OrbaxCheckpointStore(directory) as store:
                store.save(1, {"model": {"w": jnp.ones(3)}})
    assert os.listdir(directory) == [_lock.LOCK_NAME]
    assert make is _fifo or victim.read_text() == "precious\n"


_NO_FLOCK_WRITER = """
import errno, fcntl, os, sys, time
from pathlib import Path

def no_flock(fd, operation):
    raise OSError(errno.ENOLCK, "No locks available")

fcntl.flock = no_flock  # a filesystem without flock (an NFS mount without a lock manager)
from nnx_save.errors import DirectoryLockedError, SaveError
from nnx_save.io._lock import LOCK_NAME, Holder, WriterLock

where, sync, me, rounds, dead = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
deadline = time.monotonic() + 120
(sync / f"ready {me}").touch()  # start together: one writer's 400 rounds may end before the other has imported
while len(list(sync.glob("ready *"))) < 2 and time.monotonic() < deadline:
    time.sleep(0.001)
taken = refused = twice = r = 0
# until this writer has taken the lock `rounds` times and some writer was refused: a fixed
# number of tries fails under load, where one process runs only while the other sleeps holding it
while (taken < rounds or not (sync / "refused").exists()) and time.monotonic() < deadline:
    r += 1
    if r % 7 == 3:  # a writer killed while it held the lock: its record stays, naming a dead process
        dead_record = where / f"dead-{me}"
        dead_record.write_text(Holder(Holder.this_process("").host, dead, None, "a killed writer").to_json())
        try:
            os.link(dead_record, where / LOCK_NAME)
        except FileExistsError:
            pass
        os.unlink(dead_record)
    try:
        lock = WriterLock.acquire(where, me, remove=r % 2 == 0)
    except DirectoryLockedError:
        refused += 1
        (sync / "refused").touch()
        continue
    try:
        os.close(os.open(where / "inside", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        twice += 1  # the other process holds it too
    else:
        time.sleep(0.0005)
        os.unlink(where / "inside")
    taken += 1
    lock.release()
print(taken, refused, twice)
"""


def test_without_flock_two_processes_never_hold_the_lock_together(tmp_path):
    """Without ``flock`` the record is created exclusively, and a dead holder's record is
    taken over under a second exclusive record: two real processes racing over many rounds
    (with records of killed writers planted between them) are never inside together."""
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    rounds = 400
    where, sync = tmp_path / "directory", tmp_path / "sync"
    where.mkdir()
    sync.mkdir()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _NO_FLOCK_WRITER, where, sync, f"writer{i}", str(rounds), dead.stdout.strip()],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err
        results.append([int(n) for n in out.split()])
    assert [twice for _, _, twice in results] == [0, 0], results
    assert all(taken >= rounds for taken, _, _ in results) and sum(refused for _, refused, _ in results) > 0, results
    assert sorted(os.listdir(where)) in ([], [_lock.LOCK_NAME])  # at most a killed writer's record


@pytest.mark.parametrize("left", ["a dead taker's record", "another tool's file"])
def test_without_flock_a_takeover_record_left_behind_refuses_naming_it(tmp_path, monkeypatch, left):
    """A takeover record is never broken by another writer (two could break it at once):
    a dead taker's is refused naming the file to remove, a foreign file as not ours; once it
    is removed, the dead holder's record is taken over."""
    import errno
    import subprocess
    import sys

    dead = int(
        subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout
    )
    host = _lock.Holder.this_process("").host
    (tmp_path / _lock.LOCK_NAME).write_text(_lock.Holder(host, dead, None, "a killed writer").to_json())
    guard = tmp_path / _lock.TAKEOVER_NAME
    guard.write_text(_lock.Holder(host, dead, None, "a killed taker").to_json() if left.startswith("a dead") else "x")

    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(_lock.fcntl, "flock", no_flock)
    if left.startswith("a dead"):
        refusal = f"a killed taker in process {dead} on host {host}, which died taking the lock over (if no writer runs, remove {guard})"
        with pytest.raises(DirectoryLockedError, match=re.escape(refusal)):
            WriterLock.acquire(tmp_path, "me")
    else:
        with pytest.raises(
            SaveError, match=re.escape(f"{guard}: the writer's lock file is not a lock record of nnx_save")
        ):
            WriterLock.acquire(tmp_path, "me")
    guard.unlink()
    lock = WriterLock.acquire(tmp_path, "me")
    assert holder_of(tmp_path) == _lock.Holder.this_process("me")
    lock.release()
    assert os.listdir(tmp_path) == []
