"""Where one CPU decode step's time goes: its pieces against vLLM CPU's, and the model's own
code run eagerly against compiled.

Why: beside a neighbour, codeferry's two single-threaded workers get about a core and a third
between them, and vLLM's one worker thread keeps a whole core (``docs/benchmarks.md``); so
those rows turn on the speed of one thread. This script takes one thread's decode step
apart, each piece alone, on the bench model's shapes (``bench_generation``: a Llama of
``--size``, float32):

- ``--part kernels``: attention for one new token a row over its keys and values, each
  ``[rows, heads, columns, dim]`` sliced from a larger buffer as ``decode._Layer`` holds it
  (torch's ``scaled_dot_product_attention`` over a buffer's first columns; the decode
  loop's own step, ``attention._step``, over its whole buffer, a quarter longer; vLLM's paged
  CPU kernel over the same keys, written by its own ``cpu_attn_reshape_and_cache``), and
  the model's linears at a given number of rows (``F.linear``; oneDNN on a packed weight, as
  ``packing.py`` packs it; vLLM's ``onednn_mm``). Twelve layers' tensors are cycled, so a
  call reads from memory as a step does, not from the cache the previous call filled. The
  vLLM rows need a Python with vLLM (its venv's); without it they are left out.
- ``--part compiled``: one decode step of the whole model, three ways: transformers'
  forward run eagerly, its linears packed as the decode loop packs them; compiled by inductor
  (``torch.compile(dynamic=True)``) with the weights frozen; and compiled with each packed
  linear one opaque op (the weights not frozen). In both compiled ways the keys' write and
  the attention are one custom op, so the graph does not break at every layer (vLLM
  compiles transformers' code so). Every row is at the same position, from ``--context``
  on. Rounds alternate; it prints the medians with their range, the seconds each
  compilation took, and whether all ways chose the same greedy tokens for 20 steps.
- ``--part loops``: one thread's whole decode of ``n`` prompts, ``--new`` tokens each:
  codeferry's ``decode.Engine`` in this process, then vLLM's ``LLM`` (started once, after
  codeferry's rounds: not alternated). Under vLLM's venv, as ``kernels``.

Run (one thread throughout)::

    HF_HUB_OFFLINE=1 /path/to/vllm-venv/bin/python benchmarks/bench_cpu_step.py --part kernels
    HF_HUB_OFFLINE=1 /path/to/vllm-venv/bin/python benchmarks/bench_cpu_step.py --part loops
    HF_HUB_OFFLINE=1 python benchmarks/bench_cpu_step.py --part compiled --reps 3
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_executor as be  # noqa: E402 - stdlib only at import
import bench_generation as bg  # noqa: E402 - stdlib only at import

LAYERS = 12


def cold(call: Callable[[int], Any], reps: int = 5) -> float:
    """Milliseconds of ``call(layer)``, median over ``reps`` passes of every layer."""
    for layer in range(LAYERS):
        call(layer)
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        for layer in range(LAYERS):
            call(layer)
        times.append((time.perf_counter() - started) / LAYERS)
    return statistics.median(times) * 1000


def vllm_ops() -> Any:
    try:
        import vllm._custom_ops as ops
    except ImportError:
        return None
    return ops


def attention_rows(heads: int, dim: int, shapes: list[tuple[int, int]]) -> None:
    ops = vllm_ops()
    print("\n### Attention, one new token a row (ms a layer; GB/s of keys and values read)\n")
    print("| rows x columns | MB a layer | torch SDPA, a buffer's first columns | codeferry's "
          "step, the whole buffer | vLLM CPU paged kernel |")
    print("|---|---:|---:|---:|---:|")
    for rows, columns in shapes:
        megabytes = rows * heads * columns * dim * 4 * 2 / 1e6
        times = attention_ways(rows, columns, heads, dim, ops)
        cells = [f"{t:.2f} ({megabytes / t:.0f} GB/s)" if t else "-" for t in times]
        print(f"| {rows} x {columns} | {megabytes:.1f} | {' | '.join(cells)} |")


def attention_ways(rows: int, columns: int, heads: int, dim: int,
                   ops: Any) -> tuple[float, float, float]:
    """Milliseconds a layer: SDPA over a buffer's first ``columns`` (``[..., columns, dim]``),
    the decode loop's step (``attention._step``) over a whole buffer a quarter longer, the
    rest masked (as ``decode._Layer`` keeps it), and vLLM's kernel (0 without vLLM)."""
    import torch

    from codeferry._exec.generate.attention import SLACK, _step

    f = torch.nn.functional
    query = torch.randn(rows, heads, 1, dim)
    keys = [torch.randn(rows, heads, columns + 128, dim)[:, :, :columns] for _ in range(LAYERS)]
    values = [torch.randn(rows, heads, columns + 128, dim)[:, :, :columns] for _ in range(LAYERS)]
    room = columns + max(SLACK, columns // 4)
    whole = [[torch.zeros(rows, heads, room, dim) for _ in range(LAYERS)] for _ in range(2)]
    for mine, plain in zip(whole[0] + whole[1], keys + values, strict=True):
        mine[:, :, :columns] = plain
    mask = (torch.arange(room) < columns).view(1, 1, 1, -1)
    sdpa = cold(lambda i: f.scaled_dot_product_attention(query, keys[i], values[i]))
    step = cold(lambda i: _step(query, whole[0][i], whole[1][i], mask, None))
    if not torch.allclose(_step(query, whole[0][0], whole[1][0], mask, None).transpose(1, 2),
                          f.scaled_dot_product_attention(query, keys[0], values[0]), atol=1e-4):
        raise SystemExit("the decode step and SDPA disagree")
    if ops is None:
        return sdpa, step, 0.0
    block = 128
    blocks = -(-columns // block)
    table = torch.arange(rows * blocks, dtype=torch.int32).view(rows, blocks)
    slots = (table[:, :, None] * block + torch.arange(block)).view(rows, -1)[:, :columns]
    paged = []
    for i in range(LAYERS):
        both = torch.zeros(rows * blocks, heads, block, 2 * dim)
        k_cache, v_cache = both.view(rows * blocks, heads, 2 * block, dim).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(
            keys[i].transpose(1, 2).reshape(-1, heads, dim),
            values[i].transpose(1, 2).reshape(-1, heads, dim),
            k_cache, v_cache, slots.reshape(-1).long(), "vec")
        paged.append((k_cache, v_cache))
    lengths = torch.full((rows,), columns, dtype=torch.int32)
    starts = torch.arange(rows + 1, dtype=torch.int32)
    plan = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=rows, num_heads=heads, num_kv_heads=heads, head_dim=dim, seq_lens=lengths,
        dtype=torch.float32, query_start_loc=starts, causal=True, sliding_window_size=-1,
        isa="vec", enable_kv_split=False)
    out = torch.empty(rows, heads, dim)

    def paged_call(i: int) -> None:
        ops.cpu_attention_with_kv_cache(
            query=query[:, :, 0], key_cache=paged[i][0], value_cache=paged[i][1], output=out,
            query_start_loc=starts, seq_lens=lengths, scale=dim ** -0.5, causal=True,
            alibi_slopes=None, sliding_window=-1, block_table=table, softcap=0.0,
            scheduler_metadata=plan, s_aux=None)

    theirs = cold(paged_call)
    paged_call(0)
    if not torch.allclose(out, f.scaled_dot_product_attention(query, keys[0], values[0])[:, :, 0],
                          atol=1e-4):
        raise SystemExit("vLLM's kernel and SDPA disagree: the paged layout is wrong")
    return sdpa, step, theirs


def timed(call: Callable[[], Any]) -> float:
    """Milliseconds of ``call()``, median of 7 after one warm-up."""
    call()
    times = []
    for _ in range(7):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def linear_rows(hidden: int, widths: list[int]) -> None:
    import torch

    from codeferry._exec.generate.packing import ROWS_HINT

    ops = vllm_ops()
    inner = hidden * 8 // 3
    shapes = [(hidden, hidden)] * 4 + [(inner, hidden)] * 2 + [(hidden, inner)]
    weights = [torch.randn(o, i) * 0.02 for _ in range(LAYERS) for o, i in shapes]
    weights.append(torch.randn(bg.VOCAB, hidden) * 0.02)
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, ROWS_HINT) for w in weights]
    handles = [ops.create_onednn_mm(w.t(), ROWS_HINT) for w in weights] if ops else []
    print(f"\n### Linears: a step's {len(weights)} (ms a step, median of 7)\n")
    print("| rows | F.linear | oneDNN, packed (codeferry) | vLLM `onednn_mm` |")
    print("|---:|---:|---:|---:|")
    for rows in widths:
        plain, ours, theirs = linear_times(rows, weights, packed, handles, ops)
        print(f"| {rows} | {plain:.1f} | {ours:.1f} | {f'{theirs:.1f}' if ops else '-'} |")


def linear_times(rows: int, weights: list[Any], packed: list[Any], handles: list[Any],
                 ops: Any) -> tuple[float, float, float]:
    """Milliseconds of every linear of a step at ``rows`` rows: plain, packed, vLLM's."""
    import torch

    f = torch.nn.functional
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
    plain = timed(lambda: [f.linear(inputs[w.shape[1]], w) for w in weights])
    ours = timed(lambda: [torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], p, None, "none",
                                                             [], "")
                          for w, p in zip(weights, packed, strict=True)])
    theirs = timed(lambda: [ops.onednn_mm(h, inputs[w.shape[1]], None)
                            for w, h in zip(weights, handles, strict=True)]) if ops else 0.0
    return plain, ours, theirs


def compiled_rows(size: str, widths: list[int], context: int, reps: int) -> None:
    import torch
    import torch._inductor.config as inductor
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from codeferry._exec.generate.packing import ROWS_HINT, pack_linears

    f = torch.nn.functional
    buffers: list[tuple[Any, Any]] = []
    weights: list[Any] = []  # the packed weights the opaque linear reads, by index

    # the schemas spelled out: annotations are strings in this module
    @torch.library.custom_op(
        "codeferry_bench::decode_attention", mutates_args=("keys", "values"),
        schema="(Tensor query, Tensor key, Tensor value, Tensor(a!) keys, Tensor(b!) values, "
               "Tensor mask, SymInt position, float scale) -> Tensor")
    def decode_attention(query: Any, key: Any, value: Any, keys: Any, values: Any, mask: Any,
                         position: int, scale: float) -> Any:
        keys[:, :, position] = key[:, :, 0]
        values[:, :, position] = value[:, :, 0]
        return f.scaled_dot_product_attention(query, keys[:, :, :position + 1],
                                              values[:, :, :position + 1],
                                              attn_mask=mask[..., :position + 1], scale=scale)

    @decode_attention.register_fake
    def _(query: Any, key: Any, value: Any, keys: Any, values: Any, mask: Any, position: int,
          scale: float) -> Any:
        return torch.empty_like(query)

    @torch.library.custom_op("codeferry_bench::packed_linear", mutates_args=(),
                             schema="(Tensor x, int index, int out) -> Tensor")
    def packed_linear(x: Any, index: int, out: int) -> Any:
        flat = x.reshape(-1, x.shape[-1])
        made = torch.ops.mkldnn._linear_pointwise(flat, weights[index], None, "none", [], "")
        return made.view(*x.shape[:-1], out)

    @packed_linear.register_fake
    def _(x: Any, index: int, out: int) -> Any:
        return x.new_empty(*x.shape[:-1], out)

    def attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                  scaling: float | None = None, **kwargs: Any) -> tuple[Any, None]:
        keys, values = buffers[module.layer_idx]
        out = torch.ops.codeferry_bench.decode_attention(
            query, key, value, keys, values, kwargs["bench_mask"], kwargs["bench_position"],
            scaling)
        return out.transpose(1, 2), None

    AttentionInterface.register("codeferry_bench", attention)
    AttentionMaskInterface.register("codeferry_bench", sdpa_mask)
    hidden, layers = bg.SIZES[size]
    config = LlamaConfig(vocab_size=bg.VOCAB, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64,
                         num_key_value_heads=hidden // 64, max_position_embeddings=2048,
                         tie_word_embeddings=False)

    def build() -> Any:  # the same weights every time
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
        model.set_attn_implementation("codeferry_bench")
        return model

    def opaque(model: Any) -> Any:
        """``model`` with every linear the packed oneDNN linear as one opaque op."""
        for module in model.modules():
            if type(module) is torch.nn.Linear:
                weights.append(torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(),
                                                                       ROWS_HINT))
                module.forward = functools.partial(torch.ops.codeferry_bench.packed_linear,
                                                   index=len(weights) - 1,
                                                   out=module.out_features)
        return model

    eager = build()
    pack_linears(eager)
    ways = {"eager, linears packed (the decode loop's way)": eager.forward,
            "compiled, weights frozen": torch.compile(build().forward, dynamic=True),
            "compiled, packed linears one opaque op": torch.compile(opaque(build()).forward,
                                                                   dynamic=True)}
    heads, capacity = hidden // 64, context + 64

    def fresh(rows: int) -> tuple[Any, Any]:
        buffers[:] = [(torch.zeros(rows, heads, capacity, 64), torch.zeros(rows, heads, capacity, 64))
                      for _ in range(layers)]
        return torch.zeros(rows, 1, 1, capacity), torch.randint(0, bg.VOCAB, (rows, 1))

    def step(forward: Any, ids: Any, position: int, mask: Any) -> Any:
        out = forward(input_ids=ids, position_ids=torch.full((ids.shape[0], 1), position),
                      use_cache=False, bench_mask=mask, bench_position=position, logits_to_keep=1)
        return out.logits[:, -1].max(-1).indices.unsqueeze(-1)

    times: dict[tuple[int, str], list[float]] = {}
    tokens = {}
    with torch.inference_mode():
        for name, forward in list(ways.items())[1:]:
            inductor.freezing = "frozen" in name  # read when it compiles: at the first call
            mask, ids = fresh(8)
            started = time.perf_counter()
            step(forward, ids, context, mask)
            step(forward, ids, context + 1, mask)  # the position turns dynamic: one recompile
            print(f"{name}: compiling took {time.perf_counter() - started:.0f} s (one thread)")
        for _ in range(reps):
            for rows in widths:
                for name, forward in ways.items():
                    mask, ids = fresh(rows)
                    steps = []
                    for at in range(20):
                        started = time.perf_counter()
                        ids = step(forward, ids, context + at, mask)
                        steps.append(time.perf_counter() - started)
                    times.setdefault((rows, name), []).append(statistics.median(steps[3:]) * 1000)
        for name, forward in ways.items():
            mask, ids = fresh(16)
            torch.manual_seed(1)
            ids, chosen = torch.randint(0, bg.VOCAB, (16, 1)), []
            for at in range(20):
                ids = step(forward, ids, context + at, mask)
                chosen.append(ids)
            tokens[name] = torch.cat(chosen, 1)
    print(f"\n### One decode step of the {size} Llama from position {context} (ms, median "
          f"[range] of {reps} alternated rounds; ratio to the first)\n")
    print("| rows | " + " | ".join(ways) + " |")
    print("|---:|" + "---:|" * len(ways))
    first = next(iter(ways))
    for rows in widths:
        base = statistics.median(times[(rows, first)])
        cells = []
        for name in ways:
            values = times[(rows, name)]
            cells.append(f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]"
                         + ("" if name == first else f", {statistics.median(values) / base:.2f}"))
        print(f"| {rows} | " + " | ".join(cells) + " |")
    same = [name for name in ways if bool((tokens[name] == tokens[first]).all())]
    print(f"\n20 greedy steps of 16 rows, the same tokens as the first way: {len(same)} of {len(ways)}")


def loop_rows(size: str, widths: list[int], new: int, reps: int) -> None:
    """Tokens/s of one thread's whole decode: codeferry's loop (``decode.Engine``, in this
    process, prepared as a worker prepares it) and then vLLM's ``LLM`` (its engine's one
    thread; its engine process polls on the other core), ``n`` prompts of 30 tokens each,
    exactly ``new`` tokens. vLLM starts once, after codeferry's rounds: not alternated."""
    import os
    import tempfile

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from codeferry._exec.generate.attention import enable
    from codeferry._exec.generate.decode import Engine, RowOptions
    from codeferry._exec.generate.packing import pack_linears

    hidden, layers = bg.SIZES[size]
    config = LlamaConfig(vocab_size=bg.VOCAB, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64,
                         num_key_value_heads=hidden // 64, max_position_embeddings=1024,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    rates: dict[tuple[str, int], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="codeferry-bench-step-") as root:
        model.save_pretrained(root)
        pack_linears(model)
        enable(model)
        for rows in widths:
            prompts = [[5 + i, 17, 300 + i] * 10 for i in range(rows)]
            for rep in range(reps + 1):
                engine = Engine(model, pad_token_id=0)
                engine.add(prompts, [RowOptions(new) for _ in prompts])
                started = time.perf_counter()
                with torch.inference_mode():
                    while engine.busy:
                        engine.step()
                if rep:  # the first warms up
                    rates.setdefault(("codeferry", rows), []).append(
                        rows * new / (time.perf_counter() - started))
        if vllm_ops() is not None:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            from vllm import LLM, SamplingParams

            llm = LLM(model=root, tokenizer=None, skip_tokenizer_init=True, dtype="float32",
                      max_model_len=512, seed=0)
            params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
            for rows in widths:
                asked = [{"prompt_token_ids": [5 + i, 17, 300 + i] * 10} for i in range(rows)]
                llm.generate(asked, params, use_tqdm=False)
                for _ in range(reps):
                    started = time.perf_counter()
                    llm.generate(asked, params, use_tqdm=False)
                    rates.setdefault(("vLLM CPU", rows), []).append(
                        rows * new / (time.perf_counter() - started))
            llm.llm_engine.engine_core.shutdown()
    print(f"\n### One thread's whole decode, {new} tokens a prompt (tok/s, median [range] of "
          f"{reps}; not alternated)\n")
    print("| prompts | codeferry `decode.Engine` | vLLM CPU `LLM` | codeferry / vLLM |")
    print("|---:|---:|---:|---:|")
    for rows in widths:
        ours, theirs = rates[("codeferry", rows)], rates.get(("vLLM CPU", rows))
        cells = [f"{statistics.median(v):.0f} [{min(v):.0f}-{max(v):.0f}]" if v else "-"
                 for v in (ours, theirs)]
        ratio = f"{statistics.median(ours) / statistics.median(theirs):.2f}" if theirs else "-"
        print(f"| {rows} | {cells[0]} | {cells[1]} | {ratio} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--part", choices=["kernels", "compiled", "loops"], required=True)
    parser.add_argument("--size", choices=sorted(bg.SIZES), default="70m")
    parser.add_argument("--rows", type=int, action="append",
                        help="rows of a step (repeatable; default 1, 16, 32, 64)")
    parser.add_argument("--context", type=int, default=60,
                        help="--part compiled: the position the steps start at")
    parser.add_argument("--new", type=int, default=128,
                        help="--part loops: the tokens each prompt generates")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    be.preamble()
    widths = args.rows or [1, 16, 32, 64]
    hidden, _ = bg.SIZES[args.size]
    if args.part == "kernels":
        attention_rows(hidden // 64, 64, [(16, 60), (24, 150), (64, 100), (32, 400)])
        linear_rows(hidden, widths)
    elif args.part == "compiled":
        compiled_rows(args.size, widths, args.context, args.reps)
    else:
        loop_rows(args.size, widths, args.new, args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
