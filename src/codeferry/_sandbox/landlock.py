"""Landlock, through its three system calls and ``prctl``: a small ``ctypes`` layer.

Why not a library: PyPI's ``landlock`` (1.0.0.dev5, pure Python) knows filesystem rights
only (no TCP ports, no scopes); ``sandlock`` (0.9.0) is a 13 MB native library that starts
the boxed program itself, while codeferry must restrict a process that is already running
(a worker after its imports). Three calls and four structures are less to trust than
either; ``tests/sandbox/test_landlock.py`` checks each one on the running kernel.

The kernel keeps a restriction for the life of the process and hands it to every child,
across ``fork`` and ``execve``; nothing here can loosen it, and nothing outside the calling
thread's process changes (no root, nothing global).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
from dataclasses import dataclass

__all__ = ["FS", "NET_BIND_TCP", "NET_CONNECT_TCP", "SCOPE_ABSTRACT_UNIX", "SCOPE_SIGNAL",
           "Ruleset", "abi_version", "fs_rights", "no_new_privs"]

_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF = 444, 445, 446  # every architecture alike
_VERSION = 1 << 0  # LANDLOCK_CREATE_RULESET_VERSION
_RULE_PATH_BENEATH, _RULE_NET_PORT = 1, 2
_PR_SET_NO_NEW_PRIVS = 38

#: Filesystem rights (``LANDLOCK_ACCESS_FS_*``), with the ABI each one came in.
FS = {
    "execute": (1 << 0, 1), "write_file": (1 << 1, 1), "read_file": (1 << 2, 1),
    "read_dir": (1 << 3, 1), "remove_dir": (1 << 4, 1), "remove_file": (1 << 5, 1),
    "make_char": (1 << 6, 1), "make_dir": (1 << 7, 1), "make_reg": (1 << 8, 1),
    "make_sock": (1 << 9, 1), "make_fifo": (1 << 10, 1), "make_block": (1 << 11, 1),
    "make_sym": (1 << 12, 1), "refer": (1 << 13, 2), "truncate": (1 << 14, 3),
    "ioctl_dev": (1 << 15, 5),
}
#: The rights a rule on a file (not a folder) may carry.
_FILE_ONLY = ("execute", "write_file", "read_file", "truncate", "ioctl_dev")
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1  # ABI 4
SCOPE_ABSTRACT_UNIX, SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1  # __attribute__((packed)) in the kernel's header: 12 bytes
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class _NetPort(ctypes.Structure):
    _fields_ = [("allowed_access", ctypes.c_uint64), ("port", ctypes.c_uint64)]


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    libc.prctl.restype = ctypes.c_int
    return libc


def _call(number: int, *args: object) -> int:
    result = _libc().syscall(ctypes.c_long(number), *args)
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return int(result)


def abi_version() -> int:
    """The kernel's Landlock ABI (``0``: none, or not on Linux), probed the documented way."""
    if platform.system() != "Linux":
        return 0
    try:
        return _call(_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_VERSION))
    except OSError as exc:
        if exc.errno in (errno.ENOSYS, errno.EOPNOTSUPP):
            return 0  # not built in, or built in and switched off at boot
        raise


def fs_rights(names: tuple[str, ...], abi: int) -> int:
    """The mask of the rights ``names`` that the kernel's ``abi`` knows."""
    return sum(FS[name][0] for name in names if FS[name][1] <= abi)


def no_new_privs() -> None:
    """``prctl(PR_SET_NO_NEW_PRIVS)``: what an unprivileged ``landlock_restrict_self`` and
    seccomp need; set-user-id programs then gain nothing."""
    libc = _libc()
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(code)}")


@dataclass
class Ruleset:
    """One Landlock ruleset: what it handles (refused unless a rule allows it), its rules."""

    abi: int
    handled_fs: int
    handled_net: int = 0
    scoped: int = 0
    fd: int = -1

    def __post_init__(self) -> None:
        attr = _RulesetAttr(self.handled_fs, self.handled_net, self.scoped)
        size = 24 if self.abi >= 6 else 16 if self.abi >= 4 else 8
        self.fd = _call(_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size),
                        ctypes.c_uint32(0))

    def allow_path(self, path: str, access: int) -> None:
        """Allow ``access`` on ``path`` and below; a file takes only file rights."""
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        try:
            if not os.path.isdir(path):
                access &= fs_rights(_FILE_ONLY, self.abi)
            rule = _PathBeneath(access & self.handled_fs, fd)
            _call(_ADD_RULE, ctypes.c_int(self.fd), ctypes.c_int(_RULE_PATH_BENEATH),
                  ctypes.byref(rule), ctypes.c_uint32(0))
        finally:
            os.close(fd)

    def allow_port(self, port: int, access: int) -> None:
        """Allow TCP ``access`` (bind, connect) on ``port``, any address."""
        rule = _NetPort(access, port)
        _call(_ADD_RULE, ctypes.c_int(self.fd), ctypes.c_int(_RULE_NET_PORT), ctypes.byref(rule),
              ctypes.c_uint32(0))

    def restrict_self(self) -> None:
        """Enforce the ruleset on this process (every thread is this process's too) and all
        it starts; the file descriptor is closed after."""
        try:
            _call(_RESTRICT_SELF, ctypes.c_int(self.fd), ctypes.c_uint32(0))
        finally:
            os.close(self.fd)
            self.fd = -1
