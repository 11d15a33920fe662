"""The output file of ``codeferry run``: appended line by line, resumable, locked.

Output: one JSON object per line and per input, in input order::

    generate  {"id": ..., "output": "generated text"}
    embed     {"id": ..., "embedding": [0.1, ...]}
    score     {"id": ..., "logprob": -9.1, "tokens": [...], "token_logprobs": [...]}
    failed    {"id": ..., "error": "RuntimeError: ..."}   (the model raised on it, every attempt)

A ``generate`` line also carries ``finish_reason``, ``prompt_tokens``, ``completion_tokens``
(and ``logprobs``, ``outputs`` for ``n`` > 1, and the input line's other keys). An input in
the OpenAI batch format gets its output in that format (``openai``): ``{"id": ...,
"custom_id": ..., "response": {"status_code": 200, "request_id": ..., "body": {...}},
"error": null}``; an OpenAI line is known by its ``custom_id``, which is its input's id.

Results arrive from the executor in any order; they are buffered and each line is written
as soon as every input before it has been written. A line is written with one ``os.write``
of the whole line and its ``\\n`` on an ``O_APPEND`` descriptor (so a kill never leaves half
a line behind, short of a full disk) and the file is ``fsync``'d about once a batch.

Resuming: a run whose output file already holds lines skips the ids written there
(results and errors alike; errors too with ``retry_errors``, see ``Sink.rewrite``) and
appends the others in input order, so the file always holds each id at most once, in input
order. Reading it changes nothing: every check passes first, then a last line torn by a
kill (it starts as codeferry's lines do, ``{"id": ``) is cut away (``Sink.repair``). A file
holding any other line that is not codeferry's JSON is not codeferry's: it is refused
(``ForeignOutputError``) and left byte for byte as it was. An output holding an id the
input lacks, an id twice, or the results of another task is refused. A lock of the file
itself (``outlock``) keeps two runs off it, by any name; a run that cannot take it at once
raises ``OutputLockError`` before anything is read or written.

An output that is not a regular file (``--output /dev/stdout | cat``, a named pipe, a
device) is written straight through, with no resume, no lock and no ``fsync``.
"""

from __future__ import annotations

import contextlib
import glob
import json
import multiprocessing.util
import os
import stat
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from ..errors import (
    ForeignOutputError,
    InputFormatError,
    OutputError,
)
from .inputs import Id, InputItem, Task
from .outlock import OutputLock, drop_inherited, lock_output, lock_path

__all__ = ["Existing", "Sink", "lock_path"]

_RESULT_KEY = {"generate": "output", "embed": "embedding", "score": "logprob"}
#: How every line codeferry writes starts (``json.dumps`` of a dict whose first key is "id").
_PREFIX = b'{"id": '


# -- existing output --------------------------------------------------------------------


@dataclass
class Existing:
    """What an output holds: its ids, those of error lines, where each line is."""

    ids: set[Id] = field(default_factory=set)
    errors: set[Id] = field(default_factory=set)
    spans: dict[Id, tuple[int, int]] = field(default_factory=dict)  # id -> (start, end) bytes
    keep: int = 0  # bytes to keep: the end of the last complete, valid line
    size: int = 0

    @property
    def failed(self) -> int:
        return len(self.errors)


def _torn(raw: bytes) -> bool:
    """Whether ``raw`` (not empty: codeferry writes no empty line) can be the start of a line
    codeferry wrote, cut short."""
    return bool(raw) and (raw.startswith(_PREFIX) or _PREFIX.startswith(raw))


def _read_existing(data: bytes, path: Path, items: Sequence[InputItem], task: Task) -> Existing:
    known = {item.id for item in items}
    state = Existing(size=len(data))
    *complete, last = data.split(b"\n")
    start = 0
    for number, raw in enumerate(complete, 1):
        end = start + len(raw) + 1
        try:
            row = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError):  # not UTF-8 or not JSON, or more than Python reads
            row = None
        if not isinstance(row, dict) or "id" not in row:
            if number == len(complete) and not last and _torn(raw):
                break  # a last line torn by a full disk: cut away
            raise _foreign(path, number, raw)
        openai = "custom_id" in row and "response" in row
        ident = row["custom_id"] if openai else row["id"]
        if isinstance(ident, bool) or not isinstance(ident, (str, int)) or ident not in known:
            raise _output_error(path, number, f"holds id {json.dumps(ident)}, which the input "
                                "does not have: it is the output of another input file.")
        if ident in state.ids:
            raise _output_error(path, number, f"holds id {json.dumps(ident)} a second time.")
        if row.get("error") is not None or (openai and not _answered(row)):
            state.errors.add(ident)
        elif not openai and _RESULT_KEY[task] not in row:
            raise _output_error(path, number, f"is not a result of --task {task} (no "
                                f'"{_RESULT_KEY[task]}"): it was written by another task.')
        state.ids.add(ident)
        state.spans[ident] = (start, end)
        state.keep = start = end
    else:
        if last and not _torn(last):
            raise _foreign(path, len(complete) + 1, last)
    return state


def _answered(row: dict[str, object]) -> bool:
    """Whether an OpenAI batch output line holds a response (status 200), not an error."""
    response = row.get("response")
    return isinstance(response, dict) and response.get("status_code") == 200


def _foreign(path: Path, line: int, raw: bytes) -> ForeignOutputError:
    shown = raw[:60].decode("utf-8", "replace") + ("..." if len(raw) > 60 else "")
    return ForeignOutputError(
        f"the file is not an output of codeferry run: this line ({json.dumps(shown)}) is not "
        "one codeferry writes. The file is left as it is.", path=str(path), line=line,
        fix="choose another --output (codeferry resumes only files it wrote, and changes no "
        "other), or move this file away.")


def _output_error(path: Path, line: int, message: str) -> InputFormatError:
    return InputFormatError(
        f"the existing output {message}", path=str(path), line=line,
        fix="a rerun appends to an output of the same input and task only: choose another "
        "--output, or delete this one to start over.",
    )


class _Rewrite:
    """The new file a rewrite writes (see ``Sink.rewrite``): every input in order, the old
    output's lines copied for the ids not run again."""

    def __init__(self, path: Path, order: list[Id], spans: dict[Id, tuple[int, int]]) -> None:
        self.order, self.spans, self.cursor = order, spans, 0
        self.fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".codeferry.tmp",
                                         dir=path.parent)
        self.tmp = Path(name)

    def copy_until(self, source: int, ident: Id | None) -> None:
        """Copy the old lines of the ids before ``ident`` (``None``: of every id left)."""
        while self.cursor < len(self.order) and self.order[self.cursor] != ident:
            span = self.spans.get(self.order[self.cursor])
            if span is not None:
                _write_all(self.fd, os.pread(source, span[1] - span[0], span[0]))
            self.cursor += 1
        self.cursor += 1  # past ``ident``, whose new line the caller writes


def _write_all(fd: int, data: bytes) -> None:
    done = os.write(fd, data)
    while done < len(data):  # only on a full disk or an odd filesystem
        done += os.write(fd, data[done:])


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
        self.lock: OutputLock | None = None  # held from open to close (regular files only)
        self.rewriting: _Rewrite | None = None

    def open(self, items: Sequence[InputItem], task: Task) -> Existing:
        """Open and lock the file, and read what it holds; nothing in it changes here.

        An output that is not a regular file (a pipe, ``/dev/stdout``, a terminal, a
        device) is written straight through: there is nothing to resume from, and
        reading "what it holds" would wait forever on a pipe.
        """
        if self.path is None:
            return Existing()
        path = self.path
        try:
            if _is_stream(path):
                # O_WRONLY: a named pipe then waits for its reader, as ``>`` would.
                self.fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
                if _is_stream(self.fd):
                    self.stream = True
                    multiprocessing.util.register_after_fork(self, Sink._forget)
                    return Existing()
                os.close(self.fd)  # replaced by a regular file meanwhile: the usual way
                self.fd = None
            path.parent.mkdir(parents=True, exist_ok=True)
            self.created = not path.exists()
            self.fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
            if _is_stream(self.fd):  # appeared as a pipe between the check and the open
                self.stream = True
                multiprocessing.util.register_after_fork(self, Sink._forget)
                return Existing()
        except OSError as exc:
            raise OutputError(f"cannot open output {path}: {exc.strerror or exc}.",
                              path=str(path), fix="choose a writable --output file.") from None
        # Workers forked later (start method fork, replacements of dead workers) must not
        # keep the output open, nor its lock held, after this process is gone.
        multiprocessing.util.register_after_fork(self, Sink._forget)
        try:
            self.lock = lock_output(path, self.fd)
            chunks = []
            while chunk := os.read(self.fd, 1 << 20):
                chunks.append(chunk)
            return _read_existing(b"".join(chunks), path, items, task)
        except BaseException:
            self.close(discard=True)
            raise

    def repair(self, state: Existing) -> None:
        """Cut away the torn last line ``open`` found (once every check has passed)."""
        if self.fd is not None and not self.stream and state.keep < state.size:
            os.ftruncate(self.fd, state.keep)
            os.fsync(self.fd)

    def rewrite(self, order: list[Id], state: Existing) -> None:
        """From now on write a new file, renamed over the output at ``close``: the lines
        written, in ``order`` (every input id), with the output's old lines copied for
        the ids ``write`` is not given. A run stopped or interrupted midway still leaves a
        whole file (the old lines of the ids it did not reach kept); a run killed leaves
        the output as it was. A hard link to the output keeps the old file."""
        assert self.path is not None and self.fd is not None
        for stale in self.path.parent.glob(f".{glob.escape(self.path.name)}.*.codeferry.tmp"):
            with contextlib.suppress(OSError):  # a killed rewrite's (its lock is ours now)
                stale.unlink()
        try:
            self.rewriting = _Rewrite(self.path, order, state.spans)
        except OSError as exc:
            raise OutputError(f"cannot write next to output {self.path}: "
                              f"{exc.strerror or exc}.", path=str(self.path),
                              fix="make its folder writable.") from None

    def _forget(self) -> None:
        """In a forked child: close our copy of the descriptor (the parent keeps its lock)."""
        for fd in (self.fd, self.rewriting.fd if self.rewriting else None):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.fd = None
        self.rewriting = None
        if self.lock is not None:
            drop_inherited(self.lock)
            self.lock = None

    def write(self, line: bytes, ident: Id | None = None) -> None:
        """Write ``line``, the line of input ``ident`` (which only a rewrite needs)."""
        if self.fd is None:
            self.stdout.write(line.decode("utf-8"))
            self.stdout.flush()
            return
        try:
            if self.rewriting is not None:
                self.rewriting.copy_until(self.fd, ident)
                _write_all(self.rewriting.fd, line)
                return
            # One write of the whole line on an O_APPEND descriptor: a kill cannot cut it.
            _write_all(self.fd, line)
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
        """Close; ``discard`` removes the file if this run created it and wrote nothing
        (and a rewrite's new file: the output stays as it was)."""
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        try:
            if self.rewriting is not None:
                self._finish_rewrite(fd, discard=discard)
            elif self.stream:
                pass  # nothing to remove or flush to disk
            elif discard and self.created and self.path is not None and os.fstat(fd).st_size == 0:
                os.unlink(self.path)
            elif self.unsynced:
                os.fsync(fd)
        finally:
            if self.lock is not None:  # before the descriptor, whose number may be reused
                lock, self.lock = self.lock, None
                lock.release()
            os.close(fd)

    def _finish_rewrite(self, source: int, *, discard: bool) -> None:
        """Complete the new file and rename it over the output (``discard``: drop it); on
        any failure the output stays as it was."""
        rewrite, self.rewriting = self.rewriting, None
        assert rewrite is not None and self.path is not None
        try:
            if not discard:
                rewrite.copy_until(source, None)
                os.fchmod(rewrite.fd, stat.S_IMODE(os.fstat(source).st_mode))
                os.fsync(rewrite.fd)
                os.replace(rewrite.tmp, self.path)
                _sync_folder(self.path.parent)
        except OSError as exc:
            raise OutputError(f"cannot replace output {self.path}: {exc.strerror or exc}; it "
                              "is left as it was.", path=str(self.path),
                              fix="free space, then rerun to resume.") from None
        finally:
            os.close(rewrite.fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(rewrite.tmp)


def _sync_folder(folder: Path) -> None:
    """The rename in ``folder``, on disk (where the filesystem allows it)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _is_stream(target: Path | int) -> bool:
    """Whether ``target`` (a path, or an open descriptor) exists and is not a regular file."""
    try:
        mode = os.fstat(target).st_mode if isinstance(target, int) else os.stat(target).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return False
    return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)
