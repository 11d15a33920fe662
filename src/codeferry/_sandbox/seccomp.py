"""The part of the box Landlock cannot draw: socket families and types, by a seccomp filter.

Landlock refuses TCP ``bind``/``connect`` by port; UDP, raw, netlink and packet sockets it
does not see. This filter lets ``socket()`` make only Unix sockets (pipes between codeferry's
processes; abstract ones are scoped by Landlock) and TCP ones (which Landlock then holds), and
answers every other ``socket()`` with ``EACCES``; in a private network (``netns``) also
``NETLINK_ROUTE`` ones, how ranks find the loopback (read only: no capability is left to
change it). ``io_uring_setup`` is refused too: its ring
makes sockets without a ``socket()`` call. A 32-bit or x32 system call answers ``EACCES``
whatever it is, since its numbers differ.

A classic BPF program (``struct sock_filter``) assembled here; ``seccomp(2)`` with
``SECCOMP_FILTER_FLAG_TSYNC`` puts it on every thread of the process, and children inherit it.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform

__all__ = ["install_socket_filter", "supported"]

#: machine -> (AUDIT_ARCH_*, socket, io_uring_setup, number above which calls are refused)
_ARCH = {
    "x86_64": (0xC000003E, 41, 425, 0x40000000),  # x32 calls carry bit 30
    "aarch64": (0xC00000B7, 198, 425, None),
}
_SECCOMP_SET_MODE_FILTER, _SECCOMP_FILTER_FLAG_TSYNC = 1, 1
_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000
_LD_W_ABS, _JEQ_K, _JGE_K, _AND_K, _RET_K = 0x20, 0x15, 0x35, 0x54, 0x06
_AF_UNIX, _AF_INET, _AF_INET6, _AF_NETLINK, _SOCK_STREAM, _IPPROTO_TCP = 1, 2, 10, 16, 1, 6
_NR, _ARCH_OFF, _ARG0, _ARG1, _ARG2 = 0, 4, 16, 24, 32  # struct seccomp_data, little endian


class _Filter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_Filter))]


def supported() -> bool:
    """Whether this machine's architecture has a filter here (x86-64, arm64)."""
    return platform.machine() in _ARCH


_Op = tuple[int, "str | int", "str | int", int]


def _program(netlink: bool = False) -> list[str | _Op]:
    """The filter: instructions ``(code, jump-if-true, jump-if-false, k)`` whose jumps name
    labels, and the labels (strings) where they land; ``netlink``: ``NETLINK_ROUTE`` too."""
    audit, socket_nr, uring_nr, high = _ARCH[platform.machine()]
    prog: list[str | _Op] = [
        (_LD_W_ABS, 0, 0, _ARCH_OFF), (_JEQ_K, 0, "deny", audit),
        (_LD_W_ABS, 0, 0, _NR),
    ]
    if high is not None:
        prog.append((_JGE_K, "deny", 0, high))
    prog += [
        (_JEQ_K, "socket", 0, socket_nr), (_JEQ_K, "deny", "allow", uring_nr),
        "socket",
        (_LD_W_ABS, 0, 0, _ARG0), (_JEQ_K, "allow", 0, _AF_UNIX), (_JEQ_K, "inet", 0, _AF_INET),
        (_JEQ_K, "inet", "netlink" if netlink else "deny", _AF_INET6),
    ]
    if netlink:
        prog += ["netlink", (_JEQ_K, 0, "deny", _AF_NETLINK),
                 (_LD_W_ABS, 0, 0, _ARG2), (_JEQ_K, "allow", "deny", 0)]  # NETLINK_ROUTE
    prog += [
        "inet",
        (_LD_W_ABS, 0, 0, _ARG1), (_AND_K, 0, 0, 0xF), (_JEQ_K, 0, "deny", _SOCK_STREAM),
        (_LD_W_ABS, 0, 0, _ARG2), (_JEQ_K, "allow", 0, 0), (_JEQ_K, "allow", "deny", _IPPROTO_TCP),
        "deny", (_RET_K, 0, 0, _RET_ERRNO | errno.EACCES),
        "allow", (_RET_K, 0, 0, _RET_ALLOW),
    ]
    return prog


def _jump(target: str | int, labels: dict[str, int], index: int) -> int:
    return labels[target] - index - 1 if isinstance(target, str) else target


def _assemble(netlink: bool = False) -> list[tuple[int, int, int, int]]:
    """The program with its labels resolved to relative jumps."""
    labels: dict[str, int] = {}
    code: list[_Op] = []
    for item in _program(netlink):
        if isinstance(item, str):
            labels[item] = len(code)
        else:
            code.append(item)
    return [(op, _jump(jt, labels, i), _jump(jf, labels, i), k)
            for i, (op, jt, jf, k) in enumerate(code)]


def install_socket_filter(*, netlink: bool = False) -> None:
    """Put the filter on every thread of this process (``no_new_privs`` must be set);
    ``netlink``: ``NETLINK_ROUTE`` sockets too (a private network's)."""
    code = _assemble(netlink)
    filters = (_Filter * len(code))(*[_Filter(*op) for op in code])
    prog = _Prog(len(code), filters)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    number = {"x86_64": 317, "aarch64": 277}[platform.machine()]
    if libc.syscall(ctypes.c_long(number), ctypes.c_uint(_SECCOMP_SET_MODE_FILTER),
                    ctypes.c_uint(_SECCOMP_FILTER_FLAG_TSYNC), ctypes.byref(prog)) != 0:
        code_ = ctypes.get_errno()
        raise OSError(code_, f"seccomp(SECCOMP_SET_MODE_FILTER): {os.strerror(code_)}")
