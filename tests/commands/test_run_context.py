"""Requests are checked against the model's context (``max_model_len``) before any worker.

One line with ``max_tokens: 1000000000000`` that reached the decode loop would ask for
terabytes of cache, and its memory error would answer for its innocent batch-mates. So a
``generate`` line whose prompt (at least its UTF-8 bytes / 8 tokens) and
``max_tokens`` exceed the context (``max_position_embeddings`` and its kin in config.json,
read without running the model's code, or ``--max-model-len``) gets its own error line,
typed, naming the file and line and the fix, as vLLM answers such a request; the others run.
``Executor.generate``/``complete`` refuse such a request before sending anything.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import codeferry
from codeferry import cli
from codeferry._commands.run import run
from codeferry._exec.batching import context_error
from codeferry._exec.files import model_context
from codeferry._exec.generate.params import Request
from codeferry.errors import SamplingParamsError

DEMO = Path(cli._demo())
HUGE = 10**12


def _lines(path: Path) -> dict[object, dict[str, object]]:
    return {row["id"]: row for row in map(json.loads, path.read_text().splitlines())}


def test_a_line_over_the_context_gets_its_own_error_and_the_others_run(tmp_path: Path) -> None:
    assert model_context(DEMO) == 256  # the demo's max_position_embeddings
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(json.dumps(row) for row in [
        {"id": "a", "prompt": "Hello", "max_tokens": 4},
        {"id": "big", "prompt": "Hello", "max_tokens": HUGE},
        {"id": "c", "prompt": "World", "max_tokens": 4},
    ]) + "\n")
    output = tmp_path / "out.jsonl"
    result = run(DEMO, source, output, workers=1, start_method="fork")
    assert (result.written, result.failed) == (3, 1)
    rows = _lines(output)
    assert list(rows) == ["a", "big", "c"]
    error = str(rows["big"]["error"])
    assert error.startswith(f"SamplingParamsError: {source}:2: ")
    assert f"max_tokens {HUGE}" in error and "context of 256 tokens" in error
    assert "give max_tokens at most 255" in error and "--max-model-len" in error
    assert all("output" in rows[i] and "error" not in rows[i] for i in ("a", "c"))


def test_a_request_that_fills_the_context_exactly_fits() -> None:
    """The edge, where generating it whole would cost the demo 255 tokens: one prompt token
    plus 255 new ones is the demo's 256; one more is refused with the largest that fits."""
    fits = Request(prompt="Hi", params=codeferry.SamplingParams(max_tokens=255))
    assert context_error(fits, None, 256) is None
    error = context_error(Request(prompt="Hi", params=codeferry.SamplingParams(max_tokens=256)),
                          None, 256)
    assert error is not None and "give max_tokens at most 255" in (error.fix or "")


def test_max_model_len_bounds_lines_on_the_command_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text('{"id": 1, "prompt": "Hello", "max_tokens": 4}\n'
                      '{"id": 2, "prompt": "Hello", "max_tokens": 16}\n')
    output = tmp_path / "out.jsonl"
    code = cli.main(["run", str(DEMO), "--input", str(source), "--output", str(output),
                     "--max-model-len", "8", "--workers", "1", "--start-method", "fork"])
    assert code == 1  # a line failed
    rows = _lines(output)
    assert "output" in rows[1] and "max_model_len" in str(rows[2]["error"])
    assert cli.main(["run", str(DEMO), "--input", str(source), "--max-model-len", "0"]) == 2
    assert "--max-model-len must be at least 1" in capsys.readouterr().err


def test_the_executor_refuses_a_request_over_the_context_before_sending() -> None:
    with codeferry.Executor(DEMO, workers=1, start_method="fork", trust_remote_code=True) as ex:
        assert ex.max_model_len == 256
        with pytest.raises(SamplingParamsError) as info:
            ex.generate(["Hello", "World"], [codeferry.SamplingParams(max_tokens=4),
                                             codeferry.SamplingParams(max_tokens=HUGE)])
        assert info.value.message.startswith("request 1: ") and info.value.fix
        with pytest.raises(SamplingParamsError):
            ex.generate(["Hello"], max_new_tokens=HUGE)
        assert len(ex.generate(["Hello"], max_new_tokens=2)) == 1  # the executor lives on


def test_the_context_is_read_from_the_config_without_code(tmp_path: Path) -> None:
    def context(config: dict[str, object]) -> int | None:
        (tmp_path / "config.json").write_text(json.dumps(config))
        return model_context(tmp_path)

    assert context({"n_positions": 1024}) == 1024
    assert context({"max_position_embeddings": 4096, "seq_length": 2048}) == 2048
    assert context({"max_position_embeddings": 4096,
                    "text_config": {"max_position_embeddings": 8192}}) == 8192
    assert context({"max_sequence_length": 512, "text_config": {"hidden_size": 8}}) == 512
    assert context({"max_position_embeddings": 4096,
                    "rope_scaling": {"rope_type": "linear", "factor": 2.0}}) == 8192
    assert context({"max_position_embeddings": 131072,
                    "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}) == 131072
    assert context({"hidden_size": 8}) is None
    (tmp_path / "config.json").unlink()
    assert model_context(tmp_path) is None
