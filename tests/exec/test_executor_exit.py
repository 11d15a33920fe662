"""``with Executor(...)`` waits for its work, as ``concurrent.futures`` executors do.

Leaving the block is ``shutdown(wait=True)``: what was submitted in it completes.
``shutdown(cancel_futures=True)`` cancels what has not started; what runs finishes. A
Ctrl-C (or ``SystemExit``) leaving the block stops at once instead of running the rest.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from _helpers import unique_model

import codeferry
from codeferry.errors import BrokenExecutorError


def nap(worker: Any, seconds: float, value: int, mark: str | None = None) -> int:
    if mark is not None:
        Path(mark).touch()
    time.sleep(seconds)
    return value


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return unique_model(tmp_path_factory.mktemp("exit"), "ex", tokenizer=True)


def executor(model: Path) -> codeferry.Executor:
    return codeferry.Executor(model, workers=1, start_method="fork", trust_remote_code=True,
                              preload=())


def test_leaving_the_block_waits_for_what_was_submitted(model: Path) -> None:
    with executor(model) as ex:
        futures = [ex.submit(nap, 0.2, i) for i in range(5)]
        outcomes = ex.generate_iter(["abc", "hello"], max_new_tokens=2)
    assert [f.result(timeout=0) for f in futures] == list(range(5))
    assert not any(f.cancelled() for f in futures)
    assert sorted(o.index for o in outcomes if o.error is None) == [0, 1]
    with pytest.raises(RuntimeError, match=r"closed|shut down"):
        ex.submit(nap, 0, 0)


def test_an_error_leaving_the_block_still_waits(model: Path) -> None:
    with pytest.raises(ValueError, match="the caller's"), executor(model) as ex:
        futures = [ex.submit(nap, 0.2, i) for i in range(3)]
        raise ValueError("the caller's own error")
    assert [f.result(timeout=0) for f in futures] == [0, 1, 2]


def test_cancel_futures_cancels_what_has_not_started(model: Path, tmp_path: Path) -> None:
    ex = executor(model)
    mark = tmp_path / "started"
    running = ex.submit(nap, 1.0, -1, str(mark))
    deadline = time.monotonic() + 30
    while not mark.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    queued = [ex.submit(nap, 0, i) for i in range(10)]
    ex.shutdown(wait=True, cancel_futures=True)
    assert running.result(timeout=0) == -1  # it ran: it finishes
    # One may have been sent on already, behind the running one (the pipeline): it ran.
    ran = [f for f in queued if not f.cancelled()]
    assert len(ran) <= 1 and all(f.result(timeout=0) == 0 for f in ran)


def test_an_interrupt_leaving_the_block_stops_at_once(model: Path) -> None:
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt), executor(model) as ex:
        futures = [ex.submit(nap, 2.0, i) for i in range(10)]
        raise KeyboardInterrupt
    assert time.monotonic() - started < 15  # not 10 naps of 2 s
    for future in futures:
        assert future.cancelled() or isinstance(future.exception(timeout=0), BrokenExecutorError)
