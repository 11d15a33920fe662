"""The executor: results in order, iterators, collective_rpc, a crash-case table, no orphans."""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import codeferry
from codeferry.errors import (
    BatchFailedError,
    BatchTimeoutError,
    BrokenExecutorError,
    TrustRequiredError,
    WorkerStartupError,
)
from codeferry.testing import ModelSpec, write_model

CRASHING_FORWARD = '''

import json as _json
import os as _os


def _maybe_crash(input_ids):
    plan_path = _os.environ.get("CODEFERRY_TEST_CRASH_PLAN")
    if not plan_path or not _os.path.exists(plan_path) or input_ids is None:
        return
    plan = _json.load(open(plan_path))
    if plan["token"] not in input_ids.tolist()[0]:
        return
    count_path = plan_path + ".count"
    count = int(open(count_path).read()) if _os.path.exists(count_path) else 0
    if count >= plan["times"]:
        return
    open(count_path, "w").write(str(count + 1))
    kind = plan["kind"]
    if kind == "raise":
        raise RuntimeError("the model raised on purpose")
    if kind == "exit":
        _os._exit(3)
    if kind == "kill":
        _os.kill(_os.getpid(), 9)
    if kind == "hang":
        import time as _time

        _time.sleep(3600)
    if kind == "segv":
        import ctypes

        ctypes.string_at(0)


_original_forward = {cls}.forward


def _forward(self, input_ids=None, **kwargs):
    _maybe_crash(input_ids)
    return _original_forward(self, input_ids=input_ids, **kwargs)


{cls}.forward = _forward
'''

PROMPTS = ["abc", "hello", "zzz crash here", "tiny model", "one more", "last"]


def crash_model(root: Path) -> Path:
    path = write_model(root / "crashy", ModelSpec(name="crashy", tokenizer=True))
    modeling = path / "modeling_crashy.py"
    modeling.write_text(modeling.read_text() + CRASHING_FORWARD.format(cls="CrashyForCausalLM"))
    return path


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    os.environ["CODEFERRY_TEST_CRASH_PLAN"] = str(path)
    yield path
    os.environ.pop("CODEFERRY_TEST_CRASH_PLAN", None)


@pytest.fixture(scope="module")
def executor(tmp_path_factory: pytest.TempPathFactory, plan: Path) -> Iterator[codeferry.Executor]:
    path = crash_model(tmp_path_factory.mktemp("models"))
    with codeferry.Executor(path, workers=2, start_method="fork", trust_remote_code=True,
                            batch_size=2, max_retries=2) as ex:
        yield ex


def set_plan(plan: Path, kind: str | None, times: int, token: int) -> None:
    Path(str(plan) + ".count").unlink(missing_ok=True)
    if kind is None:
        plan.unlink(missing_ok=True)
    else:
        plan.write_text(json.dumps({"kind": kind, "times": times, "token": token}))


def z_token(ex: codeferry.Executor) -> int:
    return int(ex.collective_rpc(token_of_z)[0])


def token_of_z(worker: Any) -> int:
    return int(worker.tokenizer.convert_tokens_to_ids("z"))


def worker_pid(worker: Any) -> int:
    return os.getpid()


def worker_cores(worker: Any) -> list[int]:
    return sorted(os.sched_getaffinity(0))


def test_results_in_input_order_and_iterators(executor: codeferry.Executor, plan: Path) -> None:
    set_plan(plan, None, 0, 0)
    texts = executor.generate(PROMPTS, max_new_tokens=4)
    assert len(texts) == len(PROMPTS) and all(isinstance(t, str) for t in texts)
    # same inputs, one at a time: batching and workers change nothing (greedy)
    assert executor.generate(PROMPTS, max_new_tokens=4, batch_size=1) == texts
    outcomes = list(executor.generate_iter(PROMPTS, max_new_tokens=4))
    assert sorted(o.index for o in outcomes) == list(range(len(PROMPTS)))
    assert {o.index: o.value for o in outcomes} == dict(enumerate(texts))
    scores = executor.score(PROMPTS[:2])
    assert len(scores[0]["token_logprobs"]) == len(scores[0]["tokens"])
    assert scores[0]["logprob"] == pytest.approx(sum(scores[0]["token_logprobs"]))
    assert all(lp <= 0 for lp in scores[0]["token_logprobs"])
    vectors = executor.embed(PROMPTS, pooling="mean")
    assert len(vectors) == len(PROMPTS) and len({len(v) for v in vectors}) == 1
    assert len(set(executor.collective_rpc(worker_pid))) == 2


def test_the_monitor_replaces_a_worker_that_dies_between_calls(
    executor: codeferry.Executor, plan: Path
) -> None:
    set_plan(plan, None, 0, 0)
    expected = executor.generate(PROMPTS, max_new_tokens=3)
    victim = executor.pids[0]
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while executor.pids[0] == victim and time.monotonic() < deadline:
        time.sleep(0.1)
    assert executor.pids[0] not in (None, victim)  # replaced with no call in flight
    assert executor.generate(PROMPTS, max_new_tokens=3) == expected
    assert_bound(executor)  # the replacement too


def assert_bound(executor: codeferry.Executor) -> None:
    """Two workers of one thread on a machine of two cores or more: each runs on a core of
    its own (``layout.cores``), as ``worker_info`` says; on one core, on it."""
    usable = sorted(os.sched_getaffinity(0))
    seen = executor.collective_rpc(worker_cores)
    said = [info["cores"] for info in executor.worker_info]
    if len(usable) >= 2:
        assert seen == said == [[usable[0]], [usable[1]]]
    else:
        assert seen == [usable, usable] and said == [[], []]


def test_each_local_cpu_worker_runs_on_cores_of_its_own(executor: codeferry.Executor) -> None:
    assert_bound(executor)


CRASHES = [
    # kind,  times, outcome
    ("raise", 1, "recovers"),
    ("exit", 1, "recovers"),
    ("kill", 1, "recovers"),
    ("segv", 1, "recovers"),
    ("raise", 99, "fails"),
    ("kill", 99, "fails"),
]


@pytest.mark.parametrize("kind, times, outcome", CRASHES)
def test_crash_table(executor: codeferry.Executor, plan: Path, kind: str, times: int,
                     outcome: str) -> None:
    set_plan(plan, None, 0, 0)
    expected = executor.generate(PROMPTS, max_new_tokens=3)
    set_plan(plan, kind, times, z_token(executor))
    pids_before = set(executor.pids)
    outcomes = list(executor.generate_iter(PROMPTS, max_new_tokens=3))
    # every input exactly one outcome
    assert sorted(o.index for o in outcomes) == list(range(len(PROMPTS)))
    crashed = PROMPTS.index("zzz crash here")
    batch = {crashed - crashed % 2, crashed - crashed % 2 + 1}
    # A batch the model raised on is split until the input that raises is alone: only it
    # fails, its batch-mate is answered. A worker that dies fails its whole batch (what
    # killed it cannot be told apart), as before.
    if kind == "raise":
        batch = {crashed}
    for o in outcomes:
        if outcome == "fails" and o.index in batch:
            assert isinstance(o.error, BatchFailedError)
            assert set(o.error.indices) == batch and "zzz crash here" in o.error.inputs
            assert o.error.__cause__ is not None
        else:
            assert o.error is None and o.value == expected[o.index]
    if kind in ("exit", "kill", "segv"):
        assert set(executor.pids) != pids_before  # the dead worker was replaced
    if outcome == "fails":
        with pytest.raises(BatchFailedError):
            set_plan(plan, kind, times, z_token(executor))
            executor.generate(PROMPTS, max_new_tokens=3)
    set_plan(plan, None, 0, 0)


def test_trust_is_required(tmp_path: Path) -> None:
    with pytest.raises(TrustRequiredError):
        codeferry.Executor(crash_model(tmp_path), workers=1)


def test_startup_error_arrives_typed_with_the_workers_traceback(tmp_path: Path) -> None:
    path = crash_model(tmp_path)
    modeling = path / "modeling_crashy.py"
    modeling.write_text(modeling.read_text() + "\nimport multiprocessing\n"
                        "if multiprocessing.parent_process():\n    raise ImportError('no gpu here')\n")
    with pytest.raises(WorkerStartupError) as info:
        codeferry.Executor(path, workers=1, start_method="fork", trust_remote_code=True)
    assert "no gpu here" in str(info.value.__cause__.__cause__)


ORPHAN_SCRIPT = """
import sys, codeferry
ex = codeferry.Executor(sys.argv[1], workers=2, start_method=sys.argv[2], trust_remote_code=True)
print(" ".join(str(p) for p in ex.pids), flush=True)
import time
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie waiting for its reaper is gone for our purpose
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
def test_killing_the_parent_leaves_no_orphan(tmp_path: Path, method: str) -> None:
    path = crash_model(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", ORPHAN_SCRIPT, str(path), method],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 2 and all(alive(p) for p in pids)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    deadline = time.monotonic() + 15
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in pids)


def worker_facts(worker: Any) -> dict[str, Any]:
    import sys as _sys

    config_cls = worker.classes["AutoConfig"]
    return {
        "ppid": os.getppid(),
        "module_loaded_here": config_cls.__module__ in _sys.modules,
        "config_module": config_cls.__module__,
    }


def test_warm_start_forks_from_a_zygote_and_still_loads_the_code_itself(
    tmp_path: Path, plan: Path
) -> None:
    from codeferry._exec.workers.zygote import shared_zygote

    set_plan(plan, None, 0, 0)
    path = crash_model(tmp_path)
    zygote = shared_zygote()
    with codeferry.Executor(path, workers=2, trust_remote_code=True, warm=True,
                            batch_size=2) as warm:
        facts = warm.collective_rpc(worker_facts)
        assert {f["ppid"] for f in facts} == {zygote.process.pid}
        assert all(f["module_loaded_here"] for f in facts)
        texts = warm.generate(PROMPTS, max_new_tokens=3)
        # a killed warm worker is replaced by a new fork of the zygote
        set_plan(plan, "kill", 1, z_token(warm))
        pids = set(warm.pids)
        assert warm.generate(PROMPTS, max_new_tokens=3) == texts
        assert set(warm.pids) != pids
    set_plan(plan, None, 0, 0)
    assert zygote.alive and zygote.remote_modules() == []  # it never holds model code
    with codeferry.Executor(path, workers=1, start_method="fork", trust_remote_code=True) as cold:
        assert cold.generate(PROMPTS, max_new_tokens=3) == texts


def test_tokenizers_that_return_token_type_ids_work_with_causal_lms(tmp_path: Path) -> None:
    path = write_model(tmp_path / "ttids", ModelSpec(name="ttids", tokenizer=True))
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["model_input_names"] = ["input_ids", "token_type_ids", "attention_mask"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    with codeferry.Executor(path, workers=1, start_method="fork", trust_remote_code=True) as ex:
        assert len(ex.generate(["abc", "hello there"], max_new_tokens=2)) == 2
        assert len(ex.score(["abc"])[0]["token_logprobs"]) == 2
        assert len(ex.embed(["abc"])[0]) == 32


def test_many_threads_and_open_iterators_share_one_executor(
    executor: codeferry.Executor, plan: Path
) -> None:
    """Callers in several threads, an iterator left open, collective_rpc meanwhile: every
    input still gets exactly one outcome (the scheduler's manager thread owns them all)."""
    set_plan(plan, None, 0, 0)
    expected = executor.generate(PROMPTS, max_new_tokens=3)
    opened = executor.generate_iter(PROMPTS, max_new_tokens=3)
    first = next(opened)  # left open while the others run
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: executor.generate(PROMPTS, max_new_tokens=3), range(4)))
        pids = executor.collective_rpc(worker_pid)
    assert results == [expected] * 4 and len(set(pids)) == 2
    rest = list(opened)
    assert sorted(o.index for o in [first, *rest]) == list(range(len(PROMPTS)))
    assert {o.index: o.value for o in [first, *rest]} == dict(enumerate(expected))
    abandoned = executor.generate_iter(PROMPTS * 4, max_new_tokens=3)
    next(abandoned)
    abandoned.close()  # what was not sent is dropped; the executor goes on
    assert executor.generate(PROMPTS, max_new_tokens=3) == expected


def test_futures_submit_map_and_shutdown(tmp_path: Path) -> None:
    path = write_model(tmp_path / "m", ModelSpec(name="futs", tokenizer=True))
    ex = codeferry.Executor(path, workers=1, start_method="fork", trust_remote_code=True)
    with ex:
        future = ex.submit(worker_pid)
        assert isinstance(future, concurrent.futures.Future)
        assert future.result(timeout=60) == ex.pids[0]
        assert list(ex.map(plus, range(5), range(10, 15))) == [10, 12, 14, 16, 18]
        failing = ex.submit(raise_value_error, "from the worker")
        with pytest.raises(ValueError, match="from the worker"):
            failing.result(timeout=60)
        queued = [ex.submit(worker_pid) for _ in range(20)]
        ex.shutdown(wait=True, cancel_futures=True)
    assert all(f.done() for f in queued)
    assert any(f.cancelled() for f in queued)  # the ones not started
    assert all(f.result() == f.result() for f in queued if not f.cancelled())
    with pytest.raises(RuntimeError, match=r"shut down|closed"):
        ex.submit(worker_pid)


def plus(worker: Any, a: int, b: int) -> int:
    return a + b


def raise_value_error(worker: Any, text: str) -> None:
    raise ValueError(text)


def test_a_hung_batch_is_killed_retried_then_failed_typed(tmp_path: Path, plan: Path) -> None:
    path = crash_model(tmp_path)
    with codeferry.Executor(path, workers=1, start_method="fork", trust_remote_code=True,
                            batch_size=2, max_retries=1, batch_timeout=3) as ex:
        set_plan(plan, "hang", 99, z_token(ex))
        started = time.monotonic()
        outcomes = list(ex.generate_iter(PROMPTS, max_new_tokens=3))
        assert time.monotonic() - started < 60  # never hangs the caller
        failed = [o for o in outcomes if o.error is not None]
        assert sorted(o.index for o in outcomes) == list(range(len(PROMPTS)))
        assert {o.index for o in failed} == {2, 3}
        error = failed[0].error
        assert isinstance(error, BatchFailedError) and "zzz crash here" in error.inputs
        assert isinstance(error.__cause__, BatchTimeoutError)
        set_plan(plan, "hang", 1, z_token(ex))  # hangs once: the retry succeeds
        assert all(isinstance(t, str) for t in ex.generate(PROMPTS, max_new_tokens=3))
    set_plan(plan, None, 0, 0)


def test_a_worker_that_cannot_be_replaced_breaks_the_executor_typed(tmp_path: Path) -> None:
    path = write_model(tmp_path / "m", ModelSpec(name="brk", tokenizer=True))
    ex = codeferry.Executor(path, workers=1, start_method="fork", trust_remote_code=True,
                            max_retries=1)
    with ex:
        shutil.rmtree(path)  # every replacement now fails to start
        pid = ex.pids[0]
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while ex._scheduler.failure is None and time.monotonic() < deadline:
            time.sleep(0.1)
        with pytest.raises(BrokenExecutorError) as info:
            ex.generate(["hello"])
        assert isinstance(info.value, concurrent.futures.BrokenExecutor)
        assert isinstance(info.value.__cause__, WorkerStartupError)


HANG_AT_START = """

def _hang_at_start(init):
    def __init__(self, *args, **kwargs):
        import os
        import time

        flag = os.environ.get("CODEFERRY_TEST_HANG_AT_START")
        if flag and os.path.exists(flag):
            time.sleep(3600)
        init(self, *args, **kwargs)
    return __init__


HangstartForCausalLM.__init__ = _hang_at_start(HangstartForCausalLM.__init__)
"""


def test_a_replacement_that_hangs_while_starting_is_not_tried_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``startup_timeout`` bounds a start: a replacement that hangs while it builds the
    model is down after one timeout, not after ``max_retries + 1`` of them (a second try would
    wait as long again), and the executor breaks typed."""
    import logging

    path = write_model(tmp_path / "m", ModelSpec(name="hangstart", tokenizer=True))
    modeling = path / "modeling_hangstart.py"
    modeling.write_text(modeling.read_text() + HANG_AT_START)
    flag = tmp_path / "hang"
    monkeypatch.setenv("CODEFERRY_TEST_HANG_AT_START", str(flag))
    ex = codeferry.Executor(path, workers=1, start_method="fork", trust_remote_code=True,
                            max_retries=2, startup_timeout=15)
    with ex, caplog.at_level(logging.WARNING, logger="codeferry._exec.scheduler"):
        flag.touch()  # from now on every start hangs
        pid = ex.pids[0]
        assert pid is not None
        started = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        deadline = started + 120
        while ex._scheduler.failure is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ex._scheduler.failure is not None
        assert time.monotonic() - started < 15 * 2  # one timeout, not three
        with pytest.raises(BrokenExecutorError) as info:
            ex.generate(["hello"])
        assert isinstance(info.value.__cause__, WorkerStartupError)
        assert "timed out while starting" in str(info.value.__cause__)
    said = [r.getMessage() for r in caplog.records]
    assert not any("trying again" in s for s in said), said
    assert any("is down" in s and "timed out" in s for s in said), said
