"""The lock that keeps two ``codeferry run`` off one output file.

The lock is of the file itself, not of a name of it: its device and inode name a lock file
in codeferry's home (``CODEFERRY_HOME``, ``run-locks/<device>-<inode>.lock``), so a path, a
symbolic link, a hard link and a bind mount of one file share one lock, and nothing is
added to the user's folder. The run that holds it records who it is beside it
(``<device>-<inode>.json``: pid, host, command, start), and a run refused names that run.
Lock files stay in place (removing one would let a run waiting on the old file and a new
one both in). The lock is per machine: two machines writing one file on a shared filesystem
are not kept apart.
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

__all__ = ["drop_inherited", "lock_output", "lock_path"]


def lock_path(output: Path | int) -> Path:
    """The lock file of the file ``output`` (a path, links followed, or an open descriptor)."""
    info = os.fstat(output) if isinstance(output, int) else os.stat(output)
    return _settings.codeferry_home() / "run-locks" / f"{info.st_dev:x}-{info.st_ino:x}.lock"


def _holder_path(lock: Path) -> Path:
    return lock.with_suffix(".json")


def lock_output(path: Path, fd: int) -> FileLock:
    """Lock the file open on ``fd`` (shown as ``path``) now, or raise ``OutputLockError``
    (``OutputHeldError`` when another run holds it): never wait for another run."""
    where = lock_path(fd)
    try:  # filelock retries an unopenable file until its timeout: say why here instead
        where.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.close(os.open(where, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
    except OSError as exc:
        raise OutputLockError(
            f"cannot lock output {path}: its lock file {where} cannot be created: "
            f"{exc.strerror or exc}.", path=str(path), lock_path=str(where),
            fix=f"make {where.parent} writable (or remove what stands at {where}), or set "
            "CODEFERRY_HOME to a writable folder.") from None
    lock = FileLock(str(where), timeout=0, thread_local=False, mode=0o600)
    try:
        lock.acquire()
    except Timeout:
        holder = _read_holder(where)
        raise OutputHeldError(
            f"output {path} is being written by another codeferry run ({_describe(holder)}; "
            f"it holds {where}).", path=str(path), lock_path=str(where), holder=holder,
            fix="wait for that run to finish (a rerun then resumes), or choose another --output.",
        ) from None
    except (OSError, NotImplementedError) as exc:
        raise OutputLockError(
            f"cannot lock output {path} with {where}: {exc}.", path=str(path),
            lock_path=str(where),
            fix="set CODEFERRY_HOME to a local filesystem that supports file locks.") from None
    _write_holder(where, path)
    return lock


def _write_holder(lock: Path, output: Path) -> None:
    """Who holds ``lock``, for the runs it refuses (best effort: the lock is what counts)."""
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "output": str(output),
              "command": shlex.join(sys.argv), "started": time.time()}
    target = _holder_path(lock)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with contextlib.suppress(OSError):
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
    return (f"pid {holder.get('pid')} on {holder.get('host')}{when}, writing "
            f"{holder.get('output')}: {holder.get('command')}")


def drop_inherited(lock: FileLock) -> None:
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
