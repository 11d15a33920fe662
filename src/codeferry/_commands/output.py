"""The output file of ``codeferry run``: appended line by line, resumable, locked.

Output: one JSON object per line and per input, in input order::

    generate  {"id": ..., "output": "generated text"}
    embed     {"id": ..., "embedding": [0.1, ...]}
    score     {"id": ..., "logprob": -9.1, "tokens": [...], "token_logprobs": [...]}
    failed    {"id": ..., "error": "RuntimeError: ..."}   (its batch failed on every attempt)

Results arrive from the executor in any order; they are buffered and each line is written
as soon as every input before it has been written. A line is written with one ``os.write``
of the whole line and its ``\\n`` on an ``O_APPEND`` descriptor (so a kill never leaves half
a line behind, short of a full disk) and the file is ``fsync``'d about once a batch.

Resuming: a run whose output file already holds lines skips the ids written there
(results and errors alike) and appends the others in input order, so the file always holds
each id at most once, in input order. A last line without its ``\\n`` (or not valid JSON) is
cut away first. An output holding an id the input lacks, an id twice, or the results of
another task is refused. An exclusive lock (filelock, on ``<output>.codeferry.lock``, left
in place) keeps two runs off one output file; a run that cannot take it at once raises
``OutputLockError`` before anything is read or written.

An output that is not a regular file (``--output /dev/stdout | cat``, a named pipe, a
device) is written straight through, with no resume, no lock and no ``fsync``.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing.util
import os
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from filelock import FileLock, Timeout

from ..errors import (
    InputFormatError,
    OutputError,
    OutputLockError,
)
from .inputs import Id, InputItem, Task

__all__ = ["Sink", "lock_path"]

_RESULT_KEY = {"generate": "output", "embed": "embedding", "score": "logprob"}


# -- existing output --------------------------------------------------------------------


@dataclass
class _Existing:
    ids: set[Id] = field(default_factory=set)
    failed: int = 0
    keep: int = 0  # bytes to keep: the end of the last complete, valid line
    size: int = 0


def _read_existing(data: bytes, path: Path, items: Sequence[InputItem], task: Task) -> _Existing:
    known = {item.id for item in items}
    state = _Existing(size=len(data))
    lines = data.split(b"\n")
    # A last piece without its newline is a torn line (or empty): dropped.
    complete, start = lines[:-1], 0
    for number, raw in enumerate(complete, 1):
        end = start + len(raw) + 1
        try:
            row = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            if number == len(complete):
                break  # a torn last line: cut away
            raise _output_error(path, number, "is not a JSON line written by codeferry run.") from None
        if not isinstance(row, dict) or "id" not in row:
            raise _output_error(path, number, 'is not a JSON object with an "id".')
        ident = row["id"]
        if isinstance(ident, bool) or not isinstance(ident, (str, int)) or ident not in known:
            raise _output_error(path, number, f"holds id {json.dumps(ident)}, which the input "
                                "does not have: it is the output of another input file.")
        if ident in state.ids:
            raise _output_error(path, number, f"holds id {json.dumps(ident)} a second time.")
        if "error" in row:
            state.failed += 1
        elif _RESULT_KEY[task] not in row:
            raise _output_error(path, number, f"is not a result of --task {task} (no "
                                f'"{_RESULT_KEY[task]}"): it was written by another task.')
        state.ids.add(ident)
        state.keep = start = end
    return state


def _output_error(path: Path, line: int, message: str) -> InputFormatError:
    return InputFormatError(
        f"the existing output {message}", path=str(path), line=line,
        fix="a rerun appends to an output of the same input and task only: choose another "
        "--output, or delete this one to start over.",
    )


class Sink:
    """Where output lines go: stdout, or an output file opened for appending."""

    def __init__(self, path: Path | None, stdout: TextIO) -> None:
        self.path = path
        self.stdout = stdout
        self.fd: int | None = None
        self.created = False
        self.unsynced = 0
        self.synced_at = time.monotonic()
        self.stream = False  # a pipe or device: no resume, no lock, no fsync
        self.lock: FileLock | None = None  # held from open to close (regular files only)

    def open(self, items: Sequence[InputItem], task: Task) -> _Existing:
        """Open and lock the file, read what it holds, cut a torn last line away.

        An output that is not a regular file (a pipe, ``/dev/stdout``, a terminal, a
        device) is written straight through: there is nothing to resume from, and
        reading "what it holds" would wait forever on a pipe.
        """
        if self.path is None:
            return _Existing()
        path = self.path
        try:
            if _is_stream(path):
                # O_WRONLY: a named pipe then waits for its reader, as ``>`` would.
                self.fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
                if _is_stream(self.fd):
                    self.stream = True
                    multiprocessing.util.register_after_fork(self, Sink._forget)
                    return _Existing()
                os.close(self.fd)  # replaced by a regular file meanwhile: the usual way
                self.fd = None
            path.parent.mkdir(parents=True, exist_ok=True)
            self.created = not path.exists()
            self.fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
            if _is_stream(self.fd):  # appeared as a pipe between the check and the open
                self.stream = True
                multiprocessing.util.register_after_fork(self, Sink._forget)
                return _Existing()
        except OSError as exc:
            raise OutputError(f"cannot open output {path}: {exc.strerror or exc}.",
                              path=str(path), fix="choose a writable --output file.") from None
        # Workers forked later (start method fork, replacements of dead workers) must not
        # keep the output open, nor its lock held, after this process is gone.
        multiprocessing.util.register_after_fork(self, Sink._forget)
        try:
            self.lock = _lock_output(path)
            chunks = []
            while chunk := os.read(self.fd, 1 << 20):
                chunks.append(chunk)
            state = _read_existing(b"".join(chunks), path, items, task)
            if state.keep < state.size:
                os.ftruncate(self.fd, state.keep)
                os.fsync(self.fd)
        except BaseException:
            self.close(discard=True)
            raise
        return state

    def _forget(self) -> None:
        """In a forked child: close our copy of the descriptor (the parent keeps its lock)."""
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None
        if self.lock is not None:
            _drop_inherited(self.lock)
            self.lock = None

    def write(self, line: bytes) -> None:
        if self.fd is None:
            self.stdout.write(line.decode("utf-8"))
            self.stdout.flush()
            return
        try:
            # One write of the whole line on an O_APPEND descriptor: a kill cannot cut it.
            done = os.write(self.fd, line)
            while done < len(line):  # only on a full disk or an odd filesystem
                done += os.write(self.fd, line[done:])
        except OSError as exc:
            raise OutputError(f"cannot write output {self.path}: {exc.strerror or exc}.",
                              path=str(self.path), fix="free space, then rerun to resume.") from None
        self.unsynced += 1

    def sync(self, every: int, *, force: bool = False) -> None:
        if self.fd is None or not self.unsynced or self.stream:
            return
        now = time.monotonic()
        if force or self.unsynced >= every or now - self.synced_at >= 1.0:
            os.fsync(self.fd)
            self.unsynced, self.synced_at = 0, now

    def close(self, *, discard: bool = False) -> None:
        """Close; ``discard`` removes the file if this run created it and wrote nothing."""
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        try:
            if self.stream:
                pass  # nothing to remove or flush to disk
            elif discard and self.created and self.path is not None and os.fstat(fd).st_size == 0:
                os.unlink(self.path)
            elif self.unsynced:
                os.fsync(fd)
        finally:
            os.close(fd)
            if self.lock is not None:
                lock, self.lock = self.lock, None
                lock.release()


def _is_stream(target: Path | int) -> bool:
    """Whether ``target`` (a path, or an open descriptor) exists and is not a regular file."""
    try:
        mode = os.fstat(target).st_mode if isinstance(target, int) else os.stat(target).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return False
    return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)


def lock_path(output: Path) -> Path:
    """The lock file that keeps two runs off ``output``: next to it, left in place after the
    run (removing it would let a run waiting on the old file and a new one both in)."""
    return output.with_name(output.name + ".codeferry.lock")


def _lock_output(path: Path) -> FileLock:
    """Take the output's lock now or raise ``OutputLockError`` (never wait for another run).

    The lock file sits next to the file itself, links resolved: ``-o out.jsonl`` and
    ``-o link-to-out.jsonl`` are one output, with one lock.
    """
    where = lock_path(Path(os.path.realpath(path)))
    try:  # filelock retries an unopenable file until its timeout: say why here instead
        os.close(os.open(where, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644))
    except OSError as exc:
        raise OutputLockError(
            f"cannot lock output {path}: its lock file {where} cannot be created: "
            f"{exc.strerror or exc}.", path=str(path), lock_path=str(where),
            fix=f"make {where.parent} writable (or remove what stands at {where}), or choose "
            "another --output.") from None
    lock = FileLock(str(where), timeout=0, thread_local=False, mode=0o644)
    try:
        lock.acquire()
    except Timeout:
        raise OutputLockError(
            f"output {path} is being written by another codeferry run (it holds {where}).",
            path=str(path), lock_path=str(where), held=True,
            fix="wait for that run to finish (a rerun then resumes), or choose another --output.",
        ) from None
    except (OSError, NotImplementedError) as exc:
        raise OutputLockError(
            f"cannot lock output {path} with {where}: {exc}.", path=str(path),
            lock_path=str(where),
            fix="write the output to a local filesystem that supports file locks.") from None
    return lock


def _drop_inherited(lock: FileLock) -> None:
    """In a forked child: close the child's copy of the lock's descriptor, never unlock it.

    Unlocking would free the parent's lock too (they share one open file); a copy left
    open would hold the lock after the parent is gone. filelock 4 detaches a forked
    child's locks itself; this covers the releases before it.
    """
    context = getattr(lock, "_context", None)
    fd = getattr(context, "lock_file_fd", None)
    if isinstance(fd, int):
        with contextlib.suppress(OSError):
            os.close(fd)
        context.lock_file_fd = None  # type: ignore[union-attr]
        if hasattr(context, "lock_counter"):
            context.lock_counter = 0  # type: ignore[union-attr]
