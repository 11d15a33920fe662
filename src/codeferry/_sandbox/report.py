"""What a boxed process tried last, and its uncaught refusals told as ``SandboxRefusedError``.

Standard library only, and codeferry imported only to tell a refusal: the boot of ``codeferry
exec`` loads this file alone in every boxed Python process (importing the package would cost
each one its imports). Python's audit events (``sys.addaudithook``) announce each socket
operation, signal and program start before the system call; the kernel then refuses it or
not. The refused call's ``OSError`` names no address or pid, so the last announced operation
of its kind names it (``last``). Bookkeeping only: the kernel decides.
"""

from __future__ import annotations

import errno
import itertools
import os
import socket
import sys
import threading

TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import TracebackType
    from typing import Any

#: Each thread's last announced operation, numbered: ``(number, operation, target)``.
_records: dict[int, tuple[int, str, str]] = {}
_count = itertools.count(1)
#: The audited operations whose refusal names no file (``OSError.filename``), and the
#: programs started (whose refusal names the program). Opens are not recorded: their errors
#: name the file.
_EVENTS = {
    "os.kill": ("kill", 0), "os.killpg": ("kill", 0), "os.system": ("exec", 0),
    "os.exec": ("exec", 0), "os.posix_spawn": ("exec", 0), "subprocess.Popen": ("exec", 1),
    "socket.connect": ("connect", 1), "socket.bind": ("bind", 1),
    "socket.sendto": ("sendto", 1), "socket.__new__": ("socket", 1),
}


def _name(kind: Any, value: Any) -> str:
    try:
        return str(kind(value).name)
    except ValueError:
        return str(value)


def audit(event: str, args: tuple[Any, ...]) -> None:
    """The audit hook: remember the last operation of ``_EVENTS``."""
    found = _EVENTS.get(event)
    if found is None:
        return
    operation, index = found
    if event == "socket.__new__":
        target = f"{_name(socket.AddressFamily, args[1])}, {_name(socket.SocketKind, args[2])}"
    elif event == "os.kill" and len(args) > 1:
        target = f"pid {args[0]} (signal {args[1]})"
    elif len(args) > index:
        value = args[index]
        target = value if isinstance(value, str) else repr(value)
    else:
        target = ""
    _records[threading.get_ident()] = (next(_count), operation, target)


def last(kill: bool | None = None, *, forget: bool = False) -> tuple[str, str]:
    """The last announced ``(operation, target)`` of this thread; where this thread announced
    none of the kind asked (``kill``: a signal, or anything else), the newest of any thread's:
    an engine may run the model on a thread of its own (vLLM's in-process engine does), and
    its refusal surface on another. ``forget``: the record names no later refusal."""
    def fits(record: tuple[int, str, str]) -> bool:
        return kill is None or (record[1] == "kill") == kill

    mine = _records.get(threading.get_ident())
    found = mine if mine is not None and fits(mine) else max(
        (r for r in list(_records.values()) if fits(r)), default=None)
    if found is None:
        return "", ""
    if forget:
        for ident, record in list(_records.items()):
            if record is found:
                _records.pop(ident, None)
    return found[1], found[2]


def watch() -> None:
    """In a process boxed before it started (``codeferry exec --sandbox``): record, and tell
    an uncaught refusal as ``SandboxRefusedError`` (codeferry imported then, not before)."""
    sys.addaudithook(audit)
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        told = value
        try:
            from codeferry._settings import sandbox_list

            told = refusal(value, keep=sandbox_list("KEEP"))
        except Exception:  # noqa: BLE001 - without codeferry, the error is told as it is
            told = value
        previous(type(told), told, tb)

    sys.excepthook = hook


def _removed_credential(exc: BaseException, keep: tuple[str, ...]) -> str | None:
    """The credential a ``KeyError`` asked the environment for, which the box removed."""
    from codeferry._sandbox.policy import is_credential

    current: BaseException | None = exc
    for _ in range(16):
        if current is None:
            return None
        if isinstance(current, KeyError) and current.args and isinstance(current.args[0], str) \
                and is_credential(current.args[0], keep):
            return current.args[0]
        current = current.__cause__ or current.__context__
    return None


def _denied(exc: BaseException, codes: tuple[int, ...] = (errno.EACCES, errno.EPERM)
            ) -> OSError | None:
    current: BaseException | None = exc
    for _ in range(16):
        if current is None:
            return None
        if isinstance(current, OSError) and current.errno in codes:
            return current
        current = current.__cause__ or current.__context__
    return None


def _private_network() -> bool:
    """Whether this process's network is a box's own (``_sandbox.netns``): netlink answers
    and lists the loopback alone (the box's other shape refuses netlink sockets)."""
    try:
        return [name for _, name in socket.if_nameindex()] == ["lo"]
    except OSError:
        return False


def _unreached(exc: BaseException) -> OSError | None:
    """A connect to the loopback that nothing answered, in a private network: the host's
    ports are outside it, so the box, not the host, kept the code from them. Elsewhere a
    refused connect is the host's ordinary answer, not the box's."""
    refused = _denied(exc, (errno.ECONNREFUSED,))
    operation, target = last(False)
    if refused is None or operation != "connect" or not target.startswith(("('127.", "('::1'")):
        return None
    return refused if _private_network() else None


def refusal(exc: BaseException, *, keep: tuple[str, ...] = ()) -> BaseException:
    """In a boxed process: ``exc`` as a ``SandboxRefusedError`` naming the operation and
    target when it (or its cause) is an access the box refused, or a credential it removed
    (``keep``: those it kept); else ``exc`` itself. codeferry's own store errors keep their
    type: faults of the machine, not the code's doing."""
    from codeferry.errors import (
        SandboxRefusedError,
        StoreCorruptError,
        StorePermissionError,
        StoreUnavailableError,
    )

    if isinstance(exc, (SandboxRefusedError, StoreUnavailableError, StorePermissionError,
                        StoreCorruptError)):
        return exc
    removed = _removed_credential(exc, keep)
    if removed is not None:
        error = SandboxRefusedError(
            f"the sandbox removed the credential {removed} from the environment (the code "
            f"raised {type(exc).__name__}: {exc})", operation="environ", target=removed,
            fix=f"set CODEFERRY_SANDBOX_KEEP={removed} if this code must have it.")
        error.__cause__ = exc
        return error
    denied = _denied(exc)
    unreached = _unreached(exc) if denied is None else None
    if unreached is not None:
        operation, target = last(False, forget=True)
        error = SandboxRefusedError(
            f"the sandbox's private network kept the code from connect {target}: the host's "
            f"loopback is outside it, and nothing in the box listens there (the code raised "
            f"{type(exc).__name__}: {exc})", operation="connect", target=target,
            fix="a distributed launcher's ranks reach only each other; run without the box "
            "only if you trust this code.")
        error.__cause__ = exc
        return error
    if denied is None:
        return exc
    # told once: a later refusal is not named by this record
    operation, target = last(None if denied.filename else denied.errno == errno.EPERM,
                             forget=True)
    if denied.filename is None and (denied.errno == errno.EPERM) != (operation == "kill"):
        operation, target = "", ""  # Landlock and the filter answer EACCES, signals EPERM
    if denied.filename is not None:
        operation = "exec" if operation == "exec" and str(denied.filename) in target else "open"
        target = str(denied.filename)
    fix = ("the code tried what the box does not allow; if it must, allow it "
           "(CODEFERRY_SANDBOX_READ, _WRITE, _PORTS, _KEEP), or run without the box only if you "
           "trust this code.")
    if target.startswith((f"/proc/{os.getpid()}/", "/proc/self/", "/proc/thread-self/")):
        fix = ("a process started inside the box cannot read its own /proc files (the box's "
               "rules name files that existed when it was made); box codeferry's workers "
               "instead (Executor(sandbox=True), run --sandbox: each enters the box itself; "
               "the vLLM engine runs in one), or run without the box only if you trust this "
               "code.")
    error = SandboxRefusedError(
        f"the sandbox refused {operation or 'an access'} {target}: {denied.strerror or denied}"
        f" (the code raised {type(exc).__name__}: {exc})",
        operation=operation, target=target, path=target if denied.filename else None, fix=fix)
    error.__cause__ = exc
    return error
