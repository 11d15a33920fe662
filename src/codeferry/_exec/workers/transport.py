"""How the scheduler reaches its workers: a transport per kind of worker.

A transport starts workers and hands back a ``Channel`` per worker: ``send`` a request,
``kill``, ``stop``. Everything a worker says, and its death, comes back as an ``Event``
posted to the scheduler's one queue, from a reader thread the channel owns: the
scheduler never blocks on a worker, so any number of callers can wait on it at once.

Events, in the order a worker produces them::

    ready  (info)                      the handshake: loaded, verified, built
    failed (error)                     it could not start; the error is typed
    reply  (request, ok, value|error)  one per request sent
    died   (description)               the process, actor or node is gone

``failed`` and ``died`` each end a channel: nothing follows either. A worker that failed
is ended by its channel (a local process reaped, or killed if it lingers; a Ray actor killed,
so that its CPUs are free for the next try), and that end is not news (the scheduler would
count it as a second failure, and start again a worker it had just given up on).

This module has the local transport (``spawn``/``forkserver``/``fork`` processes, or
forks of the warm zygote); ``ray_backend`` has the Ray one. Both speak the worker protocol
of ``worker``, so the scheduler is the same for both.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Literal, Protocol

from .worker import STOP, WorkerSpec, pack, remote_error, unpack_reply, worker_main

__all__ = ["Channel", "Event", "LocalTransport", "Post", "Transport"]

EventKind = Literal["ready", "failed", "reply", "died"]


@dataclass(frozen=True)
class Event:
    channel: Channel
    kind: EventKind
    body: Any = None


Post = Callable[[Event], None]


class Channel(Protocol):
    """One worker, as the scheduler sees it."""

    slot: int

    @property
    def pid(self) -> int | None: ...

    @property
    def where(self) -> str:
        """Where it runs, for messages: ``pid 123``, ``actor ... on node ...``."""
        ...

    def send(self, request: int, payload: bytes) -> None:
        """Queue one request (a packed ``Work``); a dead worker's ``died`` event follows instead of a reply."""
        ...

    def kill(self) -> None:
        """End it now (SIGKILL, ``ray.kill``); its ``died`` event follows."""
        ...

    def stop(self, timeout: float) -> None:
        """Ask it to stop, wait up to ``timeout``, then kill it. Posts nothing more."""
        ...


class Transport(Protocol):
    name: str
    #: Requests sent ahead to each worker (the one it runs, and the next ones): the next
    #: one is already there when the current one finishes, so the round trip hides
    #: behind compute.
    depth: int

    def pack(self, payload: Any) -> bytes:
        """A request's payload as this kind of worker unpickles it."""
        ...

    def start(self, slot: int, spec: WorkerSpec, post: Post) -> Channel:
        """Start a worker; returns at once, its handshake arrives as an event."""
        ...

    def close(self) -> None: ...


class LocalTransport:
    """Worker processes on this machine: started with ``start_method``, or forked warm."""

    name = "local"
    depth = 2
    #: Another process on this machine: tickets carry digests, the store has the bytes.
    pack = staticmethod(pack)

    def __init__(self, start_method: str = "spawn", *, warm: bool = False) -> None:
        self.warm = warm
        self._ctx: Any = mp.get_context(start_method)
        # Workers exit when this pipe reads EOF: when this process is gone (_watch_parent).
        self._lifeline, self._lifeline_end = self._ctx.Pipe(duplex=False)

    def start(self, slot: int, spec: WorkerSpec, post: Post) -> Channel:
        if self.warm or spec.engine.release:  # a release's workers: forks of its own zygote
            from .release import folder
            from .zygote import shared_zygote

            release = spec.engine.release
            forked, conn = shared_zygote(release and str(folder(release))).fork(spec, slot)
            return _LocalChannel(slot, forked, conn, post)
        parent_end, child_end = self._ctx.Pipe()
        inherited = self._lifeline_end if self._ctx.get_start_method() == "fork" else None
        proc = self._ctx.Process(
            target=worker_main,
            args=(spec, child_end, os.getpid(), self._lifeline, inherited, slot),
            name=f"codeferry-worker-{slot}", daemon=True,
        )
        proc.start()
        child_end.close()
        return _LocalChannel(slot, proc, parent_end, post)

    def close(self) -> None:
        self._lifeline_end.close()
        self._lifeline.close()


class _LocalChannel:
    def __init__(self, slot: int, process: Any, conn: Connection, post: Post) -> None:
        self.slot = slot
        self.process = process
        self.conn = conn
        self._pid: int | None = None
        self._post = post
        self._closing = False
        self._send_lock = threading.Lock()
        threading.Thread(target=self._read, name=f"codeferry-reader-{slot}", daemon=True).start()

    @property
    def pid(self) -> int | None:
        return self._pid or self.process.pid

    @property
    def where(self) -> str:
        return f"pid {self.pid}"

    def _read(self) -> None:
        # A zygote's child has no sentinel of its own: its pipe closes when it dies.
        sentinel = self.process.sentinel
        waitables = [self.conn] if sentinel is self.conn else [self.conn, sentinel]
        while not self._closing:
            try:
                wait(waitables)
                message = self.conn.recv() if self.conn.poll(0) else None
            except (EOFError, OSError, ValueError):
                message = None
            if self._closing:
                return
            if message is None:
                self.process.join(1)
                code = getattr(self.process, "exitcode", None)
                how = "died" if code is None else f"died with exit code {code}"
                self._post(Event(self, "died", how))
                return
            tag = message[0]
            if tag == "ready":
                self._pid = message[1]
                self._post(Event(self, "ready", message[2]))
            elif tag == "failed":
                self._post(Event(self, "failed", remote_error(message[2], self.slot)))
                self._reap(5.0)
                return
            else:
                request, status, body = message
                self._post(Event(self, "reply", (request, *unpack_reply(status, body, self.slot))))

    def _reap(self, timeout: float) -> None:
        """Wait ``timeout`` seconds for the worker to exit, then kill it: one that sent
        ``failed`` or was told to stop is on its way out, but a thread of the model's that is
        not a daemon would hold its exit for ever."""
        self.process.join(timeout)
        if self.process.is_alive():
            self.kill()
            self.process.join(5)

    def send(self, request: int, payload: bytes) -> None:
        with self._send_lock, contextlib.suppress(OSError, ValueError):
            self.conn.send((request, payload))  # a dead worker: its sentinel says so

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.process.kill()

    def stop(self, timeout: float) -> None:
        self._closing = True
        self.send(-1, STOP)
        self._reap(timeout)
        with contextlib.suppress(OSError):
            self.conn.close()
