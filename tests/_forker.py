"""A new process per case, without a new interpreter per case.

Some cases need a process of their own (a lock binds a process for good; a marker file counts
what executed in it) and must run under each start method. Starting a spawned or forkserver
process per case pays for a Python interpreter and ``import torch`` every time. Instead, a
``Forker`` is one long-lived process started with the start method (a fresh interpreter under
spawn and forkserver, a copy of the test process under fork) that imports torch, and nothing
of codeferry or transformers, once; each case runs in a child it forks. The child starts in
the state the start method gives (nothing of codeferry installed, locked or loaded under spawn
and forkserver; the test process's own state under fork), lives for one case and exits.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

#: What the long-lived process imports once: heavy, and nothing that decides how remote code
#: loads (codeferry and transformers are imported by each case, in its own order).
PRELOAD = ("torch",)


class CaseError(Exception):
    """A case raised (or its process died): the child's traceback."""


def _one_case(function: Callable[..., Any], args: tuple[Any, ...]) -> bytes:
    """Run ``function(*args)`` in a forked child; its pickled ``(ok, value)``."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the case's process: one case, then gone without running any cleanup
        os.close(read)
        code = 0
        try:
            try:
                data = pickle.dumps((True, function(*args)))
            except BaseException:
                data = pickle.dumps((False, traceback.format_exc()))
            with os.fdopen(write, "wb") as out:
                out.write(data)
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as answer:
        data = answer.read()
    _, status = os.waitpid(pid, 0)
    if not data:
        return pickle.dumps((False, f"the case's process {pid} died: wait status {status}"))
    return data


def _serve(conn: Connection) -> None:
    """The long-lived process: preload, then fork a child per ``(function, args)`` received."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    conn.send_bytes(pickle.dumps((True, os.getpid())))
    while True:
        try:
            request = conn.recv_bytes()
        except EOFError:
            return
        if not request:  # ``close``: other processes may hold this pipe open, so no EOF
            return
        function, args = pickle.loads(request)
        conn.send_bytes(_one_case(function, args))


class Forker:
    """One long-lived process of start method ``method``; ``run`` forks a child per case."""

    def __init__(self, method: str) -> None:
        self.method = method
        ctx = mp.get_context(method)
        self._conn, theirs = ctx.Pipe()
        self._process = ctx.Process(target=_serve, args=(theirs,), daemon=True,
                                    name=f"forker-{method}")
        self._process.start()
        theirs.close()
        self.pid = self._answer(300)

    def _answer(self, timeout: float) -> Any:
        if not self._conn.poll(timeout):
            raise CaseError(f"no answer from the {self.method} forker in {timeout} s")
        ok, value = pickle.loads(self._conn.recv_bytes())
        if not ok:
            raise CaseError(value)
        return value

    def run(self, function: Callable[..., Any], *args: Any, timeout: float = 300) -> Any:
        """``function(*args)`` in a new process forked from this one; its return value."""
        self._conn.send_bytes(pickle.dumps((function, args)))
        return self._answer(timeout)

    def close(self) -> None:
        try:
            self._conn.send_bytes(b"")
        except OSError:
            pass  # already gone
        self._conn.close()
        self._process.join(30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)
