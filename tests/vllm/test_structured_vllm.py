"""Structured output on the vLLM engine: ``response_format``/``guided_*`` requests go to
vLLM's own structured output (its ``guidance`` backend), and greedy texts equal the
transformers engine's, which masks with the same library (``generate/structured.py``).

One child process in the vLLM environment (``CODEFERRY_VLLM_PYTHON``) writes a random Llama
over a byte-level tokenizer (every byte a token; heads of 32 dimensions, which vLLM's CPU
attention takes) with that environment's transformers, then
runs the same requests through ``Executor(engine="transformers")`` and
``Executor(engine="vllm")`` (one vLLM start), and writes both engines' results as JSON.
The JSON schema turns llguidance's flexible whitespace off (``x-guidance``): a random model
left free to write whitespace writes little else. Without the vLLM environment the module
skips, except under CI, where it fails (``conftest.py``).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))
import _vllm_child  # noqa: E402 - stdlib only at import

CHOICES = ["red", "green", "blue"]
REGEX = r"[a-z]{2,5}-[0-9]{1,3}"
TIMEOUT = 900

CHILD = '''
import json
import sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode


def build(path):
    vocab = {"<s>": 0, "</s>": 1} | {c: i + 2 for i, c in
                                     enumerate(sorted(bytes_to_unicode().values()))}
    inner = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=inner, bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         head_dim=32, max_position_embeddings=256, bos_token_id=0, eos_token_id=1,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
    model.save_pretrained(path)


def main():
    import codeferry
    from codeferry import Request, SamplingParams

    folder, bodies, target = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    prompts = json.loads(sys.argv[4])
    build(folder)
    requests = [Request(prompt=p, params=SamplingParams.from_body(b))
                for b in bodies for p in prompts]
    out = {}
    # vLLM without compiled graphs: the constraint is the same, the start-up much shorter
    eager = {"max_model_len": 256, "enforce_eager": True}
    for engine, options in (("transformers", None), ("vllm", eager)):
        with codeferry.Executor(folder, engine=engine, workers=1,
                                engine_options=options) as ex:
            out[engine] = {"path": ex.worker_info[0]["generate_path"], "results": [
                {"text": r.text, "tokens": list(r.completions[0].token_ids),
                 "finish": r.finish_reason} for r in ex.complete(requests)]}
    with open(target, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
'''

SCHEMA = {"x-guidance": {"whitespace_flexible": False}, "type": "object",
          "properties": {"ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["ok", "n"], "additionalProperties": False}
PROMPTS = ["hello", "a json: ", "x", "The answer is"]
BASE = {"max_tokens": 40, "temperature": 0}
BODIES = {"json": {**BASE, "response_format": {"type": "json_schema",
                                               "json_schema": {"name": "s", "schema": SCHEMA}}},
          "guided_json": {**BASE, "guided_json": SCHEMA},
          "choice": {**BASE, "guided_choice": CHOICES},
          "regex": {**BASE, "structured_outputs": {"regex": REGEX}},
          # any JSON object: whitespace is free here, so some rows reach the cap
          "json_object": {**BASE, "response_format": {"type": "json_object"}}}


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory, vllm_python: str) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("vllm_structured")
    script, out, log = work / "child.py", work / "report.json", work / "child.log"
    script.write_text(CHILD)
    env = _vllm_child.child_env(work, TESTS.parent / "src")
    with log.open("wb") as sink:
        _vllm_child.run_in_group(
            [vllm_python, str(script), str(work / "model"), json.dumps(list(BODIES.values())),
             str(out), json.dumps(PROMPTS)], env=env, stdout=sink, timeout=TIMEOUT)
    assert out.exists(), log.read_text(errors="replace")[-6000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def _by_kind(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    n = len(PROMPTS)
    return {kind: rows[i * n:(i + 1) * n] for i, kind in enumerate(BODIES)}


def test_vllm_outputs_match_their_constraints(report: dict[str, Any]) -> None:
    assert report["vllm"]["path"] == "vllm"
    got = _by_kind(report["vllm"]["results"])
    objects = got.pop("json_object")
    assert all(r["finish"] == "stop" for rows in got.values() for r in rows), got
    assert all(r["text"].startswith("{") for r in objects), objects
    closed = [json.loads(r["text"]) for r in objects if r["finish"] == "stop"]
    assert closed and all(isinstance(value, dict) for value in closed), objects
    for kind in ("json", "guided_json"):
        for row in got[kind]:
            value = json.loads(row["text"])
            assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool)
            assert type(value["n"]) is int and 0 <= value["n"] <= 99
    assert all(r["text"] in CHOICES for r in got["choice"])
    assert all(re.fullmatch(REGEX, r["text"]) for r in got["regex"])


def test_both_engines_give_the_same_greedy_texts(report: dict[str, Any]) -> None:
    ours, theirs = report["transformers"]["results"], report["vllm"]["results"]
    assert report["transformers"]["path"] == "decode"
    assert [(r["text"], r["tokens"], r["finish"]) for r in ours] == [
        (r["text"], r["tokens"], r["finish"]) for r in theirs]
