"""The progress bar of ``codeferry run``: on a terminal only, with items/s and an ETA."""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Iterator
from typing import TextIO

from tqdm import tqdm

from .. import _settings

# -- progress ---------------------------------------------------------------------------



__all__ = ["Progress", "clock", "quiet_workers"]

def clock(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class _Bar(tqdm):  # type: ignore[misc, type-arg, unused-ignore]  # Any without stubs, generic with
    """tqdm without its monitor thread: no thread of ours runs while workers are forked."""

    monitor_interval = 0


def _width(stream: TextIO) -> int:
    """The width the terminal behind ``stream`` reports (0: none, or not a terminal)."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return 0


class Progress:
    """The run's progress bar: tqdm's (count, bar, percent, rate, ETA), redrawn in place.

    Only on a terminal (``enabled``); disabled, every method does nothing. While the
    workers start, the bar at 0 says so; ``start`` resets its clock, so rate and ETA
    count inference only. Lines for the same terminal go through ``printing`` (results
    on stdout) or ``note`` (messages on the bar's stream): the bar is cleared, the line
    written whole, the bar drawn again below it, so neither tears the other.
    """

    def __init__(self, total: int, stream: TextIO, *, enabled: bool, interval: float = 0.1) -> None:
        self.total = total
        self.stream = stream
        self.enabled = enabled
        self.interval = interval
        self.started = time.monotonic()
        self._bar: _Bar | None = None

    def _open(self, desc: str = "") -> _Bar:
        if self._bar is None:
            # Follow the terminal's width as it is resized; a terminal that reports none
            # (a bare pseudo-terminal) gets $COLUMNS/$LINES or 80x20, where tqdm would draw
            # nothing at all.
            size = None if _width(self.stream) > 0 else shutil.get_terminal_size((80, 20))
            self._bar = _Bar(total=self.total, file=self.stream, desc=desc, unit="input", leave=False,
                             dynamic_ncols=size is None, mininterval=self.interval,
                             ncols=size and size.columns, nrows=size and size.lines)
        return self._bar

    def message(self, text: str) -> None:
        """Show ``text`` in front of the bar (what the run is waiting for)."""
        if self.enabled:
            self._open(text).set_description_str(text)

    def start(self) -> None:
        self.started = time.monotonic()
        if self.enabled:
            bar = self._open()
            bar.set_description_str("", refresh=False)
            bar.reset()

    def advance(self, count: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(count)
            if self._bar.n >= self.total:
                # tqdm skips redraws within ``mininterval``: the last one is drawn regardless,
                # so the terminal always shows the run at 100% before the bar goes
                self._bar.refresh()

    @contextlib.contextmanager
    def printing(self) -> Iterator[None]:
        """Write other output to the bar's terminal inside this block, without tearing it."""
        bar = self._bar
        if bar is None:
            yield
            return
        bar.clear()
        try:
            yield
        finally:
            bar.refresh()

    def note(self, text: str) -> None:
        """A line of its own on the bar's stream, above the bar."""
        if self.enabled:
            with self.printing():
                self.stream.write(text + "\n")
                self.stream.flush()

    def finish(self, summary: str | None = None) -> None:
        """Take the bar off the screen; then ``summary`` on a line of its own."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if summary:
            self.stream.write(summary + "\n")
            self.stream.flush()


@contextlib.contextmanager
def quiet_workers() -> Iterator[None]:
    """The workers started in this block inherit ``HF_HUB_DISABLE_PROGRESS_BARS=1`` (unless
    the user set it): N workers loading at once would draw N "Loading weights" bars over the
    run's own. The caller's environment is restored after."""
    set_here = _settings.quiet_hub_progress()
    try:
        yield
    finally:
        if set_here:
            _settings.restore_hub_progress()
