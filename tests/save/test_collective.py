"""The step protocol of multi-process saves (structured step results), without a real job:
two in-process "processes" share a dict standing in for the coordination key-value store.
The real multi-process runs are in tests/multiprocess/."""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import nnx_save
from nnx_save.io import _kv
from nnx_save.io._kv import StepResult, Sync


class FakeStore:
    """The calls the protocol makes on jax's key-value client."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}
        self.lock = threading.Lock()

    def blocking_key_value_get(self, key: str, timeout_ms: int) -> str:
        deadline = time.monotonic() + timeout_ms / 1000
        while time.monotonic() < deadline:
            with self.lock:
                if key in self.values:
                    return self.values[key]
            time.sleep(0.001)
        raise TimeoutError(f"DEADLINE_EXCEEDED: {key}")

    def key_value_increment(self, key: str, by: int) -> int:
        with self.lock:
            self.values[key] = str(int(self.values.get(key, "0")) + by)
            return int(self.values[key])

    def key_value_set(self, key: str, value: str) -> None:
        with self.lock:
            assert key not in self.values, f"{key} posted twice"
            self.values[key] = value

    def key_value_dir_get(self, prefix: str) -> list[tuple[str, str]]:
        with self.lock:
            return [(k, v) for k, v in self.values.items() if k.startswith(prefix)]

    def key_value_delete(self, prefix: str) -> None:
        with self.lock:
            for k in [k for k in self.values if k.startswith(prefix)]:
                del self.values[k]


def _pair(path: Path) -> tuple[Sync, Sync, FakeStore]:
    store = FakeStore()
    return (
        Sync(path, _kv.Channel(0, 2, store), "nnx_save/save/7", 7),
        Sync(path, _kv.Channel(1, 2, store), "nnx_save/save/7", 7),
        store,
    )


def _both(fn0, fn1):
    with ThreadPoolExecutor(2) as pool:
        f0, f1 = pool.submit(fn0), pool.submit(fn1)
        return f0.exception(timeout=60) or f0.result(), f1.exception(timeout=60) or f1.result()


def test_step_results_travel_as_json_objects(tmp_path):
    a, b, store = _pair(tmp_path / "w.safetensors")
    got = _both(
        lambda: a.step("write", StepResult(True, {"w": "01"})), lambda: b.step("write", StepResult(True, {"v": "02"}))
    )
    assert got == ({0: {"w": "01"}, 1: {"v": "02"}},) * 2
    assert store.values["nnx_save/save/7/write/1"] == '{"ok": true, "value": {"v": "02"}, "error": ""}'


def test_a_failure_on_one_process_raises_the_same_error_on_all(tmp_path):
    path = tmp_path / "w.safetensors"
    a, b, _ = _pair(path)
    boom = StepResult.of(lambda: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    e0, e1 = _both(lambda: a.step("write", StepResult(True, {})), lambda: b.step("write", boom))
    expected = (
        f"{path}: the multi-process save failed (process 1: OSError: [Errno 28] No space left on device); "
        "the previous file, if any, is intact"
    )
    assert isinstance(e0, nnx_save.SaveError) and isinstance(e1, nnx_save.SaveError)
    assert str(e0) == str(e1) == expected and e0.file == str(path)


def test_a_step_only_the_primary_posts(tmp_path):
    a, b, _ = _pair(tmp_path / "d")
    a.intact = "the previous save in it, if any, is intact"
    b.intact = a.intact
    assert (
        _both(lambda: a.step("token", StepResult(True, "1a2b3c4d"), only=0), lambda: b.step("token", None, only=0))
        == ({0: "1a2b3c4d"},) * 2
    )
    refused = StepResult(False, error="cannot create a temporary file in /x: Permission denied")
    e0, e1 = _both(lambda: a.step("open", refused, only=0), lambda: b.step("open", None, only=0))
    assert str(e0) == str(e1) == f"{tmp_path / 'd'}: {refused.error}; the previous save in it, if any, is intact"


def test_a_decision_is_read_by_one_wait_and_deleted_by_its_last_reader():
    store = FakeStore()
    primary, readers = _kv.Channel(0, 3, store), [_kv.Channel(p, 3, store) for p in (1, 2)]
    assert primary.gather("nnx_save/d/4", "yes", {0}, 1.0) == {0: "yes"}  # the poster does not wait
    assert [r.gather("nnx_save/d/4", None, {0}, 1.0) for r in readers] == [{0: "yes"}] * 2
    readers[0].read_once("nnx_save/d/4", 2)
    assert sorted(store.values) == ["nnx_save/d/4/0", "nnx_save/d/4/done"]  # one reader still to read it
    readers[1].read_once("nnx_save/d/4", 2)
    assert store.values == {}
    with pytest.raises(_kv.Unanswered, match=re.escape("nnx_save/d/5: process(es) [0] posted nothing")):
        readers[0].gather("nnx_save/d/5", None, {0}, 0.05)


def test_a_single_process_exchanges_nothing(tmp_path):
    solo = Sync.open(tmp_path / "w.safetensors")
    assert (solo.n, solo.kv.client) == (1, None)
    assert solo.step("write", StepResult(True, {"w": "01"})) == {0: {"w": "01"}}


def test_a_jax_without_the_key_value_store_falls_back_to_the_public_collective(tmp_path, monkeypatch):
    from jax._src import distributed

    monkeypatch.setattr(distributed, "global_state", None)
    assert _kv.client(str(tmp_path / "w.safetensors"), nnx_save.SaveError) is None
    sync = Sync(tmp_path / "w.safetensors", _kv.Channel(0, 1, None))  # one process, forced through the collective
    assert sync.gather("write", StepResult(True, {"w": "01"}).encode()) == {
        0: '{"ok": true, "value": {"w": "01"}, "error": ""}'
    }
    assert _kv.allgather(None) == {}
    with pytest.raises(nnx_save.SaveError, match=re.escape("process(es) [0] posted nothing for the 'open' step")):
        sync.gather("open", None, only=0)


def test_without_jax_distributed_initialize_the_error_says_so(tmp_path):
    path = tmp_path / "w.safetensors"
    with pytest.raises(nnx_save.SaveError, match=re.escape("call jax.distributed.initialize() first")):
        _kv.client(str(path), nnx_save.SaveError)


class _LostService:
    """A channel whose coordination service fails on every wait."""

    pid, n = 1, 2

    def gather(self, key, value, want, timeout):
        raise _kv.Unanswered(key, None, None, "connection reset")


@pytest.mark.parametrize(
    ("what", "intact", "said"),
    [
        ("multi-process save", "", "the previous file at the path, if any, is intact"),
        ("pod save", "the previous save in it, if any, is intact", "the previous save in it, if any, is intact"),
        ("shared-read load", "nothing was loaded", "nothing was loaded"),
    ],
)
def test_a_lost_coordination_service_says_what_survived_for_each_protocol(tmp_path, what, intact, said):
    sync = Sync(tmp_path / "d", _LostService(), "nnx_save/save/1", 1, what, intact or Sync.intact)
    expected = f"{tmp_path / 'd'}: lost the JAX coordination service during the 'write' step of the {what} "
    with pytest.raises(nnx_save.SaveError, match=re.escape(expected + f"(connection reset); {said}")):
        sync.gather("write", None)
