"""Continuous batching and planned batches give exactly the batched path's greedy outputs.

A tiny plain Llama takes the continuous path when asked (``generate_batch``); the bundled
demo and a factory model cannot (their configs and attention are their own) and fall back,
saying why. Every way, and batches planned by length, give the same texts in input order.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import codeferry
from codeferry import cli
from codeferry._exec.engines.base import Complete
from codeferry._exec.scheduler import STREAM_DEPTH, Call
from codeferry.testing import ModelSpec, write_model


def _plain(new: int) -> Complete:
    """What ``generate(prompts, max_new_tokens=new)`` sends: one ``Complete`` of texts."""
    return Complete((), codeferry.SamplingParams(max_tokens=new), texts=True)


def _requests(prompts: list[str]) -> list[codeferry.Request]:
    return [codeferry.Request(prompt=p) for p in prompts]

PROMPTS = ["w1 w2 w3", "w4", "w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15", "w16 w17", "w3 w9 w27 w81",
           "w2", "w40 w41 w42 w43 w44 w45 w46", "w100 w101 w102 w103"]


def write_llama(path: Path) -> Path:
    """A 2-layer Llama with random weights large enough that greedy tokens vary."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i + 3 for i in range(120)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="</s>")
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         head_dim=32, max_position_embeddings=128, bos_token_id=1,
                         eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama(tmp_path_factory.mktemp("llama") / "llama")


def run(path: Path | str, prompts: list[str], options: dict[str, Any],
        **settings: Any) -> tuple[list[str], dict[str, Any]]:
    with codeferry.Executor(path, workers=1, start_method="fork", trust_remote_code=True,
                            **settings) as ex:
        return ex.generate(prompts, **options), ex.worker_info[0]


@pytest.fixture(scope="module")
def llama_batched(llama: Path) -> Iterator[codeferry.Executor]:
    with codeferry.Executor(llama, workers=2, start_method="fork",
                            generate_path="batched") as ex:
        yield ex


@pytest.mark.parametrize("options", [{"max_new_tokens": 6, "min_new_tokens": 6},
                                     {"max_new_tokens": 6}])
def test_continuous_batching_matches_batched_generate_on_a_llama(
        llama: Path, llama_batched: codeferry.Executor, options: dict[str, Any]) -> None:
    texts, info = run(llama, PROMPTS, options, generate_path="continuous")
    assert info["generate_path"] == "continuous", info["generate_reason"]
    assert texts == llama_batched.generate(PROMPTS, batch_size=1, **options)
    assert texts == llama_batched.generate(PROMPTS, batch_size=3, **options)
    assert len(set(texts)) > 1  # the tokens vary: the comparison means something


def test_planned_batches_keep_every_output_at_its_input(
        llama_batched: codeferry.Executor) -> None:
    many = [PROMPTS[i % len(PROMPTS)] + f" w{i}" for i in range(40)]
    one_by_one = llama_batched.generate(many, batch_size=1, max_new_tokens=4)
    planned = llama_batched._batches(_plain(4), _requests(many), None, Call(len(many)))
    assert len(planned) > 1 and any(b.indices != sorted(b.indices) or len(b.indices) > 1
                                    for b in planned)
    assert llama_batched.generate(many, max_new_tokens=4) == one_by_one
    outcomes = list(llama_batched.generate_iter(many, max_new_tokens=4))
    assert sorted(o.index for o in outcomes) == list(range(len(many)))
    assert all(o.value == one_by_one[o.index] for o in outcomes)


def test_auto_takes_the_decode_loop_on_cpu(llama_batched: codeferry.Executor,
                                           llama: Path) -> None:
    texts, info = run(llama, PROMPTS[:3], {"max_new_tokens": 4})
    assert info["generate_path"] == "decode", info["generate_reason"]
    assert "matched generate token for token" in info["generate_reason"]
    assert texts == llama_batched.generate(PROMPTS[:3], max_new_tokens=4)


def test_decoding_workers_stream_small_batches_with_the_same_outputs(
        llama_batched: codeferry.Executor, llama: Path) -> None:
    many = [PROMPTS[i % len(PROMPTS)] + f" w{i}" for i in range(40)]
    with codeferry.Executor(llama, workers=2, start_method="fork") as ex:
        assert all(info["streams"] for info in ex.worker_info), ex.worker_info
        planned = ex._batches(_plain(4), _requests(many), None, Call(len(many)))
        # an eighth of a worker's rows a batch, STREAM_DEPTH of them in its pipe at once
        assert max(len(b.indices) for b in planned) <= ex.max_batch_size // STREAM_DEPTH
        assert sorted(i for b in planned for i in b.indices) == list(range(len(many)))
        got = ex.generate(many, max_new_tokens=5)
    assert got == llama_batched.generate(many, max_new_tokens=5)
    assert not any(info.get("streams") for info in llama_batched.worker_info)  # batched path


@pytest.mark.parametrize("which", ["demo", "factory"])
def test_models_continuous_batching_cannot_run_fall_back_with_the_same_outputs(
        which: str, tmp_path: Path) -> None:
    if which == "demo":
        path: Path | str = cli._demo()
        prompts = Path(path, "prompts.txt").read_text().splitlines()[:6]
    else:
        path = write_model(tmp_path / "tok", ModelSpec(name="tok", tokenizer=True))
        prompts = ["abc", "hello there", "a much longer prompt than the others", "xy"]
    options = {"max_new_tokens": 5}
    asked, info = run(path, prompts, options, generate_path="continuous")
    assert info["generate_path"] == "batched"
    assert "continuous batching does not work for this model" in info["generate_reason"]
    batched, _ = run(path, prompts, options, generate_path="batched", batch_size=1)
    assert asked == batched


def test_an_unknown_generate_path_is_refused_before_any_worker_starts(llama: Path) -> None:
    with pytest.raises(ValueError, match="generate_path must be 'auto', 'decode', 'continuous' or"):
        run(llama, PROMPTS[:1], {}, generate_path="fastest")


def test_doctor_says_which_path_a_model_takes(llama: Path) -> None:
    from codeferry._commands.doctor import doctor, render_doctor

    works = doctor(str(llama), workers=1, start_method="fork")
    assert works.workers[0].checks["generate_path"] == {
        "cpu": "decode", "accelerator": "decode",
        "reason": "a greedy probe of the decode loop matched generate token for token"}
    assert "generate: decode on cpu, decode on an accelerator" in render_doctor(works)
    demo = doctor(cli._demo(), workers=1, start_method="fork", trust_remote_code=True)
    line = render_doctor(demo)
    assert "generate: batched on cpu, batched on an accelerator (the decode loop does not " \
           "work for this model: " in line


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_lighter_min_new_tokens_gives_transformers_tokens(llama: Path, sample: bool) -> None:
    """The worker's ``min_new_tokens`` (one in-place processor) against transformers' own
    (two cloning processors), on a model whose favourite first token is made its
    end-of-sequence: without the minimum it would stop at once."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from codeferry._exec.generate.generation import lighter_min_new_tokens

    model = AutoModelForCausalLM.from_pretrained(llama).eval()
    tok = AutoTokenizer.from_pretrained(llama, padding_side="left")
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    enc.pop("token_type_ids", None)
    width = enc["input_ids"].shape[1]
    with torch.inference_mode():
        first = model.generate(**enc, max_new_tokens=1, do_sample=False)[:, width]
    favourite = int(torch.mode(first).values)
    model.generation_config.eos_token_id = favourite
    options = {"max_new_tokens": 8, "min_new_tokens": 5, "do_sample": sample, "pad_token_id": 2}
    lighter = lighter_min_new_tokens(options, width, model.generation_config)
    assert "min_new_tokens" not in lighter and len(lighter["logits_processor"]) == 1

    def tokens(opts: dict[str, Any]) -> list[list[int]]:
        torch.manual_seed(7)
        with torch.inference_mode():
            return model.generate(**enc, **opts)[:, width:].tolist()

    theirs = tokens(options)
    assert tokens(lighter) == theirs
    assert all(favourite not in row[:5] for row in theirs)  # the minimum was enforced
    if not sample:
        free = tokens({k: v for k, v in options.items() if k != "min_new_tokens"})
        assert free != theirs  # and without it, greedy ends at the favourite token


def test_lighter_min_new_tokens_leaves_what_it_cannot_match(llama: Path) -> None:
    from transformers import GenerationConfig

    from codeferry._exec.generate.generation import lighter_min_new_tokens

    config = GenerationConfig(eos_token_id=2)
    for options in ({"max_new_tokens": 4}, {"min_new_tokens": 0},
                    {"min_new_tokens": 3, "forced_eos_token_id": 2}):
        assert lighter_min_new_tokens(options, 5, config) is options
    assert lighter_min_new_tokens({"min_new_tokens": 3}, 5, GenerationConfig()) == {
        "min_new_tokens": 3}  # no end-of-sequence: nothing to enforce


def test_auto_on_an_accelerator_takes_the_decode_loop_and_never_continuous_batching(
        llama: Path) -> None:
    """The choice a ``cuda`` worker makes (its probe runs where the model is: here, on CPU).
    Measured on an H200 (docs/benchmarks.md), continuous batching made 177 tokens/s where
    the decode loop made 1336: ``auto`` takes the loop where its probe matches, batched
    ``generate`` (saying why) where it does not, and continuous batching only when asked."""
    from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM

    from codeferry._exec.generate.generation import choose_path
    from codeferry._exec.generate.stream import choose

    model = AutoModelForCausalLM.from_pretrained(llama).eval()
    path, why = choose(model, "auto", "cuda", 2)
    assert path == "decode" and "codeferry's attention" not in why  # CPU's attention only
    assert choose(model, "batched", "cuda", 2) == ("batched", "asked for (generate_path='batched')")
    with pytest.raises(ValueError, match=r"stream\.choose decides 'auto'"):
        choose_path(model, "auto", 2)  # never the way auto reaches continuous batching
    windowed = MistralForCausalLM(MistralConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, head_dim=32, sliding_window=4)).eval()
    path, why = choose(windowed, "auto", "cuda", 0)
    assert path == "batched" and why.startswith("the decode loop does not work for this model")
