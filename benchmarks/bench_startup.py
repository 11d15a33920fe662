"""Time to N ready executor workers: plain spawn vs warm start (forks of a preloaded zygote).

Run: HF_HUB_OFFLINE=1 python benchmarks/bench_startup.py [--repeats 3]

"Ready" means the executor's constructor returned: every worker has loaded and verified
the model's code itself, built the model, and answered the start-up handshake. The warm
column assumes the zygote is already running (it is started once per process and reused);
its own start is reported on its own line.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", default="1,2,4")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="codeferry-bench-")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["CODEFERRY_HOME"] = os.path.join(root, "store")
    os.environ["HF_HOME"] = os.path.join(root, "hf")

    import torch
    import transformers

    import codeferry
    from codeferry._exec.workers.zygote import shared_zygote
    from codeferry.testing import demo_model_path

    model = demo_model_path()
    codeferry.load(model, trust_remote_code=True)  # the store holds the code, as in a job

    start = time.perf_counter()
    shared_zygote()
    zygote_s = time.perf_counter() - start

    def ready_time(n: int, warm: bool) -> float:
        start = time.perf_counter()
        ex = codeferry.Executor(model, workers=n, trust_remote_code=True, warm=warm)
        elapsed = time.perf_counter() - start
        ex.close()
        return elapsed

    print(f"command: {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    print(f"machine: {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"zygote start (once per process): {zygote_s:.2f} s\n")
    print("| workers | spawn median s | warm median s | speed-up |")
    print("|---|---|---|---|")
    for n in [int(x) for x in args.workers.split(",")]:
        spawn = statistics.median(ready_time(n, False) for _ in range(args.repeats))
        warm = statistics.median(ready_time(n, True) for _ in range(args.repeats))
        print(f"| {n} | {spawn:.2f} | {warm:.2f} | {spawn / warm:.1f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
