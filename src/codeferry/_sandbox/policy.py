"""What the box allows, as one value (``Policy``) built from what the process needs.

Pure: no system call restricts anything here (``_sandbox.box`` does). A process that runs
model code needs to read its Python environment (the interpreter's prefixes, every
``sys.path`` folder, the system's libraries), the model's own files (its folder, its hub
cache entry, codeferry's store), a few kernel files torch reads (``/proc/self``'s status
files, ``/sys`` CPU facts), and to write a private scratch folder and ``/dev/shm``. Nothing
else: no home directory, no credentials, no new programs but the interpreter itself (its
children are boxed too), no network.

A folder that would open the home directory whole (the home, ``/`` or any folder above the
home) is never granted from what the process found (``sys.path`` may hold the current
folder); only an explicit ``Request.read``/``write`` may name one.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["Policy", "Request", "build_policy", "is_credential", "scrubbed", "elf_interpreter",
           "system_reads", "python_reads", "device_writes"]

#: System folders every dynamically linked interpreter reads (libraries, zone data).
_SYSTEM = ("/usr", "/lib", "/lib64", "/lib32", "/usr/lib64", "/etc/ld.so.cache",
           "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/passwd", "/etc/group",
           "/etc/nsswitch.conf", "/etc/os-release", "/etc/mime.types")
#: Kernel facts torch, the OpenMP runtime and Python read; never ``/proc/self/environ``.
_PROC_SELF = ("status", "stat", "statm", "maps", "cgroup", "mountinfo", "limits", "fd",
              "auxv", "cmdline", "task", "smaps", "comm", "exe")
_KERNEL = ("/proc/cpuinfo", "/proc/meminfo", "/proc/stat", "/proc/sys/kernel/osrelease",
           "/proc/sys/vm/overcommit_memory", "/sys/devices/system/cpu",
           "/sys/devices/system/node", "/sys/fs/cgroup")
_DEVICES_READ = ("/dev/urandom", "/dev/random", "/dev/zero")
_DEVICES_WRITE = ("/dev/null", "/dev/shm")
_PREFIXES = ("AWS_", "GOOGLE_", "AZURE_", "GCP_", "GCLOUD_")
_PARTS = frozenset({"TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL",
                    "CREDENTIALS", "APIKEY", "TOKENS", "KEYS", "SECRETS"})
_NAMED = frozenset({"HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "NETRC"})


@dataclass(frozen=True)
class Request:
    """What the caller adds to the box (it travels pickled to each worker): folders to read
    or write, TCP ports to reach (a distributed init on loopback), credential variables to
    keep, programs (a compiler the engine needs) that may be started; ``groups``: the
    process makes torch.distributed groups of its own (vLLM's engine does, even alone)."""

    read: tuple[str, ...] = ()
    write: tuple[str, ...] = ()
    ports: tuple[int, ...] = ()
    keep: tuple[str, ...] = ()
    execute: tuple[str, ...] = ()
    groups: bool = False


@dataclass(frozen=True)
class Policy:
    """Every path and port the box allows, and which variables it removes;
    ``private_network``: a network namespace of its own instead of ``ports`` (``netns``);
    ``groups``: torch.distributed (gloo) groups in the process, whose every group listens on
    a port the kernel picks and looks its interface up (``NETLINK_ROUTE``), even one process
    alone; connecting stays refused but for ``ports``."""

    read: tuple[str, ...]
    write: tuple[str, ...]
    execute: tuple[str, ...]
    ports: tuple[int, ...]
    scratch: str
    keep: tuple[str, ...] = ()
    devices: tuple[str, ...] = field(default=_DEVICES_WRITE)
    private_network: bool = False
    groups: bool = False


def is_credential(name: str, keep: Iterable[str] = ()) -> bool:
    """Whether the variable ``name`` is named like a credential (and not kept)."""
    upper = name.upper()
    if name in keep:
        return False
    if upper in _NAMED or upper.startswith(_PREFIXES):
        return True
    parts = set(re.split(r"[^A-Z0-9]+", upper))
    return bool(parts & _PARTS) or any(w in upper for w in ("SECRET", "PASSWORD", "CREDENTIAL"))


def scrubbed(environment: Mapping[str, str], keep: Iterable[str] = ()) -> dict[str, str]:
    """``environment`` without its credentials (``is_credential``)."""
    kept = tuple(keep)
    return {k: v for k, v in environment.items() if not is_credential(k, kept)}


def elf_interpreter(executable: str) -> str | None:
    """The dynamic loader an ELF program names (``PT_INTERP``): ``execve`` of the program
    opens it for execution too, so the box must allow it."""
    try:
        with open(executable, "rb") as f:
            head = f.read(64)
            if head[:4] != b"\x7fELF" or head[4] != 2:  # 64-bit only
                return None
            order: Literal["little", "big"] = "little" if head[5] == 1 else "big"
            phoff = int.from_bytes(head[32:40], order)
            size, count = int.from_bytes(head[54:56], order), int.from_bytes(head[56:58], order)
            for index in range(count):
                f.seek(phoff + index * size)
                entry = f.read(size)
                if int.from_bytes(entry[0:4], order) == 3:  # PT_INTERP
                    offset = int.from_bytes(entry[8:16], order)
                    length = int.from_bytes(entry[32:40], order)
                    f.seek(offset)
                    return f.read(length).rstrip(b"\0").decode()
    except (OSError, ValueError, IndexError):
        return None
    return None


def system_reads(proc: str) -> tuple[str, ...]:
    """What every box lets its process read, whatever the machine: system libraries, the
    kernel facts torch reads (``proc``: the process's own ``/proc`` folder), harmless devices."""
    return (*_SYSTEM, *(f"{proc}/{name}" for name in _PROC_SELF), *_KERNEL, *_DEVICES_READ)


def python_reads() -> list[str]:
    """The Python environment a box lets its process read: the interpreter's prefixes and the
    library folders of ``sys.path`` (``_library_path``)."""
    prefixes = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    return [*prefixes, *_library_path(prefixes)]


def device_writes() -> tuple[str, ...]:
    """The devices every box lets its process write (and read): ``/dev/null``, ``/dev/shm``."""
    return _DEVICES_WRITE


def _opens_home(path: str, home: str) -> bool:
    """Whether granting ``path`` would grant the home directory (or all of ``/``)."""
    return path == "/" or home == path or home.startswith(path.rstrip("/") + "/")


def _existing(paths: Iterable[str], home: str, *, guard: bool = True) -> tuple[str, ...]:
    out: list[str] = []
    for path in paths:
        if not path:
            continue
        real = os.path.realpath(path)
        for candidate in {os.path.abspath(path), real}:
            if not os.path.exists(candidate) or (guard and _opens_home(candidate, home)):
                continue
            if candidate not in out:
                out.append(candidate)
    return tuple(out)


def _library_path(prefixes: list[str]) -> list[str]:
    """``sys.path`` without the user's own folders: the main script's folder and the current
    one (``""``) are left out unless inside the environment (a project folder may hold a
    ``.env``; what the process needed from there it imported before the box)."""
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    own = {os.path.realpath(os.path.dirname(main))} if main else set()
    own.add(os.path.realpath(os.getcwd()))
    inside = tuple(os.path.realpath(p).rstrip("/") + "/" for p in prefixes)
    return [p for p in sys.path if p and (os.path.realpath(p) not in own
                                          or (os.path.realpath(p) + "/").startswith(inside))]


def build_policy(request: Request, *, model_paths: Iterable[str], scratch: str, home: str,
                 stores: Iterable[str] = ()) -> Policy:
    """The box for a process that runs the code in ``model_paths`` (folders or files, read
    only), with codeferry's ``stores`` and its private ``scratch`` folder (read and write:
    the store is content-addressed and verified on every read, so what boxed code writes
    there is refused by every reader); ``home`` is the home directory, never granted whole."""
    home = os.path.realpath(home)
    system = system_reads(f"/proc/{os.getpid()}")
    read = _existing([*python_reads(), *model_paths, *system], home)
    read += _existing(request.read, home, guard=False)
    write = _existing([scratch, *stores], home) + _existing(request.write, home, guard=False)
    programs = [sys.executable, *request.execute]
    loaders = [elf_interpreter(os.path.realpath(p)) for p in programs]
    execute = _existing([*programs, *[p for p in loaders if p]], home)
    return Policy(read=read, write=write, execute=execute, ports=tuple(request.ports),
                  scratch=scratch, keep=tuple(request.keep), groups=request.groups)
