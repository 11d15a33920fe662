"""``codeferry run`` keeps what the model answered apart from what the machine did.

An input the model raised on gets its error line; a fault of the machine (the code changed
and a replacement worker refused it, a batch past ``--batch-timeout``, a broken executor)
stops the run with ``RunStoppedError`` and a resume line, and is never written: the same
command resumes. ``--retry-errors`` runs error lines again, the output rewritten whole.
"""

from __future__ import annotations

import errno
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

# Workers forked from this process start in about a second when torch and transformers are
# already imported here.
import torch
import transformers.modeling_utils  # noqa: F401
from _helpers import read_jsonl, run_cli, summary_only, write_jsonl

from codeferry import cli, errors
from codeferry._commands.run import record_path, run
from codeferry.testing import ModelSpec, write_model

pytestmark = pytest.mark.usefixtures("no_progress_bars")

# Read in the worker at call time, on a forward pass of a prompt that starts with the token
# (generated tokens come after it: they cannot trip it): KILL appends a line to the model's code (CHANGE_FILE) and SIGKILLs the worker, HANG
# sleeps a minute, FAIL raises (an answer: the model raised on that input).
PATCH = '''

import os as _os
import signal as _signal
import time as _time

_original_forward = FaultyForCausalLM.forward


def _forward(self, input_ids=None, **kwargs):
    if input_ids is not None:
        tokens = input_ids[:, :2].flatten().tolist()
        token = lambda name: int(_os.environ.get(name) or -1)
        if token("CODEFERRY_TEST_KILL_TOKEN") in tokens:
            with open(_os.environ["CODEFERRY_TEST_CHANGE_FILE"], "a") as handle:
                handle.write("\\n# changed during the run\\n")
            _os.kill(_os.getpid(), _signal.SIGKILL)
        if token("CODEFERRY_TEST_HANG_TOKEN") in tokens:
            _time.sleep(60)
        if token("CODEFERRY_TEST_FAIL_TOKEN") in tokens:
            raise RuntimeError("the model raised on purpose")
    return _original_forward(self, input_ids=input_ids, **kwargs)


FaultyForCausalLM.forward = _forward
'''

ENV = ("CODEFERRY_TEST_KILL_TOKEN", "CODEFERRY_TEST_HANG_TOKEN", "CODEFERRY_TEST_FAIL_TOKEN",
       "CODEFERRY_TEST_CHANGE_FILE")
#: Prompts of letters a to h; one that starts with "x", "y" or "z" trips the model.
ROWS = [{"id": f"r{i}", "prompt": "abcdefgh"[i:] + "abc"} for i in range(8)]
FAST = ["--workers", "1", "--start-method", "fork", "--batch-size", "1", "--max-new-tokens", "2",
        "--trust-remote-code"]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_model(tmp_path_factory.mktemp("faults") / "faulty",
                       ModelSpec(name="faulty", tokenizer=True))
    modeling = path / "modeling_faulty.py"
    modeling.write_text(modeling.read_text() + PATCH)
    return path


def token(model: Path, char: str) -> str:
    return str(json.loads((model / "vocab.json").read_text())[char])


def argv(model: Path, source: Path, output: Path, *extra: str) -> list[str]:
    return ["run", str(model), "--input", str(source), "-o", str(output), *FAST, *extra]


def rows_with(char: str, *at: int) -> list[dict[str, Any]]:
    return [{**row, "prompt": char + row["prompt"]} if i in at else row
            for i, row in enumerate(ROWS)]


def test_changed_code_after_a_killed_worker_stops_the_run_and_a_rerun_resumes(
    tmp_path: Path, faulty: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The issue's run: a file of the model changed, a worker was SIGKILLed, its replacement
    refused the changed code. The inputs left were written as error lines, which a rerun
    counted as done; now the run stops, writes none of them, and the command it prints
    resumes."""
    modeling = faulty / "modeling_faulty.py"
    original = modeling.read_bytes()
    source, output = write_jsonl(tmp_path / "in.jsonl", rows_with("z", 4)), tmp_path / "out.jsonl"
    monkeypatch.setenv("CODEFERRY_TEST_KILL_TOKEN", token(faulty, "z"))
    monkeypatch.setenv("CODEFERRY_TEST_CHANGE_FILE", str(modeling))
    try:
        code, out, err = run_cli(capsys, *argv(faulty, source, output))
    finally:
        changed = modeling.read_bytes()
        modeling.write_bytes(original)
    assert changed != original  # the worker did change the code
    rows = read_jsonl(output)
    assert [row["id"] for row in rows] == ["r0", "r1", "r2", "r3"]
    assert all("error" not in row for row in rows)
    assert (code, out) == (1, "")
    error = err[err.index("codeferry: error: "):]
    assert 'stopped at input "r4" (line 5 of the input): CodeChangedError' in error
    assert "4 of 8 lines" in error
    lines = err.splitlines()
    assert lines[-1] == ("codeferry: to resume, run: codeferry "
                         + shlex.join(argv(faulty, source, output)))
    # the code is back as it was: the printed command resumes where the run stopped
    monkeypatch.delenv("CODEFERRY_TEST_KILL_TOKEN")
    again = shlex.split(lines[-1].split(": ", 2)[2])[1:]
    code, out, err = run_cli(capsys, *again)
    assert (code, out) == (0, "") and summary_only(err, failed=0)
    rows = read_jsonl(output)
    assert [row["id"] for row in rows] == [row["id"] for row in ROWS]
    assert all(isinstance(row["output"], str) for row in rows)


def test_a_batch_past_its_timeout_stops_the_run(
    tmp_path: Path, faulty: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--batch-timeout reaches the executor; a batch that times out on every attempt is the
    machine's fault (a hung forward pass), not an answer for its inputs."""
    source, output = write_jsonl(tmp_path / "in.jsonl", rows_with("y", 2)), tmp_path / "out.jsonl"
    monkeypatch.setenv("CODEFERRY_TEST_HANG_TOKEN", token(faulty, "y"))
    started = time.monotonic()
    with pytest.raises(errors.RunStoppedError) as info:
        run(faulty, source, output, workers=1, start_method="fork", batch_size=1,
            max_new_tokens=2, trust_remote_code=True, batch_timeout=1.0)
    assert time.monotonic() - started < 45  # three attempts of a second, not three minutes
    assert isinstance(info.value.__cause__, errors.BatchTimeoutError)
    assert (info.value.written, info.value.total, info.value.stopped_at) == (2, 8, "r2")
    assert info.value.output == str(output) and info.value.resume is None
    assert "rerun the same command" in str(info.value)
    assert [row["id"] for row in read_jsonl(output)] == ["r0", "r1"]
    monkeypatch.delenv("CODEFERRY_TEST_HANG_TOKEN")
    result = run(faulty, source, output, workers=1, start_method="fork", batch_size=1,
                 max_new_tokens=2, trust_remote_code=True)
    assert (result.skipped, result.written, result.failed) == (2, 6, 0)
    assert [row["id"] for row in read_jsonl(output)] == [row["id"] for row in ROWS]


def test_what_is_an_answer_and_what_is_a_fault() -> None:
    """Each kind of error an outcome can hold, sorted: only what the worker's model raised
    on the input is an answer (its error line)."""
    from codeferry._commands.faults import machine_fault

    def failed(cause: BaseException, remote: bool = False) -> errors.BatchFailedError:
        if remote:
            cause.__cause__ = errors.RemoteTraceback("Traceback ...")
        error = errors.BatchFailedError("a batch failed.", indices=(0,))
        error.__cause__ = cause
        return error

    answers = [RuntimeError("the model raised"), ValueError("bad input"),
               errors.WorkerError("worker 0 raised Odd: x")]
    for cause in answers:
        assert machine_fault(failed(cause, remote=True)) is None
    faults: list[BaseException] = [
        errors.BatchTimeoutError("past batch_timeout"), errors.WorkerStartupError("no start"),
        errors.WorkerError("worker 0 died while running a batch."),  # no traceback: killed
        errors.CodeChangedError("changed"), errors.StoreUnavailableError("read-only"),
        errors.ClusterError("a node died"), MemoryError(),
        torch.cuda.OutOfMemoryError("CUDA out of memory"),
        OSError(errno.ENOSPC, "No space left on device"),
    ]
    for cause in faults:
        assert machine_fault(failed(cause)) is cause
    store = errors.StoreUnavailableError("read-only")  # raised in the worker: still the machine's
    assert machine_fault(failed(store, remote=True)) is store
    for error in (errors.BrokenExecutorError("broken"), errors.CodeChangedError("changed")):
        assert machine_fault(error) is error


def test_retry_errors_rewrites_the_output_whole(
    tmp_path: Path, faulty: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Error lines count as done for a rerun; --retry-errors runs them again, and the output
    is replaced whole: each id once, in input order. Killed midway, the output is as it was."""
    rows = rows_with("x", 1)
    rows[5] = {**rows[5], "prompt": "xy" + rows[5]["prompt"]}  # fails too, and can hang
    source, output = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    monkeypatch.setenv("CODEFERRY_TEST_FAIL_TOKEN", token(faulty, "x"))
    assert run_cli(capsys, *argv(faulty, source, output))[0] == 1
    before = output.read_bytes()
    assert [row["id"] for row in read_jsonl(output) if "error" in row] == ["r1", "r5"]
    monkeypatch.delenv("CODEFERRY_TEST_FAIL_TOKEN")
    assert run_cli(capsys, *argv(faulty, source, output))[0] == 1  # errors are done...
    assert output.read_bytes() == before

    # ...until retried on purpose; a retry killed midway (r1 written, r5 hanging) leaves the
    # output as it was
    env = {**os.environ, "CODEFERRY_TEST_HANG_TOKEN": token(faulty, "y"),
           "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "codeferry.cli",
                             *argv(faulty, source, output, "--retry-errors")],
                            env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if any(p.name.endswith(".codeferry.tmp") and p.stat().st_size
                   for p in tmp_path.iterdir()):
                break  # the new file is being written (the hang holds it there)
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if proc.stderr:
            proc.stderr.close()
    assert output.read_bytes() == before

    inode = output.stat().st_ino
    code, out, err = run_cli(capsys, *argv(faulty, source, output, "--retry-errors"))
    assert (code, out) == (0, "") and summary_only(err, 2, 0)
    rows = read_jsonl(output)
    assert [row["id"] for row in rows] == [row["id"] for row in ROWS]
    assert all(isinstance(row["output"], str) for row in rows)
    kept = [line for line in before.splitlines(keepends=True) if b'"error"' not in line]
    assert [line for line in output.read_bytes().splitlines(keepends=True)
            if json.loads(line)["id"] not in ("r1", "r5")] == kept  # the rest, byte for byte
    assert output.stat().st_ino != inode  # renamed into place, never written in place
    # the killed retry's temporary file was cleared away by the next
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["in.jsonl", "out.jsonl", record_path(output).name])


def test_more_workers_than_cores_are_warned_of(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--workers 64 on 2 cores ran silently slowly: one line says so (local workers only)."""
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    output = tmp_path / "out.jsonl"
    code, out, err = run_cli(capsys, "run", "-o", str(output), "--workers", "2",
                             "--start-method", "fork", "--batch-size", "2")
    assert (code, out) == (0, "")
    warning = ("codeferry: warning: 2 workers on 1 core: the extra ones only take turns "
               "(and memory), no faster; pass --workers 1.\n")
    assert err.startswith(warning) and summary_only(err[len(warning):], 8, 0)
    assert len(read_jsonl(output)) == 8


def test_help_documents_the_new_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    text = capsys.readouterr().out
    assert "--retry-errors" in text and "--batch-timeout SECONDS" in text
    assert run_cli(capsys, "run", "--batch-timeout", "0")[0] == 2


def test_workers_that_cannot_start_write_nothing_and_say_how_to_resume(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No worker can start (its model raises while it is built there): the machine's fault,
    before any line. Nothing is written, the error is typed, and the resume line is the same
    command, which runs every input once the cause is gone."""
    model = write_model(tmp_path / "stubborn", ModelSpec(name="stubborn", tokenizer=True))
    modeling = model / "modeling_stubborn.py"
    modeling.write_text(modeling.read_text() + (
        "\n\nimport os as _os\n_init = StubbornForCausalLM.__init__\n\n\n"
        "def _refuse(self, *args, **kwargs):\n"
        "    if _os.environ.get('CODEFERRY_TEST_REFUSE'):\n"
        "        raise MemoryError('no memory for the weights (on purpose)')\n"
        "    _init(self, *args, **kwargs)\n\n\n"
        "StubbornForCausalLM.__init__ = _refuse\n"))
    source, output = write_jsonl(tmp_path / "in.jsonl", ROWS), tmp_path / "out.jsonl"
    monkeypatch.setenv("CODEFERRY_TEST_REFUSE", "1")
    args = argv(model, source, output)
    assert cli.main(args) == 1
    err = capsys.readouterr().err
    assert "WorkerStartupError" in err or "could not start" in err, err
    assert f"codeferry: to resume, run: codeferry {shlex.join(args)}" in err.splitlines()
    assert not output.exists() or read_jsonl(output) == []
    monkeypatch.delenv("CODEFERRY_TEST_REFUSE")
    assert cli.main(args) == 0
    assert [row["id"] for row in read_jsonl(output)] == [row["id"] for row in ROWS]
