"""Every field of a batch line is honoured or refused, through ``codeferry run``: a field
codeferry does not implement, another model's name, a typo'd key or a content part that is not
text answers that line with vLLM's 400 (the field named) while the others run; OpenAI content
parts give the plain text's prompt tokens; a plain line's typo'd parameter stops the run before
anything starts, naming file:line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _helpers import read_jsonl, run_cli, summary_only, write_jsonl

import codeferry
from codeferry import cli
from codeferry.errors import SamplingParamsError

DEMO = Path(cli._demo())
FAST = ["--start-method", "fork", "--workers", "1"]
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def line(custom_id: str, url: str, **body: Any) -> dict[str, Any]:
    body.setdefault("model", "demo")
    body.setdefault("max_tokens", 2)
    if url == CHAT:
        body.setdefault("messages", [{"role": "user", "content": "Hi there"}])
    else:
        body.setdefault("prompt", "the cat")
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


PARTS = [{"role": "system", "content": [{"type": "text", "text": "be brief"}]},
         {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                      {"type": "input_text", "text": "there"}]}]
PLAIN = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hi\nthere"}]
#: custom_id -> the field its 400 names (``None``: answered, status 200).
CASES: dict[str, tuple[dict[str, Any], str | None]] = {
    "plain": (line("plain", CHAT, messages=PLAIN), None),
    "parts": (line("parts", CHAT, messages=PARTS), None),
    "neutral": (line("neutral", CMPL, echo=False, logit_bias={}, tools=[], user="u1",
                     best_of=1, response_format={"type": "text"}), None),
    "same-model": (line("same-model", CMPL, model=str(DEMO)), None),
    "served-name": (line("served-name", CMPL, model="my-served"), None),
    "image": (line("image", CHAT, messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]),
        "messages"),
    "tools": (line("tools", CHAT, tools=[{"type": "function", "function": {"name": "f"}}],
                   tool_choice="auto"), "tools"),
    "echo": (line("echo", CMPL, echo=True), "echo"),
    "logit-bias": (line("logit-bias", CMPL, logit_bias={"5": 10}), "logit_bias"),
    "prompt-logprobs": (line("prompt-logprobs", CMPL, prompt_logprobs=1), "prompt_logprobs"),
    "best-of": (line("best-of", CMPL, best_of=3), "best_of"),
    "suffix": (line("suffix", CMPL, suffix="end"), "suffix"),
    "other-model": (line("other-model", CMPL, model="meta-llama/Llama-3-8B"), "model"),
    "typo": (line("typo", CHAT, temprature=0.9), "temprature"),
    "unknown": (line("unknown", CMPL, colour="blue"), "colour"),
}


def test_every_field_is_honoured_or_refused_per_line_and_parts_count_as_plain_text(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    cases = CASES
    source = write_jsonl(tmp_path / "batch.jsonl", [request for request, _ in cases.values()])
    output = tmp_path / "out.jsonl"
    argv = ["run", str(DEMO), "--input", str(source), "-o", str(output),
            "--chat-template", str(template), "--served-model-name", "my-served", *FAST]
    refused = sum(field is not None for _, field in cases.values())
    code, out, err = run_cli(capsys, *argv)
    assert (code, out) == (1, "") and summary_only(err, len(cases), refused), err
    rows = {row["custom_id"]: row for row in read_jsonl(output)}
    assert list(rows) == list(cases)
    for name, (_, field) in cases.items():
        row = rows[name]
        if field is None:
            assert row["error"] is None and row["response"]["status_code"] == 200, row
            continue
        assert row["response"] == {"status_code": 400, "request_id": row["response"][
            "request_id"], "body": None}, row
        error = row["error"]["error"]
        assert (error["code"], error["type"], error["param"]) == (400, "BadRequestError", field)
        assert f"{source}:" in error["message"] and "Fix:" in error["message"]
    assert '"temperature"' in rows["typo"]["error"]["error"]["message"]  # did you mean
    assert '"image_url"' in rows["image"]["error"]["error"]["message"]
    usage = {name: rows[name]["response"]["body"]["usage"] for name in ("plain", "parts")}
    assert usage["parts"]["prompt_tokens"] == usage["plain"]["prompt_tokens"] > 10
    # the demo echoed as the body's model name, another model never
    assert rows["plain"]["response"]["body"]["model"] == "demo"
    # a refused line is an answer: the rerun runs nothing
    code, _, err = run_cli(capsys, *argv)
    assert code == 1 and summary_only(err, 0, refused)


@pytest.mark.parametrize(("key", "near"), [("temprature", "temperature"),
                                            ("max_token", "max_tokens"),
                                            ("Max-Tokens", "max_tokens"),
                                            ("frequency_penality", "frequency_penalty")])
def test_a_plain_line_with_a_typo_of_a_parameter_stops_before_anything_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str, near: str) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "a", "speed": "fast"},
                                                 {"id": 2, "prompt": "b", key: 1}])
    output = tmp_path / "out.jsonl"
    with pytest.raises(SamplingParamsError) as info:
        codeferry.run(DEMO, source, output)
    assert (info.value.path, info.value.line, info.value.field) == (str(source), 2, key)
    assert f'did you mean "{near}"' in str(info.value) and "Fix:" in str(info.value)
    code, out, err = run_cli(capsys, "run", str(DEMO), "--input", str(source), "-o", str(output))
    assert code == 1 and out == "" and "in.jsonl:2: " in err and near in err
    assert not output.exists()


def test_pass_through_keys_far_from_any_parameter_stay(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [{"id": 1, "prompt": "a", "speed": "fast", "stop_words": 2, "max_len": 3,
             "temperature": 0, "max_tokens": 2}]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    output = tmp_path / "out.jsonl"
    code, _, err = run_cli(capsys, "run", str(DEMO), "--input", str(source), "-o", str(output),
                           *FAST)
    assert code == 0 and summary_only(err, 1, 0)
    (got,) = read_jsonl(output)
    assert (got["speed"], got["stop_words"], got["max_len"]) == ("fast", 2, 3)
    assert got["completion_tokens"] <= 2 and json.dumps(got).count("temperature") == 0


def test_embedding_lines_refuse_what_an_embedding_cannot_honour(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def embed(custom_id: str, **body: Any) -> dict[str, Any]:
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings",
                "body": {"model": "demo", "input": "a sentence", **body}}

    cases = {"ok": (embed("ok", encoding_format="float", user="u"), None),
             "dims": (embed("dims", dimensions=8), "dimensions"),
             "base64": (embed("base64", encoding_format="base64"), "encoding_format"),
             "sampled": (embed("sampled", temperature=0.5), "temperature")}
    source = write_jsonl(tmp_path / "in.jsonl", [line for line, _ in cases.values()])
    output = tmp_path / "out.jsonl"
    code, _, err = run_cli(capsys, "run", str(DEMO), "--input", str(source), "-o", str(output),
                           "--task", "embed", *FAST)
    assert code == 1 and summary_only(err, 4, 3), err
    for row, (name, (_, field)) in zip(read_jsonl(output), cases.items(), strict=True):
        assert row["custom_id"] == name
        if field is None:
            assert row["response"]["status_code"] == 200 and row["response"]["body"]["data"]
        else:
            assert row["response"]["status_code"] == 400
            assert row["error"]["error"]["param"] == field
