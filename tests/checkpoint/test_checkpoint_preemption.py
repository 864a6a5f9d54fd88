"""When to save: should_save from intervals in steps and seconds, and
preemption: SIGTERM makes the next step due, and a training job killed that way
resumes bit-exactly from the step it saved."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import pytest

from nnx_save.checkpoint import OrbaxCheckpointStore

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_resume.py"


def state(step: int) -> dict:
    return {"model": {"w": jnp.full((2,), step, jnp.float32)}}


def test_interval_in_steps(tmp_path):
    with OrbaxCheckpointStore(tmp_path, save_interval_steps=10) as store:
        assert [s for s in range(1, 35) if store.should_save(s)] == [10, 20, 30]


def test_without_an_interval_every_step_is_due(tmp_path):
    with OrbaxCheckpointStore(tmp_path) as store:
        assert all(store.should_save(s) for s in range(5))


def test_interval_in_seconds(tmp_path):
    with OrbaxCheckpointStore(tmp_path, save_interval_seconds=0.3) as store:
        assert not store.should_save(1)  # the clock starts when the store opens
        time.sleep(0.35)
        assert store.should_save(2)
        store.save(2, state(2))
        assert not store.should_save(3)  # and again at each save
        time.sleep(0.35)
        assert store.should_save(4)


def test_a_step_already_held_is_never_due(tmp_path):
    with OrbaxCheckpointStore(tmp_path, save_interval_steps=5) as store:
        store.save(10, state(10))
        assert [s for s in (5, 10, 15) if store.should_save(s)] == [15]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"save_interval_steps": 0}, "save_interval_steps must be an int >= 1 or None, got 0"),
        ({"save_interval_seconds": -1.0}, "save_interval_seconds must be a positive number or None, got -1.0"),
    ],
)
def test_bad_intervals_are_refused(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        OrbaxCheckpointStore(tmp_path, **kwargs)


def test_sigterm_makes_the_next_step_due_whatever_the_interval(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    store = OrbaxCheckpointStore(tmp_path, save_interval_steps=1000)
    assert not store.should_save(1) and not store.preemption_requested
    os.kill(os.getpid(), signal.SIGTERM)  # the handler installed by should_save records it
    assert store.preemption_requested
    assert store.should_save(2)
    store.save(2, state(2))  # the save an interval would not have asked for
    store.close()
    assert signal.getsignal(signal.SIGTERM) is before
    assert OrbaxCheckpointStore(tmp_path).list_steps() == [2]


def _job(directory, *extra: str) -> list[str]:
    return [sys.executable, "-W", "error", str(EXAMPLE), "--dir", str(directory), "--until", "80", *extra]


def _run(command: list[str]) -> str:
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=_env(), check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def _env() -> dict[str, str]:
    return {**os.environ, "JAX_PLATFORMS": "cpu"}


@pytest.mark.slow
def test_a_job_stopped_by_sigterm_saves_and_resumes_bit_exactly(tmp_path):
    uninterrupted = _run(_job(tmp_path / "a", "--save-interval-steps", "1000"))
    expected = re.search(r"done at step 80: state digest (\w+)", uninterrupted).group(1)

    lines = []
    with subprocess.Popen(
        _job(tmp_path / "b", "--save-interval-steps", "1000", "--step-delay", "0.05"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(),
    ) as job:
        try:
            for line in job.stdout:  # bounded: the job ends by itself after 80 steps
                lines.append(line)
                if line == "step 20\n":
                    job.send_signal(signal.SIGTERM)
            job.wait(60)
        finally:
            if job.poll() is None:
                job.kill()
    output = "".join(lines)
    assert job.returncode == 0, output
    saved = int(re.search(r"preempted: saved step (\d+)", output).group(1))
    assert 20 <= saved < 80, output  # saved where the signal found it, not at an interval
    assert OrbaxCheckpointStore(tmp_path / "b" / "checkpoints").list_steps() == [saved]

    resumed = _run(_job(tmp_path / "b", "--save-interval-steps", "1000"))
    assert f"start at step {saved}\n" in resumed
    assert f"done at step 80: state digest {expected}" in resumed
