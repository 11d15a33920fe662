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
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
import os
import secrets
import signal
import tempfile
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

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
        importlib.import_module(name)
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

    def __init__(self, preload: Sequence[str] = PRELOAD) -> None:
        ctx: Any = mp.get_context("spawn")
        self._lock = threading.Lock()
        self._dir = tempfile.mkdtemp(prefix="codeferry-zygote-")
        self._address = os.path.join(self._dir, "workers.sock")
        self._authkey = secrets.token_bytes(32)
        self._listener = Listener(self._address, family="AF_UNIX", authkey=self._authkey)
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_zygote_main, args=(child, tuple(preload), os.getpid()),
                                   name="codeferry-zygote", daemon=True)
        self.process.start()
        child.close()
        message = self._conn.recv()
        if message[0] != "ready":
            raise RuntimeError(f"the codeferry zygote failed to start: {message!r}")

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


_shared: Zygote | None = None
_shared_lock = threading.Lock()


def shared_zygote() -> Zygote:
    """This process's zygote, started on first use."""
    global _shared
    with _shared_lock:
        if _shared is None or not _shared.alive:
            _shared = Zygote()
        return _shared
