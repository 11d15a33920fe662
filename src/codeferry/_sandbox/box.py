"""Entering the box: the policy enforced by the kernel on this process and all it starts,
and a refused access named when it surfaces as the model's own ``PermissionError``.

``enter`` fails closed: a kernel without Landlock (or below the ABI the box needs), an
architecture without a socket filter, a thread already running beside the caller (Landlock
before ABI 8 restricts only the calling thread and those it starts) or any call that fails
raises ``SandboxUnavailableError`` before any model code runs, and the process that raised
runs none after (a worker reports it and ends).

Refusals are the kernel's (``EACCES``/``EPERM``); which operation and target the model tried
is read from the error where it names a file, else from the last operation of its kind
announced through Python's audit events (``sys.addaudithook``): bookkeeping only, the
kernel decides.
"""

from __future__ import annotations

import atexit
import glob
import os
import platform
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from .. import _settings
from ..errors import SandboxUnavailableError
from . import landlock, netns, report, seccomp
from .policy import Policy, Request, build_policy, is_credential, scrubbed

__all__ = ["NEEDED_ABI", "active", "check_available", "enter", "enter_for_command",
           "enter_policy", "is_launcher", "policy_for", "refusal", "request_from_settings"]

#: Landlock ABI 6: filesystem rights, TCP bind/connect (4), signal and abstract-socket scopes.
NEEDED_ABI = 6
_READ = ("read_file", "read_dir")
_WRITE = tuple(n for n in landlock.FS if n != "execute")
_FIX = ("run on Linux 6.12 or later with Landlock enabled (`lsm=...,landlock` on the kernel "
        "command line; `cat /sys/kernel/security/lsm` lists it), or run without the box "
        "(no --sandbox, CODEFERRY_SANDBOX unset) if you trust this code.")
_entered: list[Policy] = []
#: What a process with gloo groups reads besides (a private network's ranks, vLLM's engine):
#: the files that resolve ``localhost`` (torchrun's rendezvous), the PCI devices' facts gloo
#: scans for the interface it binds.
_RANK_READS = ("/etc/hosts", "/etc/host.conf", "/etc/gai.conf", "/sys/bus/pci/devices",
               "/sys/devices/pci*")


def active() -> Policy | None:
    """The policy this process entered, if any."""
    return _entered[0] if _entered else None


def _unavailable(reason: str, abi: int) -> SandboxUnavailableError:
    kernel = platform.release()
    return SandboxUnavailableError(
        f"the sandbox cannot be built here: {reason} (kernel {kernel}, Landlock ABI {abi}, "
        f"the box needs ABI {NEEDED_ABI}); nothing ran.", kernel=kernel, abi=abi,
        needed=NEEDED_ABI, reason=reason, fix=_FIX)


def check_available() -> int:
    """The kernel's Landlock ABI, or ``SandboxUnavailableError`` saying what is missing."""
    if not _settings.sandbox_landlock():
        raise _unavailable("Landlock is switched off (CODEFERRY_SANDBOX_LANDLOCK=0 acts as a "
                           "kernel without it)", 0)
    try:
        abi = landlock.abi_version()
    except OSError as exc:
        raise _unavailable(f"probing Landlock failed: {exc}", 0) from None
    if abi == 0:
        raise _unavailable("the kernel has no Landlock (not built in, or not enabled at boot)", 0)
    if abi < NEEDED_ABI:
        raise _unavailable("the kernel's Landlock is too old for network and signal rules", abi)
    if not seccomp.supported():
        raise _unavailable(f"no socket filter for the {platform.machine()} architecture", abi)
    return abi


def request_from_settings(*, groups: bool = False, **more: Iterable[Any]) -> Request:
    """The ``Request`` the ``CODEFERRY_SANDBOX_*`` settings make, plus ``more`` of each
    (and ``groups``: ``Request.groups``)."""
    def ports(values: Iterable[str]) -> tuple[int, ...]:
        try:
            return tuple(int(v) for v in values)
        except ValueError:
            raise _unavailable(f"CODEFERRY_SANDBOX_PORTS is not a list of numbers: "
                               f"{','.join(values)}", 0) from None
    return Request(read=(*_settings.sandbox_list("READ"), *more.get("read", ())),
                   write=(*_settings.sandbox_list("WRITE"), *more.get("write", ())),
                   ports=(*ports(_settings.sandbox_list("PORTS")), *more.get("ports", ())),
                   keep=(*_settings.sandbox_list("KEEP"), *more.get("keep", ())),
                   execute=tuple(more.get("execute", ())), groups=groups)


def policy_for(request: Request, model_paths: Iterable[str], scratch: str | None = None) -> Policy:
    """The policy of a process that runs the code in ``model_paths``: codeferry's store and
    the hub cache entries of those models read too, a fresh private scratch folder."""
    paths = [os.path.realpath(p) for p in model_paths]
    hub = os.path.realpath(_settings.hub_cache())
    entries = []
    for path in paths:  # a snapshot's files are links into the repo's blobs/
        if path.startswith(hub + os.sep):
            entries.append(os.path.join(hub, path[len(hub) + 1:].split(os.sep)[0]))
    _sweep()
    scratch = scratch or tempfile.mkdtemp(prefix=f"codeferry-box-{os.getpid()}-")
    store = _settings.codeferry_home()  # made now (private, as the store makes it): a rule
    store.mkdir(mode=0o700, parents=True, exist_ok=True)  # names only what exists
    policy = build_policy(request, model_paths=[*paths, *entries], scratch=scratch,
                          home=os.path.expanduser("~"), stores=[str(store)])
    return replace(policy, read=(*policy.read, *_rank_reads())) if request.groups else policy


def _rank_reads() -> tuple[str, ...]:
    """``_RANK_READS`` as they exist here (gloo opens the PCI folders whatever they hold)."""
    return tuple(p for pattern in _RANK_READS for p in sorted(glob.glob(pattern)))


def _sweep() -> None:
    """Remove the scratch folders of boxed processes that are gone (a command that ``exec``
    replaced runs no ``atexit`` of codeferry's): this user's own, named by their pid."""
    root = tempfile.gettempdir()
    with os.scandir(root) as entries:
        for entry in entries:
            parts = entry.name.split("-")
            if not entry.name.startswith("codeferry-box-") or len(parts) < 4 \
                    or not parts[2].isdigit():
                continue
            try:
                if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                    continue
                os.kill(int(parts[2]), 0)
            except ProcessLookupError:
                shutil.rmtree(entry.path, ignore_errors=True)
            except OSError:
                continue


def enter_policy(policy: Policy) -> None:
    """Enforce ``policy`` on this process and everything it starts, for good."""
    abi = check_available()
    if threading.active_count() > 1:
        raise _unavailable(f"{threading.active_count() - 1} thread(s) already run beside this "
                           "one and would stay outside the box", abi)
    if policy.private_network:
        _private_network(abi)
    everything = landlock.fs_rights(tuple(landlock.FS), abi)
    net = 0 if policy.private_network else landlock.NET_BIND_TCP | landlock.NET_CONNECT_TCP
    try:
        ruleset = landlock.Ruleset(abi, everything, net,
                                   landlock.SCOPE_ABSTRACT_UNIX | landlock.SCOPE_SIGNAL)
        for path in policy.read:
            ruleset.allow_path(path, landlock.fs_rights(_READ, abi))
        for path in (*policy.write, *policy.devices):
            if os.path.exists(path):
                ruleset.allow_path(path, landlock.fs_rights(_WRITE, abi))
        for path in policy.execute:
            ruleset.allow_path(path, landlock.fs_rights(("execute", "read_file"), abi))
        for port in policy.ports:
            ruleset.allow_port(port, landlock.NET_BIND_TCP | landlock.NET_CONNECT_TCP)
        if policy.groups and not policy.private_network:  # port 0: one the kernel picks
            ruleset.allow_port(0, landlock.NET_BIND_TCP)
        landlock.no_new_privs()
        seccomp.install_socket_filter(netlink=policy.private_network or policy.groups)
        ruleset.restrict_self()
    except OSError as exc:
        raise _unavailable(f"building the box failed: {exc}", abi) from None
    _settings.scrub_environment({n for n in _settings.environment_with({})
                                 if is_credential(n, policy.keep)})
    _settings.set_temp_dir(policy.scratch)
    tempfile.tempdir = policy.scratch
    atexit.register(shutil.rmtree, policy.scratch, True)
    _entered.append(policy)
    sys.addaudithook(report.audit)


def _private_network(abi: int) -> None:
    """Move this process into a network of its own (``netns.enter``), or fail closed."""
    try:
        netns.enter()
    except OSError as exc:
        kernel = platform.release()
        raise SandboxUnavailableError(
            f"the sandbox cannot give the command a private network: {exc} (kernel {kernel}: "
            "unprivileged user namespaces refused); nothing ran.", kernel=kernel, abi=abi,
            needed=NEEDED_ABI, reason=f"no user and network namespace: {exc}",
            fix="allow unprivileged user namespaces (sysctl user.max_user_namespaces above 0; "
            "kernel.unprivileged_userns_clone=1 and kernel.apparmor_restrict_unprivileged_userns"
            "=0 where they exist), or run without the box only if you trust this code.") \
            from None


def enter(request: Request, model_paths: Iterable[str]) -> Policy:
    """Build this process's policy and enforce it (``enter_policy``)."""
    check_available()  # before a scratch folder is made for nothing
    policy = policy_for(request, model_paths)
    enter_policy(policy)
    return policy


def refusal(exc: BaseException) -> BaseException:
    """``exc`` as a ``SandboxRefusedError`` naming what the box refused, when this process
    entered the box (``report.refusal``); else ``exc`` itself."""
    return report.refusal(exc, keep=_entered[0].keep) if _entered else exc


def enter_for_command(command: list[str], environment: dict[str, str], *,
                      groups: bool = False) -> dict[str, str]:
    """Box this process for ``codeferry exec --sandbox``: ``command`` replaces it next, so
    its every process (the user's own code included) is boxed. Readable besides the
    environment: the current folder (unless it would open the home) and the hub cache;
    the command's program may be started (and the interpreter, for the processes it
    starts), nothing else; ``groups``: ``Request.groups`` (vLLM's engine in the command).
    ``environment`` comes back without credentials, ``TMPDIR`` set."""
    check_available()
    found = shutil.which(command[0], path=environment.get("PATH")) or command[0]
    if not os.path.exists(found):
        return environment  # the caller's execvpe reports the missing command
    request = request_from_settings(execute=[found], groups=groups)
    policy = policy_for(request, [os.getcwd(), str(_settings.hub_cache())])
    shebang = _shebang(found)
    if shebang is not None:  # a script: the kernel starts its interpreter
        policy = replace(policy, execute=(*policy.execute, shebang))
    if is_launcher(command):
        policy = replace(policy, private_network=True, ports=(),
                         read=(*policy.read, *_rank_reads()))
    enter_policy(policy)
    # CODEFERRY_SANDBOX: the boot tells refusals (``report.watch``); executors box workers.
    return {**scrubbed(environment, policy.keep), "TMPDIR": policy.scratch,
            "CODEFERRY_SANDBOX": "1"}


def is_launcher(command: list[str]) -> bool:
    """Whether ``command`` is torch's distributed launcher (``torchrun``, ``python -m
    torch.distributed.run`` or ``.launch``): its ranks meet on ports the kernel picks, so its
    box gets a private network (``netns``) rather than port rules."""
    if os.path.basename(command[0]) == "torchrun":
        return True
    for index, word in enumerate(command[1:-1], 1):
        if word == "-m":
            return command[index + 1] in ("torch.distributed.run", "torch.distributed.launch")
        if not word.startswith("-"):
            return False
    return False


def _shebang(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            first = f.readline(256)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    words = first[2:].decode(errors="replace").split()
    return os.path.realpath(words[0]) if words else None
