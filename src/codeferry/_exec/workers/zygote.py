"""Warm start: a spawned process with the heavy modules imported, that forks workers.

Starting N spawn workers imports torch and transformers N times, seconds each on a
small machine. A *zygote* pays that once: it is a spawned (clean) process that imports
``torch``, ``transformers`` and codeferry's worker module, and then does nothing but
fork on request. Each forked worker connects back to the executor over a Unix socket
(authenticated with a random key) and from there is an ordinary worker.

Why it stays correct for remote code: the zygote never loads a model or remote code,
so a worker inherits nothing about the model. It runs ``codeferry.load`` itself,
verifying the bytes against the digest in its own process, exactly like a spawned
worker (vLLM's forkserver preload makes the same trade). Why not multiprocessing's own
forkserver with ``set_forkserver_preload``: that server is one per process, shared with
every other user of the "forkserver" start method, and its preload list is fixed once
it has started.

The zygote watches its parent and exits with it; workers watch the zygote (their
parent) and exit with it, so a killed executor process leaves nothing behind.

A model whose code needs another transformers release than the installed one gets a zygote of
its own, started as a plain interpreter with the release's folder first on its path
(``release``): a spawned process would take this process's path and import its ``__main__``,
whose imports may be transformers, before anything could change it.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import multiprocessing as mp
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

from .release import hide_conflicts
from .stdout import route_stdout
from .worker import WorkerSpec, worker_main

__all__ = ["Zygote", "shared_zygote"]

PRELOAD = (
    "torch",
    "transformers",
    "transformers.modeling_utils",
    "transformers.generation.utils",
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto",
    "transformers.tokenization_python",
    "transformers.modeling_outputs",
    "codeferry._exec.workers.worker",
    "codeferry._load",
)


def _warm(preload: Sequence[str]) -> None:
    """Import, and fill library caches that do not depend on any model."""
    for name in preload:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            # a module another transformers release does not have (tokenization_python: 5.x)
    # A cache we could not fill here is filled later, in the worker that needs it.
    with contextlib.suppress(Exception):
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping

        from ..._code.requirements import _module_names

        get_checkpoint_conversion_mapping("llama")  # type: ignore[no-untyped-call]
        _module_names("transformers")


def _zygote_main(conn: Connection, preload: Sequence[str], parent_pid: int) -> None:
    route_stdout("codeferry zygote")  # its stdout is its parent's: maybe `run`'s output
    _warm(preload)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps our children
    conn.send(("ready", os.getpid()))
    while True:
        if not conn.poll(0.2):
            if os.getppid() != parent_pid:
                return  # the executor's process is gone
            continue
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        if request[0] == "stop":
            return
        if request[0] == "remote-modules":  # for tests: the zygote must hold no model code
            import sys

            names = sorted(n for n in sys.modules
                           if n.startswith(("codeferry._dyn.", "transformers_modules")))
            conn.send(("remote-modules", names))
            continue
        _, spec, address, authkey, slot = request
        pid = os.fork()
        if pid == 0:  # the worker
            try:
                conn.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                worker_conn = Client(address, family="AF_UNIX", authkey=authkey)
                worker_main(spec, worker_conn, os.getppid(), slot=slot)
            finally:
                os._exit(0)
        conn.send(("forked", pid))


def _serve(settings: str) -> None:
    """A release zygote's entry (``_BOOT``), its path already set: the user's packages that
    conflict with the release hidden, then the zygote's own work."""
    given = json.loads(settings)
    hide_conflicts(sys.path[0])
    _zygote_main(Connection(given["fd"]), given["preload"], given["parent"])


#: What a release zygote runs: the release first on the path, then this process's path (the
#: code of the tests or the script that pickled the worker's spec), then its own.
_BOOT = ("import json, sys; paths = json.loads(sys.argv[1]); "
         "sys.path[:] = paths + [p for p in sys.path if p not in paths]; "
         "from codeferry._exec.workers.zygote import _serve; _serve(sys.argv[2])")


class _Popen:
    """The parts of ``multiprocessing.Process`` the zygote's owner uses, for a subprocess."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self._popen = popen
        self.pid = popen.pid

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout)

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self._popen.kill()


class ForkedProcess:
    """The parts of ``multiprocessing.Process`` the executor uses, for a zygote's child.

    The executor is not its parent, so there is no exit code to wait for; death is seen
    on the worker's connection, which closes when the process dies.
    """

    def __init__(self, pid: int, conn: Connection) -> None:
        self.pid = pid
        self.sentinel: Any = conn
        self.exitcode: int | None = None

    def is_alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        try:
            with open(f"/proc/{self.pid}/stat") as handle:
                return handle.read().split()[2] != "Z"
        except OSError:
            return True

    def join(self, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        while self.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Zygote:
    """One warm process that forks executor workers on request."""

    def __init__(self, preload: Sequence[str] = PRELOAD, release: str | None = None) -> None:
        """``release``: the folder of a release environment (``release.ensure``) the zygote,
        and so every worker it forks, imports transformers from."""
        self._lock = threading.Lock()
        self._dir = tempfile.mkdtemp(prefix="codeferry-zygote-")
        self._address = os.path.join(self._dir, "workers.sock")
        self._authkey = secrets.token_bytes(32)
        self._listener = Listener(self._address, family="AF_UNIX", authkey=self._authkey)
        self.process: Any
        if release is None:
            ctx: Any = mp.get_context("spawn")
            self._conn, child = ctx.Pipe()
            self.process = ctx.Process(target=_zygote_main,
                                       args=(child, tuple(preload), os.getpid()),
                                       name="codeferry-zygote", daemon=True)
            self.process.start()
            child.close()
        else:
            self._conn = self._start_in(release, preload)
        try:
            message = self._conn.recv()
        except (EOFError, OSError):
            message = ("exited at start", release and f"with transformers from {release}")
        if message[0] != "ready":
            raise RuntimeError(f"the codeferry zygote failed to start: {message!r}")

    def _start_in(self, release: str, preload: Sequence[str]) -> Connection:
        """Start the zygote as an interpreter of its own with ``release`` first on its path;
        its connection back is one end of a socket pair only the two processes hold."""
        ours, theirs = socket.socketpair()
        with ours, theirs:
            paths = [release, *(p for p in sys.path if p and p != release)]
            settings = {"fd": theirs.fileno(), "parent": os.getpid(), "preload": list(preload)}
            popen = subprocess.Popen(
                [sys.executable, "-c", _BOOT, json.dumps(paths), json.dumps(settings)],
                pass_fds=(theirs.fileno(),))
            self.process = _Popen(popen)
            return Connection(ours.detach())  # EOF at start: the zygote died (its stderr)

    def fork(self, spec: WorkerSpec, slot: int | None = None) -> tuple[ForkedProcess, Connection]:
        """A new worker forked from the zygote, and the executor's end of its connection;
        ``slot`` names the worker's stdout lines."""
        with self._lock:
            self._conn.send(("fork", spec, self._address, self._authkey, slot))
            conn = self._listener.accept()
            _, pid = self._conn.recv()
        return ForkedProcess(pid, conn), conn

    def remote_modules(self) -> list[str]:
        """Remote-code modules loaded in the zygote itself: always none."""
        with self._lock:
            self._conn.send(("remote-modules",))
            names: list[str] = self._conn.recv()[1]
        return names

    @property
    def alive(self) -> bool:
        return bool(self.process.is_alive())

    def close(self) -> None:
        try:
            self._conn.send(("stop",))
        except (OSError, ValueError):
            pass
        self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
        self._listener.close()


_shared: dict[str | None, Zygote] = {}
_shared_lock = threading.Lock()


def shared_zygote(release: str | None = None) -> Zygote:
    """This process's zygote (for a release environment's folder: that release's), started on
    first use."""
    with _shared_lock:
        zygote = _shared.get(release)
        if zygote is None or not zygote.alive:
            zygote = _shared[release] = Zygote(release=release)
        return zygote
