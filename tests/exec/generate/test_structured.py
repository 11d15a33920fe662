"""Structured output: the request's spellings read into one ``StructuredOutput``
(``params.py``), and on the transformers engine every completion matching it
(``structured.py``: llguidance masks each row's logits), in the decode loop and in
``generate`` alike, in real workers through ``codeferry.Executor``.

The model is a random-weight Llama over a byte-level tokenizer (every byte a token, as a
byte-level BPE without merges), so any JSON, pattern or choice can be spelled. Its JSON
schema turns llguidance's flexible whitespace off (``x-guidance``): a random model left
free to write whitespace writes little else.
"""

from __future__ import annotations

import json
import pickle
import re
import sys
from pathlib import Path
from typing import Any

import pytest

import codeferry
from codeferry import SamplingParams
from codeferry._exec.generate.params import (
    BODY_KEYS,
    StructuredOutput,
    group_key,
    resolve,
)
from codeferry.errors import ExtraMissingError, SamplingParamsError

SCHEMA = {"x-guidance": {"whitespace_flexible": False}, "type": "object",
          "properties": {"ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["ok", "n"], "additionalProperties": False}
CHOICES = ["red", "green", "blue"]
REGEX = r"[a-z]{2,5}-[0-9]{1,3}"
GRAMMAR = 'root ::= "x" ab ab "y"\nab ::= "a" | "b"'
PROMPTS = ["hello", "a json: ", "x", "The answer is", "colour?", "0"]
EOS = 1


def valid(value: Any) -> bool:
    """``value`` matches ``SCHEMA`` (read by hand: two keys, a boolean, an integer 0..99)."""
    return (isinstance(value, dict) and set(value) == {"ok", "n"}
            and isinstance(value["ok"], bool) and type(value["n"]) is int
            and 0 <= value["n"] <= 99)


# -- the spellings of a request body ------------------------------------------------------

def test_every_spelling_of_a_schema_is_one_constraint() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    bodies = [{"response_format": {"type": "json_schema",
                                   "json_schema": {"name": "s", "schema": schema}}},
              {"guided_json": schema}, {"guided_json": json.dumps(schema)},
              {"structured_outputs": {"json": schema}}]
    found = {SamplingParams.from_body(b).structured_outputs for b in bodies}
    assert found == {StructuredOutput("json", json.dumps(schema))}
    assert next(iter(found)).schema() == schema  # property order kept
    assert SamplingParams.from_body({"response_format": {"type": "json_object"}}) \
        .structured_outputs == StructuredOutput("json_object")
    assert SamplingParams.from_body({"guided_choice": ["a", "b"]}).structured_outputs == \
        SamplingParams(structured_outputs={"choice": ["a", "b"]}).structured_outputs
    assert SamplingParams.from_body({"guided_regex": "a+"}).structured_outputs == \
        StructuredOutput("regex", "a+")
    assert SamplingParams.from_body({"guided_grammar": 'root ::= "a"'}).structured_outputs \
        == StructuredOutput("grammar", 'root ::= "a"')
    assert SamplingParams.from_body({"response_format": {"type": "text"}}) == SamplingParams()


@pytest.mark.parametrize(("body", "field", "words"), [
    ({"guided_regex": "(a"}, "guided_regex", "no regular expression"),
    ({"guided_json": {"type": "obj"}}, "guided_json", "the schema.type is \"obj\""),
    ({"guided_json": {"properties": {"a": 3}}}, "guided_json", "the schema.properties.a"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_choice": []}, "guided_choice", "not a non-empty list of strings"),
    ({"guided_grammar": "  "}, "guided_grammar", "empty grammar"),
    ({"response_format": {"type": "xml"}}, "response_format", "json_object, json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "without json_schema.schema"),
    ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs", "only true"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "both constrain"),
])
def test_a_malformed_constraint_is_refused_naming_its_field(body: dict[str, Any], field: str,
                                                           words: str) -> None:
    with pytest.raises(SamplingParamsError) as caught:
        SamplingParams.from_body(body)
    assert caught.value.field == field and words in str(caught.value), str(caught.value)
    assert caught.value.fix


def test_the_constraint_travels_groups_and_is_recorded() -> None:
    params = SamplingParams.from_body({"guided_choice": ["a", "b"], "max_tokens": 3})
    assert pickle.loads(pickle.dumps(params)) == params
    assert params.set_fields() == {"max_tokens": 3, "structured_outputs": {"choice": ["a", "b"]}}
    json.dumps(params.set_fields())  # the run record keeps it as JSON
    merged = SamplingParams(temperature=0).over(params)
    assert merged.structured_outputs == params.structured_outputs and merged.temperature == 0
    other = SamplingParams(structured_outputs={"choice": ["a", "c"]})
    keys = [group_key(resolve(p, {}), i) for i, p in enumerate([params, params, other,
                                                                 SamplingParams()])]
    assert keys[0] == keys[1] and len(set(keys)) == 3  # equal grammars share a call
    # the keys a batch line may carry and from_body reads: fields, aliases, spellings
    assert {"response_format", "structured_outputs", "guided_json", "guided_regex",
            "guided_choice", "guided_grammar", "top_logprobs", "max_tokens"} <= BODY_KEYS
    assert "guided_decoding_backend" not in BODY_KEYS


# -- the transformers engine ----------------------------------------------------------------

def byte_llama(path: Path) -> tuple[Any, Any]:
    """A random Llama over a byte-level tokenizer (token 0 ``<s>``, 1 ``</s>``), saved in
    ``path``: (model, tokenizer)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {"<s>": 0, "</s>": 1} | {c: i + 2 for i, c in
                                     enumerate(sorted(bytes_to_unicode().values()))}
    inner = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=inner, bos_token="<s>",
                                        eos_token="</s>")
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, bos_token_id=0, eos_token_id=EOS,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # peaked: greedy outputs that vary
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model, tokenizer


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    path = tmp_path_factory.mktemp("structured") / "byte-llama"
    model, tokenizer = byte_llama(path)
    return path, model, tokenizer


def test_the_decode_loop_masks_as_generate_does(llama: tuple[Path, Any, Any]) -> None:
    """Greedy tokens of structured rows (each its own grammar) beside an unconstrained one,
    in one loop that drops and joins rows, equal ``generate``'s with the same mask."""
    import torch
    from transformers import LogitsProcessorList

    from codeferry._exec.generate.decode import RowOptions, decode
    from codeferry._exec.generate.structured import Constrained, grammars

    _, model, tokenizer = llama
    constraints = [StructuredOutput("json", json.dumps(SCHEMA)),
                   StructuredOutput("choice", tuple(CHOICES)), None,
                   StructuredOutput("regex", REGEX), StructuredOutput("json", json.dumps(SCHEMA)),
                   StructuredOutput("grammar", GRAMMAR)]
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:len(constraints)]]
    options = [RowOptions(max_new_tokens=40, eos=(EOS,), structured=c) for c in constraints]
    got = decode(model, prompts, options, pad_token_id=EOS, max_rows=2, tokenizer=tokenizer)
    for prompt, constraint, row in zip(prompts, constraints, got, strict=True):
        extra = {} if constraint is None else {"logits_processor": LogitsProcessorList(
            [Constrained(grammars(tokenizer, model), constraint, len(prompt), {EOS})])}
        with torch.inference_mode():
            want = model.generate(input_ids=torch.tensor([prompt]), do_sample=False,
                                  max_new_tokens=40, pad_token_id=EOS, eos_token_id=EOS,
                                  **extra)[0, len(prompt):].tolist()
        assert row == want, (constraint, tokenizer.decode(row), tokenizer.decode(want))
    texts = [tokenizer.decode(r, skip_special_tokens=True) for r in got]
    assert valid(json.loads(texts[0])) and valid(json.loads(texts[4]))
    assert texts[1] in CHOICES and re.fullmatch(REGEX, texts[3])
    assert re.fullmatch("x[ab]{2}y", texts[5]), texts[5]  # the GBNF grammar's language


def test_a_grammar_llguidance_refuses_and_a_missing_llguidance_are_typed(
        llama: tuple[Path, Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from codeferry._exec.generate import structured

    _, model, tokenizer = llama
    with pytest.raises(SamplingParamsError) as caught:
        structured.check(tokenizer, model, [StructuredOutput("grammar", "root ::= (")])
    assert caught.value.field == "structured_outputs" and "llguidance refused" in str(
        caught.value)
    for name in [m for m in sys.modules if m == "llguidance" or m.startswith("llguidance.")]:
        monkeypatch.setitem(sys.modules, name, None)  # an import of it now fails
    with pytest.raises(ExtraMissingError) as missing:
        structured.require()
    assert missing.value.extra == "structured"
    assert "pip install 'codeferry[structured]'" in str(missing.value)


def test_executor_workers_give_outputs_that_match(llama: tuple[Path, Any, Any]) -> None:
    """In spawned workers, on the decode loop (``auto`` takes it on this Llama) and on
    batched ``generate``: every structured output matches its constraint and ended by
    itself; unconstrained requests in the same batch get what they get alone; the texts
    are the same on both paths."""
    folder = llama[0]
    body = {"max_tokens": 40, "temperature": 0}
    kinds = {"json": SamplingParams.from_body({**body, "response_format": {
                 "type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}}),
             "choice": SamplingParams.from_body({**body, "guided_choice": CHOICES}),
             "regex": SamplingParams.from_body({**body, "guided_regex": REGEX})}
    plain = SamplingParams.from_body({**body, "max_tokens": 8})
    # sampled, n completions each: generate's own warpers run after the mask (complete.py)
    sampled = [SamplingParams.from_body({"max_tokens": 40, "temperature": 1.5, "top_k": 5,
                                         "top_p": 0.9, "seed": i, "n": 2, "guided_regex": REGEX})
               for i in range(3)]
    requests = [codeferry.Request(prompt=p, params=params) for params in kinds.values()
                for p in PROMPTS] + [codeferry.Request(prompt=p, params=plain) for p in PROMPTS]
    requests += [codeferry.Request(prompt="x", params=params) for params in sampled]
    # json_object: any JSON object; this model closes four at once and writes whitespace
    # in the other two until the cap
    anything = SamplingParams.from_body({**body, "response_format": {"type": "json_object"}})
    requests += [codeferry.Request(prompt=p, params=anything) for p in PROMPTS]
    texts = {}
    for path in ("auto", "batched"):
        with codeferry.Executor(folder, workers=1, generate_path=path) as ex:
            assert ex.worker_info[0]["generate_path"] == ("decode" if path == "auto" else path)
            results = ex.complete(requests)
            alone = ex.generate(PROMPTS, plain)
        by_kind = {kind: results[i * len(PROMPTS):(i + 1) * len(PROMPTS)]
                   for i, kind in enumerate(kinds)}
        assert all(r.finish_reason == "stop" for rows in by_kind.values() for r in rows), [
            (r.text, r.finish_reason) for rows in by_kind.values() for r in rows]
        assert all(valid(json.loads(r.text)) for r in by_kind["json"])
        assert all(r.text in CHOICES for r in by_kind["choice"])
        assert all(re.fullmatch(REGEX, r.text) for r in by_kind["regex"])
        assert len({r.text for r in by_kind["choice"]}) > 1  # the model chose, not the mask
        objects, results = results[-len(PROMPTS):], results[:-len(PROMPTS)]
        closed = [json.loads(r.text) for r in objects if r.finish_reason == "stop"]
        assert len(closed) >= 4 and all(isinstance(v, dict) for v in closed), objects
        assert all(r.text.startswith("{") for r in objects), objects  # the rest: cut by length
        draws = [c.text for r in results[-len(sampled):] for c in r.completions]
        assert len(draws) == 6 and all(re.fullmatch(REGEX, t) for t in draws), draws
        results = results[:-len(sampled)]
        assert [r.text for r in results[-len(PROMPTS):]] == [r.text for r in alone]
        texts[path] = [r.text for r in results + objects]
    assert texts["auto"] == texts["batched"]
