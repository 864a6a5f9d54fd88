"""A small progress bar for long loads and saves, on stderr when it is a terminal.

``progress=None`` shows a bar when stderr is a TTY and the operation moves at least
:data:`MIN_BYTES`; ``True`` shows it on a TTY whatever the size; ``False`` never.
Nothing is written to a pipe or a file. A save's setting travels in its options
(:class:`~nnx_save.SaveOptions`, carried by the layout's writer down to the file writer).
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from typing import IO

from . import _config
from .format._units import human_bytes

__all__ = ["MIN_BYTES", "Bar", "NullBar", "bar"]

MIN_BYTES = _config.PROGRESS_MIN_BYTES.default  # NNX_SAVE_PROGRESS_MIN_BYTES overrides it, read per bar
_INTERVAL_S = 0.1


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


def _width(stream: IO[str]) -> int:
    try:  # the terminal being drawn on, not whatever stdout is
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        return shutil.get_terminal_size((100, 24)).columns


def bar(
    label: str, total_bytes: int, total_items: int, progress: bool | None, stream: IO[str] | None = None
) -> NullBar:
    """A :class:`Bar` when ``progress`` asks for one and ``stream`` (stderr) is a
    terminal, else a :class:`NullBar`."""
    stream = sys.stderr if stream is None else stream
    if progress is False or (progress is None and total_bytes < _config.PROGRESS_MIN_BYTES.get()):
        return NullBar()
    isatty = getattr(stream, "isatty", None)
    if isatty is None or not isatty():
        return NullBar()
    return Bar(label, total_bytes, total_items, stream)
