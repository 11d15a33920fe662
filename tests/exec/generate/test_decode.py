"""The decode loop (``_exec/decode.py``) gives ``generate``'s greedy tokens, row by row.

Rows leave the batch when they end and waiting prompts are prefilled and merged in
(``max_rows`` small forces both); each row keeps its own options; a group of prompts added
while others run joins them and is handed back when its own rows ended. The pure loop runs
in this process on a tiny random Llama; one test runs it in real workers through
``codeferry.Executor``, whose default takes it on CPU, and whose workers merge the batches
in their pipe into one loop (``_exec/stream.py``).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest

import codeferry
from codeferry._exec.generate.calling import supports
from codeferry._exec.generate.cuts import blocks
from codeferry._exec.generate.decode import Engine, RowOptions, decode, rows_for
from codeferry._exec.generate.stream import _follows, probe

EOS = 108  # a token this model's greedy outputs reach, at different positions


def tiny_llama(**extra: Any) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=120, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                         eos_token_id=EOS, **extra)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # peaked: greedy paths that vary and reach EOS
    return model


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_llama()


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 14, (n,), generator=g).tolist()
    return [torch.randint(8, 120, (k,), generator=g).tolist() for k in lengths]


def generated(model: Any, prompt: list[int], option: RowOptions) -> list[int]:
    """``generate`` on the prompt alone: the reference."""
    import torch

    with torch.inference_mode():
        out = model.generate(input_ids=torch.tensor([prompt]), do_sample=False,
                             max_new_tokens=option.max_new_tokens,
                             min_new_tokens=option.min_new_tokens or None,
                             eos_token_id=list(option.eos) or None, pad_token_id=0)
    row: list[int] = out[0, len(prompt):].tolist()
    ends = [at for at, token in enumerate(row) if token in option.eos]
    return row[:ends[0] + 1] if ends else row


@pytest.mark.parametrize("max_rows", [1, 3, 64])
def test_greedy_rows_equal_generate_while_rows_leave_and_join(model: Any, max_rows: int) -> None:
    batch = prompts(10)
    options = [RowOptions(max_new_tokens=4 + 3 * i, eos=(EOS, 70) if i % 3 != 1 else (),
                          min_new_tokens=2 if i == 4 else 0) for i in range(len(batch))]
    got = decode(model, batch, options, pad_token_id=0, max_rows=max_rows)
    expected = [generated(model, p, o) for p, o in zip(batch, options, strict=True)]
    assert got == expected
    assert any(row[-1] in (EOS, 70) and len(row) < o.max_new_tokens
               for row, o in zip(got, options, strict=True))  # some rows ended early
    assert len({len(row) for row in got}) > 3  # and at different lengths


def test_a_group_added_while_another_runs_joins_it_and_ends_first(model: Any) -> None:
    import torch

    first, second = prompts(5, seed=7), prompts(3, seed=8)
    long = [RowOptions(40, (EOS,), min_new_tokens=40) for _ in first]
    short = [RowOptions(3 + i, (EOS, 70)) for i in range(len(second))]
    engine = Engine(model, pad_token_id=0, max_rows=8)
    ended: list[tuple[int, list[list[int]]]] = []
    with torch.inference_mode():
        a = engine.add(first, long)
        for _ in range(5):  # the first group is decoding when the second comes
            ended += engine.step()
        b = engine.add(second, short)
        while engine.busy:
            ended += engine.step()
            assert len(engine.batch.rows) <= 8
    assert [group for group, _ in ended] == [b, a]  # the short group did not wait for the long
    outputs = dict(ended)
    assert outputs[a] == [generated(model, p, o) for p, o in zip(first, long, strict=True)]
    assert outputs[b] == [generated(model, p, o) for p, o in zip(second, short, strict=True)]
    assert not engine.prompts and not engine.outputs  # nothing kept of groups handed back


def test_a_group_whose_last_row_ends_alone_leaves_the_others_decoding(model: Any) -> None:
    """A group's rows but one end and are compacted away; its last row then ends while too
    few rows are done to compact (fewer than an eighth): the group is handed back and the
    loop goes on with that ended row still in the batch. A sampled workload met it about
    one call in eight (a ``KeyError`` failed the loop, every batch in it ran again)."""
    import torch

    first, second = prompts(8, seed=3), prompts(8, seed=4)
    short = [RowOptions(2) for _ in range(7)] + [RowOptions(6)]
    long = [RowOptions(20) for _ in second]
    engine = Engine(model, pad_token_id=0, max_rows=16)
    ended: list[tuple[int, list[list[int]]]] = []
    with torch.inference_mode():
        a, b = engine.add(first, short), engine.add(second, long)
        while engine.busy:
            ended += engine.step()
    outputs = dict(ended)
    assert [group for group, _ in ended] == [a, b]
    assert outputs[a] == [generated(model, p, o) for p, o in zip(first, short, strict=True)]
    assert outputs[b] == [generated(model, p, o) for p, o in zip(second, long, strict=True)]


def test_min_new_tokens_masks_end_of_sequence(model: Any) -> None:
    batch = prompts(6, seed=3)
    options = [RowOptions(12, (EOS,), min_new_tokens=12) for _ in batch]
    got = decode(model, batch, options, pad_token_id=0, max_rows=4)
    assert [len(row) for row in got] == [12] * len(batch)
    assert all(EOS not in row for row in got)
    assert got == [generated(model, p, o) for p, o in zip(batch, options, strict=True)]


def test_sampling_follows_each_rows_seed(model: Any) -> None:
    batch = prompts(6, seed=5)
    sampled = [RowOptions(10, do_sample=True, temperature=2.0, top_p=0.9, seed=i)
               for i in range(len(batch))]
    first = decode(model, batch, sampled, pad_token_id=0, max_rows=4)
    assert decode(model, batch, sampled, pad_token_id=0, max_rows=4) == first
    greedy = decode(model, batch, [RowOptions(10) for _ in batch], pad_token_id=0)
    assert first != greedy  # it samples
    top1 = [RowOptions(10, do_sample=True, top_k=1, seed=i) for i in range(len(batch))]
    assert decode(model, batch, top1, pad_token_id=0, max_rows=4) == greedy


def test_a_sliding_window_model_is_refused_with_the_reason() -> None:
    from transformers import MistralConfig, MistralForCausalLM

    mistral = MistralForCausalLM(MistralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, sliding_window=4))
    why = supports(mistral)
    assert why is not None and "sliding" in why
    assert probe(mistral, 0) == why


def test_a_pick_between_tied_logits_passes_the_probe_and_any_other_does_not() -> None:
    """Batched and single-row products round apart, so a loop may pick the other of two tied
    logits (a 217M bfloat16 Llama: a gap of exactly 0.0). Here every token has a twin with
    the same head row: every step is an exact tie, ``generate`` takes the lower id."""
    import torch

    model = tiny_llama()
    with torch.no_grad():
        model.lm_head.weight[60:] = model.lm_head.weight[:60]
    prompt, new = [5, 9, 14, 3], 5

    def greedy(prefix: list[int], count: int) -> list[int]:
        with torch.inference_mode():
            out = model.generate(input_ids=torch.tensor([prefix]), do_sample=False,
                                 max_new_tokens=count, min_new_tokens=count, pad_token_id=0)
        return list(out[0, len(prefix):].tolist())

    want = greedy(prompt, new)
    assert all(t < 60 for t in want)
    assert _follows(model, prompt, want, 0)
    twin = [want[0], want[1] + 60]  # the tied token at step 1, then generate's way on
    twin += greedy(prompt + twin, new - 2)
    assert twin != want and _follows(model, prompt, twin, 0)
    # a token below the best at step 1, not tied with it: refused
    other = next(t for t in range(60) if t != want[1])
    wrong = [want[0], other, *greedy([*prompt, want[0], other], new - 2)]
    assert not _follows(model, prompt, wrong, 0)
    assert probe(model, 0) is None


def test_rows_are_bounded_by_the_kv_budget(model: Any) -> None:
    per_row = 2 * 2 * 2 * 16 * 4 * 100  # layers, K and V, kv heads, head dim, fp32, positions
    assert rows_for(model, 100, kv_budget=per_row * 5) == 5
    assert rows_for(model, 100, kv_budget=1) == 1
    assert rows_for(model, 100) == 64


def test_kept_rows_move_in_runs_of_consecutive_rows() -> None:
    assert blocks([]) == []
    assert blocks([0, 1, 2]) == [(0, 3, 0)]
    assert blocks([0, 2, 3, 7]) == [(0, 1, 0), (2, 4, 1), (7, 8, 3)]


def _filled(layer_class: Any, rows: int, length: int, capacity: int) -> Any:
    import torch

    layer = layer_class()
    layer.capacity = capacity
    keys = torch.arange(rows * 2 * length * 4, dtype=torch.float32).reshape(rows, 2, length, 4)
    layer.update(keys + 1, -(keys + 1))  # no zero among the real columns
    return layer


def _poison() -> None:
    """Hand the allocator back blocks full of NaN, the memory an empty buffer may get."""
    import torch

    for size in (64, 128, 256, 512, 1024, 2048):
        torch.full((size,), float("nan"))


def test_cache_moves_keep_the_rows_and_zero_only_the_padding() -> None:
    """Rows joined on the longer length get zeroed padding (attention reads it masked: 0
    weight times NaN left in memory would be NaN), compaction keeps rows and drops columns,
    and columns past the length are never read."""
    import torch

    from codeferry._exec.generate.decode import _layer_class

    layer_class = _layer_class()
    for _ in range(20):
        long, short = _filled(layer_class, 3, 6, 9), _filled(layer_class, 2, 2, 2)
        want_long, want_short = long.keys.clone(), short.keys.clone()
        _poison()
        long.append_rows(short, 12)
        assert long.keys.shape == (5, 2, 6, 4) and long.kbuf.shape[-2] == 12
        assert torch.equal(long.keys[:3], want_long)
        assert torch.equal(long.keys[3:, :, 4:], want_short)
        assert torch.equal(long.values[3:, :, 4:], -want_short)
        assert not long.keys[3:, :, :4].any() and not long.values[3:, :, :4].any()

        short, other = _filled(layer_class, 2, 2, 2), _filled(layer_class, 2, 5, 5)
        want_short = short.keys.clone()
        _poison()
        short.append_rows(other, 5)
        assert torch.equal(short.keys[:2, :, 3:], want_short)
        assert not short.keys[:2, :, :3].any() and not short.values[:2, :, :3].any()

        before = long.keys.clone()
        _poison()
        long.resize([0, 2, 3], 1, 11)
        assert torch.equal(long.keys, before[[0, 2, 3], :, 1:])
        assert long.kbuf.shape[-2] == 11


def test_a_fill_in_runs_writes_every_run_into_one_buffer(model: Any) -> None:
    """Prompts of very different lengths are prefilled in several runs; the runs write their
    keys and values into one buffer, right-aligned, their left padding zeroed (over memory
    full of NaN): a first fill copies nothing, and a group joining a running batch is copied
    into it once, not once a run. Every row gives ``generate``'s tokens."""
    import torch

    from codeferry._exec.generate.cuts import prefill_runs

    g = torch.Generator().manual_seed(3)
    lengths = [(40, 3, 25, 2, 33, 9, 17, 5), (30, 2, 21, 4, 12)]
    first, second = ([torch.randint(8, 120, (k,), generator=g).tolist() for k in group]
                     for group in lengths)
    assert all(len(prefill_runs(sorted(group, reverse=True))) > 2 for group in lengths)
    long = [RowOptions(30, (EOS,), min_new_tokens=30) for _ in first]
    short = [RowOptions(4 + i, (EOS, 70)) for i in range(len(second))]
    engine = Engine(model, pad_token_id=0)
    joined: list[int] = []
    append_rows = engine.batch.layer.append_rows

    def copied(layer: Any, other: Any, capacity: int) -> None:
        joined.append(other.kbuf.shape[0])
        append_rows(layer, other, capacity)

    engine.batch.layer.append_rows = copied
    a = engine.add(first, long)
    _poison()
    ended: list[tuple[int, list[list[int]]]] = []
    with torch.inference_mode():
        engine.step()  # the first fill: no copy
        layers = engine.batch.cache.layers
        assert not joined and all(layer.kbuf.shape[0] == len(first) == layer.keys.shape[0]
                                  and layer.length == 40 for layer in layers)
        for at, row in enumerate(engine.batch.rows):  # longest first: each row's own padding
            pad = 40 - len(first[row])
            assert not layers[0].kbuf[at, :, :pad].any() and not layers[0].vbuf[at, :, :pad].any()
            assert not layers[0].kbuf[at, :, pad:40].isnan().any()
        ended += engine.step()
        b = engine.add(second, short)
        _poison()
        ended += engine.step()  # the second group joins, in runs: copied in once a layer
        assert joined == [len(second)] * len(layers)
        while engine.busy:
            ended += engine.step()
    outputs = dict(ended)
    assert outputs[a] == [generated(model, p, o) for p, o in zip(first, long, strict=True)]
    assert outputs[b] == [generated(model, p, o) for p, o in zip(second, short, strict=True)]


def llama_folder(path: Any) -> tuple[Any, Any]:
    """``tiny_llama`` saved in ``path`` with a word-level tokenizer: (model, tokenizer)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i + 3 for i in range(117)}
    inner = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="w105", pad_token="w105")
    model = tiny_llama()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model, tokenizer


@pytest.mark.parametrize("start_method", ["spawn", "forkserver", "fork"])
def test_executor_defaults_decode_in_workers_with_generates_tokens(
        tmp_path_factory: pytest.TempPathFactory, start_method: str) -> None:
    path = tmp_path_factory.mktemp("decode") / "llama"
    model, tokenizer = llama_folder(path)
    texts = [" ".join(f"w{(i * 7 + j) % 100 + 8}" for j in range(2 + i % 9)) for i in range(12)]
    with codeferry.Executor(path, start_method=start_method, preload=("generate",)) as ex:
        # two workers on a CPU machine (layout.py), their Linear layers packed (packing.py)
        assert len(ex.worker_info) == min(2, len(os.sched_getaffinity(0)))
        # each worker's upcast copies must fit beside those of the others starting with it
        assert [s.place.sharing for s in ex._scheduler.specs] == [len(ex.worker_info)] * len(
            ex.worker_info)
        assert ex.worker_info[0]["generate_path"] == "decode", ex.worker_info[0]
        assert ex.worker_info[0]["packed_linears"] == 2 * 7 + 1, ex.worker_info[0]
        got = ex.generate(texts, max_new_tokens=24)
        # A second call's batch joins the loop of a first one still running: it is answered
        # first. Decoded one batch after the other, it would wait for the first to end.
        arrived: list[float] = []
        long = ex.generate_iter(texts[:4], max_new_tokens=150, min_new_tokens=150)
        reader = threading.Thread(target=lambda: arrived.extend(time.monotonic() for _ in long))
        reader.start()
        short = ex.generate(texts[4:6], max_new_tokens=3)
        # and a batch of per-request parameters (codeferry run's), sampled ones included,
        # joins it the same way
        seeded = codeferry.SamplingParams(max_tokens=6, temperature=1.5, seed=1234)
        results = ex.generate(texts[6:8], [codeferry.SamplingParams(max_tokens=2), seeded])
        short_done = time.monotonic()
        reader.join()
        alone = ex.generate([texts[7]], seeded)[0]
        # logprobs: a batch the loop does not do, answered by complete on the stream's plan
        logged = ex.generate([texts[9]], codeferry.SamplingParams(max_tokens=3, logprobs=1))[0]
    assert len(arrived) == 4 and short_done < max(arrived)
    for part, whole in zip(short, got[4:6], strict=True):
        assert whole.split()[:len(part.split())] == part.split()  # greedy: the first tokens
    assert list(results[0].completions[0].token_ids) == generated(
        model, tokenizer(texts[6])["input_ids"], RowOptions(2, (EOS,)))
    assert alone.completions == results[1].completions  # its own seed: its own tokens
    assert list(logged.completions[0].token_ids) == generated(
        model, tokenizer(texts[9])["input_ids"], RowOptions(3, (EOS,)))
    assert logged.completions[0].logprobs is not None
    expected = []
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        row = generated(model, ids, RowOptions(24, (EOS,)))
        expected.append(tokenizer.decode(row, skip_special_tokens=True))
    assert got == expected
    assert len({len(t.split()) for t in got}) > 2  # outputs end at different lengths
