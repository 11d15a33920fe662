"""Workers that cannot start: the local channel's ``failed`` is its last event (the process
exits after it, or is killed, and that exit is not a second failure), so the start-up error
the executor raises is the worker's own, and a worker that is down stays down."""

from __future__ import annotations

import os
import queue
import signal
import time
from pathlib import Path
from typing import Any

import pytest

# Workers forked from this process start in about a second with these imported here.
import torch  # noqa: F401
import transformers.modeling_utils  # noqa: F401
from _helpers import refusing_model

import codeferry
from codeferry._exec.workers.transport import LocalTransport
from codeferry.errors import BrokenExecutorError, WorkerStartupError


@pytest.fixture
def refusing(tmp_path: Path) -> tuple[Path, Path]:
    return refusing_model(tmp_path)


def spec_of(model: Path) -> Any:
    """A real worker spec for ``model``, as the executor builds it (its flag not yet set)."""
    with codeferry.Executor(model, workers=1, start_method="fork", trust_remote_code=True) as ex:
        return ex._scheduler.specs[0]


def tries(flag: Path) -> int:
    path = Path(f"{flag}.tries")
    return len(path.read_text().split()) if path.exists() else 0


@pytest.mark.parametrize("warm", [False, True], ids=["fork", "zygote"])
def test_a_channel_says_failed_once_and_nothing_after(refusing: tuple[Path, Path],
                                                      warm: bool) -> None:
    """The worker sends its error and exits: the parent's reader posts ``failed`` and stops.
    A ``died`` after it reached the scheduler as a second start-up failure, which replaced
    the worker's own error with "died with exit code 0" when both arrived together."""
    model, flag = refusing
    spec = spec_of(model)
    flag.touch()
    events: queue.SimpleQueue[Any] = queue.SimpleQueue()
    transport = LocalTransport("fork", warm=warm)
    channel = transport.start(0, spec, events.put)
    try:
        first = events.get(timeout=60)
        assert first.kind == "failed", first
        assert "no memory for the weights" in str(first.body.__cause__ or first.body)
        pid = int(Path(f"{flag}.tries").read_text().split()[0])
        deadline = time.monotonic() + 30
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid)  # the worker has exited: anything more would be posted now
        with pytest.raises(queue.Empty):
            extra = events.get(timeout=2)
            pytest.fail(f"an event after failed: {extra.kind} {extra.body}")
    finally:
        channel.stop(5.0)
        transport.close()


def test_a_worker_that_failed_and_does_not_exit_is_killed(refusing: tuple[Path, Path]) -> None:
    """Its model left a thread that is not a daemon: the worker sent ``failed`` and then
    waits on that thread for ever. The channel kills it 5 s after ``failed``."""
    model, flag = refusing
    spec = spec_of(model)
    flag.touch()
    Path(f"{flag}.hold").touch()
    events: queue.SimpleQueue[Any] = queue.SimpleQueue()
    transport = LocalTransport("fork")
    channel = transport.start(0, spec, events.put)
    try:
        assert events.get(timeout=60).kind == "failed"
        # Wait on the exit code, not on /proc: a killed worker is a zombie (gone for /proc)
        # until the reader's join reaps it, and only then is its exit code known (CI saw None).
        deadline = time.monotonic() + 30
        while channel.process.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert channel.process.exitcode == -signal.SIGKILL, "the worker that failed was not killed"
    finally:
        channel.stop(5.0)
        transport.close()


def test_a_worker_that_is_down_is_not_started_again(refusing: tuple[Path, Path]) -> None:
    """Worker 0 dies and every replacement fails: after ``max_retries + 1`` tries it is down
    and stays down while worker 1 serves; the exit of its last try does not start it again."""
    model, flag = refusing
    with codeferry.Executor(model, workers=2, start_method="fork", trust_remote_code=True,
                            max_retries=1) as ex:
        flag.touch()
        pid = ex.pids[0]
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while ex.pids[0] is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ex.pids[0] is None, "worker 0 never went down"
        time.sleep(3)  # a restart of the down worker would try (and fail) within this
        assert tries(flag) == 2, Path(f"{flag}.tries").read_text()
        assert ex.pids[0] is None and ex.pids[1] is not None
        assert len(ex.generate(["hello", "there"], max_new_tokens=2)) == 2  # worker 1 serves
    assert tries(flag) == 2


def test_the_start_up_error_raised_is_the_workers_own(refusing: tuple[Path, Path]) -> None:
    model, flag = refusing
    flag.touch()
    with pytest.raises(WorkerStartupError) as info:
        codeferry.Executor(model, workers=2, start_method="fork", trust_remote_code=True)
    assert "could not start: MemoryError: no memory for the weights" in str(info.value)
    assert not isinstance(info.value, BrokenExecutorError)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
