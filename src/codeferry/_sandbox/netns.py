"""A private network for a boxed command tree: a user and a network namespace of its own.

The ranks of a distributed launcher (``torchrun``) meet over TCP on ports the kernel picks
and look up interfaces through netlink, which the box's port rules cannot name in advance.
In a network namespace of their own they may: its only interface is a loopback nobody
outside the namespace shares, so the host's listening ports, its other interfaces and the
network beyond are out of reach whatever port or address the code names. Routes of type
``prohibit`` for every other destination make those connects fail with ``EACCES``, as the
box's other refusals do. The user namespace is what lets an unprivileged user make one; its
capabilities are dropped before the command runs.

Only the calling process (about to be replaced by the command) moves; the parent's
namespaces, routes and settings stay as they were.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct

__all__ = ["enter"]

_CLONE_NEWUSER, _CLONE_NEWNET = 0x10000000, 0x40000000
_SIOCSIFFLAGS, _IFF_UP, _IFF_LOOPBACK, _IFF_RUNNING = 0x8914, 0x1, 0x8, 0x40
_RTM_NEWROUTE, _NLM_F_REQUEST, _NLM_F_ACK, _NLM_F_CREATE = 24, 0x1, 0x4, 0x400
_NLMSG_ERROR, _RT_TABLE_MAIN, _RTPROT_BOOT, _RTN_PROHIBIT = 2, 254, 3, 8
_PR_CAPBSET_DROP, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 24, 47, 4
_CAPABILITY_VERSION_3 = 0x20080522


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _loopback_up() -> None:
    import fcntl  # Unix only: importing codeferry elsewhere must not need it

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH22x", b"lo", _IFF_UP | _IFF_LOOPBACK | _IFF_RUNNING)
        fcntl.ioctl(sock.fileno(), _SIOCSIFFLAGS, request)


def _prohibit_default(family: int) -> None:
    """``ip route add prohibit default``: a connect anywhere but the loopback gets EACCES."""
    route = struct.pack("BBBBBBBBI", family, 0, 0, 0, _RT_TABLE_MAIN, _RTPROT_BOOT, 0,
                        _RTN_PROHIBIT, 0)
    header = struct.pack("IHHII", 16 + len(route), _RTM_NEWROUTE,
                         _NLM_F_REQUEST | _NLM_F_ACK | _NLM_F_CREATE, 1, 0)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0) as sock:
        sock.bind((0, 0))
        sock.send(header + route)
        answer = sock.recv(4096)
    kind = struct.unpack_from("H", answer, 4)[0]
    code = -struct.unpack_from("i", answer, 16)[0] if kind == _NLMSG_ERROR else 0
    if code:
        raise OSError(code, f"adding a prohibit route (family {family}): {os.strerror(code)}")


def _drop_capabilities() -> None:
    """No capability in the new user namespace survives into the command (root's included:
    an empty bounding set leaves ``execve`` nothing to grant)."""
    libc = _libc()
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        _check(libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0), f"prctl(PR_CAPBSET_DROP, {cap})")
    _check(libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0),
           "prctl(PR_CAP_AMBIENT_CLEAR_ALL)")
    header = struct.pack("Ii", _CAPABILITY_VERSION_3, 0)
    data = bytes(24)  # two empty {effective, permitted, inheritable}
    _check(libc.capset(header, data), "capset")


def enter() -> None:
    """Move this process (single-threaded) into a new user and network namespace with only
    its loopback up, every other destination prohibited, and no capabilities; ``OSError``
    (``EPERM``, ``ENOSPC``, ``EINVAL``) where the kernel refuses unprivileged namespaces."""
    uid, gid = os.getuid(), os.getgid()
    _check(_libc().unshare(_CLONE_NEWUSER | _CLONE_NEWNET), "unshare(CLONE_NEWUSER|CLONE_NEWNET)")
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{uid} {uid} 1")
    _write("/proc/self/gid_map", f"{gid} {gid} 1")
    _loopback_up()
    _prohibit_default(socket.AF_INET)
    if socket.has_ipv6 and os.path.exists("/proc/net/if_inet6"):  # a kernel without IPv6
        _prohibit_default(socket.AF_INET6)
    _drop_capabilities()

