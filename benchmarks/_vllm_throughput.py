"""Runs inside a vLLM environment for ``bench_vs_vllm.py``: one engine, timed generate calls.

``python _vllm_throughput.py MODEL PROMPTS.json OUT.json --new-tokens N --reps R``: start
``LLM(MODEL)`` (fp32), one warm-up ``generate`` of every prompt, then ``R`` timed calls;
writes start-up seconds, the call times and the texts of the last call as JSON. Greedy,
``ignore_eos`` and ``min_tokens = max_tokens``, so every output has exactly N tokens, as
``min_new_tokens`` does for transformers. Standard library only at import.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("prompts", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--eager", action="store_true", help="enforce_eager=True")
    args = parser.parse_args()
    prompts = json.loads(args.prompts.read_text())
    result: dict[str, Any] = {}
    started = time.perf_counter()
    try:
        from vllm import LLM, SamplingParams

        llm = LLM(model=args.model, dtype="float32", max_model_len=256, seed=0,
                  enforce_eager=args.eager)
        result["startup_s"] = time.perf_counter() - started
        params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens,
                                min_tokens=args.new_tokens, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)  # warm-up
        times = []
        for _ in range(args.reps):
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            times.append(time.perf_counter() - start)
        result["times"] = times
        result["texts"] = [o.outputs[0].text for o in outputs]
        result["tokens"] = [len(o.outputs[0].token_ids) for o in outputs]
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    args.out.write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # vLLM's shutdown of its processes is not what is measured


if __name__ == "__main__":
    main()
