"""A worker's stdout goes to its stderr, each line named by the worker.

``codeferry run`` writes its JSONL output to stdout by default, and workers inherit that
stdout: a model that prints in ``forward`` (or a C extension's ``printf``) wrote into the
output, and two workers tore one line between them. ``route_stdout`` runs first thing in
every worker and in the zygote: fd 1 becomes a copy of fd 2, and ``sys.stdout`` writes each
whole line to fd 2 in one ``os.write``, ``[codeferry worker N] `` in front.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import threading

__all__ = ["finish_stdout", "route_stdout"]


class _NamedLines(io.TextIOBase):
    """A worker's ``sys.stdout``: whole lines only, each after ``prefix``, to stderr (fd 2)
    in one ``os.write`` a call: lines of several workers never tear each other."""

    encoding = "utf-8"

    def __init__(self, prefix: str, fd: int = 2) -> None:
        super().__init__()
        self._prefix = prefix
        self._fd = fd
        #: For code that writes bytes (``sys.stdout.buffer.write``): to stderr, as they are.
        self.buffer = io.FileIO(fd, "w", closefd=False)
        self._pending = ""
        self._lock = threading.Lock()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return 1  # which is stderr now, too (``route_stdout``)

    def write(self, text: str) -> int:
        with self._lock:
            self._pending += text
            if "\n" in self._pending:
                *lines, self._pending = self._pending.split("\n")
                self._emit(lines)
        return len(text)

    def flush(self) -> None:
        """Whole lines are out already; a partial one waits for its end (or ``finish``)."""

    def finish(self) -> None:
        """Write the partial last line, if any (the worker is about to exit)."""
        with self._lock:
            if self._pending:
                self._emit([self._pending])
                self._pending = ""

    def _emit(self, lines: list[str]) -> None:
        data = "".join(f"{self._prefix}{line}\n" for line in lines).encode(
            "utf-8", errors="backslashreplace")
        with contextlib.suppress(OSError):
            while data:
                data = data[os.write(self._fd, data):]


def route_stdout(name: str) -> None:
    """Send this process's stdout to its stderr: fd 1 (C code, child processes) and
    ``sys.stdout``, whose lines get ``[name] `` in front. Called first thing in a worker
    (and the zygote), before any model code runs."""
    with contextlib.suppress(OSError):
        os.dup2(2, 1)
    previous, sys.stdout = sys.stdout, _NamedLines(f"[{name}] ")
    # What was buffered before goes to fd 1: stderr now. (A partial line of the zygote's,
    # in a worker forked from it, is the zygote's to write, not this process's.)
    if previous is not None and not isinstance(previous, _NamedLines):
        with contextlib.suppress(Exception):
            previous.flush()


def finish_stdout() -> None:
    """Write out the partial last line of ``route_stdout``'s ``sys.stdout``, if any."""
    if isinstance(sys.stdout, _NamedLines):
        sys.stdout.finish()
