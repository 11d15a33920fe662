"""Batch jobs as users already write them, through ``codeferry run`` and
``codeferry.run``: OpenAI batch lines in and out, chat messages, per-line parameters,
extra keys passed through, stdin, the closing summary; and the inputs refused, typed."""

from __future__ import annotations

import io
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from _helpers import read_jsonl, run_cli, summary_only, write_jsonl

import codeferry
from codeferry import SamplingParams, cli
from codeferry._commands.record import record_path
from codeferry.errors import ChatTemplateMissingError, InputFormatError, SamplingParamsError

DEMO = Path(cli._demo())
FAST = ["--start-method", "fork", "--workers", "1"]
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def openai_line(custom_id: str, url: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "demo", **body}}


CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
BATCH = [
    openai_line("chat-1", "/v1/chat/completions", messages=CHAT, max_tokens=5, temperature=0),
    openai_line("cmpl-1", "/v1/completions", prompt="the cat", max_tokens=4, logprobs=1,
                temperature=0),
    openai_line("chat-2", "/v1/chat/completions", messages=CHAT[1:], max_completion_tokens=3,
                temperature=0.9, seed=3),
    openai_line("cmpl-2", "/v1/completions", prompt="a dog", max_tokens=6, stop=["\n"]),
]


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(TEMPLATE)
    return path


def test_an_openai_batch_file_runs_and_resumes_in_the_openai_output_format(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], template: Path) -> None:
    source, output = tmp_path / "batch.jsonl", tmp_path / "out.jsonl"
    write_jsonl(source, BATCH[:2])
    argv = ["run", str(DEMO), "--input", str(source), "-o", str(output),
            "--chat-template", str(template), *FAST]
    code, out, err = run_cli(capsys, *argv)
    assert (code, out) == (0, "") and summary_only(err, 2, 0)
    write_jsonl(source, BATCH)  # two more lines: the same command resumes
    code, out, err = run_cli(capsys, *argv)
    assert (code, out) == (0, "") and summary_only(err, 2, 0)
    rows = read_jsonl(output)
    assert [r["custom_id"] for r in rows] == ["chat-1", "cmpl-1", "chat-2", "cmpl-2"]
    for row, request in zip(rows, BATCH, strict=True):
        assert set(row) == {"id", "custom_id", "response", "error"} and row["error"] is None
        response = row["response"]
        assert response["status_code"] == 200 and response["request_id"]
        body = response["body"]
        chat = request["url"] == "/v1/chat/completions"
        assert body["object"] == ("chat.completion" if chat else "text_completion")
        assert body["model"] == "demo"
        (choice,) = body["choices"]
        text = choice["message"]["content"] if chat else choice["text"]
        assert isinstance(text, str) and choice["finish_reason"] in ("stop", "length")
        usage = body["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        limit = request["body"].get("max_tokens") or request["body"]["max_completion_tokens"]
        assert usage["completion_tokens"] <= limit
    # the chat template rendered the system prompt: the prompt is longer than the user's text
    assert rows[0]["response"]["body"]["usage"]["prompt_tokens"] > len(
        "system: be brief\nuser: hello\nassistant:") - 1
    logprobs = rows[1]["response"]["body"]["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == rows[1]["response"][
        "body"]["usage"]["completion_tokens"]
    summary = json.loads(record_path(output).read_text())["summary"]
    assert summary["written"] == 2 and summary["skipped"] == 2 and summary["completion_tokens"] > 0


def test_plain_lines_with_messages_parameters_and_extra_keys_from_stdin(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        template: Path) -> None:
    rows = [{"id": "p", "prompt": "hello", "max_tokens": 3, "tag": {"keep": [1, 2]}},
            {"id": "c", "messages": CHAT, "max_tokens": 4, "source": "chat"},
            {"id": "s", "prompt": "hello", "temperature": 1.0, "seed": 9, "n": 2}]
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    output = tmp_path / "out.jsonl"
    code, out, err = run_cli(capsys, "run", str(DEMO), "--input", "-", "-o", str(output),
                             "--chat-template", str(template), "--max-new-tokens", "5", *FAST)
    assert (code, out) == (0, "") and summary_only(err, 3, 0)
    got = read_jsonl(output)
    assert [r["id"] for r in got] == ["p", "c", "s"]
    assert got[0]["tag"] == {"keep": [1, 2]} and got[1]["source"] == "chat"
    assert got[0]["completion_tokens"] <= 3 and got[1]["completion_tokens"] <= 4
    assert got[2]["completion_tokens"] == sum(o["completion_tokens"] for o in got[2]["outputs"])
    assert len(got[2]["outputs"]) == 2 and got[2]["completion_tokens"] <= 10  # the run's 5

    # the Python API, with the same options, writes the same lines
    again = tmp_path / "again.jsonl"
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    result = codeferry.run(DEMO, source, again, chat_template=template, max_new_tokens=5,
                           workers=1, start_method="fork")
    assert (result.written, result.failed, result.complete) == (3, 0, True)
    assert result.completion_tokens == sum(r["completion_tokens"] for r in got)
    assert read_jsonl(again) == got


def test_sampling_flags_are_the_defaults_of_lines_that_set_none(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", [
        {"id": 1, "prompt": "the cat sat"}, {"id": 2, "prompt": "the cat sat", "temperature": 0}])
    output = tmp_path / "out.jsonl"
    code, _, err = run_cli(capsys, "run", str(DEMO), "--input", str(source), "-o", str(output),
                           "--temperature", "1.0", "--seed", "5", "--max-tokens", "8",
                           "--stop", "zzz", *FAST)
    assert code == 0, err
    flagged = read_jsonl(output)
    python = tmp_path / "python.jsonl"
    codeferry.run(DEMO, source, python, params=SamplingParams(temperature=1.0, seed=5, stop="zzz"),
                  max_new_tokens=8, workers=1, start_method="fork")
    assert read_jsonl(python) == flagged
    assert flagged[0]["output"] != flagged[1]["output"]  # sampled vs the line's own greedy
    options = json.loads(record_path(output).read_text())["options"]
    assert options["params"] == {"temperature": 1.0, "seed": 5, "stop": ["zzz"]}
    # another default is another producer: a resume is refused, as for --max-new-tokens
    code, _, err = run_cli(capsys, "run", str(DEMO), "--input", str(source), "-o", str(output),
                           "--temperature", "0.5", *FAST)
    assert code == 1 and "ResumeMismatch" not in err and "params" in err
    code, _, err = run_cli(capsys, "run", str(DEMO), "--input", str(source), "--top-p", "2",
                           *FAST)
    assert code == 2 and "--top-p" in err and "above 1.0" in err


def test_chat_without_a_template_stops_before_writing_and_the_fixed_command_resumes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], template: Path) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "messages": CHAT, "max_tokens": 2}])
    output = tmp_path / "out.jsonl"
    argv = ["run", str(DEMO), "--input", str(source), "-o", str(output), *FAST]
    with pytest.raises(ChatTemplateMissingError) as info:  # before any worker starts
        codeferry.run(DEMO, source, output, workers=1, start_method="fork", stderr=io.StringIO())
    assert "--chat-template" in str(info.value)
    assert not output.exists() or output.read_bytes() == b""
    code, _, err = run_cli(capsys, *argv, "--chat-template", str(template))
    assert code == 0 and summary_only(err, 1, 0)
    assert len(read_jsonl(output)) == 1


@pytest.mark.parametrize(("text", "line", "error", "words"), [
    ('[{"id": 1, "prompt": "a"},\n {"id": 2, "prompt": "b"}]\n', 1, InputFormatError,
     "one JSON array (of 2 items), not JSON Lines"),
    (json.dumps(openai_line("e", "/v1/embeddings", input="x")) + "\n", 1, InputFormatError,
     "need --task embed"),
    (json.dumps(openai_line("s", "/v1/score", text_1="a", text_2="b")) + "\n", 1,
     InputFormatError, "is not an endpoint codeferry runs"),
    (json.dumps(openai_line("a", "/v1/completions", prompt="x")) + '\n{"id": 2, "prompt": "y"}\n',
     2, InputFormatError, "mixes OpenAI batch lines"),
    ('{"id": 1, "prompt": "a"}\n{"id": 2, "prompt": "b", "temperature": -1}\n', 2,
     SamplingParamsError, "temperature is -1, below 0.0"),
    ('{"id": 1, "prompt": "a", "finish_reason": "x"}\n', 1, InputFormatError,
     'the key "finish_reason" is one the output line writes itself'),
    ('{"id": 1, "messages": "hi"}\n', 1, InputFormatError, '"messages" is not a list'),
    (json.dumps(openai_line("a", "/v1/completions", prompt="x", stream=True)) + "\n", 1,
     InputFormatError, "asks to stream"),
])
def test_inputs_that_would_be_misread_are_refused_naming_file_and_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, line: int,
        error: type[Exception], words: str) -> None:
    source = tmp_path / "in.json"
    source.write_text(text)
    output = tmp_path / "out.jsonl"
    with pytest.raises(error) as info:
        codeferry.run(DEMO, source, output)
    assert (info.value.path, info.value.line) == (str(source), line)  # type: ignore[attr-defined]
    assert words in str(info.value) and "Fix:" in str(info.value)
    code, out, err = run_cli(capsys, "run", str(DEMO), "--input", str(source), "-o", str(output))
    assert code == 1 and out == "" and re.search(rf"in\.json:{line}: ", err)
    assert not output.exists()


RAISING = '''

_original_forward = RaiserForCausalLM.forward


def _forward(self, input_ids=None, **kwargs):
    if input_ids is not None and 29 in input_ids.flatten().tolist():  # "z"
        raise RuntimeError("the model raised on purpose")
    return _original_forward(self, input_ids=input_ids, **kwargs)


RaiserForCausalLM.forward = _forward
'''


def test_an_input_the_model_fails_on_is_an_openai_error_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from codeferry.testing import ModelSpec, write_model

    model = write_model(tmp_path / "raiser", ModelSpec(name="raiser", tokenizer=True))
    modeling = next(model.glob("modeling_*.py"))
    modeling.write_text(modeling.read_text() + RAISING)
    source = write_jsonl(tmp_path / "in.jsonl", [
        openai_line("ok", "/v1/completions", prompt="abc", max_tokens=2, model="raiser"),
        openai_line("bad", "/v1/completions", prompt="xyz", max_tokens=2, model="raiser")])
    output = tmp_path / "out.jsonl"
    code, _, err = run_cli(capsys, "run", str(model), "--input", str(source), "-o", str(output),
                           "--trust-remote-code", "--batch-size", "1", *FAST)
    assert code == 1 and summary_only(err, 2, 1)
    ok, bad = read_jsonl(output)
    assert ok["error"] is None and ok["response"]["status_code"] == 200
    assert bad["custom_id"] == "bad" and bad["response"]["status_code"] == 500
    assert bad["error"]["error"]["type"] == "RuntimeError"
    assert "raised on purpose" in bad["error"]["error"]["message"]
    # an error line is an answer: a rerun skips it
    code, _, err = run_cli(capsys, "run", str(model), "--input", str(source), "-o", str(output),
                           "--trust-remote-code", *FAST)
    assert code == 1 and summary_only(err, 0, 1)


def test_openai_embedding_lines_with_task_embed(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", [
        openai_line(f"e{i}", "/v1/embeddings", input=text)
        for i, text in enumerate(["a sentence", "another one"])])
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"id": "e0", "text": "a sentence"},
                                                   {"id": "e1", "text": "another one"}])
    output, expected = tmp_path / "out.jsonl", tmp_path / "expected.jsonl"
    for src, out in ((source, output), (plain, expected)):
        code, _, err = run_cli(capsys, "run", str(DEMO), "--input", str(src), "-o", str(out),
                               "--task", "embed", *FAST)
        assert code == 0 and summary_only(err, 2, 0)
    for row, reference in zip(read_jsonl(output), read_jsonl(expected), strict=True):
        body = row["response"]["body"]
        assert (row["custom_id"], body["object"], body["model"]) == (reference["id"], "list",
                                                                     "demo")
        assert body["data"] == [{"index": 0, "object": "embedding",
                                 "embedding": reference["embedding"]}]
