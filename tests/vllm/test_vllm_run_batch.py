"""One OpenAI batch file through real ``vllm run-batch`` and through ``codeferry run``.

The same tiny Llama (``tests/_vllm_child.py build``'s reference model, written by vLLM's own
transformers once per session, ``tests/vllm/conftest.py``; a copy with a chat template added) and the same file of chat requests, greedy, with
stop strings, stop tokens, ``min_tokens`` and logprobs. The outputs are compared field by
field: the same ``custom_id``s in the same order, codeferry's keys a subset of vLLM's at every
level (vLLM adds its own: ``refusal``, ``token_ids``, ``service_tier``...), the same greedy
texts, finish reasons, stop reasons and token counts, and logprobs within float tolerance.

vLLM 0.32's ``run_batch`` serves ``/v1/chat/completions``, ``/v1/embeddings`` and scoring, not
``/v1/completions``: the file holds chat requests. Texts are compared with whitespace
normalized: vLLM detokenizes incrementally after the prompt, which for this word-level
tokenizer (its tokens joined by spaces) puts a space before the first word.

vLLM runs in its own environment (``CODEFERRY_VLLM_PYTHON``), as in ``test_vllm.py``: without
it the module skips, except under CI, where it fails.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))
import _vllm_child  # noqa: E402 - stdlib only at import

import codeferry  # noqa: E402

TIMEOUT = 600
TEMPLATE = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}w0{% endif %}")


def chat(custom_id: str, content: str, **body: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": content}]
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": messages, "temperature": 0, **body}}


BATCH = [
    {**chat("system", ""), "body": {"model": "tiny", "temperature": 0, "max_tokens": 8,
                                    "messages": [{"role": "system", "content": "w5 w6"},
                                                 {"role": "user", "content": "w1 w2 w3"}]}},
    chat("plain", "w1 w2 w3 w4 w5", max_tokens=6),
    chat("logprobs", "w7 w8", max_completion_tokens=10, logprobs=True, top_logprobs=2),
    chat("stop-token", "w3 w3 w3", max_tokens=12, stop_token_ids=[42]),  # w39
    chat("min-tokens", "w100 w101", max_tokens=3, min_tokens=3),
    chat("stop-string", "w20 w21 w22", max_tokens=12, stop=["w58"]),
    chat("long", "w40", max_tokens=30),
    # OpenAI content parts: codeferry joins the text parts as vLLM's server does
    {**chat("parts", ""), "body": {"model": "tiny", "temperature": 0, "max_tokens": 6,
                                   "messages": [{"role": "user", "content": [
                                       {"type": "text", "text": "w1 w2"},
                                       {"type": "text", "text": "w3 w4"}]}]}},
]


def _env(root: Path) -> dict[str, str]:
    return _vllm_child.child_env(root, TESTS.parent / "src")


@pytest.fixture(scope="session")
def outputs(tmp_path_factory: pytest.TempPathFactory,
            vllm_built: Callable[[str, dict[str, str]], Path],
            vllm_python: str) -> tuple[list[Any], list[Any]]:
    """(vLLM's output lines, codeferry's) for ``BATCH`` on the same model."""
    work = tmp_path_factory.mktemp("run_batch")
    env = _env(work)
    # the session's reference model (test_vllm.py's too), copied: a chat template is added
    model = Path(shutil.copytree(vllm_built(vllm_python, env) / "reference", work / "reference"))
    settings = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**settings,
                                                             "chat_template": TEMPLATE}))
    source = work / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in BATCH))
    theirs, ours = work / "vllm.jsonl", work / "codeferry.jsonl"
    with (work / "vllm.log").open("wb") as log:
        _vllm_child.run_in_group(
            [vllm_python, "-m", "vllm.entrypoints.openai.run_batch", "-i", str(source), "-o",
             str(theirs), "--model", str(model), "--served-model-name", "tiny",
             "--dtype", "float32", "--max-model-len", "128", "--enforce-eager", "--seed", "0"],
            env=env, stdout=log, timeout=TIMEOUT)
    assert theirs.exists(), (work / "vllm.log").read_text(errors="replace")[-5000:]
    result = codeferry.run(model, source, ours, workers=1, start_method="fork",
                           served_model_name="tiny")
    assert result.complete and result.failed == 0
    read = [[json.loads(line) for line in path.read_text().splitlines()] for path in (theirs, ours)]
    return read[0], read[1]


def _keys_within(ours: Any, theirs: Any, where: str) -> None:
    """Every key of ours is one of theirs, recursively (vLLM adds fields of its own)."""
    if isinstance(ours, dict):
        assert isinstance(theirs, dict), where
        assert set(ours) <= set(theirs), f"{where}: {sorted(set(ours) - set(theirs))}"
        for key, value in ours.items():
            _keys_within(value, theirs[key], f"{where}.{key}")
    elif isinstance(ours, list) and ours and isinstance(ours[0], dict):
        assert isinstance(theirs, list) and len(theirs) == len(ours), where
        _keys_within(ours[0], theirs[0], f"{where}[0]")


def test_the_same_batch_file_through_vllm_run_batch_and_codeferry_run(
        outputs: tuple[list[Any], list[Any]]) -> None:
    theirs, ours = outputs
    assert [r["custom_id"] for r in ours] == [r["custom_id"] for r in theirs] == [
        line["custom_id"] for line in BATCH]
    for mine, vllm in zip(ours, theirs, strict=True):
        name = mine["custom_id"]
        assert set(mine) == set(vllm) == {"id", "custom_id", "response", "error"}
        assert mine["error"] is None and vllm["error"] is None, vllm["error"]
        assert mine["response"]["status_code"] == vllm["response"]["status_code"] == 200
        _keys_within(mine, vllm, name)
        a, b = mine["response"]["body"], vllm["response"]["body"]
        assert (a["object"], a["model"]) == (b["object"], b["model"]) == ("chat.completion",
                                                                          "tiny")
        assert a["usage"] == {k: b["usage"][k] for k in a["usage"]}, name
        (x,), (y,) = a["choices"], b["choices"]
        assert " ".join(x["message"]["content"].split()) == " ".join(
            y["message"]["content"].split()), name
        assert (x["finish_reason"], x["stop_reason"]) == (y["finish_reason"],
                                                          y["stop_reason"]), name
        assert (x["logprobs"] is None) == (y["logprobs"] is None), name
        if x["logprobs"] is not None:
            for p, q in zip(x["logprobs"]["content"], y["logprobs"]["content"], strict=True):
                assert p["token"] == q["token"] and p["logprob"] == pytest.approx(
                    q["logprob"], abs=1e-3)
                assert [t["token"] for t in p["top_logprobs"]] == [
                    t["token"] for t in q["top_logprobs"]]
    # the file exercises each way a completion ends
    reasons = {r["custom_id"]: r["response"]["body"]["choices"][0] for r in ours}
    assert reasons["stop-token"]["finish_reason"] == "stop"
    assert reasons["stop-token"]["stop_reason"] == 42
    assert reasons["stop-string"]["stop_reason"] == "w58"
    assert reasons["plain"]["finish_reason"] == "length"
