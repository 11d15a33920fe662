"""What ``codeferry run`` checks before any worker starts, each a one-line error with a fix
that works when followed: ``--input`` without a model, a model name that is no folder and no
cached repo, a safetensors file cut short, a remote-code model without the
``tokenizer_config.json`` that names its tokenizer, and a chat template supplied on resume
when no written line used another; and the run options of the command line."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _helpers import read_jsonl, run_cli, summary_only, write_jsonl

import codeferry
from codeferry import cli
from codeferry._commands.preflight import engine_options
from codeferry._commands.record import record_path
from codeferry.errors import ModelFilesMissingError, RunStoppedError, WeightsUnreadableError

DEMO = Path(cli._demo())
FAST = ["--start-method", "fork", "--workers", "1"]
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture
def source(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "hello", "max_tokens": 2}])


def _demo_copy(tmp_path: Path) -> Path:
    return Path(shutil.copytree(DEMO, tmp_path / "mymodel"))


def test_input_without_a_model_is_refused_rather_than_run_on_the_demo(
        tmp_path: Path, source: Path, capsys: pytest.CaptureFixture[str]) -> None:
    output = tmp_path / "out.jsonl"
    code, out, err = run_cli(capsys, "run", "--input", str(source), "-o", str(output))
    assert (code, out) == (2, "") and err.count("\n") == 1
    assert f"codeferry run MODEL --input {source}" in err and not output.exists()


def test_a_model_name_that_is_no_folder_nor_cached_is_a_typo_not_a_connection_problem(
        tmp_path: Path, source: Path) -> None:
    _demo_copy(tmp_path)
    env = {**os.environ, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}
    done = subprocess.run([sys.executable, "-m", "codeferry", "run", "mymodle", "--input",
                           str(source), "-o", "out.jsonl"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "neither a folder here nor a repo in the Hugging Face cache" in done.stderr
    assert "did you mean ./mymodel?" in done.stderr and "check the name" in done.stderr
    assert not (tmp_path / "out.jsonl").exists()


def test_a_truncated_safetensors_file_is_named_before_any_worker_starts(
        tmp_path: Path, source: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = _demo_copy(tmp_path)
    weights = model / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 100)
    with pytest.raises(WeightsUnreadableError) as info:
        codeferry.run(model, source, tmp_path / "out.jsonl", trust_remote_code=True)
    assert info.value.path == str(weights) and "bytes its header describes" in str(info.value)
    code, _, err = run_cli(capsys, "run", str(model), "--input", str(source), "-o",
                           str(tmp_path / "out.jsonl"), "--trust-remote-code")
    assert code == 1 and err.count("\n") == 1 and "model.safetensors" in err
    assert not (tmp_path / "out.jsonl").exists()


def test_a_missing_tokenizer_config_is_named_as_such(tmp_path: Path, source: Path) -> None:
    model = _demo_copy(tmp_path)
    (model / "tokenizer_config.json").unlink()
    with pytest.raises(ModelFilesMissingError) as info:
        codeferry.run(model, source, tmp_path / "out.jsonl", trust_remote_code=True)
    assert info.value.path == str(model / "tokenizer_config.json")
    assert "sentencepiece" not in str(info.value) and "Fix:" in str(info.value)


def test_chat_lines_for_a_model_without_a_chat_template_stop_before_any_worker(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", [
        {"id": 1, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}])
    output = tmp_path / "out.jsonl"
    code, out, err = run_cli(capsys, "run", str(DEMO), "--input", str(source), "-o",
                             str(output), *FAST)
    assert (code, out) == (1, "") and err.count("\n") == 1 and "--chat-template FILE" in err
    assert "ChatTemplateMissingError" not in err and not output.exists()


def test_the_chat_template_given_as_the_fix_resumes_a_run_that_wrote_no_chat_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # a tokenizer whose code could set a template: only a worker can tell it has none
    model = _demo_copy(tmp_path)
    code_file = model / "tokenization_charlm.py"
    code_file.write_text(code_file.read_text() + "\n# no chat_template set here\n")
    source = write_jsonl(tmp_path / "in.jsonl", [
        {"id": 1, "prompt": "hello", "max_tokens": 2},
        {"id": 2, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}])
    output, template = tmp_path / "out.jsonl", tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    with pytest.raises(RunStoppedError) as info:
        codeferry.run(model, source, output, workers=1, start_method="fork",
                      trust_remote_code=True, stderr=io.StringIO())
    assert "--chat-template" in str(info.value) and len(read_jsonl(output)) == 1
    code, _, err = run_cli(capsys, "run", str(model), "--input", str(source), "-o", str(output),
                           "--chat-template", str(template), "--trust-remote-code", *FAST)
    assert code == 0 and summary_only(err, 1, 0), err
    assert [row["id"] for row in read_jsonl(output)] == [1, 2]
    assert "chat_template" in record_path(output).read_text()


def test_run_options_of_the_command_line_and_of_run(
        tmp_path: Path, source: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert engine_options(["gpu_memory_utilization=0.5", "enforce_eager=false",
                           "kv_cache_dtype=fp8"]) == {
        "gpu_memory_utilization": 0.5, "enforce_eager": False, "kv_cache_dtype": "fp8"}
    assert run_cli(capsys, "run", str(DEMO), "--input", str(source), "--engine-option",
                   "novalue")[0] == 2
    assert run_cli(capsys, "run", str(DEMO), "--input", str(source), "--max-batch-tokens",
                   "0")[0] == 2
    output = tmp_path / "out.jsonl"
    code, _, err = run_cli(capsys, "run", str(DEMO), "--input", str(source), "-o", str(output),
                           "--max-batch-tokens", "64", "--no-progress", "--engine",
                           "transformers", "--engine-option", "enforce_eager=true", *FAST)
    assert code == 0 and summary_only(err, 1, 0)
    again = tmp_path / "again.jsonl"
    result = codeferry.run(DEMO, source, again, max_batch_tokens=64, progress=False,
                           engine="transformers", engine_options={"enforce_eager": True},
                           workers=1, start_method="fork", stderr=io.StringIO())
    assert result.written == 1 and read_jsonl(again)[0]["output"] == read_jsonl(output)[0]["output"]
    with pytest.raises(ValueError, match="max_batch_tokens"):
        codeferry.run(DEMO, source, again, max_batch_tokens=0)


def test_the_workers_draw_no_loading_bars_over_the_run(
        tmp_path: Path, source: Path, capfd: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    result = codeferry.run(DEMO, source, tmp_path / "out.jsonl", workers=2, progress=False)
    assert result.written == 1
    err = capfd.readouterr().err
    assert "Loading" not in err and "HF_HUB_DISABLE_PROGRESS_BARS" not in os.environ
