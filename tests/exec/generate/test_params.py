"""Per-request parameters, the pure part: values checked, defaults layered in the
order request > run > the model's generation_config > neutral, groups that may share a
``generate`` call, stop strings."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from codeferry import SamplingParams
from codeferry._exec.generate.params import cut_at_stop, group_key, resolve
from codeferry.errors import SamplingParamsError


@pytest.mark.parametrize(("field", "value", "words"), [
    ("temperature", -0.1, "below"),
    ("top_p", 0.0, "below or at 0.0"),
    ("top_p", 1.5, "above 1.0"),
    ("top_k", -2, "below"),
    ("max_tokens", 0, "below"),
    ("max_tokens", 2.5, "not an integer"),
    ("n", True, "not an integer"),
    ("presence_penalty", 3, "above 2.0"),
    ("temperature", float("nan"), "not a number"),
    ("stop", [""], "not a string or a list of non-empty strings"),
    ("stop_token_ids", [-1], "not a list of token ids"),
    ("logprobs", 21, "above 20"),
])
def test_a_bad_value_is_a_typed_error_naming_its_field(field: str, value: object,
                                                       words: str) -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    assert info.value.field == field and words in str(info.value) and info.value.fix
    assert isinstance(info.value, ValueError)


def test_min_tokens_above_max_tokens_is_refused() -> None:
    with pytest.raises(SamplingParamsError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)


def test_an_openai_body_maps_to_the_same_parameters() -> None:
    body = {"model": "m", "messages": [], "max_completion_tokens": 7, "stop": "END",
            "logprobs": True, "top_logprobs": 3, "temperature": 0, "seed": 1, "user": "x"}
    params = SamplingParams.from_body(body)
    assert params == SamplingParams(max_tokens=7, stop=("END",), logprobs=3, temperature=0.0,
                                    seed=1)
    assert SamplingParams.from_body({"logprobs": 2, "stop": ["a", "b"]}) == SamplingParams(
        logprobs=2, stop=("a", "b"))
    assert SamplingParams.from_body({"logprobs": False}).logprobs is None
    assert pickle.loads(pickle.dumps(params)) == params  # it travels to workers


def test_defaults_layer_request_then_run_then_model_then_neutral() -> None:
    model = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "max_new_tokens": 40}
    run = SamplingParams(max_tokens=10, top_k=5)
    mine = resolve(SamplingParams(top_p=0.5).over(run), model)
    assert (mine.do_sample, mine.temperature, mine.top_p, mine.top_k, mine.max_tokens) == (
        True, 0.6, 0.5, 5, 10)
    plain = resolve(SamplingParams(), {})
    assert (plain.do_sample, plain.top_k, plain.top_p, plain.max_tokens, plain.n) == (
        False, 0, 1.0, 16, 1)  # a model that sets nothing is greedy, as in transformers
    assert resolve(SamplingParams(temperature=0), model).do_sample is False  # 0: greedy
    assert resolve(SamplingParams(temperature=0.8), {}).do_sample is True
    assert resolve(SamplingParams(), model).max_tokens == 40
    assert resolve(SamplingParams(top_k=-1), {"top_k": 50}).top_k == 0  # -1: off, as in vLLM


def test_groups_share_what_generate_takes_per_call_and_seeded_requests_go_alone() -> None:
    def key(index: int, **fields: object) -> tuple[object, ...]:
        return group_key(resolve(SamplingParams(**fields), {}), index)  # type: ignore[arg-type]

    # max_tokens and stop strings are cut per row: they share a call
    assert key(0, max_tokens=3, stop=["x"]) == key(1, max_tokens=9)
    assert key(0, temperature=0.5) != key(1, temperature=0.6)
    assert key(0, temperature=0.5, seed=1) != key(1, temperature=0.5, seed=1)
    assert key(0, seed=1) == key(1)  # greedy: the seed changes nothing
    assert key(0, n=2) != key(1)
    assert key(0, logprobs=1) != key(1)
    # greedy rows ignore the sampling knobs
    assert key(0, top_p=0.5) == key(1, top_k=3)


@given(st.text(max_size=30), st.lists(st.text(min_size=1, max_size=3), max_size=3))
def test_a_stop_string_ends_the_text_before_its_first_occurrence(text: str,
                                                                 stop: list[str]) -> None:
    cut, which = cut_at_stop(text, stop)
    assert text.startswith(cut)
    if which is None:
        assert cut == text and not any(s in text for s in stop)
    else:
        assert text[len(cut):].startswith(which)
        assert not any(s in cut for s in stop)  # no stop string ends earlier


def test_generate_keywords_map_onto_sampling_params() -> None:
    """``Executor.generate`` without ``params`` sends the same request as with them: its
    ``model.generate`` keywords mean these parameters, as ``generate`` reads them."""
    from_options = SamplingParams.from_generate_options
    assert from_options({}) == SamplingParams()
    assert from_options({"max_new_tokens": 5, "min_new_tokens": 2, "pad_token_id": 0}) == \
        SamplingParams(max_tokens=5, min_tokens=2)
    assert from_options({"do_sample": False, "temperature": 0.7}).temperature == 0.0
    assert from_options({"do_sample": True, "top_k": 3}, 0.6) == SamplingParams(temperature=0.6,
                                                                                top_k=3)
    assert from_options({"do_sample": True}, None).temperature == 1.0  # transformers' default
    assert from_options({"do_sample": True, "temperature": 0.3}, 0.6).temperature == 0.3
    with pytest.raises(SamplingParamsError, match="'num_beams' is not one the executor takes"):
        from_options({"num_beams": 2})
