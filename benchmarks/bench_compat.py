"""What serving code written for transformers 4 costs a model that does not need it.

codeferry gives every remote module that names transformers its own ``__import__`` (which
answers removed names) and, once the module ran, looks at its classes (``_hf/compat.py``:
the removed methods where missing, transformers 5's empty non-persistent buffers refilled
after ``from_pretrained``). A model written for the installed release needs none of it; this
measures what it pays anyway, against the same codeferry with the two hooks taken out and
against plain transformers (``trust_remote_code=True``, no codeferry).

Models: bench_generation's random-weight Llama as remote code (``--size``: 70m or 200m,
float32; its own ``configuration_``/``modeling_`` files, a ``model_type`` transformers does
not know, rotary ``inv_freq`` as a non-persistent buffer), and codeferry's bundled demo.

Each sample is a fresh spawned Python (torch and transformers imported before the clock):
"load" is the classes and ``from_pretrained`` with the weights, "tok/s" a greedy ``generate``
of ``--new`` tokens (every row at its cap) for 8 prompts at once, one thread. The ways run
alternately (A B C A B C), ``--rounds`` rounds; the table gives medians with their range,
whether each way's tokens equal plain transformers' (the demo: the hooks-out way's, its
sub-package helper is a layout plain transformers cannot load), and the names the hooks
added.

Run: ``HF_HUB_OFFLINE=1 python benchmarks/bench_compat.py [--rounds 5] [--size 70m]``.
"""

from __future__ import annotations

# Only the standard library at module level: the samples import this file as __mp_main__.
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WAYS = ("codeferry", "codeferry, hooks out", "plain transformers")
PROMPTS = ["w1 w2 w3", "w4 w5", "w6 w7 w8 w9 w10", "w11", "w12 w13", "w14 w15 w16",
           "w17 w18 w19 w20", "w21 w22"]


def make_llama(root: Path, size: str) -> Path:
    """bench_generation's Llama shape with random weights, saved as remote code."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(HERE))
    from bench_generation import SIZES, as_remote

    hidden, layers = SIZES[size]
    config = LlamaConfig(vocab_size=32000, hidden_size=hidden,
                         intermediate_size=hidden * 8 // 3, num_hidden_layers=layers,
                         num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
                         max_position_embeddings=1024, tie_word_embeddings=False,
                         pad_token_id=0, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    path = root / f"llama-{size}"
    LlamaForCausalLM(config).eval().save_pretrained(path)
    as_remote(path)
    return path


def sample(way: str, path: str, new: int) -> dict[str, Any]:
    """In a fresh process: load ``path`` the ``way`` way, then generate; times and texts."""
    import torch
    import transformers  # noqa: F401 - imported before the clock, as a worker has it

    torch.set_num_threads(1)
    started = time.perf_counter()
    added: list[str] = []
    if way == "plain transformers":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
    else:
        import codeferry
        from codeferry._runtime import loader

        if way == "codeferry, hooks out":
            from codeferry._hf import compat

            loader.on_module_setup.remove(compat.setup_module)
            loader.on_module_executed.remove(compat.shim_classes)
        classes = codeferry.load(path, trust_remote_code=True)
        model = classes["AutoModelForCausalLM"].from_pretrained(path)
        loaded = [c for v in classes.values() for c in (v if isinstance(v, tuple) else (v,))
                  if isinstance(c, type)]  # a tokenizer's entry is its (slow, fast) pair
        for module in {c.__module__ for c in loaded}:
            added += sorted(sys.modules[module].__dict__.get("__codeferry_compat__", ()))
    load = time.perf_counter() - started
    model.eval()
    vocab = model.config.vocab_size - 4  # ids past the first few (padding, marks)
    ids = [[(sum(map(ord, p)) * 7 + i) % vocab + 4 for i in range(len(p.split()))]
           for p in PROMPTS]
    width = max(map(len, ids))
    batch = torch.tensor([[0] * (width - len(r)) + r for r in ids])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ids])
    with torch.inference_mode():
        model.generate(batch[:2, -2:], attention_mask=mask[:2, -2:], max_new_tokens=2,
                       do_sample=False, pad_token_id=0)  # warm-up
        begin = time.perf_counter()
        out = model.generate(batch, attention_mask=mask, max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=0)
        seconds = time.perf_counter() - begin
    wrapped = hasattr(type(model).forward, "__codeferry_compat__")
    return {"load_s": load, "tok_s": len(PROMPTS) * new / seconds,
            "tokens": out[:, width:].tolist(), "added": added, "forward_wrapped": wrapped}


def named(added: list[str]) -> str:
    """The names the hooks added, by owner, config defaults counted rather than listed."""
    if not added:
        return "-"
    configs = [n for n in added if n.split(".")[0].endswith("Config")]
    rest = sorted({n.split(".", 1)[1] for n in added if n not in configs})
    return f"{len(configs)} config defaults; " * bool(configs) + ", ".join(rest)


def spread(values: list[float], scale: float = 1.0, digits: int = 0) -> str:
    low, mid, high = min(values) * scale, statistics.median(values) * scale, max(values) * scale
    return f"{mid:.{digits}f} [{low:.{digits}f}-{high:.{digits}f}]"


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--size", choices=["70m", "200m"], default="70m")
    parser.add_argument("--new", type=int, default=32, help="new tokens per row (the cap)")
    parser.add_argument("--sample", nargs=3, help=argparse.SUPPRESS)  # way, path, new: a child
    args = parser.parse_args()
    if args.sample:
        print(json.dumps(sample(args.sample[0], args.sample[1], int(args.sample[2]))))
        return 0
    with tempfile.TemporaryDirectory(prefix="codeferry-bench-compat-") as name:
        root = Path(name)
        env = {**os.environ, "HF_HOME": str(root / "hf"), "CODEFERRY_HOME": str(root / "cf"),
               "HF_MODULES_CACHE": str(root / "modules"), "HF_HUB_OFFLINE": "1",
               "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error"}
        os.environ.update(env)
        import torch
        import transformers

        from codeferry.testing import demo_model_path

        print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
              f"{os.cpu_count()} cores, {args.rounds} rounds, {args.new} new tokens x "
              f"{len(PROMPTS)} rows, 1 thread")
        # the demo's sub-package helper is a layout plain transformers cannot load
        models = {f"remote Llama {args.size}": (make_llama(root, args.size), WAYS),
                  "codeferry demo": (Path(demo_model_path()), WAYS[:2])}
        for label, (path, ways) in models.items():
            found: dict[str, list[dict[str, Any]]] = {way: [] for way in ways}
            for _ in range(args.rounds):
                for way in ways:
                    done = subprocess.run(
                        [sys.executable, __file__, "--sample", way, str(path), str(args.new)],
                        capture_output=True, text=True, env=env, check=False)
                    if done.returncode != 0:
                        print(f"{label}, {way}: failed\n{done.stderr[-3000:]}")
                        return 1
                    found[way].append(json.loads(done.stdout.splitlines()[-1]))
            print(f"\n### {label}\n")
            print(f"| way | load ms | tok/s | tokens as {ways[-1]}'s | forward wrapped | "
                  "names added |")
            print("|---|---:|---:|---:|---|---|")
            plain = found[ways[-1]][0]["tokens"]
            for way in ways:
                rows = found[way]
                same = sum(r["tokens"] == plain for r in rows)
                print(f"| {way} | {spread([r['load_s'] for r in rows], 1000)} | "
                      f"{spread([r['tok_s'] for r in rows], digits=1)} | {same}/{len(rows)} | "
                      f"{rows[0]['forward_wrapped']} | {named(rows[0]['added'])} |")
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
