"""Under trust, the parent's decision is a digest: every worker runs exactly it, or says so.

A worker started, or started again to replace one that died, after the model folder
changed finds other code than the parent checked: it raises ``CodeChangedError`` naming
both digests before executing any of it, and the executor does not try again.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

# Workers forked from this process start in about a second when torch and transformers are
# already imported here.
import torch  # noqa: F401
import transformers.modeling_utils  # noqa: F401

import codeferry
from codeferry._commands import doctor as _doctor
from codeferry._trust import options as _options
from codeferry.errors import CodeChangedError, RemoteTraceback
from codeferry.testing import ModelSpec, write_model


def pinned_model(root: Path) -> Path:
    return write_model(root / "pinned", ModelSpec(name="pinned", tokenizer=True))


def change(path: Path) -> str:
    """Edit the modeling file as a `git pull` would; return the digest of the code now."""
    modeling = path / "modeling_pinned.py"
    modeling.write_text(modeling.read_text() + "\nCHANGED_AFTER_THE_CHECK = True\n")
    return codeferry.resolve(path).digest


def assert_names_both(err: CodeChangedError, checked: str, now: str) -> None:
    assert (err.expected, err.actual) == (checked, now) and checked != now
    assert checked in str(err) and now in str(err)


def live_workers() -> list[Any]:
    return [p for p in mp.active_children() if p.name.startswith("codeferry-worker")]


@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
def test_a_replacement_worker_refuses_code_changed_since_the_check(
    method: str, tmp_path: Path
) -> None:
    path = pinned_model(tmp_path)
    earlier = set(live_workers())  # another test's workers may still be on their way out
    with codeferry.Executor(path, workers=1, start_method=method, trust_remote_code=True) as ex:
        checked = ex.digest
        assert checked == codeferry.resolve(path).digest
        assert len(ex.generate(["abc", "hello"], max_new_tokens=2)) == 2
        now = change(path)
        pid = ex.pids[0]
        assert pid is not None
        os.kill(pid, signal.SIGKILL)  # the executor replaces it: with the new code?
        with pytest.raises(CodeChangedError) as info:
            ex.generate(["abc", "hello"], max_new_tokens=2)
        assert_names_both(info.value, checked, now)
        assert isinstance(info.value.__cause__, RemoteTraceback)  # the worker found it
        # Not a crash: nothing is retried. The next call fails at once, and no worker is
        # being started again behind it.
        started = time.monotonic()
        with pytest.raises(CodeChangedError):
            ex.generate(["abc"], max_new_tokens=2)
        assert time.monotonic() - started < 1.0
        time.sleep(1.5)  # a few rounds of the monitor: none may start a new worker
        seen = {p.pid for p in live_workers()} - {p.pid for p in earlier}
        deadline = time.monotonic() + 30  # the refused one exits by itself (slowly, under load)
        while not set(live_workers()) <= earlier and time.monotonic() < deadline:
            assert {p.pid for p in live_workers()} - {p.pid for p in earlier} <= seen
            time.sleep(0.2)
        assert set(live_workers()) <= earlier


def test_workers_started_after_the_check_refuse_changed_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = pinned_model(tmp_path)
    checked: list[str] = []
    real_resolve = _options.resolve  # the Executor resolves through its ModelOptions

    def resolve_then_change(*args: Any, **kwargs: Any) -> codeferry.Bundle:
        bundle = real_resolve(*args, **kwargs)  # the parent's check...
        checked.append(bundle.digest)
        change(path)  # ...and the folder changes before any worker starts
        return bundle

    monkeypatch.setattr(_options, "resolve", resolve_then_change)
    with pytest.raises(CodeChangedError) as info:
        codeferry.Executor(path, workers=2, start_method="spawn", trust_remote_code=True)
    assert_names_both(info.value, checked[0], codeferry.resolve(path).digest)
    assert isinstance(info.value.__cause__, RemoteTraceback)


def test_a_caller_checked_digest_is_refused_when_the_code_differs(tmp_path: Path) -> None:
    path = pinned_model(tmp_path)
    checked = codeferry.resolve(path).digest
    now = change(path)
    with pytest.raises(CodeChangedError) as info:
        codeferry.Executor(path, workers=1, trust_remote_code=True, digest=checked)
    assert_names_both(info.value, checked, now)
    assert live_workers() == []  # refused before any worker started


def test_doctor_workers_refuse_code_changed_after_the_parent_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = pinned_model(tmp_path)
    checked = codeferry.resolve(path).digest
    real_load = _doctor.load_pinned
    now: list[str] = []

    def load_then_change(*args: Any, **kwargs: Any) -> Any:
        classes = real_load(*args, **kwargs)  # the parent loads what it checked...
        now.append(change(path))  # ...then the folder changes; spawned workers load anew
        return classes

    monkeypatch.setattr(_doctor, "load_pinned", load_then_change)
    report = _doctor.doctor(str(path), trust_remote_code=True, workers=1, start_method="spawn")
    assert report.digest == checked and not report.ok
    err = report.workers[0].error
    assert isinstance(err, CodeChangedError)
    assert_names_both(err, checked, now[0])
