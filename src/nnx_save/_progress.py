"""A small progress bar for long loads and saves on stderr: a redrawn bar on a terminal,
plain lines in a log.

``progress=None`` shows a bar when stderr is a TTY and the operation moves at least
``NNX_SAVE_PROGRESS_MIN_BYTES`` (256 MiB unless set), and nothing on a pipe or a file; ``True`` shows a bar on a TTY whatever
the size, and on a pipe or a file (a pod's log, a notebook's captured output) plain lines
at a bounded rate, as tqdm and transformers do in logs (:class:`LogLines`); ``False``
never. A save's setting travels in its options (:class:`~nnx_save.SaveOptions`, carried
by the layout's writer down to the file writer).
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from typing import IO

from . import _config
from .format._units import human_bytes

__all__ = ["LOG_EVERY_S", "Bar", "LogLines", "NullBar", "bar"]

_INTERVAL_S = 0.1
LOG_EVERY_S = 5.0  # a log line at least this often while the work lasts
_LOG_MIN_S = 1.0  # and at most one a second: a new tenth done shows once this passed


class NullBar:
    """The bar when none is shown: every call does nothing."""

    active = False

    def update(self, nbytes: int = 0, items: int = 0) -> None:
        pass

    def close(self) -> None:
        pass


class Bar(NullBar):
    """``label  42% |#####     | 1.1/2.6 GiB  12/40 tensors  850.0 MiB/s  ETA 2s``.

    Thread-safe (the reader threads update it); redraws at most every 0.1 s.
    """

    active = True

    def __init__(self, label: str, total_bytes: int, total_items: int, stream: IO[str]) -> None:
        self.label, self.total, self.items_total, self.stream = label, max(total_bytes, 0), total_items, stream
        self.done = self.items = 0
        self.start = self._drawn = time.monotonic()
        self._lock = threading.Lock()
        self._closed = False
        self._draw(time.monotonic())

    def update(self, nbytes: int = 0, items: int = 0) -> None:
        with self._lock:
            self.done += nbytes
            self.items += items
            now = time.monotonic()
            if now - self._drawn >= _INTERVAL_S:
                self._draw(now)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._draw(time.monotonic(), final=True)
            self._end()

    def _end(self) -> None:
        """After the last draw: the terminal's line ends."""
        self.stream.write("\n")
        self.stream.flush()

    def line(self, now: float, width: int, final: bool = False) -> str:
        """The bar as one line of at most ``width - 1`` characters: the bar itself,
        then the rate, give way first on a narrow terminal."""
        elapsed = max(now - self.start, 1e-9)
        frac = min(self.done / self.total, 1.0) if self.total else 1.0
        rate = self.done / elapsed
        if final:
            tail = f"in {elapsed:.1f}s"
        elif rate > 0 and self.total:
            tail = f"ETA {max(self.total - self.done, 0) / rate:.0f}s"
        else:
            tail = "ETA ?"
        head = f"{self.label} {frac * 100:3.0f}%"
        amounts = f"{human_bytes(self.done)}/{human_bytes(self.total)}  {self.items}/{self.items_total} tensors"
        limit = max(width - 1, 20)
        text = f"{amounts}  {human_bytes(rate)}/s  {tail}"
        if len(head) + len(text) + 1 > limit:
            text = f"{amounts}  {tail}"
        cells = min(limit - len(head) - len(text) - 4, 30)
        if cells < 10:
            return f"{head} {text}"[:limit]
        filled = int(frac * cells)
        return f"{head} |{'#' * filled}{' ' * (cells - filled)}| {text}"

    def _draw(self, now: float, final: bool = False) -> None:
        self.stream.write("\r" + self.line(now, _width(self.stream), final) + "\x1b[K")
        self.stream.flush()
        self._drawn = now


class LogLines(Bar):
    """Progress as plain lines, for a stream that is not a terminal:

    ``loading m.safetensors: 40% 1.0 GiB/2.6 GiB  16/40 tensors  850.0 MiB/s  ETA 2s``

    A line when a new tenth of the bytes is done (at most one a second) or when
    :data:`LOG_EVERY_S` passed since the last one, and one when the work ends (``in``
    its time). Short work writes only the last line. Each line is one write, so lines
    of two files saved at a time never mix.
    """

    def __init__(self, label: str, total_bytes: int, total_items: int, stream: IO[str]) -> None:
        self._tenth, self._started = 0, False
        super().__init__(label, total_bytes, total_items, stream)

    def line(self, now: float, width: int = 0, final: bool = False) -> str:
        """The line written at ``now`` (``width`` is a terminal's; a log's lines are whole)."""
        elapsed = max(now - self.start, 1e-9)
        rate = self.done / elapsed
        amounts = f"{human_bytes(self.done)}/{human_bytes(self.total)}  {self.items}/{self.items_total} tensors"
        if final:
            return f"{self.label}: done, {amounts}  {human_bytes(rate)}/s  in {elapsed:.1f}s"
        frac = min(self.done / self.total, 1.0) if self.total else 1.0
        eta = f"ETA {max(self.total - self.done, 0) / rate:.0f}s" if rate > 0 and self.total else "ETA ?"
        return f"{self.label}: {frac * 100:3.0f}% {amounts}  {human_bytes(rate)}/s  {eta}"

    def update(self, nbytes: int = 0, items: int = 0) -> None:
        with self._lock:
            self.done += nbytes
            self.items += items
            now = time.monotonic()
            tenth = int(10 * self.done / self.total) if self.total else 10
            since = now - self._drawn
            if (tenth > self._tenth and since >= _LOG_MIN_S) or since >= LOG_EVERY_S:
                self._tenth = tenth
                self._draw(now)

    def _end(self) -> None:
        """Nothing: each line was written whole."""

    def _draw(self, now: float, final: bool = False) -> None:
        if self._started or final:  # the first call (from __init__) writes nothing
            self.stream.write(self.line(now, final=final) + "\n")
            self.stream.flush()
        self._started, self._drawn = True, now


def _width(stream: IO[str]) -> int:
    try:  # the terminal being drawn on, not whatever stdout is
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        return shutil.get_terminal_size((100, 24)).columns


def bar(
    label: str,
    total_bytes: int | Callable[[], int],
    total_items: int,
    progress: bool | None,
    stream: IO[str] | None = None,
) -> NullBar:
    """A :class:`Bar` when ``progress`` asks for one and ``stream`` (stderr) is a
    terminal; :class:`LogLines` for ``progress=True`` on anything else; else a
    :class:`NullBar`. ``total_bytes`` may be a function, called only when a bar or log
    lines may be made (a load sums a hundred thousand tensors' sizes only then)."""
    stream = sys.stderr if stream is None else stream
    if progress is False:
        return NullBar()
    # asked on every call that may show a bar, a terminal or not: a bad value is refused alike
    minimum = _config.PROGRESS_MIN_BYTES.get() if progress is None else 0
    if progress is None and not _is_terminal(stream):
        return NullBar()
    total = total_bytes() if callable(total_bytes) else total_bytes
    if total < minimum:
        return NullBar()
    isatty = getattr(stream, "isatty", None)
    if isatty is None or not isatty():
        return LogLines(label, total, total_items, stream) if progress is True else NullBar()
    return Bar(label, total, total_items, stream)


def _is_terminal(stream: IO[str]) -> bool:
    """Whether ``stream`` is a terminal (a closed or odd stream is not)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, OSError, ValueError):
        return False
