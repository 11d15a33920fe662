"""What runs inside an executor worker: load the code, build the model, serve batches.

A worker is started with everything it needs in one ``WorkerSpec`` (the model's folder,
its ``ModelOptions`` with the parent's trust decision, the digest the parent checked,
device, dtype, threads). It loads the remote code itself,
through ``codeferry.load``: nothing it inherited (from a fork, a preloaded zygote) is
trusted to mean the code is there, and it executes only the digest the parent checked
(``CodeChangedError`` otherwise), so a worker started after the folder changed cannot
run code nobody decided on. It then answers one message per request on its pipe::

    parent -> worker   (request_id, pickled Work)   Work: Complete | Embed | Score | Rpc
                       (request_id, STOP)           drain, then exit
    worker -> parent   (request_id, "ok", pickled result) | (request_id, "error", (blob, tb, text))

The payload travels pickled on its own, inside the message: the worker unpickles it
inside its error handling, so an input whose unpickling raises (or exits) becomes a
typed error reply for that request (``RequestUnpicklingError``) instead of killing the
worker, which the parent would retry until it gave up without the cause.

and a first ``("ready", pid, info)`` or ``("failed", ...)``: the start-up handshake. A
thread watches the parent (its pid, and a lifeline pipe for forkserver children, whose
parent is the fork server): if it dies, the worker exits at once, busy or not, so a
killed parent leaves no orphan behind.

A worker's stdout is its stderr (``stdout.route_stdout``): ``codeferry run`` writes its
output to the stdout the workers inherited, and a model that prints must not write into it
(nor tear its lines). Python-level lines arrive whole, named: ``[codeferry worker 0] ...``.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time
import traceback
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any

from ... import _settings
from ..._sandbox.box import enter, refusal
from ..engines.base import Complete, Embed, Engine, Rpc, Score, Work
from ..engines.hf_engine import TransformersEngine
from ..engines.spec import WorkerSpec
from ..generate.complete import Planned
from .stdout import finish_stdout, route_stdout

__all__ = ["STOP", "WorkerSpec", "build_engine", "error_payload", "handle", "pack", "remote_error",
           "unpack_reply", "worker_main"]

#: The payload that tells a worker to finish what it holds and exit.
STOP = b""


def _watch_parent(parent_pid: int, lifeline: Connection | None) -> None:
    """Exit the moment the executor's process is gone.

    ``os.getppid()`` names the executor only when it started us itself (spawn, fork, a
    zygote that passes its own pid). A forkserver child's parent is the fork server,
    so a change of parent means nothing there: the ``lifeline`` does. It is the read
    end of a pipe whose only write end the executor holds, so it reads EOF (``poll``
    returns) when the executor dies, however it dies; nothing is ever written to it.
    A process forked from the executor for other reasons would hold a copy of that write
    end, so the executor's pid is checked too.
    """
    ours = os.getppid() == parent_pid  # False under forkserver
    while True:
        if lifeline is not None:
            try:
                if lifeline.poll(0.2):
                    os._exit(0)  # EOF: the executor is gone
            except (EOFError, OSError):
                os._exit(0)
        else:
            time.sleep(0.2)
        if ours and os.getppid() != parent_pid:
            os._exit(0)  # orphaned: leave now, whatever we were doing
        if not ours:
            try:
                os.kill(parent_pid, 0)
            except ProcessLookupError:
                os._exit(0)
            except PermissionError:
                pass  # the pid is someone else's now, or not ours to signal: rely on the pipe


ErrorPayload = tuple[bytes | None, str, str]


def error_payload(exc: BaseException) -> ErrorPayload:
    """A worker's error as it travels: (pickled error or None, traceback, summary); an
    access the box refused travels as the ``SandboxRefusedError`` that names it."""
    exc = refusal(exc)  # first: formatting the traceback reads files
    text = traceback.format_exc()
    try:
        blob = pickle.dumps(exc)
        pickle.loads(blob)
    except Exception:  # noqa: BLE001 - an unpicklable error still travels as text
        blob = None
    return blob, text, f"{type(exc).__name__}: {exc}"


def pack(payload: Any) -> bytes:
    """A request's payload as the worker receives it (pickled by the sender's pickler, so
    objects of remote-code classes carry their tickets, as on any multiprocessing pipe)."""
    from multiprocessing.reduction import ForkingPickler

    return bytes(ForkingPickler.dumps(payload))


def remote_error(payload: ErrorPayload, worker: int) -> BaseException:
    """The parent's side of ``error_payload``: the worker's own error when it unpickles
    (a ``WorkerError`` with its summary when not), the worker's traceback as its cause.

    A ``SystemExit``, ``KeyboardInterrupt`` or other ``BaseException`` that is not an
    ``Exception`` is never handed back as is: raised in the parent it would exit the
    parent, or look like its own Ctrl-C. It becomes a ``WorkerError`` naming it.
    """
    from ...errors import RemoteTraceback, WorkerError

    blob, tb, text = payload
    exc: BaseException | None = None
    if blob is not None:
        try:
            exc = pickle.loads(blob)
        except Exception:  # noqa: BLE001 - fall back to the text
            exc = None
    if exc is not None and not isinstance(exc, Exception):
        exc = WorkerError(f"worker {worker} raised {text} (a {type(exc).__name__} in a "
                          "worker ends that call, not the parent)", worker=worker,
                          fix="the cause above is the worker's own traceback.")
    if exc is None:
        exc = WorkerError(f"worker {worker} raised {text}", worker=worker)
    exc.__cause__ = RemoteTraceback(tb)
    return exc


def _unpack(blob: Any) -> Any:
    from ...errors import RequestUnpicklingError

    if not isinstance(blob, bytes):
        raise RequestUnpicklingError(f"a request's payload is {type(blob).__name__}, not bytes.",
                                     fix="send requests through codeferry.Executor only.")
    try:
        return pickle.loads(blob)
    except BaseException as exc:  # a SystemExit from __reduce__ included
        raise RequestUnpicklingError(
            f"a worker could not unpickle a request: {type(exc).__name__}: {exc}",
            fix="an input object fails to unpickle in a fresh process; make it picklable "
            "(or send plain data), then retry.",
        ) from exc


def worker_main(spec: WorkerSpec, conn: Connection, parent_pid: int,
                lifeline: Connection | None = None,
                inherited: Connection | None = None, slot: int | None = None) -> None:
    """Entry point of a worker process.

    ``lifeline``: see ``_watch_parent``. ``inherited``: the executor's write end of it,
    which a forked worker holds a copy of and must close, or EOF would never come.
    ``slot``: the worker's number, which names its stdout lines on stderr.
    """
    if spec.engine.sandbox is not None:
        # Before any thread starts (Landlock holds the calling thread and those it starts)
        # and before the model's code is imported; torch and transformers are imported.
        try:
            request = spec.engine.sandbox
            if spec.serve and spec.engine.name != "transformers":
                from ..engines.vllm_engine import before_box

                request = replace(request, read=(*request.read, *before_box()))
            enter(request, [p for p in (spec.model, spec.code) if p])
        except BaseException as exc:  # noqa: BLE001 - the handshake carries it to the parent
            conn.send(("failed", os.getpid(), error_payload(exc)))
            return
    route_stdout("codeferry worker" if slot is None else f"codeferry worker {slot}")
    # Ctrl-C reaches the whole process group: the parent decides what stops, and how.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if inherited is not None:
        inherited.close()
    threading.Thread(target=_watch_parent, args=(parent_pid, lifeline), daemon=True).start()
    try:
        _serve(spec, conn)
    finally:
        finish_stdout()


def build_engine(spec: WorkerSpec) -> Engine:
    """The worker's engine: transformers' (``hf_engine``) or vLLM's (``vllm_engine``); for
    ``auto``, vLLM's unless it refuses the model (or ``half_without_kernels`` says vLLM would
    be slow here), then transformers' with the reason first in ``generate_reason`` (and on
    the worker's stderr)."""
    if spec.engine.name == "transformers" or not spec.serve:
        return TransformersEngine(spec)
    from ...errors import EngineRefusedError, ExtraMissingError
    from ..engines.vllm_engine import VllmEngine, half_without_kernels

    if spec.engine.name == "vllm":
        return VllmEngine(spec)
    refused = half_without_kernels(spec.dtype, spec.device, spec.model)
    if refused is None:
        lock = _settings.lock_file()
        try:
            return VllmEngine(spec)
        except (EngineRefusedError, ExtraMissingError) as exc:
            _settings.set_lock_file(lock)  # as it was: the lock was for vLLM's processes
            refused = exc.message
    else:
        refused = f"{refused}."
    why = f"engine='auto': {refused} transformers generates instead"
    print(f"codeferry: {why}", file=sys.stderr, flush=True)
    engine = TransformersEngine(spec)
    if engine.generate_path is not None:
        path, reason = engine.generate_path
        engine.generate_path = (path, f"{why}; {reason}")
    return engine


def _serve(spec: WorkerSpec, conn: Connection) -> None:
    try:
        engine = build_engine(spec)
    except BaseException as exc:  # noqa: BLE001 - the handshake carries it to the parent
        conn.send(("failed", os.getpid(), error_payload(exc)))
        return
    # The engine's running batch, where it has one: batches join it as they arrive, and
    # "streams" lets the scheduler keep more of them in this worker's pipe (STREAM_DEPTH).
    stream = engine.stream()
    conn.send(("ready", os.getpid(), {**engine.info(), "streams": stream is not None,
                                      "transformers": sys.modules["transformers"].__version__}))
    taken: dict[int, Complete] = {}  # the work in the stream, by request id

    def step() -> None:
        assert stream is not None
        for request_id, ok, value in stream.step():
            work = taken.pop(request_id)
            conn.send((request_id, *(("ok", pack(work.answer(value))) if ok
                                     else ("error", error_payload(value)))))

    while True:
        if stream is not None and stream.busy and not conn.poll(0):
            step()
            continue
        try:
            request_id, payload = conn.recv()
        except (EOFError, OSError):
            return  # the parent closed our pipe: shut down
        planned = None  # a batch the stream planned and did not take
        if stream is not None and payload != STOP:
            try:
                work = _unpack(payload)
                if isinstance(work, Complete):
                    planned = stream.take(request_id, engine, work)
                    if planned is None:
                        taken[request_id] = work
                        continue
                payload = work
            except BaseException as exc:  # noqa: BLE001 - reported, the worker lives on
                conn.send((request_id, "error", error_payload(exc)))
                continue
        while stream is not None and stream.busy:  # anything else runs with no decode in flight
            step()
        if payload == STOP:
            return
        conn.send((request_id, *handle(engine, payload, planned)))


def handle(engine: Engine, payload: bytes | Work, planned: Planned | None = None) -> tuple[str, Any]:
    """One request: ``("ok", pickled result)`` or ``("error", error payload)``; ``payload``:
    the ``Work`` (pickled, or unpickled already); ``planned``: a ``Complete`` batch already
    planned (``Stream.take``).

    The result travels pickled on its own, like the request: the parent unpickles it
    knowing which request it answers, so a result it refuses (code its lock does not
    list) fails that request, typed, instead of the connection.
    """
    try:
        work = _unpack(payload) if isinstance(payload, bytes) else payload
        result: Any
        if isinstance(work, Complete):
            result = work.answer(engine.complete(work, planned))
        elif isinstance(work, Embed):
            result = engine.embed(work.texts, work.pooling)
        elif isinstance(work, Score):
            result = engine.score(work.texts)
        elif isinstance(work, Rpc):
            result = work.func(engine, *work.args, **work.kwargs)
        else:
            raise ValueError(f"unknown request {type(work).__name__}")
        return "ok", pack(result)
    except BaseException as exc:  # noqa: BLE001 - reported, the worker lives on
        return "error", error_payload(exc)


def unpack_reply(status: str, body: Any, worker: int) -> tuple[bool, Any]:
    """The parent's side of ``handle``: ``(True, result)`` or ``(False, error)``."""
    if status != "ok":
        return False, remote_error(body, worker)
    try:
        return True, pickle.loads(body)
    except Exception as exc:  # noqa: BLE001 - typed errors (a refused ticket) pass as they are
        from ...errors import CodeferryError, WorkerError

        if isinstance(exc, CodeferryError):
            return False, exc
        error = WorkerError(f"worker {worker}'s reply could not be unpickled here: "
                            f"{type(exc).__name__}: {exc}", worker=worker,
                            fix="return plain data (or objects importable here) from the worker.")
        error.__cause__ = exc
        return False, error
