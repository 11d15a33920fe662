"""``codeferry run``: input formats, output order and ids, each task, trust, bad input, resume."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

# Workers forked from this process start in about a second when torch and transformers are
# already imported here (instead of importing them in every worker).
import torch  # noqa: F401
import transformers.modeling_utils  # noqa: F401
from _helpers import GENERATED, SUMMARY, read_jsonl, run_cli, summary_only, write_jsonl

import codeferry
from codeferry import cli
from codeferry._commands.run import read_inputs
from codeferry._trust.decide import DEMO_DIGEST
from codeferry.errors import InputFormatError
from codeferry.testing import ModelSpec, write_model

DEMO = Path(cli._demo())

# The slow model: sleeps CODEFERRY_TEST_SLOW seconds per forward pass, and raises on inputs
# holding the token CODEFERRY_TEST_FAIL_TOKEN. Both are read at call time in the worker.
PATCH = '''

import os as _os
import time as _time

_original_forward = SlowyForCausalLM.forward


def _forward(self, input_ids=None, **kwargs):
    if _os.environ.get("CODEFERRY_TEST_SLOW"):
        _time.sleep(float(_os.environ["CODEFERRY_TEST_SLOW"]))
    fail = _os.environ.get("CODEFERRY_TEST_FAIL_TOKEN")
    if fail and input_ids is not None and int(fail) in input_ids.flatten().tolist():
        raise RuntimeError("the model raised on purpose")
    return _original_forward(self, input_ids=input_ids, **kwargs)


SlowyForCausalLM.forward = _forward
'''

RESUME_INPUTS = [{"id": f"r{i}", "prompt": f"prompt number {i}"} for i in range(24)]
FAST = ["--start-method", "fork", "--workers", "1"]


@pytest.fixture(scope="module", autouse=True)
def _no_load_bars() -> Any:
    """Forked workers inherit transformers' progress-bar switch from this process."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    yield
    if was:
        hf_logging.enable_progress_bar()


@pytest.fixture(autouse=True)
def _quiet_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    monkeypatch.delenv("CODEFERRY_TEST_SLOW", raising=False)
    monkeypatch.delenv("CODEFERRY_TEST_FAIL_TOKEN", raising=False)


@pytest.fixture(scope="module")
def slowy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_model(tmp_path_factory.mktemp("run") / "slowy", ModelSpec(name="slowy", tokenizer=True))
    modeling = path / "modeling_slowy.py"
    modeling.write_text(modeling.read_text() + PATCH)
    return path


@pytest.fixture(scope="module")
def resume_case(tmp_path_factory: pytest.TempPathFactory, slowy: Path) -> tuple[Path, bytes]:
    """The resume test's input, and the output of one clean, uninterrupted run of it."""
    root = tmp_path_factory.mktemp("resume")
    source = write_jsonl(root / "in.jsonl", RESUME_INPUTS)
    clean = root / "clean.jsonl"
    assert cli.main(["run", str(slowy), "--input", str(source), "--output", str(clean),
                     "--trust-remote-code", "--batch-size", "1", "--max-new-tokens", "3",
                     *FAST]) == 0
    return source, clean.read_bytes()


def resume_argv(slowy: Path, source: Path, output: Path) -> list[str]:
    return ["run", str(slowy), "--input", str(source), "--output", str(output),
            "--trust-remote-code", "--batch-size", "1", "--max-new-tokens", "3", *FAST]


# -- the demo -------------------------------------------------------------------------------


def test_demo_digest_is_pinned() -> None:
    """Regenerating the demo changes its digest: update DEMO_DIGEST in _trust.py with it."""
    assert codeferry.resolve(DEMO).digest == DEMO_DIGEST


def test_no_arguments_runs_the_demo_on_its_prompts() -> None:
    """The README's first command: demo model, bundled prompts, 2 spawn workers, JSONL out.

    Through ``python -m codeferry``: spawn workers import that main module again, which
    must not run the command a second time."""
    env = {**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    proc = subprocess.run([sys.executable, "-m", "codeferry", "run"], check=False,
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [row["id"] for row in rows] == list(range(1, 9))  # plain text: id = line number
    assert all(isinstance(row["output"], str) and set(row) == GENERATED for row in rows)
    # no progress bar in a pipe: only the closing summary
    assert re.fullmatch(SUMMARY.format(written=8, failed=0), proc.stderr), proc.stderr


def test_tampered_demo_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    copy = shutil.copytree(DEMO, tmp_path / "demo")
    modeling = copy / "modeling_charlm.py"
    modeling.write_text(modeling.read_text() + "\nimport os  # changed\n")
    output = tmp_path / "out.jsonl"
    code, out, err = run_cli(capsys, "run", str(copy), "--input", str(DEMO / "prompts.txt"),
                             "--output", str(output))
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("codeferry: error: ")
    assert "--trust-remote-code" in err and "modeling_charlm.py" in err
    assert not output.exists()


def test_embed_on_the_demo_without_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "in.txt"
    source.write_text("first line\n\n  second line\nthird\n")
    output = tmp_path / "out.jsonl"
    code, out, err = run_cli(capsys, "run", str(DEMO), "--input", str(source), "--output", str(output),
                             "--task", "embed", "--pooling", "last", *FAST)
    assert (code, out) == (0, "") and summary_only(err, 3, 0)
    rows = read_jsonl(output)
    assert [row["id"] for row in rows] == [1, 3, 4]  # the blank line 2 is skipped
    assert all(len(row["embedding"]) == 48 for row in rows)  # the demo's hidden size


# -- input, order, tasks, trust ---------------------------------------------------------------


def test_generate_mixed_input_in_input_order_with_a_failed_batch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], slowy: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    vocab = json.loads((slowy / "vocab.json").read_text())
    monkeypatch.setenv("CODEFERRY_TEST_FAIL_TOKEN", str(vocab["q"]))  # "q" makes the model raise
    source = tmp_path / "in.jsonl"
    source.write_text(
        '{"id": "a", "prompt": "hello there"}\n'
        "a plain line\n"
        "\n"
        '{"id": 7, "text": "text key"}\n'
        '{"id": "boom", "prompt": "quiet"}\n'
        '{"id": "b", "prompt": "abc", "extra": 1}\n'
        + "".join(f'{{"id": "n{i}", "prompt": "number {i}"}}\n' for i in range(6))
    )
    output = tmp_path / "out.jsonl"
    code, out, err = run_cli(capsys, "run", str(slowy), "--input", str(source), "--output", str(output),
                             "--trust-remote-code", "--batch-size", "1", "--max-new-tokens", "2",
                             "--start-method", "fork", "--workers", "2")
    # a failed input: exit 1, quiet in a pipe but for the closing summary
    assert code == 1 and out == "" and re.fullmatch(SUMMARY.format(written=11, failed=1), err)
    rows = read_jsonl(output)
    assert [row["id"] for row in rows] == ["a", 2, 7, "boom", "b", *[f"n{i}" for i in range(6)]]
    failed = [row for row in rows if "error" in row]
    assert [row["id"] for row in failed] == ["boom"]
    assert "RuntimeError: the model raised on purpose" in failed[0]["error"]
    assert all(isinstance(row["output"], str) for row in rows if "error" not in row)


def test_score_with_a_lock_file(tmp_path: Path, capsys: pytest.CaptureFixture[str], slowy: Path) -> None:
    lock = tmp_path / "slowy.lock"
    assert cli.main(["lock", str(slowy), "-o", str(lock)]) == 0
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": "x", "prompt": "hello"},
                                                 {"id": "y", "text": "abc def"}])
    output = tmp_path / "out.jsonl"
    capsys.readouterr()
    code, out, err = run_cli(capsys, "run", str(slowy), "--input", str(source), "--output", str(output),
                             "--lock", str(lock), "--task", "score", *FAST)
    assert (code, out) == (0, "") and re.fullmatch(SUMMARY.format(written=2, failed=0), err)
    rows = read_jsonl(output)
    assert [row["id"] for row in rows] == ["x", "y"]
    for row in rows:
        assert set(row) == {"id", "logprob", "tokens", "token_logprobs"}
        assert len(row["tokens"]) == len(row["token_logprobs"]) > 0
        assert row["logprob"] == pytest.approx(sum(row["token_logprobs"]))


def test_remote_code_refused_without_trust(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], slowy: Path
) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "hi"}])
    output = tmp_path / "sub" / "out.jsonl"
    code, out, err = run_cli(capsys, "run", str(slowy), "--input", str(source), "--output", str(output))
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("codeferry: error: ")
    assert "--trust-remote-code or --lock FILE" in err
    assert not output.exists()


@pytest.mark.parametrize(
    ("text", "line", "words"),
    [
        ('{"id": 1, "prompt": "a"}\n{"id": 2, "prompt": \n', 2, "invalid JSON"),
        ('{"prompt": "a"}\n', 1, 'no "id"'),
        ('\n{"id": "a"}\n', 2, 'neither "prompt" nor "text"'),
        ('{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}\n', 2, "already used on line 1"),
        ('first\n{"id": 1, "prompt": "y"}\n', 2, "already used on line 1"),
        ('{"id": true, "prompt": "x"}\n', 1, "not a non-empty string or an integer"),
        ('{"id": "a", "prompt": 3}\n', 1, '"prompt" is not a non-empty string'),
        # a lone surrogate crashed the run after its workers started, and every resume
        ('{"id": "a", "prompt": "ok"}\n{"id": "b", "prompt": "x\\udfff"}\n', 2,
         '"prompt" holds a lone surrogate \\udfff (character 2)'),
        ('{"id": "\\ud800", "prompt": "x"}\n', 1, '"id" holds a lone surrogate \\ud800'),
        ("[1, 2]\nok\n", 0, ""),  # not an object, not starting with "{": plain text, accepted
    ],
)
def test_bad_input_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                        text: str, line: int, words: str) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text(text)
    if not line:
        assert [(item.id, item.text) for item in read_inputs(source)] == [(1, "[1, 2]"), (2, "ok")]
        return
    with pytest.raises(InputFormatError) as info:
        read_inputs(source)
    assert (info.value.path, info.value.line) == (str(source), line)
    output = tmp_path / "out.jsonl"
    code, out, err = run_cli(capsys, "run", str(DEMO), "--input", str(source), "--output", str(output))
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and f"in.jsonl:{line}: " in err and words in err and "Fix:" in err
    assert not output.exists()


def test_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    output = tmp_path / "out.jsonl"
    code, _, err = run_cli(capsys, "run", str(DEMO), "--input", str(tmp_path / "missing.jsonl"),
                           "-o", str(output))
    assert code == 2 and "does not exist" in err and err.count("\n") == 1
    assert run_cli(capsys, "run", "--pooling", "mean")[0] == 2
    assert run_cli(capsys, "run", "--task", "embed", "--max-new-tokens", "3")[0] == 2
    assert run_cli(capsys, "run", "--workers", "0")[0] == 2
    assert run_cli(capsys, "run", str(DEMO))[0] == 2  # a MODEL needs --input
    with pytest.raises(SystemExit) as info:
        cli.main(["run", "--trust-remote-code", "--lock", "x.lock"])
    assert info.value.code == 2
    assert not output.exists()


# -- resuming -------------------------------------------------------------------------------


def test_resume_after_killing_the_process_group(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], slowy: Path,
    resume_case: tuple[Path, bytes],
) -> None:
    source, clean = resume_case
    output = tmp_path / "out.jsonl"
    env = {**os.environ, "CODEFERRY_TEST_SLOW": "0.1"}
    proc = subprocess.Popen([sys.executable, "-m", "codeferry.cli", *resume_argv(slowy, source, output)],
                            env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if output.exists() and output.read_bytes().count(b"\n") >= 3:
                break
            time.sleep(0.02)
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the CLI and its workers: one process group
        proc.wait()
        if proc.stderr:
            proc.stderr.close()
    partial = output.read_bytes()
    assert partial.endswith(b"\n")  # no torn line
    written = read_jsonl(output)
    assert 3 <= len(written) < len(RESUME_INPUTS)
    assert partial == clean[:len(partial)]  # a prefix of a clean run, line for line

    code, out, err = run_cli(capsys, *resume_argv(slowy, source, output))
    assert (code, out) == (0, "") and summary_only(err, failed=0)
    ids = [row["id"] for row in read_jsonl(output)]
    assert ids == [row["id"] for row in RESUME_INPUTS]  # every id once, in input order
    assert output.read_bytes() == clean


def test_torn_last_line_is_repaired_and_a_finished_run_is_left_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], slowy: Path,
    resume_case: tuple[Path, bytes],
) -> None:
    source, clean = resume_case
    lines = clean.splitlines(keepends=True)
    output = tmp_path / "out.jsonl"
    output.write_bytes(b"".join(lines[:20]) + lines[20][:15])  # killed mid-line by hand
    shutil.copy(source.with_name("clean.jsonl.codeferry.json"), f"{output}.codeferry.json")
    argv = resume_argv(slowy, source, output)
    code, out, err = run_cli(capsys, *argv)
    assert (code, out) == (0, "") and summary_only(err, failed=0)
    assert output.read_bytes() == clean
    started = time.monotonic()
    code, out, err = run_cli(capsys, *argv)  # nothing left: no worker starts
    assert (code, out) == (0, "") and summary_only(err, 0, 0)
    assert time.monotonic() - started < 10
    assert output.read_bytes() == clean


def test_output_of_another_input_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], resume_case: tuple[Path, bytes]
) -> None:
    output = tmp_path / "out.jsonl"
    before = b'{"id": 1, "output": "x"}\n{"id": "other", "output": "y"}\n'
    output.write_bytes(before)
    code, _, err = run_cli(capsys, "run", str(DEMO), "--input", str(resume_case[0]),
                           "--output", str(output))
    assert code == 1 and "out.jsonl:1: the existing output holds id 1" in err
    assert output.read_bytes() == before


def _screen(stream: str) -> list[str]:
    """The lines a terminal shows after ``stream``: ``\\r`` returns, text overwrites."""
    lines, line, col = [], [], 0
    for char in stream:
        if char == "\n":
            lines.append("".join(line).rstrip())
            line, col = [], 0
        elif char == "\r":
            col = 0
        else:
            assert char >= " " or char == "\t", f"unexpected control character {char!r}"
            line[col:col + 1] = [char]
            col += 1
    return [*lines, "".join(line).rstrip()]


def test_progress_bar_on_a_terminal_only(tmp_path: Path) -> None:
    """tqdm's bar on a real pseudo-terminal: rate and ETA while it runs; the results printed
    to the same terminal are whole lines above it, never torn by it. In a pipe: the summary."""
    import fcntl
    import pty
    import select
    import struct
    import termios

    def args(*extra: str) -> list[str]:
        return [sys.executable, "-m", "codeferry.cli", "run", str(DEMO), "--input",
                str(DEMO / "prompts.txt"), "--workers", "1", "--start-method", "fork",
                "--batch-size", "2", *extra]

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 100 columns
    # stdout and stderr on one terminal: the JSON lines and the bar share the screen
    proc = subprocess.Popen(args(), stdin=subprocess.DEVNULL, stdout=slave, stderr=slave,
                            close_fds=True)
    os.close(slave)
    seen = b""
    while True:
        ready, _, _ = select.select([master], [], [], 120)
        if not ready:
            break
        try:
            chunk = os.read(master, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    os.close(master)
    assert proc.wait(120) == 0
    text = seen.decode("utf-8", "replace")
    # tqdm's bar: count, percent, elapsed<ETA and rate, redrawn in place, 100% at the end
    # (below one input a second, as on a loaded machine, tqdm writes the rate as s/input)
    frames = re.findall(
        r"(\d+)%\|[^|]*\| (\d)/8 \[\d\d:\d\d<(\d\d:\d\d|\?), +([\d.?]+)(?:input/s|s/input)\]", text)
    assert any(done not in ("0", "8") and eta != "?" for _, done, eta, _ in frames), text
    assert ("100", "8") in {(pct, done) for pct, done, _, _ in frames}
    assert "starting 1 worker (fork)..." in text
    screen = [line for line in _screen(text) if line]
    # what the terminal shows at the end: how the workers generate, the results, whole and
    # in order, then the summary; the bar took itself off the screen
    assert screen[0].startswith(
        "generating by batched batching (the decode loop does not work for this model: "), screen[0]
    rows = [json.loads(line) for line in screen[1:-1]]
    assert [row["id"] for row in rows] == list(range(1, 9))
    assert re.fullmatch(r"8 written, 0 failed, in \d+:\d\d; [\d.]+ tokens/s", screen[-1])
    piped = subprocess.run(args("--output", str(tmp_path / "again.jsonl")), capture_output=True,
                           timeout=300)
    assert piped.returncode == 0
    assert re.fullmatch(SUMMARY.format(written=8, failed=0), piped.stderr.decode())
