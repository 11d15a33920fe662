"""What `codeferry exec` costs each Python process it starts: plain vs under the switch.

Every process of the command reads the switch at start-up (the boot sitecustomize), and one
that imports transformers' remote-code module also imports codeferry to route it. Prints the
median wall time of fresh interpreters, side by side, in one run (a shared machine: read the
ratios). Run::

    python benchmarks/bench_exec_startup.py [--reps 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from codeferry._install import switch


def median_seconds(code: str, extra: dict[str, str], reps: int) -> float:
    env = {**os.environ, **extra}
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], env=env, check=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    reps = parser.parse_args().reps
    boot = switch.variables(None)
    print("| process | plain | under `codeferry exec` | ratio |\n|---|---:|---:|---:|")
    for label, code, n in (("`python -c pass`", "pass", reps),
                           ("imports transformers' remote-code module",
                            "import transformers.dynamic_module_utils", max(3, reps // 2))):
        plain, routed = median_seconds(code, {}, n), median_seconds(code, boot, n)
        print(f"| {label} | {plain * 1000:.0f} ms | {routed * 1000:.0f} ms | {routed / plain:.2f}x |")


if __name__ == "__main__":
    main()
