"""The decode loop's attention on CPU (``_exec/attention.py``) and its cuts (``decode.runs``).

A bfloat16 or float16 model's loop stores keys and values in float32 and attends in
float32; a decode step attends over each layer's whole buffers (a little longer than their
columns, zeroed, the rest masked), and prompts are prefilled in groups padded to their own
longest. Greedy tokens stay ``generate``'s (within
rounding in bfloat16). Runs in this process on a tiny random Llama; one test runs it in a
real worker through ``codeferry.Executor``.
"""

from __future__ import annotations

from typing import Any

import pytest

import codeferry
from codeferry._exec.generate import attention
from codeferry._exec.generate.cuts import prefill_runs
from codeferry._exec.generate.decode import Engine, RowOptions, decode, rows_for
from codeferry._exec.generate.stream import choose

torch = pytest.importorskip("torch")

from test_decode import EOS, generated, llama_folder, prompts, tiny_llama  # noqa: E402


def half(dtype: str = "bfloat16", **extra: Any) -> Any:
    return tiny_llama(**extra).to(getattr(torch, dtype))


def near_greedy(model: Any, prompt: list[int], row: list[int]) -> bool:
    """Whether each of ``row``'s tokens is greedy within the model dtype's rounding: its
    logit in a plain forward over prompt and row (no cache) is within 2% of the largest."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + row[:-1]])).logits[0].float()
    steps = logits[len(prompt) - 1:]
    picked = steps[torch.arange(len(row)), torch.tensor(row)]
    return bool((picked >= steps.max(-1).values - 0.02 * steps.abs().max(-1).values).all())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_half_precision_model_attends_in_float32_and_gives_greedy_tokens(dtype: str) -> None:
    model = half(dtype)
    assert attention.enable(model) and model.config._attn_implementation == attention.NAME
    batch = prompts(8, seed=11)
    options = [RowOptions(6 + 3 * i, (EOS,)) for i in range(len(batch))]
    got = decode(model, batch, options, pad_token_id=0, max_rows=3)  # rows leave and join
    # generate keeps its own cache in the model's dtype: plain sdpa runs under the new name.
    want = [generated(model, p, o) for p, o in zip(batch, options, strict=True)]
    if dtype == "float16":
        assert got == want
    else:  # bfloat16's 8 bits of mantissa: where two logits round alike, another token may win
        assert sum(g == w for g, w in zip(got, want, strict=True)) >= len(batch) - 2
        assert all(near_greedy(model, p, g) for p, g in zip(batch, got, strict=True))
    engine = Engine(model, pad_token_id=0)
    engine.add(batch[:2], options[:2])
    with torch.inference_mode():
        engine.step()
    layer = engine.batch.cache.layers[0]
    assert layer.kbuf.dtype == layer.vbuf.dtype == torch.float32
    attention.disable(model)
    assert model.config._attn_implementation == "sdpa"
    assert attention.cache_dtype(model) is None


def test_prompts_are_prefilled_in_groups_padded_to_their_own_longest() -> None:
    assert prefill_runs([51, 50, 48, 12, 11, 10, 9, 6]) == ((0, 3), (3, 8))
    assert prefill_runs([12, 11, 10, 9]) == ((0, 4),)  # not worth one more forward
    assert prefill_runs([]) == ()


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_short_and_long_prompts_give_generates_tokens_over_buffers_a_little_longer(dtype: str) -> None:
    model = half(dtype)
    attention.enable(model)
    batch = [list(range(8, 108)) + list(range(8, 108)), list(range(9, 12)), list(range(20, 24)),
             list(range(30, 119)) * 2, list(range(40, 43))]
    options = [RowOptions(10, (EOS,)) for _ in batch]
    engine = Engine(model, pad_token_id=0)
    engine.add(batch, options)
    widths: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda _, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    with torch.inference_mode():
        engine.step()  # the prefill: rows sorted longest first
    hook.remove()
    assert widths == [200, 178, 4]  # groups, each padded to its own longest prompt
    for layer in engine.batch.cache.layers:  # 200 columns, a quarter more, zeroed
        assert layer.kbuf.shape[-2] == layer.vbuf.shape[-2] == 250
        assert not layer.kbuf[:, :, 200:].any() and not layer.vbuf[:, :, 200:].any()
    got = decode(model, batch, options, pad_token_id=0)
    assert got == [generated(model, p, o) for p, o in zip(batch, options, strict=True)]


@pytest.mark.parametrize("way", attention.WAYS)
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("mask", ["none", "bool", "additive"])
def test_a_decode_step_attends_over_whole_buffers_as_sdpa_over_the_columns_written(
        kv_heads: int, mask: str, way: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    monkeypatch.setenv("CODEFERRY_CPU_DECODE_KEYS", way)
    torch.manual_seed(0)
    rows, heads, columns, dim = 5, 4, 37, 16
    kbuf = attention.empty_keys((rows, kv_heads, columns + 9, dim), torch.float32, "cpu", True)
    assert (kbuf.stride(-2) == 1) == (way == "innermost") and not kbuf.any()
    assert attention.empty_keys((1, 2, 3, 4), torch.float32, "cpu", False).is_contiguous()
    vbuf = torch.zeros(rows, kv_heads, columns + 9, dim)
    keys, values = kbuf[:, :, :columns], vbuf[:, :, :columns]  # as the loop's cache hands them
    keys.copy_(torch.randn(rows, kv_heads, columns, dim))
    values.copy_(torch.randn(rows, kv_heads, columns, dim))
    query = torch.randn(rows, heads, 1, dim)
    pad = [0, 0, 6, 9, 12] if mask != "none" else [0] * rows  # left padding, row by row
    allowed = torch.arange(columns)[None, :] >= torch.tensor(pad)[:, None]
    given = {"none": None, "bool": allowed[:, None, None, :],
             "additive": torch.zeros(rows, 1, 1, columns).masked_fill(
                 ~allowed[:, None, None, :], torch.finfo(torch.float32).min)}[mask]
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True, layer_idx=0)
    want, _ = sdpa_attention_forward(module, query, keys.contiguous(), values.contiguous(), given,
                                     scaling=0.3)
    layer = SimpleNamespace(keys=keys, kbuf=kbuf, vbuf=vbuf, at=(0, 0))
    cache = SimpleNamespace(layers=[layer])
    assert attention._whole(cache, module, query, keys, given) is layer
    got, _ = attention._attention(module, query, keys, values, given, scaling=0.3,
                                  **{attention.CACHE: cache})
    assert got.shape == want.shape == (rows, 1, heads, dim)
    assert torch.allclose(got, want, atol=1e-5)
    # a key the layer did not hand over (a copy, another layer's): attended as it is
    assert attention._whole(cache, module, query, keys.clone(), given) is None
    assert attention._whole(cache, SimpleNamespace(layer_idx=1), query, keys, given) is None
    got, _ = attention._attention(module, query, keys.clone(), values, given, scaling=0.3,
                                  **{attention.CACHE: cache})
    assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("way", attention.WAYS)
def test_the_loops_decode_steps_attend_through_the_way_set_over_whole_buffers(
        way: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # what this transformers passes to attention must not turn the whole buffers down
    model = _ours(way, monkeypatch)
    rows: list[int] = []
    real = attention._step
    monkeypatch.setattr(attention, "_step", lambda *a: rows.append(a[1].shape[-2]) or real(*a))
    batch = prompts(4, seed=3)
    options = [RowOptions(5) for _ in batch]
    engine = Engine(model, pad_token_id=0)
    engine.add(batch, options)
    with torch.inference_mode():
        while engine.busy:
            engine.step()
    # a call a layer at every step after the prefill, over the whole buffer; none for SDPA
    longest = max(len(p) for p in batch)
    assert rows == ([longest + max(attention.SLACK, longest // 4)] * 4 * 2
                    if way != "sdpa" else []), rows
    assert engine.batch.cache is None  # every row ended
    got = decode(model, batch, options, pad_token_id=0)
    assert got == [generated(model, p, o) for p, o in zip(batch, options, strict=True)]
    layer = _layer(model, batch[:1])
    assert (layer.kbuf.stride(-2) == 1) == (way == "innermost") and layer.vbuf.is_contiguous()


@pytest.mark.parametrize("way", attention.WAYS)
def test_a_buffer_grows_by_a_quarter_as_its_rows_outgrow_it_and_tokens_stay_generates(
        way: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _ours(way, monkeypatch)
    batch = [list(range(10, 18)), list(range(30, 33)), list(range(50, 62))]
    options = [RowOptions(60, (EOS,), min_new_tokens=60) for _ in batch]  # every row 60 long
    engine = Engine(model, pad_token_id=0)
    engine.add(batch, options)
    widths: list[int] = []
    outputs: list[list[int]] = []
    with torch.inference_mode():
        while engine.busy:
            for _, rows in engine.step():
                outputs = rows
            if engine.batch.cache is not None:
                layer = engine.batch.cache.layers[1]
                assert not layer.kbuf[:, :, layer.length:].any()  # the rest stays zero
                assert not layer.vbuf[:, :, layer.length:].any()
                widths.append(layer.kbuf.shape[-2])
    # 12 columns after the prefill and 16 more; grown to 16 (at least a quarter) past each
    assert sorted(set(widths)) == [28, 45, 62, 79], sorted(set(widths))
    assert outputs == [generated(model, p, o) for p, o in zip(batch, options, strict=True)]


def test_unset_the_way_is_the_one_timed_fastest_once_a_process(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CODEFERRY_CPU_DECODE_KEYS", raising=False)
    model = half("float32")
    heads, dim = attention.kv_shape(model)
    assert (heads, dim) == (2, 16)
    times = attention.timed_ways(heads, dim)
    assert set(times) == set(attention.WAYS) and all(t > 0 for t in times.values())
    fastest = min(times, key=times.__getitem__)
    assert attention.decode_way(heads, dim) == fastest
    misses = attention.timed_ways.cache_info().misses
    assert attention.enable(model)
    layer = _layer(model, prompts(2, seed=4)[:1])
    assert (layer.kbuf.stride(-2) == 1) == (fastest == "innermost")
    assert attention.timed_ways.cache_info().misses == misses  # timed once, not again
    note = attention.layout_note(model)
    assert note.endswith("whole buffers: ms a layer timed " + ", ".join(
        f"{way} {times[way]:.2f}" for way in attention.WAYS))
    monkeypatch.setenv("CODEFERRY_CPU_DECODE_KEYS", "sdpa")
    assert attention.decode_way(heads, dim) == "sdpa"
    assert attention.layout_note(model) == (
        "a step attends by torch's SDPA over keys as they come: CODEFERRY_CPU_DECODE_KEYS")


def _ours(way: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A float32 tiny Llama on codeferry's attention, its steps set to ``way``."""
    monkeypatch.setenv("CODEFERRY_CPU_DECODE_KEYS", way)
    model = half("float32")
    assert attention.enable(model)
    return model


def _layer(model: Any, batch: list[list[int]]) -> Any:
    engine = Engine(model, pad_token_id=0)
    engine.add(batch, [RowOptions(3)])
    with torch.inference_mode():
        engine.step()
    return engine.batch.cache.layers[0]


def test_other_attention_is_left_as_it_is() -> None:
    eager = half(attn_implementation="eager")
    assert not attention.enable(eager) and eager.config._attn_implementation == "eager"


def test_the_kv_budget_counts_float32_keys() -> None:
    model = half()
    per_row = 2 * 2 * 2 * 16 * 2 * 100  # layers, K and V, kv heads, head dim, bf16, positions
    assert rows_for(model, 100, kv_budget=per_row * 6) == 6
    attention.enable(model)
    assert rows_for(model, 100, kv_budget=per_row * 6) == 3  # float32: twice the bytes


def test_the_worker_choice_and_its_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    model = half()
    path, why = choose(model, "auto", "cpu", 0) or ("", "")
    assert path == "decode" and "codeferry's attention" in why and "; a step attends by " in why
    monkeypatch.setenv("CODEFERRY_CPU_FLOAT32_ATTENTION", "0")
    other = half()
    path, why = choose(other, "auto", "cpu", 0) or ("", "")
    assert path == "decode" and "codeferry's attention" not in why
    assert other.config._attn_implementation == "sdpa"


def test_a_bfloat16_worker_decodes_in_float32_with_generates_tokens(tmp_path: Any) -> None:
    model, tokenizer = llama_folder(tmp_path / "llama")
    model = model.to(torch.bfloat16)
    model.save_pretrained(tmp_path / "llama")
    texts = ["w9 w20 w31", "w40 w41", "w77 w12 w13 w14 w60"]
    with codeferry.Executor(tmp_path / "llama", workers=1, dtype="bfloat16",
                            preload=("generate",)) as ex:
        info = ex.worker_info[0]
        assert info["generate_path"] == "decode", info
        assert "codeferry's attention" in info["generate_reason"], info
        # the worker timed the ways itself, in its own process, and says what it chose
        assert "whole buffers: ms a layer timed innermost " in info["generate_reason"], info
        got = ex.generate(texts, max_new_tokens=12)
    want = [tokenizer.decode(generated(model, tokenizer(t)["input_ids"], RowOptions(12, (EOS,))),
                             skip_special_tokens=True) for t in texts]
    assert got == want
