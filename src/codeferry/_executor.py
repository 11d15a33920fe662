"""The executor: batch inference of one model across worker processes that survive crashes.

::

    caller thread                         worker processes (spawn by default)
    ─────────────                         ───────────────────────────────────
    generate/embed/score(inputs)          worker_main: codeferry.load(model) itself,
      │ split into batches                 builds the model, then serves requests
      ▼
    _Scheduler ── pipe per worker ──────▶  (request_id, kind, payload)
      ▲  wait() on every pipe AND every     │
      │  process sentinel: a death is       ▼
      └─ seen the moment it happens ◀───── (request_id, "ok"|"error", ...)

Every worker runs exactly the code digest the parent checked (``Executor.digest``): one
started or replaced after the model folder changed fails with ``CodeChangedError``,
naming both digests, before it executes anything; that is not retried, and every later
call raises it too.

Every batch is in flight on at most one worker. When a worker's process dies (an
``os._exit``, SIGKILL, a segfault) the scheduler sees its sentinel, starts a
replacement and sends the batch again; a batch whose model raised is sent again too.
After ``max_retries`` further attempts the batch fails with ``BatchFailedError`` naming
its inputs; every input gets exactly one outcome. Workers start with a handshake that
carries a start-up error back typed, with the worker's traceback as its cause.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing as mp
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Literal

from ._batching import batch_limits, estimate_tokens, fixed_batches, plan_batches
from ._checks import check_device, check_main_guard, dtype_name
from ._lockfile import Lock, read_lock
from ._resolve import resolve
from ._worker import DEFAULT_NEW_TOKENS, WorkerSpec, pack, remote_error, worker_main
from .errors import (
    BatchFailedError,
    CodeChangedError,
    RequestUnpicklingError,
    WorkerError,
    WorkerStartupError,
)

__all__ = ["Executor", "Outcome"]

StartMethod = Literal["spawn", "forkserver", "fork"]

logger = logging.getLogger(__name__)

#: Batches sent ahead to each worker (the one it runs, and the next).
QUEUE_DEPTH = 2
#: Inputs sorted by length together: a stream's outputs are held back at most this many.
BATCH_WINDOW = 1024


@dataclass(frozen=True)
class Outcome:
    """The result for input ``index``: ``value``, or ``error`` when its batch failed."""

    index: int
    value: Any = None
    error: BaseException | None = None


@dataclass
class _Batch:
    kind: str
    indices: list[int]
    payload: dict[str, Any]
    inputs: list[Any]
    attempts: int = 0
    last_error: BaseException | None = None


@dataclass
class _Worker:
    slot: int
    process: Any
    conn: Connection
    pid: int | None = None
    #: (request id, batch) sent and not answered yet, oldest first: the first is running.
    queue: deque[tuple[int, _Batch]] = field(default_factory=deque)
    info: dict[str, Any] = field(default_factory=dict)


def needed_classes(tasks: Sequence[str]) -> set[str]:
    """The ``auto_map`` keys workers load for ``tasks``: the config, tokenizer and model heads."""
    return {"AutoConfig", "AutoTokenizer"} | {
        "AutoModel" if task == "embed" else "AutoModelForCausalLM" for task in tasks}


class Executor:
    """Batch inference of ``model`` on ``workers`` processes; a context manager.

    ``model`` is a folder, a cached repo id or a snapshot folder of the hub cache, remote
    code or not; workers get the snapshot folder, fenced like the repo. Remote code runs only
    with ``trust_remote_code=True`` or a ``lock``, in the parent's decision and again in
    each worker, which loads and verifies the code itself.

    ``dtype`` is a ``torch.dtype`` or its name (``"float16"``), as for ``from_pretrained``;
    ``cache_dir`` the hub cache that holds ``model`` (a repo id) and cross-repo code.

    ``digest`` is the code digest the caller already checked, if any: other code found
    now raises ``CodeChangedError``. Either way, ``self.digest`` is what every worker (and
    every replacement) verifies before it executes anything.

    ``warm=True`` forks workers from a zygote that has torch and transformers imported
    already (started once per process, see ``_zygote``) instead of starting each one
    with ``start_method``: seconds saved per worker, and each still loads and verifies
    the code itself.

    Batches: ``batch_size`` fixes the inputs per batch; by default inputs of similar length
    are batched together, ``max_batch_tokens`` padded tokens a batch (``_batching``).
    ``generate_path``: ``"auto"`` (continuous batching on an accelerator when the model
    supports it, batched ``generate`` otherwise), ``"continuous"`` or ``"batched"``; each
    worker's choice is in ``worker_info`` (``_generation``).

    Refused before any worker starts (``_checks``): a ``device`` this machine's torch
    cannot use (``DeviceError``), and spawn or forkserver workers started by a main script
    outside ``if __name__ == "__main__":`` (``MainGuardError``).
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        workers: int = 2,
        start_method: StartMethod = "spawn",
        device: str = "cpu",
        dtype: str | Any | None = None,
        trust_remote_code: bool = False,
        lock: Lock | str | os.PathLike[str] | None = None,
        revision: str | None = None,
        batch_size: int | None = None,
        max_batch_tokens: int | None = None,
        generate_path: Literal["auto", "continuous", "batched"] = "auto",
        max_retries: int = 2,
        threads_per_worker: int | None = None,
        preload: Sequence[str] = ("generate",),
        warm: bool = False,
        startup_timeout: float = 600.0,
        digest: str | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if workers < 1:
            raise ValueError("workers must be at least 1")
        if generate_path not in ("auto", "continuous", "batched"):
            raise ValueError(f"generate_path must be 'auto', 'continuous' or 'batched', "
                             f"got {generate_path!r}")
        # Mistakes a worker would only report as an exit code: refused here, typed.
        check_main_guard("spawn" if warm else start_method)  # the zygote is spawned
        check_device(device)
        dtype = dtype_name(dtype)  # torch.float16 or "float16": the name travels
        cache = None if cache_dir is None else os.fspath(cache_dir)
        bundle = resolve(model, revision=revision, cache_dir=cache)
        if digest is not None and bundle.digest != digest:
            from ._api import code_changed

            raise code_changed(bundle, digest)
        bundle.check_classes(needed_classes(preload))  # another class's problem is no matter
        locked = lock if isinstance(lock, Lock) or lock is None else read_lock(lock)
        if locked is not None:
            locked.check(bundle)
            # The parent unpickles its workers' replies (results, errors of classes the
            # model defines): it must refuse what its workers would refuse, from now on,
            # as ``load(model, lock=...)`` here would.
            from . import _policy
            from ._api import units_of

            _policy.allow({u.digest for u in units_of(bundle).values()}, from_lock=True)
        elif bundle.files and not trust_remote_code:
            from ._api import trust_error

            raise trust_error(bundle)
        self.model = str(bundle.source.root)
        #: The code decided on here; every worker, and every replacement, runs exactly it.
        self.digest = bundle.digest
        #: Set when the model's code changed under a running executor: every call raises it.
        self._failure: CodeChangedError | None = None
        #: A fixed count per batch, in input order; ``None``: batches planned by tokens.
        self.batch_size = batch_size
        #: Padded tokens and rows per planned batch (the device's defaults: ``_batching``).
        self.max_batch_tokens, self.max_batch_size = batch_limits(device, max_batch_tokens)
        self.max_retries = max_retries
        self.startup_timeout = startup_timeout
        self.warm = warm
        self._ctx: Any = mp.get_context(start_method)
        # Workers exit when this pipe reads EOF: when this process is gone (_watch_parent).
        self._lifeline, self._lifeline_end = self._ctx.Pipe(duplex=False)
        threads = threads_per_worker or max(1, (os.cpu_count() or 1) // workers)
        self._specs = [
            WorkerSpec(self.model, revision, trust_remote_code, locked,
                       _device_for(device, slot), dtype, threads, tuple(preload), self.digest,
                       cache, generate_path)
            for slot in range(workers)
        ]
        self._workers: list[_Worker | None] = [None] * workers
        self._requests = itertools.count()
        self._closed = False
        self._state = threading.RLock()
        self._active = 0  # calls in progress: they replace dead workers themselves
        try:
            for slot in range(workers):
                self._start(slot, wait_ready=False)
            for slot in range(workers):
                self._handshake(slot)
        except BaseException:
            self.close()
            raise
        self._monitor = threading.Thread(target=self._watch, name="codeferry-monitor",
                                         daemon=True)
        self._monitor.start()

    # -- lifecycle ------------------------------------------------------------------------

    def _start(self, slot: int, *, wait_ready: bool = True) -> None:
        if self.warm:
            from ._zygote import shared_zygote

            forked, conn = shared_zygote().fork(self._specs[slot])
            self._workers[slot] = _Worker(slot, forked, conn)
            if wait_ready:
                self._handshake(slot)
            return
        parent_end, child_end = self._ctx.Pipe()
        proc = self._ctx.Process(
            target=worker_main,
            args=(self._specs[slot], child_end, os.getpid(), self._lifeline,
                  self._lifeline_end if self._ctx.get_start_method() == "fork" else None),
            name=f"codeferry-worker-{slot}", daemon=True,
        )
        proc.start()
        child_end.close()
        self._workers[slot] = _Worker(slot, proc, parent_end)
        if wait_ready:
            self._handshake(slot)

    def _handshake(self, slot: int) -> None:
        worker = self._workers[slot]
        assert worker is not None
        deadline = time.monotonic() + self.startup_timeout
        ready = wait(_waitables(worker), timeout=self.startup_timeout)
        message = None
        if worker.conn in ready or worker.conn.poll(0):
            try:
                message = worker.conn.recv()
            except (EOFError, OSError):
                message = None
        if message is not None and message[0] == "ready":
            _, worker.pid, worker.info = message
            return
        if message is not None and message[0] == "failed":
            cause = remote_error(message[2], slot)
            if isinstance(cause, CodeChangedError):
                # Not a crash: every replacement would find the same code. Stop here.
                self._failure = cause
                worker.process.join(5)  # it exits by itself, having run nothing
                raise cause
            raise WorkerStartupError(
                f"worker {slot} could not start: {type(cause).__name__}: {cause}",
                worker=slot, fix="the cause above is the worker's own traceback.",
            ) from cause
        worker.process.join(max(0.0, min(5.0, deadline - time.monotonic())))
        how = "timed out" if worker.process.exitcode is None else (
            f"died with exit code {worker.process.exitcode}")
        raise WorkerStartupError(f"worker {slot} {how} while starting.", worker=slot,
                                 fix="run `codeferry doctor MODEL` to see each worker's error.")

    def _watch(self) -> None:
        """The monitor: notice a worker that dies between calls, and replace it at once.

        During a call the scheduler sees deaths itself (it waits on every sentinel), so
        the monitor stands back while one is active. Zygote-forked workers have no
        sentinel of their own apart from their pipe, which only the scheduler reads.
        """
        while not self._closed and self._failure is None:
            sentinels = {w.process.sentinel: w for w in self._workers
                         if w is not None and w.process.sentinel is not w.conn}
            if not sentinels:
                return
            for ready in wait(list(sentinels), timeout=0.5):
                worker = sentinels[ready]
                with self._state:
                    if self._closed or self._active or self._workers[worker.slot] is not worker:
                        continue
                    try:
                        self._replace(worker.slot)
                    except CodeChangedError:
                        return  # recorded in _failure: the next call raises it
                    except Exception:
                        logger.exception("codeferry: could not replace worker %d", worker.slot)

    @contextlib.contextmanager
    def _call(self) -> Iterator[None]:
        if self._closed:
            raise RuntimeError("this executor is closed")
        with self._state:
            if self._failure is not None:
                raise self._failure
            self._active += 1
        try:
            yield
        finally:
            with self._state:
                self._active -= 1

    def close(self) -> None:
        """Stop every worker; kill those that do not stop within a few seconds."""
        if self._closed:
            return
        self._closed = True
        for worker in self._workers:
            if worker is None:
                continue
            try:
                worker.conn.send((None, "stop", None))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 5
        for worker in self._workers:
            if worker is None:
                continue
            worker.process.join(max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(5)
            worker.conn.close()
        self._lifeline_end.close()
        self._lifeline.close()

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # At interpreter shutdown the modules close() needs may already be gone.
        with contextlib.suppress(Exception):
            self.close()

    @property
    def worker_info(self) -> list[dict[str, Any]]:
        """Each worker's ready message: ``classes``, ``generate_path`` and its reason."""
        return [dict(w.info) if w else {} for w in self._workers]

    @property
    def pids(self) -> list[int | None]:
        return [(w.pid or w.process.pid) if w else None for w in self._workers]

    # -- scheduling -----------------------------------------------------------------------

    def _replace(self, slot: int) -> None:
        old = self._workers[slot]
        if old is not None:
            old.conn.close()
            old.process.join(1)
        self._start(slot)

    def _run(self, batches: Iterable[_Batch]) -> Iterator[Outcome]:
        with self._call():
            yield from self._schedule(batches)

    def _schedule(self, batches: Iterable[_Batch]) -> Iterator[Outcome]:
        pending = deque(batches)
        for worker in self._workers:
            if worker is not None:
                worker.queue.clear()  # replies to an abandoned iterator are ignored below
        while pending or any(w is not None and w.queue for w in self._workers):
            # Keep QUEUE_DEPTH batches sent to each worker: the next one is already in its
            # pipe when the current one finishes, so the round trip hides behind compute.
            for worker in self._workers:
                while pending and worker is not None and len(worker.queue) < QUEUE_DEPTH:
                    job = pending.popleft()
                    request = next(self._requests)
                    job.attempts += 1
                    worker.queue.append((request, job))
                    try:
                        worker.conn.send((request, job.kind, pack(job.payload)))
                    except (OSError, ValueError):
                        break  # a dead worker: its sentinel fires below
            watched = [w for w in self._workers if w is not None and w.queue]
            waitables: list[Any] = []
            for worker in watched:
                waitables += _waitables(worker)
            for ready in wait(waitables):
                worker = next(w for w in watched if ready is w.conn or ready == w.process.sentinel)
                if self._workers[worker.slot] is not worker or not worker.queue:
                    continue  # replaced, or its pipe and sentinel were both ready: handled
                message = None
                if ready is worker.conn or worker.conn.poll(0):
                    try:
                        message = worker.conn.recv()
                    except (EOFError, OSError):
                        message = None
                if message is not None and message[0] != worker.queue[0][0]:
                    continue  # the reply to a request whose iterator was abandoned
                failed: list[_Batch] = []
                if message is not None:
                    _, batch = worker.queue.popleft()
                    if message[1] == "ok":
                        for index, value in zip(batch.indices, message[2], strict=True):
                            yield Outcome(index, value)
                        continue
                    batch.last_error = remote_error(message[2], worker.slot)
                    failed.append(batch)
                else:
                    # The process died. Only the batch it was running is charged; the
                    # ones queued behind it go back as they were.
                    worker.process.join(1)
                    code = worker.process.exitcode
                    (_, batch), *queued = worker.queue
                    worker.queue.clear()
                    batch.last_error = WorkerError(
                        f"worker {worker.slot} (pid {worker.pid}) died with exit code {code} "
                        "while running a batch.", worker=worker.slot)
                    failed.append(batch)
                    for _, waiting in reversed(queued):
                        waiting.attempts -= 1
                        pending.appendleft(waiting)
                    self._replace(worker.slot)
                for batch in failed:
                    # A request the worker cannot unpickle fails the same way every time.
                    final = isinstance(batch.last_error, RequestUnpicklingError)
                    if final or batch.attempts > self.max_retries:
                        times = "once (not retried)" if final else f"{batch.attempts} times"
                        failure = BatchFailedError(
                            f"a batch of {len(batch.indices)} inputs failed {times}; "
                            f"inputs {batch.indices}: {batch.last_error}",
                            indices=tuple(batch.indices), inputs=tuple(batch.inputs),
                            fix="the cause is the last attempt's error; inputs that crash the "
                            "model can be isolated with batch_size=1.",
                        )
                        failure.__cause__ = batch.last_error
                        for index in batch.indices:
                            yield Outcome(index, error=failure)
                    else:
                        pending.appendleft(batch)

    def _batches(self, kind: str, inputs: Sequence[Any], extra: dict[str, Any],
                 batch_size: int | None) -> list[_Batch]:
        """A fixed ``batch_size``: consecutive batches of that many. Otherwise inputs of
        similar length, within windows of ``BATCH_WINDOW``, ``max_batch_tokens`` padded
        tokens a batch (generate counts the new tokens of every row), cut into batches of
        about equal cost, a multiple of workers x ``QUEUE_DEPTH`` (``_batching``): each
        worker is sent that many at once, so fewer would leave a worker idle."""
        size = batch_size or self.batch_size
        if size:
            plan = fixed_batches(len(inputs), size)
        else:
            new = int(extra.get("options", {}).get("max_new_tokens") or DEFAULT_NEW_TOKENS)
            lengths = [estimate_tokens(x) + (new if kind == "generate" else 0) for x in inputs]
            plan = plan_batches(lengths, max_batch_tokens=self.max_batch_tokens,
                                max_batch_size=self.max_batch_size, window=BATCH_WINDOW,
                                spread=len(self._workers) * QUEUE_DEPTH)
        return [_Batch(kind, indices, {"texts": [inputs[i] for i in indices], **extra},
                       [inputs[i] for i in indices]) for indices in plan]

    def _collect(self, outcomes: Iterator[Outcome], n: int) -> list[Any]:
        results: list[Any] = [None] * n
        failed: list[Outcome] = []
        for outcome in outcomes:
            if outcome.error is not None:
                failed.append(outcome)
            results[outcome.index] = outcome.value
        if failed:
            raise failed[0].error  # type: ignore[misc]
        return results

    # -- the API --------------------------------------------------------------------------

    def generate_iter(self, prompts: Sequence[str], *, batch_size: int | None = None,
                      **options: Any) -> Iterator[Outcome]:
        """Generated texts as they complete (any order); see ``Outcome``."""
        return self._run(self._batches("generate", prompts, {"options": options}, batch_size))

    def generate(self, prompts: Sequence[str], *, batch_size: int | None = None,
                 **options: Any) -> list[str]:
        """Greedy by default (``do_sample=False``); ``options`` go to ``model.generate``."""
        return self._collect(self.generate_iter(prompts, batch_size=batch_size, **options),
                             len(prompts))

    def embed_iter(self, texts: Sequence[str], *, pooling: str = "mean",
                   batch_size: int | None = None) -> Iterator[Outcome]:
        return self._run(self._batches("embed", texts, {"pooling": pooling}, batch_size))

    def embed(self, texts: Sequence[str], *, pooling: str = "mean",
              batch_size: int | None = None) -> list[list[float]]:
        """One vector per text: ``mean`` (attention-masked), ``cls`` or ``last`` pooling."""
        return self._collect(self.embed_iter(texts, pooling=pooling, batch_size=batch_size),
                             len(texts))

    def score_iter(self, texts: Sequence[str], *, batch_size: int | None = None) -> Iterator[Outcome]:
        return self._run(self._batches("score", texts, {}, batch_size))

    def score(self, texts: Sequence[str], *, batch_size: int | None = None) -> list[dict[str, Any]]:
        """Per text: ``tokens``, ``token_logprobs`` (of each token after the first), ``logprob``."""
        return self._collect(self.score_iter(texts, batch_size=batch_size), len(texts))

    def collective_rpc(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``func(worker, *args, **kwargs)`` on every worker; one result per worker.

        For control messages only. ``func`` must be importable by name (a module-level
        function); ``worker`` exposes ``models``, ``tokenizer``, ``classes`` and ``spec``.
        """
        results: list[Any] = []
        with self._call():
            for worker in self._workers:
                assert worker is not None
                request = next(self._requests)
                try:
                    worker.conn.send((request, "rpc", pack((func, args, kwargs))))
                    reply = worker.conn.recv()
                    while reply[0] != request:  # a reply to an abandoned iterator
                        reply = worker.conn.recv()
                except (EOFError, OSError):
                    raise WorkerError(f"worker {worker.slot} (pid {worker.pid}) died during "
                                      "collective_rpc.", worker=worker.slot) from None
                if reply[1] == "error":
                    raise remote_error(reply[2], worker.slot)
                results.append(reply[2])
        return results


def _waitables(worker: _Worker) -> list[Any]:
    """What signals a worker: its pipe, and its process sentinel when it has its own."""
    sentinel = worker.process.sentinel
    return [worker.conn] if sentinel is worker.conn else [worker.conn, sentinel]


def _device_for(device: str, slot: int) -> str:
    if device == "cuda":
        import torch

        count = torch.cuda.device_count()
        return f"cuda:{slot % count}" if count else "cpu"
    return device
