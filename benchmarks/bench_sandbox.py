"""The box's cost: the same model, the same prompts, one executor in the box and one out of it.

(a) Generation: two executors (1 spawn worker each, ``--threads`` torch threads), both kept
up, called alternately A B A B (``--reps`` times each): greedy generation of ``--tokens``
tokens for ``--prompts`` prompts. The outputs must be equal (they are checked); the table
gives each side's median seconds, its spread (min-max) and the ratio of the medians, as
throughput in the box relative to outside it (the goal: 0.97 or better).

(b) Start-up: an executor started and closed, alternately boxed and not (``--starts`` each):
what entering the box adds to a worker's start (policy, rules, the filter).

The model is codeferry's bundled demo (a tiny character LM with remote code): its work per
token is small, so the box's per-call costs (Landlock's checks on each open, the seccomp
filter on every system call, the audit hook) weigh more than on a real model. Run:
``python benchmarks/bench_sandbox.py [--reps 7]`` (about a minute on 2 quiet cores).

``--engine vllm --model FOLDER`` times vLLM's engine instead (run by the Python of a vLLM
environment; FOLDER a remote-code model vLLM runs, such as ``tests/_vllm_child.py build``'s
``plain``): vLLM in the box against vLLM out of it, the same way.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time


def _line(name: str, times: list[float]) -> str:
    return (f"{name:<12} median {statistics.median(times):.3f} s   spread "
            f"{min(times):.3f}-{max(times):.3f} s   (n={len(times)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--starts", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--engine", default="transformers", choices=("transformers", "vllm"))
    parser.add_argument("--model", default=None, help="a model folder (default: the demo)")
    args = parser.parse_args()

    import codeferry
    from codeferry._sandbox.landlock import abi_version
    from codeferry.testing import demo_model_path

    model = args.model or demo_model_path()
    words = ("prompt number", "w1 w2") if args.model else ("prompt number", "prompt")
    prompts = [f"{words[i % 2]} {i % 9} " * (1 + i % 4) for i in range(args.prompts)]
    print(f"kernel {platform.release()}, Landlock ABI {abi_version()}, "
          f"load {os.getloadavg()[0]:.2f}; {args.prompts} prompts x {args.tokens} tokens; "
          f"engine {args.engine}")

    keywords = {"workers": 1, "threads_per_worker": args.threads, "trust_remote_code": True,
                "engine": args.engine}
    if args.engine == "vllm":  # two engines side by side: a share of the memory each
        keywords["engine_options"] = {"gpu_memory_utilization": 0.2, "max_model_len": 128}
    times: dict[str, list[float]] = {"unboxed": [], "boxed": []}
    with codeferry.Executor(model, sandbox=False, **keywords) as plain, \
            codeferry.Executor(model, sandbox=True, **keywords) as boxed:
        reference = plain.generate(prompts, max_new_tokens=args.tokens)
        assert boxed.generate(prompts, max_new_tokens=args.tokens) == reference
        for _ in range(args.reps):
            for name, ex in (("unboxed", plain), ("boxed", boxed)):
                start = time.perf_counter()
                out = ex.generate(prompts, max_new_tokens=args.tokens)
                times[name].append(time.perf_counter() - start)
                assert out == reference
    print("(a) generation, alternated A B A B")
    for name, found in times.items():
        print("   ", _line(name, found))
    ratio = statistics.median(times["unboxed"]) / statistics.median(times["boxed"])
    print(f"    throughput in the box: {ratio:.3f}x of outside it (goal: 0.97x or better)")

    if not args.starts:
        return
    starts: dict[str, list[float]] = {"unboxed": [], "boxed": []}
    for _ in range(args.starts):
        for name, sandbox in (("unboxed", False), ("boxed", True)):
            start = time.perf_counter()
            with codeferry.Executor(model, sandbox=sandbox, **keywords) as ex:
                ex.generate(["x"], max_new_tokens=1)
            starts[name].append(time.perf_counter() - start)
    print("(b) start-up, one generated token, closed; alternated")
    for name, found in starts.items():
        print("   ", _line(name, found))
    print(f"load {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
