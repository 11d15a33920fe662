"""``Executor.generate``/``chat`` with per-request parameters, in real workers.

One executor per module on a tiny remote-code model with a chat template; a second one on
a model whose ``generation_config.json`` asks for sampling.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from codeferry import Executor, GenerateResult, SamplingParams
from codeferry.errors import BatchFailedError, ChatTemplateMissingError
from codeferry.testing import ModelSpec, write_model

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
PROMPTS = ["hello there", "abc", "a longer prompt than the others", "q"]


def chat_model(root: Path, name: str, **config: object) -> Path:
    """A model whose tokenizer has a chat template (and ``config`` as generation_config)."""
    path = write_model(root / name, ModelSpec(name=name, tokenizer=True))
    settings = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**settings,
                                                            "chat_template": TEMPLATE}))
    if config:
        (path / "generation_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def executor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Executor]:
    model = chat_model(tmp_path_factory.mktemp("params"), "chatty")
    with Executor(str(model), workers=1, trust_remote_code=True) as ex:
        yield ex


def test_results_carry_finish_reason_and_token_counts_and_strings_stay(
        executor: Executor) -> None:
    plain = executor.generate(PROMPTS, max_new_tokens=6)
    results = executor.generate(PROMPTS, SamplingParams(max_tokens=6))
    assert all(isinstance(r, GenerateResult) for r in results)
    assert [r.text for r in results] == plain == [str(r) for r in results]  # greedy both ways
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert result.prompt_tokens == len(prompt)  # a character-level tokenizer
        assert result.finish_reason in ("stop", "length")
        assert (result.completion_tokens == 6) == (result.finish_reason == "length")
        assert result.completions[0].token_ids and result.logprobs is None


def test_a_seeded_request_gives_the_same_text_alone_and_in_any_batch(
        executor: Executor) -> None:
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=12)
    alone = executor.generate(["abc"], seeded)[0].text
    mixed = executor.generate([*PROMPTS, "abc"], [
        SamplingParams(temperature=0.7, max_tokens=5), SamplingParams(max_tokens=12),
        SamplingParams(temperature=1.0, seed=7, max_tokens=12), seeded, seeded],
        batch_size=5)
    assert mixed[3].text == mixed[4].text == alone
    assert mixed[2].text != alone  # another seed, another text (the vocabulary is wide)
    again = executor.generate(["abc", "abc"], [seeded, SamplingParams(temperature=1.0,
                                                                      max_tokens=12)])
    assert again[0].text == alone


def test_rows_with_other_max_tokens_share_a_call_and_are_cut_each(executor: Executor) -> None:
    long = executor.generate(PROMPTS, SamplingParams(max_tokens=10, min_tokens=10))
    short = executor.generate(PROMPTS, [SamplingParams(max_tokens=k, min_tokens=k)
                                        for k in (2, 10, 4, 7)], batch_size=4)
    for a, b, k in zip(long, short, (2, 10, 4, 7), strict=True):
        assert b.completions[0].token_ids == a.completions[0].token_ids[:k]
        assert b.finish_reason == "length" and b.completion_tokens == k


def test_stop_strings_and_stop_tokens_end_the_completion(executor: Executor) -> None:
    full = executor.generate(["hello there"], SamplingParams(max_tokens=12, min_tokens=12))[0]
    text, ids = full.text, full.completions[0].token_ids
    stop = text[3:5]
    cut = executor.generate(["hello there"], SamplingParams(max_tokens=12, min_tokens=12,
                                                            stop=[stop]))[0]
    assert cut.text == text[:text.index(stop)] and cut.finish_reason == "stop"
    assert cut.completions[0].stop_reason == stop
    assert cut.completion_tokens == text.index(stop) + len(stop)  # up to the one completing it
    token = ids[4]
    first = ids.index(token)
    ended = executor.generate(["hello there"], SamplingParams(max_tokens=12,
                                                              stop_token_ids=[token]))[0]
    assert ended.completions[0].token_ids == ids[:first + 1]
    assert (ended.finish_reason, ended.completions[0].stop_reason) == ("stop", token)


def test_n_completions_logprobs_and_penalties(executor: Executor) -> None:
    many = executor.generate(["abc"], SamplingParams(n=3, temperature=1.0, seed=3,
                                                     max_tokens=5, min_tokens=5))[0]
    assert len(many.completions) == 3 and many.completion_tokens == 15
    assert len({c.text for c in many.completions}) > 1
    copies = executor.generate(["abc"], SamplingParams(n=2, max_tokens=4))[0]  # greedy
    assert len(copies.completions) == 2 and copies.completions[0] == copies.completions[1]
    greedy = executor.generate(["abc"], SamplingParams(max_tokens=5, logprobs=3))[0]
    assert greedy.logprobs is not None and len(greedy.logprobs) == greedy.completion_tokens
    for entry, token in zip(greedy.logprobs, greedy.completions[0].token_ids, strict=True):
        assert entry["token_id"] == token and entry["logprob"] <= 0
        assert [t["logprob"] for t in entry["top"]] == sorted(
            (t["logprob"] for t in entry["top"]), reverse=True)
        assert entry["top"][0]["token_id"] == token  # greedy: the most likely one
    # a frequency penalty large enough changes what greedy repeats
    plain = executor.generate(["aaaa"], SamplingParams(max_tokens=12, min_tokens=12))[0]
    penalized = executor.generate(["aaaa"], SamplingParams(max_tokens=12, min_tokens=12,
                                                           frequency_penalty=2.0,
                                                           presence_penalty=2.0))[0]
    counts = [max(c.token_ids.count(t) for t in c.token_ids)
              for c in (plain.completions[0], penalized.completions[0])]
    assert counts[1] <= counts[0]
    presence = executor.generate(["aaaa"], SamplingParams(max_tokens=12, presence_penalty=2.0))
    assert presence[0].completion_tokens <= 12  # without min_tokens too


def test_chat_renders_the_models_template_or_the_one_given(executor: Executor) -> None:
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    result = executor.chat(conversation, SamplingParams(max_tokens=4))[0]
    assert result.prompt == "system: be brief\nuser: hi\nassistant:"
    assert result.prompt_tokens == len(result.prompt)
    two = executor.chat([conversation, conversation[1:]], SamplingParams(max_tokens=4),
                        chat_template="{{ messages[-1]['content'] }}!")
    assert [r.prompt for r in two] == ["hi!", "hi!"]
    assert two[0].text == two[1].text


def test_chat_without_a_template_is_a_typed_error(tmp_path: Path) -> None:
    model = write_model(tmp_path / "bare", ModelSpec(name="bare", tokenizer=True))
    with Executor(str(model), workers=1, trust_remote_code=True, max_retries=0) as ex:
        with pytest.raises(BatchFailedError) as info:
            ex.chat([{"role": "user", "content": "hi"}])
    assert isinstance(info.value.__cause__, ChatTemplateMissingError)
    assert "--chat-template" in str(info.value.__cause__)


def test_the_models_generation_config_gives_the_defaults(tmp_path: Path) -> None:
    """It asks for sampling: neither path forces greedy any more."""
    model = chat_model(tmp_path, "sampler", do_sample=True, temperature=1.0, max_new_tokens=5)
    with Executor(str(model), workers=1, trust_remote_code=True) as ex:
        greedy = ex.generate(PROMPTS, SamplingParams(temperature=0))
        sampled = ex.generate(PROMPTS, SamplingParams(seed=11))
        legacy = [ex.generate(PROMPTS) for _ in range(2)]
    assert all(r.completion_tokens <= 5 for r in greedy + sampled)  # its max_new_tokens
    assert [r.text for r in sampled] != [r.text for r in greedy]
    assert legacy[0] != legacy[1] or legacy[0] != [r.text for r in greedy]
