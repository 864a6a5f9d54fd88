"""Progress bars: on a terminal only, above the size threshold or when asked; checked
in a real terminal under tmux (the captured screen is docs/progress.txt)."""

import io
import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import nnx_save
from nnx_save import _config, _progress

DOCS = Path(__file__).resolve().parents[1] / "docs" / "progress.txt"


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_bar_only_on_a_tty_and_when_asked():
    tty, pipe = FakeTTY(), io.StringIO()
    assert not _progress.bar("x", 10 << 30, 1, None, pipe).active  # a pipe never gets one
    assert not _progress.bar("x", 10 << 30, 1, False, tty).active
    least = _config.PROGRESS_MIN_BYTES.default
    assert not _progress.bar("x", least - 1, 1, None, tty).active  # small: automatic says no
    assert _progress.bar("x", least, 1, None, tty).active
    assert _progress.bar("x", 1, 1, True, tty).active
    assert tty.getvalue().count("\r") == 2 and pipe.getvalue() == ""


def test_progress_true_on_a_pipe_writes_plain_lines():
    pipe = io.StringIO()
    assert isinstance(_progress.bar("x", 1, 1, True, pipe), _progress.LogLines)
    assert not _progress.bar("x", 10 << 30, 1, None, pipe).active  # automatic: nothing on a pipe
    assert pipe.getvalue() == ""  # nothing until there is something to say


def test_the_total_is_asked_only_where_a_bar_or_lines_may_show():
    """A load passes its total as a function: summing a hundred thousand tensors' sizes
    is skipped where nothing is drawn (the default, on anything but a terminal)."""
    asked = []

    def total():
        asked.append(1)
        return 1 << 30

    assert not _progress.bar("x", total, 1, None, io.StringIO()).active
    assert not _progress.bar("x", total, 1, False, FakeTTY()).active
    assert asked == []
    assert _progress.bar("x", total, 1, None, FakeTTY()).total == 1 << 30
    assert _progress.bar("x", total, 1, True, io.StringIO()).total == 1 << 30
    assert asked == [1, 1]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@settings(max_examples=40)
@given(st.lists(st.tuples(st.integers(0, 1 << 20), st.floats(0.0, 7.0)), min_size=1, max_size=60))
def test_log_lines_come_at_a_bounded_rate(steps):
    """Whatever the pace of the work: a line per new tenth (at most one a second) or
    per 5 s, whole lines only, the last one saying it is done."""
    clock = Clock()
    pipe = io.StringIO()
    total = sum(n for n, _ in steps) or 1
    times = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_progress.time, "monotonic", clock)
        lines = _progress.LogLines("loading m.safetensors", total, len(steps), pipe)
        for nbytes, pause in steps:
            clock.now += pause
            before = pipe.getvalue().count("\n")
            lines.update(nbytes, 1)
            if pipe.getvalue().count("\n") > before:
                times.append(clock.now)
        lines.close()
    written = pipe.getvalue().splitlines()
    assert pipe.getvalue().endswith("\n") and "\r" not in pipe.getvalue()
    assert len(written) == len(times) + 1
    assert all(b - a >= 1.0 for a, b in zip([0.0, *times], times, strict=False))  # at most one a second
    assert len(times) <= 10 + clock.now / 5.0  # tenths, plus one per 5 s of slow work
    done = _progress.human_bytes(sum(n for n, _ in steps))
    assert written[-1].startswith(f"loading m.safetensors: done, {done}/{_progress.human_bytes(total)}  ")
    assert all(re.fullmatch(r"loading m\.safetensors: +\d+% .* tensors  .*/s  ETA \S+", w) for w in written[:-1])


def test_a_slow_log_still_hears_every_five_seconds(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(_progress.time, "monotonic", clock)
    pipe = io.StringIO()
    lines = _progress.LogLines("saving x", 1000, 100, pipe)
    for _ in range(30):  # 1 byte a second: no tenth in 30 s
        clock.now += 1.0
        lines.update(1, 1)
    assert pipe.getvalue().splitlines() == [
        f"saving x: {round(k / 2):3d}% {5 * k} B/1000 B  {5 * k}/100 tensors  1 B/s  ETA {1000 - 5 * k}s"
        for k in range(1, 7)
    ]


def test_bar_line_shows_bytes_tensors_rate_and_eta():
    bar = _progress.Bar("loading m.safetensors", 4 << 20, 8, FakeTTY())
    bar.start = 0.0
    bar.done, bar.items = 1 << 20, 2
    line = bar.line(1.0, 120)
    assert line == (
        "loading m.safetensors  25% |#######                       | 1.0 MiB/4.0 MiB  2/8 tensors  1.0 MiB/s  ETA 3s"
    )
    assert bar.line(2.0, 120, final=True).endswith("| 1.0 MiB/4.0 MiB  2/8 tensors  512.0 KiB/s  in 2.0s")
    assert (
        bar.line(1.0, 90) == "loading m.safetensors  25% |###         | 1.0 MiB/4.0 MiB  2/8 tensors  1.0 MiB/s  ETA 3s"
    )
    assert (
        bar.line(1.0, 70) == "loading m.safetensors  25% 1.0 MiB/4.0 MiB  2/8 tensors  ETA 3s"
    )  # bar and rate give way
    assert bar.line(1.0, 50) == "loading m.safetensors  25% 1.0 MiB/4.0 MiB  2/8 t"  # never wraps


def test_a_multi_file_save_draws_each_file_as_its_options_say(monkeypatch, tmp_path):
    """The setting travels in the save's options down to the writer threads (two files
    at a time): one finished bar per file with progress=True, none with False."""
    tty = FakeTTY()
    monkeypatch.setattr(sys, "stderr", tty)
    tree = {f"t{i}": np.full(256, i, np.float32) for i in range(4)}  # 1 KiB each, one per file
    nnx_save.save_file(tree, tmp_path / "on", max_shard_size=1024, progress=True)
    names = re.findall(r"\rsaving (model-\d{5}-of-00004(?:\.[0-9a-f]{8})?\.safetensors) 100% [^\r]*\n", tty.getvalue())
    assert sorted(names) == sorted(p.name for p in (tmp_path / "on").glob("model-*.safetensors")) and len(names) == 4
    tty.seek(0), tty.truncate()
    nnx_save.save_file(tree, tmp_path / "off", max_shard_size=1024, options=nnx_save.SaveOptions(progress=False))
    assert tty.getvalue() == ""


def test_save_and_load_draw_on_a_tty(monkeypatch, tmp_path):
    tty = FakeTTY()
    monkeypatch.setattr(sys, "stderr", tty)
    path = tmp_path / "w.safetensors"
    tree = {"a": np.ones((64, 64), np.float32), "b": np.zeros(16, np.int8)}
    nnx_save.save_file(tree, path, progress=True)
    assert re.search(
        r"\rsaving w\.safetensors 100% \|#+\| 16\.0 KiB/16\.0 KiB  2/2 tensors  .* in \d+\.\ds\x1b\[K\n$",
        tty.getvalue(),
    )
    tty.seek(0), tty.truncate()
    nnx_save.load_file(path, progress=True)
    assert re.search(r"\rloading w\.safetensors 100% \|#+\| 16\.0 KiB/16\.0 KiB  2/2 tensors", tty.getvalue())
    tty.seek(0), tty.truncate()
    nnx_save.load_file(path, progress=False)
    nnx_save.save_file(tree, path, progress=False)
    nnx_save.load_file(path)  # automatic: 16 KiB is under the threshold
    assert tty.getvalue() == ""


def test_a_pipe_gets_lines_only_when_asked_and_diagnostics_through_the_logger(capsys, caplog, tmp_path):
    path = tmp_path / "w.safetensors"
    with caplog.at_level(logging.DEBUG, logger="nnx_save"):
        nnx_save.save_file({"a": np.ones(4, np.float32)}, path, progress=True)
        nnx_save.load_file(path, progress=True)
        out, err = capsys.readouterr()
        assert out == "" and "\r" not in err and "\x1b" not in err
        lines = err.splitlines()
        assert len(lines) == 2, err  # short work: the last line of each only
        assert re.fullmatch(r"saving w\.safetensors: done, 16 B/16 B  1/1 tensors  .*/s  in \d+\.\ds", lines[0]), err
        assert re.fullmatch(r"loading w\.safetensors: done, 16 B/16 B  1/1 tensors  .*/s  in \d+\.\ds", lines[1]), err
        nnx_save.save_file({"a": np.ones(4, np.float32)}, path)  # automatic: nothing on a pipe
        nnx_save.load_file(path, progress=False)
        assert capsys.readouterr() == ("", "")
    messages = [r.getMessage() for r in caplog.records if r.name == "nnx_save"]
    assert any(m.startswith(f"saved {path}: 1 tensors, 16 bytes in ") for m in messages)
    assert any(m.startswith(f"loaded 1 tensors from {path}") for m in messages)


def test_sharded_load_counts_only_this_process_bytes(monkeypatch, tmp_path):
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    tty = FakeTTY()
    monkeypatch.setattr(sys, "stderr", tty)
    path = tmp_path / "w.safetensors"
    nnx_save.save_file({"w": np.ones((8, 256), np.float32)}, path)
    mesh = jax.make_mesh((8,), ("x",))
    abstract = {"w": jax.ShapeDtypeStruct((8, 256), np.float32, sharding=NamedSharding(mesh, P("x")))}
    nnx_save.load_file(path, abstract, progress=True)
    assert "8.0 KiB/8.0 KiB  1/1 tensors" in tty.getvalue()


SCRIPT = """
import numpy as np, nnx_save
tree = {f"layers.{i}.w": np.full((1024, 1024), i, np.float32) for i in range(24)}
nnx_save.save_file(tree, "model.safetensors")
nnx_save.load_file("model.safetensors")
print("DONE")
"""


@pytest.mark.slow  # a terminal, a fresh process importing jax, 96 MiB written and read
@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_real_terminal_under_tmux(tmp_path):
    (tmp_path / "demo.py").write_text(textwrap.dedent(SCRIPT))
    session = f"nnx-save-{uuid.uuid4().hex[:8]}"
    env = f"JAX_PLATFORMS=cpu NNX_SAVE_PROGRESS_MIN_BYTES={64 << 20}"
    command = f"cd {tmp_path} && {env} {sys.executable} demo.py; sleep 60"
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "110", "-y", "12", command], check=True)
    try:
        deadline, screen = time.monotonic() + 180, ""
        while time.monotonic() < deadline and "DONE" not in screen:
            time.sleep(0.5)
            screen = subprocess.run(
                ["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True, check=True
            ).stdout
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
    lines = [ln for ln in screen.splitlines() if ln.strip()]
    assert lines[-1] == "DONE", screen
    assert re.fullmatch(
        r"saving model\.safetensors 100% \|#+\| 96\.0 MiB/96\.0 MiB  24/24 tensors  "
        r"[\d.]+ [KMG]iB/s  in [\d.]+s",
        lines[0],
    ), screen
    assert re.fullmatch(
        r"loading model\.safetensors 100% \|#+\| 96\.0 MiB/96\.0 MiB  24/24 tensors  "
        r"[\d.]+ [KMG]iB/s  in [\d.]+s",
        lines[1],
    ), screen
    if os.environ.get("NNX_SAVE_UPDATE_DOCS"):
        DOCS.write_text("\n".join(lines) + "\n")
