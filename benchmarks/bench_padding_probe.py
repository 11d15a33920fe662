"""What the padding probe costs a worker on the batched path, against one batch it serves.

A worker whose model takes batched ``generate`` (not the decode loop) asks once, at start-up,
whether left padding changes the model's greedy tokens (``generation.pads_safely``: a short
prompt alone and beside a long one, 3 new tokens each); code that drops the attention mask
(ChatGLM-6B's) then gets one ``generate`` call per prompt length. Every other model pays the
probe and nothing after it. This times the probe on bench_compat's remote-code Llama (its
own files, random weights, float32, one thread) against one batch of 8 prompts x ``--new``
greedy tokens (every row at its cap), ``--reps`` times each, alternated.

Run: ``HF_HUB_OFFLINE=1 python benchmarks/bench_padding_probe.py [--size 70m] [--reps 5]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="70m", choices=("70m", "200m"))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--new", type=int, default=64)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(HERE))
    from bench_compat import make_llama
    from transformers import AutoModelForCausalLM

    import codeferry
    from codeferry._exec.generate import generation

    path = make_llama(Path(tempfile.mkdtemp(prefix="codeferry-bench-")), args.size)
    codeferry.load(path, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
    short, long = [5, 6], list(range(5, 37))
    batch = torch.tensor([long] * 8)
    probes, batches, safe = [], [], None
    for _ in range(args.reps):
        generation._PADS.pop(model, None)  # ask again, as a fresh worker does
        start = time.perf_counter()
        safe = generation.pads_safely(model, short, long, pad=0)
        probes.append(time.perf_counter() - start)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=batch, attention_mask=torch.ones_like(batch), do_sample=False,
                           max_new_tokens=args.new, min_new_tokens=args.new, pad_token_id=0)
        batches.append(time.perf_counter() - start)

    def cell(values: list[float]) -> str:
        return (f"{statistics.median(values) * 1000:.0f} ms "
                f"[{min(values) * 1000:.0f}-{max(values) * 1000:.0f}]")

    print(f"Llama {args.size}, remote code, 1 thread, {args.reps} reps alternated "
          f"(pads safely: {safe})")
    print("| what | median [range] |\n|---|---:|")
    print(f"| padding probe, once per worker | {cell(probes)} |")
    print(f"| one batch, 8 x {args.new} greedy tokens | {cell(batches)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
