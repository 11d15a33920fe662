"""The scheduler: batches, attempts, retries and outcomes, owned by one manager thread.

::

    caller threads, iterators            manager thread                 transport
    ─────────────────────────            ──────────────                 ─────────
    submit(batches) ──┐                  pending batches ─ send ──────▶ worker (process, actor)
    cancel(call) ─────┼─▶ one queue ───▶ per worker: what is in flight
    shutdown() ───────┘        ▲         deadlines (batch, start-up)
                               └──────── ready / failed / reply / died events (reader threads)

Only the manager thread touches the bookkeeping, so any number of callers and open
iterators share the workers safely (loky's executor has the same shape): a caller posts
its batches and waits on its own ``Call``. Every batch is in flight on at most one worker;
when a worker dies (exit, SIGKILL, a dead node) or runs past ``batch_timeout`` (it is
killed) the batch it was running is charged an attempt and sent again, the ones queued
behind it go back as they were, and the worker is replaced. After ``max_retries`` further
attempts a batch fails with ``BatchFailedError`` naming its inputs: every input gets
exactly one outcome; a batch of inputs that *raised* is split in halves instead (``_split``)
until only the input that raises gets the error. With no worker left and none startable, the
executor is broken: everything not done fails with ``BrokenExecutorError``, at once.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from ..errors import (
    BatchFailedError,
    BatchTimeoutError,
    BrokenExecutorError,
    CodeChangedError,
    EngineRefusedError,
    RequestUnpicklingError,
    SamplingParamsError,
    WorkerError,
    WorkerStartupError,
)
from .batching import halves
from .engines.base import Rpc, Work
from .workers.transport import Channel, Event, Transport
from .workers.worker import WorkerSpec

__all__ = ["STREAM_DEPTH", "Batch", "Call", "Outcome", "Scheduler"]

#: Batches in the pipe of a worker that streams: its decode loop takes up to 64 rows, and
#: the planner cuts batches of an eighth of that (``Executor._plan``), so that results come
#: back batch by batch while every row stays busy.
STREAM_DEPTH = 8

#: Errors a batch would raise again on any worker: it fails at once, not after retries.
_NOT_RETRIED = (RequestUnpicklingError, SamplingParamsError, EngineRefusedError)

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class Outcome:
    """The result for input ``index``: ``value``, or ``error`` when its batch failed."""

    index: int
    value: Any = None
    error: BaseException | None = None


class Call:
    """What one caller waits on: ``n`` inputs, one outcome each, in any order. ``future``
    resolves to the values in input order (or the error of the lowest failed index);
    ``stream=True`` also queues each outcome as it arrives, for iterators."""

    def __init__(self, n: int, *, stream: bool = False) -> None:
        self.n = n
        self.future: Future[list[Any]] = Future()
        self.outcomes: queue.SimpleQueue[Outcome] | None = queue.SimpleQueue() if stream else None
        self._values: list[Any] = [None] * n
        self._errors: dict[int, BaseException] = {}
        self._left = n
        self.started = False
        if n == 0:
            self.future.set_result([])

    def deliver(self, outcome: Outcome) -> None:
        if self.outcomes is not None:
            self.outcomes.put(outcome)
        if outcome.error is not None:
            self._errors[outcome.index] = outcome.error
        else:
            self._values[outcome.index] = outcome.value
        self._left -= 1
        if self._left == 0 and not self.future.done():
            if self._errors:
                self.future.set_exception(self._errors[min(self._errors)])
            else:
                self.future.set_result(self._values)

    def start(self) -> bool:
        """Mark it running; ``False`` when the caller cancelled its future first."""
        if not self.started:
            self.started = True
            return self.future.set_running_or_notify_cancel()
        return not self.future.cancelled()


@dataclass
class Batch:
    #: The inputs' positions in the call, and the work the worker does for them.
    indices: list[int]
    payload: Work
    inputs: list[Any]
    call: Call
    #: Only this worker may run it (``collective_rpc``); never retried elsewhere.
    slot: int | None = None
    #: A reply that is an error ends it (user functions); else it is retried like a death.
    final_errors: bool = False
    attempts: int = 0
    last_error: BaseException | None = None
    packed: bytes | None = None
    #: A half of a batch that raised: it runs alone in its worker (a worker that streams
    #: merges batches, whose error fails them all), so its error is its own.
    solo: bool = False


@dataclass
class _Slot:
    channel: Channel
    state: str = "starting"  # starting | ready | down
    since: float = field(default_factory=time.monotonic)  # start-up, or the running batch
    queue: deque[tuple[int, Batch]] = field(default_factory=deque)
    pinned: deque[Batch] = field(default_factory=deque)
    info: dict[str, Any] = field(default_factory=dict)
    timed_out: bool = False
    failures: int = 0  # start-up failures in a row


class Scheduler:
    """Runs batches on the workers of one transport; see the module docstring."""

    def __init__(self, transport: Transport, specs: list[WorkerSpec], *, max_retries: int,
                 startup_timeout: float, batch_timeout: float | None = None) -> None:
        self.transport, self.specs, self.max_retries = transport, specs, max_retries
        self.startup_timeout, self.batch_timeout = startup_timeout, batch_timeout
        #: Set when the model's code changed under us, or no worker is left: calls raise it.
        self.failure: BaseException | None = None
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pending: deque[Batch] = deque()
        self._requests = itertools.count()
        self._slots: list[_Slot] = []
        self._stopping = False
        self._started, self._done = threading.Event(), threading.Event()
        self._startup_error: BaseException | None = None
        self._thread = threading.Thread(target=self._manage, name="codeferry-scheduler",
                                        daemon=True)

    # -- what callers do (any thread) ----------------------------------------------------

    def start(self) -> None:
        """Start every worker and wait for all handshakes; the first failure is raised."""
        try:
            for slot, spec in enumerate(self.specs):
                self._slots.append(_Slot(self.transport.start(slot, spec, self._inbox.put)))
        except BaseException:
            for started in self._slots:
                started.channel.stop(5.0)
            self.transport.close()
            raise
        self._thread.start()
        self._started.wait()
        if self._startup_error is not None:
            self.shutdown(wait=True, cancel=True)
            raise self._startup_error

    def submit(self, batches: list[Batch]) -> None:
        if self.failure is not None:
            raise self.failure
        if self._stopping:
            raise RuntimeError("this executor is shut down")
        self._inbox.put(("submit", batches))

    def cancel(self, call: Call) -> None:
        """Drop what of ``call`` is not sent yet (an abandoned iterator, a cancelled future)."""
        self._inbox.put(("cancel", call))

    def shutdown(self, *, wait: bool = True, cancel: bool = False, abort: bool = False) -> None:
        """Stop accepting work; finish what is queued (unless ``cancel``) and running (unless
        ``abort``: it fails at once), then stop the workers."""
        self._stopping = True
        self._inbox.put(("abort", None) if abort else ("shutdown", cancel))
        if wait and self._thread.is_alive():
            self._done.wait()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def pids(self) -> list[int | None]:
        return [s.channel.pid if s.state != "down" else None for s in self._slots]

    def info(self) -> list[dict[str, Any]]:
        return [dict(s.info) for s in self._slots]

    def iterate(self, call: Call) -> Iterator[Outcome]:
        """``call``'s outcomes as they arrive; closing the iterator cancels what is unsent."""
        assert call.outcomes is not None
        try:
            for _ in range(call.n):
                while True:
                    try:
                        yield call.outcomes.get(timeout=1.0)
                        break
                    except queue.Empty:
                        if not self.alive:  # never hang on a scheduler that is gone
                            raise self.failure or BrokenExecutorError(
                                "the executor's scheduler stopped.") from None
        finally:
            self.cancel(call)

    # -- the manager thread ----------------------------------------------------------------

    def _manage(self) -> None:
        try:
            while True:
                try:
                    item = self._inbox.get(timeout=self._wait_time())
                except queue.Empty:
                    item = None
                while item is not None:
                    self._handle(item)
                    try:
                        item = self._inbox.get_nowait()
                    except queue.Empty:
                        item = None
                self._check_deadlines()
                if self._startup_error is not None or (self._stopping and self._idle()):
                    break
                self._dispatch()
        except BaseException as exc:  # a bug here must not hang the callers
            logger.exception("codeferry: the scheduler failed")
            self._break(BrokenExecutorError(f"the scheduler failed: {exc!r}"), cause=exc)
        finally:
            self._started.set()
            for slot in self._slots:
                slot.channel.stop(5.0)
            self.transport.close()
            self._done.set()

    def _idle(self) -> bool:
        return not self._pending and not any(s.queue or s.pinned for s in self._slots)

    def _wait_time(self) -> float | None:
        deadlines = [self._deadline(s) for s in self._slots]
        known = [d for d in deadlines if d is not None]
        return max(0.0, min(known) - time.monotonic()) if known else None

    def _deadline(self, slot: _Slot) -> float | None:
        if slot.state == "starting":
            return slot.since + self.startup_timeout
        if slot.state == "ready" and slot.queue and self.batch_timeout and not slot.timed_out:
            return slot.since + self.batch_timeout
        return None

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for slot in self._slots:
            deadline = self._deadline(slot)
            if deadline is not None and now >= deadline:
                slot.timed_out = True
                slot.channel.kill()  # its "died" event does the rest

    def _handle(self, item: Any) -> None:
        if isinstance(item, Event):
            slot = self._slots[item.channel.slot] if item.channel.slot < len(self._slots) else None
            if slot is None or slot.channel is not item.channel:
                return  # from a worker already replaced
            getattr(self, f"_on_{item.kind}")(slot, item.body)
            return
        command, argument = item
        if command == "submit":
            for batch in argument:
                (self._slots[batch.slot].pinned if batch.slot is not None
                 else self._pending).append(batch)
        elif command == "cancel":
            self._pending = deque(b for b in self._pending if b.call is not argument)
        elif command == "shutdown" and argument:
            # ``cancel_futures``: what has not started is dropped; what runs finishes.
            cancelled, self._pending = self._pending, deque()
            for batch in cancelled:
                batch.call.future.cancel()
                self._finish(batch, BrokenExecutorError("the executor was shut down "
                                                        "before this batch ran."))
        elif command == "abort":
            self._break(BrokenExecutorError("the executor was closed while this batch ran.",
                                            fix="close the executor after its results are in."))

    def _on_ready(self, slot: _Slot, info: Any) -> None:
        slot.state, slot.info, slot.failures, slot.timed_out = "ready", dict(info), 0, False
        if all(s.state == "ready" for s in self._slots):
            self._started.set()

    def _on_failed(self, slot: _Slot, error: BaseException) -> None:
        index = self._slots.index(slot)
        if isinstance(error, CodeChangedError):
            # Not a crash: every replacement would find the same code. Stop everything.
            self._break(error)
            self._startup_error = self._startup_error or error
            return
        failure = WorkerStartupError(
            f"worker {index} could not start: {type(error).__name__}: {error}", worker=index,
            fix="the cause above is the worker's own traceback.")
        failure.__cause__ = error
        self._start_failed(slot, failure)

    def _start_failed(self, slot: _Slot, failure: WorkerStartupError) -> None:
        """A replacement that failed to start is tried again, up to ``max_retries`` times,
        but not one that timed out: a second try would wait as long again (a Ray actor that
        no node alive can place waits forever)."""
        index = self._slots.index(slot)
        if not self._started.is_set():
            # the constructor raises the first (the others' are often that one's echo)
            self._startup_error = self._startup_error or failure
            return
        slot.failures += 1
        if slot.failures <= self.max_retries and not slot.timed_out and self._wanted():
            logger.warning("codeferry: worker %d failed to start (%s); trying again", index,
                           failure)
            self._restart(slot)
            return
        logger.warning("codeferry: worker %d is down: %s", index, failure)
        slot.state = "down"
        for batch in slot.pinned:
            self._finish(batch, failure)
        slot.pinned.clear()
        if all(s.state == "down" for s in self._slots):
            self._break(BrokenExecutorError(
                "no worker is left and none could be started; the last start-up error is "
                "the cause.", worker=index,
                fix="see the cause; `codeferry doctor MODEL` shows each worker's error."),
                cause=failure)

    def _on_reply(self, slot: _Slot, body: tuple[int, bool, Any]) -> None:
        request, ok, value = body
        found = next((pair for pair in slot.queue if pair[0] == request), None)
        if found is None:
            return
        slot.queue.remove(found)
        slot.since = time.monotonic()  # the next batch in its queue starts now
        batch = found[1]
        if ok:
            self._succeed(batch, value)
        elif not self._split(batch, value):
            self._retry_or_fail(batch, value, final=batch.final_errors or batch.slot is not None
                                or isinstance(value, _NOT_RETRIED))

    def _on_died(self, slot: _Slot, body: str | tuple[str, BaseException]) -> None:
        """``body``: how it died, and what reported it (Ray's error) when there is one."""
        how, cause = body if isinstance(body, tuple) else (body, None)
        index = self._slots.index(slot)
        where = slot.channel.where
        if slot.state == "starting":
            how = "timed out" if slot.timed_out else how
            failure = WorkerStartupError(
                f"worker {index} ({where}) {how} while starting.", worker=index,
                fix="run `codeferry doctor MODEL` to see each worker's error.")
            failure.__cause__ = cause
            self._start_failed(slot, failure)
            return
        running, *queued = slot.queue or [None]
        slot.queue.clear()
        for _, waiting in reversed(queued):  # type: ignore[misc]  # not charged: they never ran
            waiting.attempts -= 1
            (slot.pinned if waiting.slot is not None else self._pending).appendleft(waiting)
        if running is not None:
            batch = running[1]
            if slot.timed_out:
                error: WorkerError = BatchTimeoutError(
                    f"worker {index} ({where}) ran a batch past batch_timeout="
                    f"{self.batch_timeout}s and was killed.", worker=index,
                    fix="raise batch_timeout, or use smaller batches.")
            else:
                error = WorkerError(f"worker {index} ({where}) {how} while running a batch.",
                                    worker=index)
            error.__cause__ = cause
            self._retry_or_fail(batch, error, final=batch.slot is not None)
        if self._wanted():
            self._restart(slot)

    def _wanted(self) -> bool:
        """Whether a worker that died, or failed to start, is replaced: unless shutting down
        with nothing left to run."""
        return not self._stopping or not self._idle()

    def _restart(self, slot: _Slot) -> None:
        index = self._slots.index(slot)
        slot.state, slot.since, slot.timed_out = "starting", time.monotonic(), False
        try:
            slot.channel = self.transport.start(index, self.specs[index], self._inbox.put)
        except Exception as exc:  # noqa: BLE001 - the zygote or Ray could not start one
            failure = WorkerStartupError(f"worker {index} could not be started: "
                                         f"{type(exc).__name__}: {exc}", worker=index)
            failure.__cause__ = exc
            self._start_failed(slot, failure)

    def _depth(self, slot: _Slot) -> int:
        """Batches a worker may hold: one that streams (``stream.py``) enough to fill its loop."""
        return STREAM_DEPTH if slot.info.get("streams") else self.transport.depth

    def _dispatch(self) -> None:
        now = time.monotonic()
        deepest = max([self.transport.depth, *(self._depth(s) for s in self._slots)])
        for depth in range(1, deepest + 1):  # one each first, then the next
            for slot in self._slots:
                if slot.state != "ready" or len(slot.queue) >= min(depth, self._depth(slot)) \
                        or any(running.solo for _, running in slot.queue):  # it runs alone
                    continue
                waiting = slot.pinned or self._pending
                while waiting:
                    batch = waiting.popleft()
                    if batch.call.start():
                        break
                else:
                    continue
                if batch.solo and slot.queue:  # it waits for a worker with nothing else
                    waiting.appendleft(batch)
                    continue
                if batch.packed is None:
                    batch.packed = self.transport.pack(batch.payload)
                request = next(self._requests)
                batch.attempts += 1
                if not slot.queue:
                    slot.since = now
                slot.queue.append((request, batch))
                slot.channel.send(request, batch.packed)

    # -- outcomes ------------------------------------------------------------------------

    def _succeed(self, batch: Batch, values: Any) -> None:
        if isinstance(batch.payload, Rpc):
            batch.call.deliver(Outcome(batch.indices[0], values))
            return
        for index, value in zip(batch.indices, values, strict=True):
            batch.call.deliver(Outcome(index, value))

    def _split(self, batch: Batch, error: BaseException) -> bool:
        """Send the halves of a batch of inputs that raised, first in line (``False``: a user
        function, work refused whole). A poison input costs ``2 log2(n)`` batches; a half keeps
        the attempts charged before (deaths), so an input alone gets its ``max_retries + 1``."""
        parts = [] if batch.final_errors or batch.slot is not None or self.failure or isinstance(
            error, (EngineRefusedError, RequestUnpicklingError)) else halves(
            batch.payload, batch.indices, batch.inputs)
        for indices, work, inputs in reversed(parts):
            self._pending.appendleft(Batch(indices, work, inputs, batch.call, solo=True,
                                           attempts=max(0, batch.attempts - 1), last_error=error))
        return bool(parts)

    def _retry_or_fail(self, batch: Batch, error: BaseException, *, final: bool) -> None:
        batch.last_error = error
        if not final and batch.attempts <= self.max_retries and not self.failure:
            self._pending.appendleft(batch)
            return
        if isinstance(batch.payload, Rpc):
            self._finish(batch, error)
            return
        times = "once (not retried)" if final else f"{batch.attempts} times"
        failure = BatchFailedError(
            f"a batch of {len(batch.indices)} inputs failed {times}; inputs {batch.indices}: "
            f"{error}", indices=tuple(batch.indices), inputs=tuple(batch.inputs),
            fix="the cause is the last attempt's error" + (
                "; inputs that crash the model can be isolated with batch_size=1."
                if len(batch.indices) > 1 else " on this input alone."))
        failure.__cause__ = error
        self._finish(batch, failure)

    def _finish(self, batch: Batch, error: BaseException) -> None:
        for index in batch.indices:
            batch.call.deliver(Outcome(index, error=error))

    def _break(self, error: BaseException, *, cause: BaseException | None = None) -> None:
        """No way on: fail everything not done with ``error``, and every later call."""
        if cause is not None:
            error.__cause__ = cause
        self.failure = self.failure or error
        doomed = list(self._pending)
        self._pending.clear()
        for slot in self._slots:
            doomed += [b for _, b in slot.queue] + list(slot.pinned)
            slot.queue.clear()
            slot.pinned.clear()
        for batch in doomed:
            self._finish(batch, self.failure)
        self._stopping = True

