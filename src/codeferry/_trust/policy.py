"""Which code this process may run: the trust decisions it made, and whether a lock binds it.

Every unit passes ``check_allowed`` when it is registered (``_runtime.loader.register``), whether
this process loaded it or received it in a message. Until a lock is used, explicit trust
(``trust_remote_code=True`` in the sender) is the decision and everything that arrives may
run; once ``load(..., lock=...)`` ran here, only code some lock of this process lists may.
"""

from __future__ import annotations

import threading

from ..errors import LockMismatchError

__all__ = ["allow", "allow_files", "check_allowed", "locked", "locked_files"]

_lock = threading.Lock()
_allowed: set[str] = set()
_locked = False
_files: set[tuple[str, str]] = set()  # (path, sha256) of every file a lock of this process lists


def allow(digests: set[str], *, from_lock: bool) -> None:
    """Record unit digests this process decided to run (explicit trust or a lock)."""
    global _locked
    with _lock:
        _allowed.update(digests)
        _locked = _locked or from_lock


def allow_files(files: set[tuple[str, str]]) -> None:
    """Record the ``(path, sha256)`` of the files a lock used here lists: what the gate at
    transformers' own execution of a module (``_install.lock_gate``) compares bytes with."""
    with _lock:
        _files.update(files)


def locked_files() -> frozenset[tuple[str, str]] | None:
    """The files some lock of this process lists, or ``None`` while no lock binds it."""
    with _lock:
        return frozenset(_files) if _locked else None


def locked() -> bool:
    """Whether a lock binds this process (``load(..., lock=...)`` ran here)."""
    with _lock:
        return _locked


def check_allowed(digest: str, label: str) -> None:
    """Refuse code that no lock of this process allows (no lock used: everything goes)."""
    with _lock:
        if not _locked or digest in _allowed:
            return
    raise LockMismatchError(
        f"this process runs locked code only, and got code of {label} ({digest}) "
        "that none of its locks lists.",
        digest=digest,
        fix="load the model with a lock that lists this code in this process first, or "
        "re-lock after reviewing it: `codeferry lock MODEL -o FILE`.",
    )
