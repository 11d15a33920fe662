"""What a release environment costs: making one, and starting workers on it.

A model whose code imports a name the installed transformers removed, without a shim, runs
in workers on the release that has it (``_exec/workers/release.py``). This measures:

- **make**: ``codeferry release MODEL`` into an empty ``CODEFERRY_RELEASES`` (pip from this
  machine's pip cache: a first make from the network adds the download, about 50 MB);
- **first start**: a fresh Python opens an ``Executor`` (1 worker) and gets its first result
  (8 prompts, 12 new tokens, greedy), clock started before ``import codeferry``;
- **later start**: a second ``Executor`` in that same process, first result again;

for the corpus's ``hybridcache`` family (Gemma 2-derived code importing ``HybridCache``: its
workers are forks of a zygote with the release on its path) against ``legacycache`` (shimmed,
the installed transformers: spawned workers, as by default), each sample a fresh process,
the two alternated (A B A B), ``--rounds`` rounds, medians and ranges. It also times the
release decision every ``prepare`` makes, on the demo model, which needs no release.

Run: ``HF_HUB_OFFLINE=1 python benchmarks/bench_release.py [--rounds 3]`` (the release made
first where the installed transformers needs one: it is made by the "make" rows).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CORPUS = HERE.parent / "tests" / "corpus"

SAMPLE = r"""
import json, sys, time
started = time.perf_counter()
import codeferry
from codeferry import Request, SamplingParams
sys.path.insert(0, {corpus!r})
from _corpus import PROMPTS

def first_result():
    begun = time.perf_counter()
    with codeferry.Executor({folder!r}, workers=1, trust_remote_code=True) as ex:
        ex.complete([Request(p) for p in PROMPTS], SamplingParams(temperature=0, max_tokens=12))
        ran_on = ex.worker_info[0]["transformers"]
    return begun, time.perf_counter(), ran_on

if __name__ == "__main__":
    _, first, ran_on = first_result()
    begun, later, _ = first_result()
    print(json.dumps({{"first": first - started, "later": later - begun, "on": ran_on}}))
"""


def _sample(folder: Path, env: dict[str, str]) -> dict[str, float | str]:
    with tempfile.TemporaryDirectory() as scratch:
        script = Path(scratch) / "sample.py"
        script.write_text(SAMPLE.format(corpus=str(CORPUS), folder=str(folder)))
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                              env=env, timeout=600, check=True)
    result: dict[str, float | str] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _make(folder: Path, releases: Path, env: dict[str, str]) -> float:
    begun = time.perf_counter()
    subprocess.run([sys.executable, "-m", "codeferry", "release", str(folder), "--json"],
                   env={**env, "CODEFERRY_RELEASES": str(releases)}, check=True,
                   capture_output=True, timeout=1800)
    return time.perf_counter() - begun


def _decision_ms() -> float:
    from codeferry._code.resolve import resolve
    from codeferry._exec.plan import release_line
    from codeferry.testing import demo_model_path

    bundle = resolve(demo_model_path())
    times = []
    for _ in range(20):
        begun = time.perf_counter()
        release_line(bundle)
        times.append(time.perf_counter() - begun)
    return statistics.median(times) * 1000


def _row(name: str, values: list[float]) -> str:
    return (f"| {name} | {statistics.median(values):.2f} | "
            f"{min(values):.2f}-{max(values):.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(CORPUS))
    import transformers
    from _corpus import build

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryDirectory() as root:
        releases = Path(root) / "releases"
        env["CODEFERRY_RELEASES"] = str(releases)
        makes, samples = [], {"hybridcache": [], "legacycache": []}
        models = {}
        for round_ in range(args.rounds):
            scratch = Path(root) / f"make{round_}"
            makes.append(_make(CORPUS / "models" / "hybridcache", scratch, env))
        # the last make stays: the samples' workers use it
        env["CODEFERRY_RELEASES"] = str(scratch)
        os.environ["CODEFERRY_RELEASES"] = str(scratch)
        for name in samples:
            models[name] = build(name, Path(root) / "models")
        for _ in range(args.rounds):
            for name in samples:  # alternated
                samples[name].append(_sample(models[name], env))
    print(f"transformers {transformers.__version__} installed, Python "
          f"{sys.version.split()[0]}, {os.cpu_count()} cores, {args.rounds} rounds")
    print("\n| seconds | median | range |\n|---|---:|---:|")
    print(_row("make the release (codeferry release, pip cache warm)", makes))
    for name, rows in samples.items():
        on = rows[0]["on"]
        print(_row(f"{name} (workers on {on}): first start", [float(r["first"]) for r in rows]))
        print(_row(f"{name} (workers on {on}): later start", [float(r["later"]) for r in rows]))
    print(f"\nthe release decision in prepare(), the demo model: {_decision_ms():.4f} ms")


if __name__ == "__main__":
    main()
