"""The decode loop alone, this checkout's against a git revision's, in one process.

Why a second script beside ``bench_generation.py``: a change inside the loop (how the cache
moves, how a token is picked) moves the Executor's figures by a few percent, less than this
shared machine's spread between runs. Here both loops run on the same model object in one
process, alternating call by call (the first round is a warm-up), so their ratio compares
calls made under the same load; the tokens of both must be equal, or the script fails.

The model and prompts are ``bench_generation``'s (a random-weight Llama of ``--size``, its
end-of-sequence ids chosen so that greedy outputs end at spread lengths, chat-formatted
prompts of mixed length), prepared as a worker prepares it on CPU: linears packed
(``_exec/packing.py``), codeferry's attention where it applies (``_exec/attention.py``).
The revision's ``_exec/generate/decode.py`` is read with ``git show`` and imported beside this one
(it uses this checkout's ``attention``, ``calling`` and ``cuts``). Run::

    HF_HUB_OFFLINE=1 python benchmarks/bench_decode.py --against HEAD~1 --size 200m \\
        --prompts 64 --max-new-tokens 256
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_executor as be  # noqa: E402 - stdlib only at import
import bench_generation as bg  # noqa: E402 - stdlib only at import


def revision_loop(revision: str, root: Path) -> Any:
    """``_exec/generate/decode.py`` at ``revision``, imported beside this checkout's as
    ``codeferry._exec.generate.decode_at`` (its relative imports resolve there)."""
    source = subprocess.run(["git", "show", f"{revision}:src/codeferry/_exec/generate/decode.py"],
                            cwd=HERE.parent, check=True, capture_output=True, text=True).stdout
    path = root / "decode_at.py"
    path.write_text(source)
    name = "codeferry._exec.generate.decode_at"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--against", default="HEAD", help="the git revision to compare with")
    parser.add_argument("--size", choices=sorted(bg.SIZES), default="70m")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import codeferry._exec.generate.decode as here
    from codeferry._exec.generate.attention import enable
    from codeferry._exec.generate.packing import pack_linears

    with tempfile.TemporaryDirectory(prefix="codeferry-bench-decode-") as name:
        root = Path(name)
        be.isolate(root)
        be.preamble()
        loops = {args.against: revision_loop(args.against, root), "this checkout": here}
        users = bg.user_texts(args.prompts)
        path, made = bg.make_model(root, args.size, users, args.max_new_tokens, args.dtype)
        tokenizer = AutoTokenizer.from_pretrained(path)
        prompts = [tokenizer(p)["input_ids"] for p in bg.chat(tokenizer, users)]
        model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype))
        model.eval()
        torch.set_num_threads(args.threads)
        packed, switched = pack_linears(model), enable(model)
        print(f"model: {made['params'] / 1e6:.0f}M parameters, {args.dtype}, {packed} linears "
              f"packed, codeferry's attention: {switched}; {args.prompts} prompts, up to "
              f"{args.max_new_tokens} new tokens (greedy ends {made['ends'][0]}-"
              f"{made['ends'][-1]}, median {statistics.median(made['ends']):.0f}); "
              f"{args.threads} threads")
        eos = tuple(made["eos"])
        rates: dict[str, list[float]] = {label: [] for label in loops}
        outputs: dict[str, list[list[int]]] = {}
        order = list(loops)
        for rep in range(args.reps + 1):
            for label in order if rep % 2 else order[::-1]:
                loop = loops[label]
                options = [loop.RowOptions(args.max_new_tokens, eos=eos) for _ in prompts]
                started = time.perf_counter()
                outputs[label] = loop.decode(model, prompts, options, pad_token_id=eos[0])
                seconds = time.perf_counter() - started
                if rep:  # the first round warms up
                    rates[label].append(sum(map(len, outputs[label])) / seconds)
        if outputs[args.against] != outputs["this checkout"]:
            print("the two loops generated different tokens", file=sys.stderr)
            return 1
        base = statistics.median(rates[args.against])
        print(f"\n{sum(map(len, outputs[args.against]))} tokens a call, the same from both\n")
        print("| loop | tok/s (median) | calls | vs " + args.against + " |")
        print("|---|---:|---|---:|")
        for label, values in rates.items():
            middle = statistics.median(values)
            print(f"| {label} | {middle:.1f} | {', '.join(f'{v:.0f}' for v in values)} | "
                  f"{middle / base:.3f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
