"""The lock that keeps two ``codeferry run`` off one output file.

The lock is of the file itself: an ``flock`` of the output's open file (its inode, on the
file system that holds it), held for the run and gone with the process, so a path, a
symbolic link, a hard link and a bind mount of one file share it, whatever each run's
``CODEFERRY_HOME`` or ``HOME`` (two shells, cron, ``sudo``), and nothing is added to the
user's folder. Who holds it is read from the kernel's table of locks (``/proc/locks``: the
holder's pid, then its command and start from ``/proc``), and from the note the holder
leaves in its home (``run-locks/<device>-<inode>.json``: pid, host, command, start), so a run
refused names that run. A file system without ``flock`` (some network ones) refuses the
run with ``OutputLockError``; on NFS the lock is the server's, across machines.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from .. import _settings
from ..errors import OutputHeldError, OutputLockError

try:
    import fcntl
except ImportError:  # Windows: a lock file in the home instead, per home (``_home_lock``)
    fcntl = None  # type: ignore[assignment]

__all__ = ["OutputLock", "drop_inherited", "lock_output", "lock_path"]

#: Attempts at locking the file a path names, when another run renamed a new file over it
#: meanwhile (``--retry-errors`` rewrites the output and renames it into place).
_RENAMED_TRIES = 5


def lock_path(output: Path | int) -> Path:
    """Where the run holding the lock of ``output`` (a path, links followed, or an open
    descriptor) leaves its note in this home; the lock itself is the file's."""
    info = os.fstat(output) if isinstance(output, int) else os.stat(output)
    return _settings.codeferry_home() / "run-locks" / f"{info.st_dev:x}-{info.st_ino:x}.lock"


def _holder_path(lock: Path) -> Path:
    return lock.with_suffix(".json")


class OutputLock:
    """The ``flock`` this run holds on its output, and its note: ``release`` drops both."""

    def __init__(self, fd: int, note: Path, home: FileLock | None = None) -> None:
        self.fd: int | None = fd
        self.note, self.home = note, home

    def release(self) -> None:
        """Remove the note (when it is still ours), then unlock (the descriptor may be
        closed already: closing it unlocked the file)."""
        fd, self.fd = self.fd, None
        if fd is None:
            return
        if _read_holder(self.note).get("pid") == os.getpid():
            with contextlib.suppress(OSError):
                _holder_path(self.note).unlink()
        with contextlib.suppress(OSError):
            if self.home is not None:
                self.home.release()
            else:
                fcntl.flock(fd, fcntl.LOCK_UN)


def _same_file(path: Path, fd: int) -> bool:
    try:
        named, held = os.stat(path), os.fstat(fd)
    except OSError:
        return False
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def lock_output(path: Path, fd: int) -> OutputLock:
    """Lock the file open on ``fd`` (opened as ``path``) now, or raise ``OutputLockError``
    (``OutputHeldError`` when another run holds it): never wait for another run. When
    ``path`` names another file once locked (a run renamed its rewrite over it), ``fd`` is
    reopened on it, the same descriptor number, and locked again."""
    if fcntl is None:
        return _home_lock(path, fd)
    for _ in range(_RENAMED_TRIES):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _find_holder(fd)
            raise OutputHeldError(
                f"output {path} is being written by another codeferry run "
                f"({_describe(holder)}).", path=str(path), lock_path=str(path), holder=holder,
                fix="wait for that run to finish (a rerun then resumes), or choose another "
                "--output.") from None
        except OSError as exc:
            raise OutputLockError(
                f"cannot lock output {path}: {exc.strerror or exc} (the file system does not "
                "take file locks).", path=str(path), lock_path=str(path),
                fix="write the output on a local file system, then copy it.") from None
        if _same_file(path, fd):
            break
        fcntl.flock(fd, fcntl.LOCK_UN)
        with contextlib.suppress(OSError):
            again = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
            os.dup2(again, fd, inheritable=False)
            os.close(again)
    note = lock_path(fd)
    _write_holder(note, path)
    return OutputLock(fd, note)


def _home_lock(path: Path, fd: int) -> OutputLock:
    """Without ``flock`` (Windows): a lock file of the output's inode in this home."""
    note = lock_path(fd)
    lock = FileLock(str(note), timeout=0, thread_local=False, mode=0o600)
    try:
        note.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        lock.acquire()
    except Timeout:
        holder = _read_holder(note)
        raise OutputHeldError(
            f"output {path} is being written by another codeferry run ({_describe(holder)}).",
            path=str(path), lock_path=str(note), holder=holder,
            fix="wait for that run to finish, or choose another --output.") from None
    except OSError as exc:
        raise OutputLockError(f"cannot lock output {path} with {note}: {exc}.",
                              path=str(path), lock_path=str(note),
                              fix="set CODEFERRY_HOME to a writable local folder.") from None
    _write_holder(note, path)
    return OutputLock(fd, note, lock)


def _write_holder(lock: Path, output: Path) -> None:
    """Who holds ``lock``, for the runs it refuses (best effort: the lock is what counts)."""
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "output": str(output),
              "command": shlex.join(sys.argv), "started": time.time()}
    target = _holder_path(lock)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with contextlib.suppress(OSError):
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp.write_text(json.dumps(holder), encoding="utf-8")
        os.replace(tmp, target)


def _read_holder(lock: Path) -> dict[str, Any]:
    try:
        holder = json.loads(_holder_path(lock).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "which one it did not record"
    started = holder.get("started")
    when = (time.strftime(" since %Y-%m-%d %H:%M:%S UTC", time.gmtime(started))
            if isinstance(started, (int, float)) else "")
    writing = f", writing {holder['output']}" if holder.get("output") else ""
    command = f": {holder['command']}" if holder.get("command") else ""
    return f"pid {holder.get('pid')} on {holder.get('host')}{when}{writing}{command}"


def drop_inherited(lock: OutputLock) -> None:
    """In a forked child: forget the lock, never unlock it (the child's copy of the
    descriptor, which the caller closes, shares the parent's lock), nor remove its note."""
    lock.fd = None


def _find_holder(fd: int) -> dict[str, Any]:
    """Who holds the lock of the file open on ``fd``: the note its holder left in this
    home when the kernel's table names that pid (or names none), else what ``/proc`` says
    of the pid the table names (the holder's home is another), else nothing."""
    pid = _locking_pid(fd)
    note = _read_holder(lock_path(fd))
    if note and (pid is None or note.get("pid") == pid):
        return note
    if pid is None:
        return {}
    holder: dict[str, Any] = {"pid": pid, "host": socket.gethostname()}
    with contextlib.suppress(OSError, ValueError, IndexError):
        raw = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        holder["command"] = shlex.join(part.decode("utf-8", "replace") for part in raw)
    with contextlib.suppress(OSError, ValueError, IndexError, StopIteration):
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        holder["started"] = boot + ticks / os.sysconf("SC_CLK_TCK")
    held = os.fstat(fd)
    with contextlib.suppress(OSError):
        for entry in os.scandir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                found = os.stat(entry.path)
                if (found.st_dev, found.st_ino) == (held.st_dev, held.st_ino):
                    holder["output"] = os.readlink(entry.path)
                    break
    return holder


def _locking_pid(fd: int) -> int | None:
    """The pid that holds an ``flock`` of the file open on ``fd``, from ``/proc/locks``
    (Linux; ``None`` elsewhere or when not listed). The inode alone matches where the
    device differs (an overlay file system lists the file below it)."""
    info = os.fstat(fd)
    device = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    try:
        table = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    found: dict[bool, int] = {}
    for line in table:
        fields = line.split()
        if len(fields) < 6 or fields[1] != "FLOCK" or fields[3] != "WRITE":
            continue  # a waiter ("->"), a POSIX lock, a shared lock
        with contextlib.suppress(ValueError):
            if fields[5] == device or fields[5].rsplit(":", 1)[-1] == str(info.st_ino):
                found.setdefault(fields[5] == device, int(fields[4]))
    return found.get(True, found.get(False))
