"""``codeferry run``: batch inference from an input file to a resumable JSONL output file.

Input (UTF-8, one input per line; blank lines are skipped):

* a JSON object ``{"id": ..., "prompt": "..."}`` (``"text"`` is accepted for every task too;
  ``generate``/``score`` prefer ``"prompt"``, ``embed`` prefers ``"text"``). ``id`` is a
  non-empty string or an integer; other keys are ignored. A line is read as JSON when its
  first non-blank character is ``{``;
* any other line is plain text, used whole (without its line ending); its ``id`` is its
  1-based line number in the file, as an integer.

Ids must be unique. Bad input raises ``InputFormatError`` naming ``file:line`` before anything
is written.

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

What produced an output is recorded next to it, in ``<output>.codeferry.json`` (written
atomically before the first line; the JSONL lines themselves stay as above)::

    {"format": "codeferry-run/1", "model": "org/name@<commit>", "digest": "sha256:...",
     "task": "generate", "options": {"max_new_tokens": 16, "dtype": null}, "earlier": []}

A resume whose model, code digest, task or options differ from the record is refused
with ``ResumeMismatchError`` naming each difference, so one output never silently mixes
them; ``force_resume`` (``--force-resume``) appends anyway and keeps the earlier record
in ``earlier``. An output written before records existed is resumed as before.

An output that is not a regular file (``--output /dev/stdout | cat``, a named pipe, a
device) is written straight through, with no resume, no lock and no ``fsync``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import multiprocessing.util
import os
import shutil
import stat
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

from filelock import FileLock, Timeout
from tqdm import tqdm

from .. import _settings
from .._code.lockfile import Lock
from .._code.resolve import Bundle
from .._exec.checks import check_device, dtype_name
from .._exec.executor import Executor, Outcome, needed_classes
from .._trust.options import ModelOptions
from ..errors import (
    BatchFailedError,
    InputFormatError,
    InputNotFoundError,
    OutputError,
    OutputLockError,
    ResumeMismatchError,
)

__all__ = [
    "TASKS",
    "InputItem",
    "RunResult",
    "read_inputs",
    "run",
]

logger = logging.getLogger(__name__)

Task = Literal["generate", "embed", "score"]
TASKS: tuple[Task, ...] = ("generate", "embed", "score")
#: The key an output line of each task is recognised by.
_RESULT_KEY = {"generate": "output", "embed": "embedding", "score": "logprob"}
#: Ids are JSON strings or integers.
Id = str | int


@dataclass(frozen=True)
class InputItem:
    """One input: its ``id``, its text, and the line of the input file it came from."""

    id: Id
    text: str
    line: int


@dataclass
class RunResult:
    """What a run did. ``failed`` counts the error lines of the whole output (this run's and
    earlier runs'); ``skipped`` the inputs an earlier run had written already."""

    total: int
    skipped: int = 0
    written: int = 0
    failed: int = 0
    output: str | None = None

    @property
    def complete(self) -> bool:
        return self.skipped + self.written == self.total


# -- input ------------------------------------------------------------------------------


def _input_error(path: Path, line: int, message: str, fix: str) -> InputFormatError:
    return InputFormatError(message, path=str(path), line=line, fix=fix)


def read_inputs(path: str | os.PathLike[str], task: Task = "generate") -> list[InputItem]:
    """Read and check an input file (see the module docstring for the format)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise InputNotFoundError(
            f"input file {path} does not exist.", path=str(path),
            fix="pass an existing JSONL or text file to --input.",
        ) from None
    except OSError as exc:
        raise InputNotFoundError(
            f"cannot read input file {path}: {exc.strerror or exc}.", path=str(path),
            fix="pass a readable JSONL or text file to --input.",
        ) from None
    keys = ("text", "prompt") if task == "embed" else ("prompt", "text")
    items: list[InputItem] = []
    seen: dict[Id, int] = {}
    for number, raw in enumerate(data.split(b"\n"), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _input_error(path, number, f"the line is not UTF-8 (byte {exc.start + 1} of the line).",
                               "save the file as UTF-8.") from None
        if number == 1:
            line = line.removeprefix("\ufeff")
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            item = _json_item(path, number, line, keys)
        else:
            item = InputItem(number, line, number)
        if item.id in seen:
            raise _input_error(
                path, number, f"id {item.id!r} is already used on line {seen[item.id]}.",
                "give every input a unique id (a plain text line's id is its line number).",
            )
        seen[item.id] = number
        items.append(item)
    return items


def _json_item(path: Path, number: int, line: str, keys: tuple[str, str]) -> InputItem:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise _input_error(
            path, number, f"invalid JSON: {exc.msg} (column {exc.colno}).",
            'write one JSON object per line, e.g. {"id": "a1", "prompt": "Hello"}; a line '
            "that does not start with '{' is read as plain text.",
        ) from None
    if not isinstance(row, dict):
        raise _input_error(path, number, "the line is not a JSON object.",
                           'write one JSON object per line, e.g. {"id": "a1", "prompt": "Hello"}.')
    if "id" not in row:
        raise _input_error(path, number, 'the object has no "id".',
                           'add a unique "id" (a string or an integer) to every object.')
    ident = row["id"]
    if isinstance(ident, bool) or not isinstance(ident, (str, int)) or ident == "":
        raise _input_error(path, number, f'"id" {json.dumps(ident)} is not a non-empty string '
                           "or an integer.", 'make "id" a non-empty string or an integer.')
    key = next((k for k in keys if k in row), None)
    if key is None:
        raise _input_error(path, number, f'the object has neither "{keys[0]}" nor "{keys[1]}".',
                           f'add the input text as "{keys[0]}".')
    text = row[key]
    if not isinstance(text, str) or not text:
        raise _input_error(path, number, f'"{key}" is not a non-empty string.',
                           f'make "{key}" the input text.')
    return InputItem(ident, text, number)


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


class _Sink:
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
                    multiprocessing.util.register_after_fork(self, _Sink._forget)
                    return _Existing()
                os.close(self.fd)  # replaced by a regular file meanwhile: the usual way
                self.fd = None
            path.parent.mkdir(parents=True, exist_ok=True)
            self.created = not path.exists()
            self.fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
            if _is_stream(self.fd):  # appeared as a pipe between the check and the open
                self.stream = True
                multiprocessing.util.register_after_fork(self, _Sink._forget)
                return _Existing()
        except OSError as exc:
            raise OutputError(f"cannot open output {path}: {exc.strerror or exc}.",
                              path=str(path), fix="choose a writable --output file.") from None
        # Workers forked later (start method fork, replacements of dead workers) must not
        # keep the output open, nor its lock held, after this process is gone.
        multiprocessing.util.register_after_fork(self, _Sink._forget)
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


# -- what produced the output ----------------------------------------------------------

_RECORD_FORMAT = "codeferry-run/1"


def record_path(output: Path) -> Path:
    """Where the record of what produced ``output`` lives: next to it."""
    return output.with_name(output.name + ".codeferry.json")


def _producer(bundle: Bundle, weights: str, task: Task, max_new_tokens: int | None,
              pooling: str | None, dtype: str | None) -> dict[str, Any]:
    """What decides an output's lines: the model (``weights``: where its weights are from,
    its name), its code, the task and its options."""
    options: dict[str, Any] = {"dtype": dtype}
    if task == "generate":
        options["max_new_tokens"] = max_new_tokens or _settings.DEFAULT_MAX_NEW_TOKENS
    elif task == "embed":
        options["pooling"] = pooling or "mean"
    return {"model": weights, "digest": bundle.digest, "task": task,
            "options": options}


def _flat(producer: dict[str, Any]) -> dict[str, Any]:
    fields = {k: producer.get(k) for k in ("model", "digest", "task")}
    options = producer.get("options")
    for key, value in sorted((options if isinstance(options, dict) else {}).items()):
        fields[key] = value
    return fields


def _check_record(output: Path, producer: dict[str, Any], resuming: bool,
                  force: bool) -> dict[str, Any] | None:
    """The record to write before the first line (``None``: the one there is right).

    Raises ``ResumeMismatchError`` when resuming an output another producer wrote.
    """
    path = record_path(output)
    fresh = {"format": _RECORD_FORMAT, **producer, "earlier": []}
    try:
        recorded: Any = json.loads(path.read_bytes())
    except FileNotFoundError:
        return fresh  # a new output, or one written before records existed
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        if not resuming or force:
            return fresh
        raise OutputError(
            f"cannot read {path}, the record of what produced {output}: {exc}.",
            path=str(path), fix="delete the output and its record to start over, or pass "
            "--force-resume to append to it anyway.") from None
    if not resuming:
        return fresh
    if not isinstance(recorded, dict) or recorded.get("format") != _RECORD_FORMAT:
        recorded = {}
    before, now = _flat(recorded), _flat(producer)
    differences = {key: (before.get(key), now[key]) for key in now if before.get(key) != now[key]}
    if not differences:
        return None
    if force:
        earlier = recorded.get("earlier")
        previous = {k: v for k, v in recorded.items() if k not in ("format", "earlier")}
        return {**fresh, "earlier": [*(earlier if isinstance(earlier, list) else []), previous]}
    shown = "; ".join(f"{key} was {json.dumps(old)}, is {json.dumps(new)}"
                      for key, (old, new) in differences.items())
    raise ResumeMismatchError(
        f"the existing output was produced by another {', '.join(differences)}: {shown} "
        f"(recorded in {path}).",
        path=str(output), differences=differences,
        fix="rerun with what produced it, choose another --output, delete the output and "
        "its record to start over, or pass --force-resume to append to it anyway.",
    )


def _write_record(output: Path, record: dict[str, Any]) -> None:
    """Replace the record whole or not at all: a temporary file, fsync'd, then renamed."""
    path = record_path(output)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, (json.dumps(record, indent=1) + "\n").encode("utf-8"))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}.", path=str(path),
                          fix="choose a writable --output folder.") from None


# -- progress ---------------------------------------------------------------------------


def _clock(seconds: float) -> str:
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


# -- the run ----------------------------------------------------------------------------


def _line(ident: Id, task: Task, value: Any, error: BaseException | None) -> tuple[bytes, bool]:
    row: dict[str, Any] = {"id": ident}
    if error is not None:
        cause = error.__cause__ if isinstance(error, BatchFailedError) else None
        shown = cause if cause is not None else error
        row["error"] = f"{type(shown).__name__}: {shown}".strip()
    elif task == "generate":
        row["output"] = value
    elif task == "embed":
        row["embedding"] = value
    else:
        row.update(logprob=value["logprob"], tokens=value["tokens"],
                   token_logprobs=value["token_logprobs"])
    try:
        data = (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate (from a "\\ud800" in the input): escape it
        data = (json.dumps(row) + "\n").encode("ascii")
    return data, error is not None


def run(
    model: str | os.PathLike[str],
    input_path: str | os.PathLike[str],
    output: str | os.PathLike[str] | None = None,
    *,
    task: Task = "generate",
    trust_remote_code: bool = False,
    lock: Lock | str | os.PathLike[str] | None = None,
    workers: int = 2,
    start_method: Literal["spawn", "forkserver", "fork"] = "spawn",
    batch_size: int | None = None,
    max_new_tokens: int | None = None,
    device: str = "cpu",
    dtype: str | Any | None = None,
    pooling: str | None = None,
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    token: str | bool | None = None,
    local_files_only: bool | None = None,
    code_revision: str | None = None,
    progress: bool | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    force_resume: bool = False,
    backend: Literal["local", "ray"] = "local",
    address: str | None = None,
) -> RunResult:
    """Run ``task`` on every input of ``input_path``; write JSONL to ``output`` (``None``:
    ``stdout``), resuming an output that already holds some ids.

    ``batch_size`` fixes the inputs per batch; by default the executor groups inputs of
    similar length into batches of a token budget (``Executor(max_batch_tokens=)``). No
    more workers start than there are inputs (or batches of ``batch_size``). ``progress`` (default: whether ``stderr``
    is a terminal) draws a progress bar on ``stderr``. ``force_resume`` appends to an output
    that another model, code digest or option set produced (refused otherwise). ``dtype``
    is a ``torch.dtype`` or its name; ``cache_dir`` the hub cache that holds ``model``, a
    repo id it lacks being downloaded whole first (``token``, ``local_files_only`` as for
    ``load``); ``code_revision`` as for ``Executor``.
    ``backend="ray"`` runs the workers as Ray actors on the cluster at ``address`` (or
    ``RAY_ADDRESS``); the output and its resumption are the same.
    """
    options = ModelOptions.of(locals())
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    if workers < 1 or (batch_size is not None and batch_size < 1):
        raise ValueError("workers and batch_size must be at least 1")
    out = sys.stdout if stdout is None else stdout
    err = sys.stderr if stderr is None else stderr
    show = err.isatty() if progress is None else progress
    items = read_inputs(input_path, task)
    dtype = dtype_name(dtype)  # recorded as its name: torch.float16 and "float16" agree
    bundle = options.resolve_code(model, whole=True)
    weights = options.locate_model(model, bundle)
    bundle.check_classes(needed_classes((task,)))
    decision = options.decide(bundle, demo=True)
    if backend == "local":
        check_device(device)  # before the output is opened (the executor checks again)

    path = None if output is None or str(output) == "-" else Path(output)
    sink = _Sink(path, out)
    state = sink.open(items, task)
    record = None
    if path is not None:
        try:
            record = _check_record(path, _producer(bundle, weights.name, task, max_new_tokens,
                                                   pooling, dtype),
                                   bool(state.ids), force_resume)
        except BaseException:
            sink.close(discard=True)
            raise
    result = RunResult(total=len(items), skipped=len(state.ids), failed=state.failed,
                       output=None if path is None else str(path))
    remaining = [item for item in items if item.id not in state.ids]
    bar = Progress(len(remaining), err, enabled=show)
    try:
        if not remaining:
            sink.close()
            return result
        size = batch_size or max(1, min(8, math.ceil(len(remaining) / max(1, workers))))
        count = max(1, min(workers, math.ceil(len(remaining) / size)))
        if result.skipped:
            bar.note(f"resuming: {result.skipped} of {result.total} already in {path}")
        how = "Ray actors" if backend == "ray" else start_method
        bar.message(f"starting {count} worker{'s' if count > 1 else ''} ({how})...")
        try:
            if path is not None and record is not None:
                _write_record(path, record)
            # The code checked above, pinned: workers verify they run exactly its digest.
            decided = options.keywords() | {"trust_remote_code": decision.trust_remote_code,
                                            "lock": decision.lock}
            executor = Executor(
                str(bundle.origin.root) if options.own_code else model, workers=count,
                start_method=start_method, device=device, dtype=dtype, batch_size=batch_size,
                preload=(task,), digest=bundle.digest, backend=backend, address=address,
                **decided,
            )
        except BaseException:
            sink.close(discard=True)
            if path is not None and record is not None and not path.exists():
                with contextlib.suppress(OSError):
                    record_path(path).unlink()
            raise
        with executor:
            if task == "generate":
                info = executor.worker_info[0]
                text = (f"generating by {info.get('generate_path')} batching "
                        f"({info.get('generate_reason')})")
                logger.info("codeferry run: %s", text)
                bar.note(text)
            bar.start()
            _drain(_outcomes(executor, task, [i.text for i in remaining], batch_size, max_new_tokens,
                             pooling), remaining, task, sink, bar, result, size)
        sink.close()
    except BaseException as exc:
        bar.finish()  # off the screen before the error (or the interruption) is printed
        if not isinstance(exc, KeyboardInterrupt):
            raise
        if path is not None and not sink.stream:
            err.write(f"codeferry: interrupted after writing {result.skipped + result.written} "
                      f"of {result.total} outputs to {path}; run the same command again to "
                      "resume.\n")
        raise
    finally:
        sink.close()
    bar.finish(f"{result.written} written, {result.failed} failed, in "
               f"{_clock(time.monotonic() - bar.started)}")
    return result


def _outcomes(executor: Executor, task: Task, texts: list[str], size: int | None,
              max_new_tokens: int | None, pooling: str | None) -> Iterator[Outcome]:
    """``size``: the user's fixed batch size; ``None`` lets the executor plan by tokens."""
    if task == "generate":
        options = {} if max_new_tokens is None else {"max_new_tokens": max_new_tokens}
        return executor.generate_iter(texts, batch_size=size, **options)
    if task == "embed":
        return executor.embed_iter(texts, pooling=pooling or "mean", batch_size=size)
    return executor.score_iter(texts, batch_size=size)


def _drain(outcomes: Iterator[Outcome], remaining: list[InputItem], task: Task, sink: _Sink,
           bar: Progress, result: RunResult, size: int) -> None:
    """Write outcomes (any order) in input order, each as soon as those before it are out."""
    waiting: dict[int, tuple[bytes, bool]] = {}
    following = 0
    for outcome in outcomes:
        waiting[outcome.index] = _line(remaining[outcome.index].id, task, outcome.value,
                                       outcome.error)
        bar.advance()
        if following not in waiting:
            continue
        # stdout may be the bar's terminal: the lines go above the bar, which is drawn again
        with bar.printing() if sink.fd is None else contextlib.nullcontext():
            while following in waiting:
                line, failed = waiting.pop(following)
                sink.write(line)
                result.written += 1
                result.failed += failed
                following += 1
        sink.sync(size)
