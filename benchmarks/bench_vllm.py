"""vLLM start-up and first-request latency, with and without codeferry's vLLM plugin.

Run it with the python of a vLLM environment that has codeferry installed (README
"Inside vLLM" builds one)::

    /path/to/vllm-venv/bin/python benchmarks/bench_vllm.py [--repeats 3]

Each measurement is one fresh process that starts ``LLM(model, trust_remote_code=True,
model_impl="transformers", ...)`` (driver, EngineCore and a worker, spawned) and sends one
greedy request (``tests/_vllm_child.py run``): "start-up" is ``LLM(...)`` returning,
"first request" is that ``generate`` call. Without codeferry is ``CODEFERRY_VLLM_PLUGIN=0``.
The plain layout works both ways (goal: codeferry adds at most 5 %); the sub-package and
``from . import`` layouts start only with codeferry. Runs alternate between the two
settings, so drift in the machine's load hits both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CHILD = HERE.parent / "tests" / "_vllm_child.py"
sys.path.insert(0, str(CHILD.parent))
import _vllm_child  # noqa: E402 - stdlib only at import


def _env(root: Path, plugin: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CODEFERRY_")}
    env.update(PYTHONPATH=str(HERE.parent / "src"), HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_WORKER_MULTIPROC_METHOD="spawn",
               TMPDIR=str(root / "tmp"), VLLM_CACHE_ROOT=str(root / "vllm-cache"),
               HF_HOME=str(root / "hf"), CODEFERRY_VLLM_PLUGIN="1" if plugin else "0")
    return env


def _run(root: Path, model: Path, plugin: bool) -> dict[str, Any]:
    out = root / "result.json"
    out.unlink(missing_ok=True)
    # its own process group, ended afterwards: the driver leaves vLLM's processes behind
    _vllm_child.run_in_group([sys.executable, str(CHILD), "run", str(model), str(out)],
                             env=_env(root, plugin), stdout=subprocess.DEVNULL, timeout=900)
    result: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {"error": "no result"}
    return result


def _cell(results: list[dict[str, Any]], key: str) -> str:
    values = [r[key] for r in results if key in r]
    if len(values) < len(results) or not values:
        failed = next(r for r in results if key not in r)
        return f"fails ({failed.get('error_type', 'error')})"
    return f"{statistics.median(values):.2f}"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="codeferry-bench-vllm-"))
    for name in ("tmp", "vllm-cache", "hf"):
        (root / name).mkdir()
    models = root / "models"
    subprocess.run([sys.executable, str(CHILD), "build", str(models)], env=_env(root, False),
                   capture_output=True, check=True)

    import torch
    import transformers
    import vllm

    print(f"command: {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    print(f"machine: {os.cpu_count()} cores, Python {platform.python_version()}, vllm "
          f"{vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"median of {args.repeats} fresh processes each; seconds\n")
    print("| layout | codeferry | start-up s | first request s | tokens |")
    print("|---|---|---|---|---|")
    plain_medians: dict[bool, float] = {}
    for layout in ("plain", "subpkg", "fromdot"):
        runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
        for _ in range(args.repeats):
            for plugin in (False, True):
                runs[plugin].append(_run(root, models / layout, plugin))
        for plugin in (False, True):
            results = runs[plugin]
            tokens = results[0].get("tokens")
            print(f"| {layout} | {'on' if plugin else 'off'} | {_cell(results, 'startup_s')} | "
                  f"{_cell(results, 'first_request_s')} | {tokens if tokens else '-'} |")
            if layout == "plain" and all("startup_s" in r for r in results):
                plain_medians[plugin] = statistics.median(r["startup_s"] for r in results)
    if len(plain_medians) == 2:
        overhead = (plain_medians[True] / plain_medians[False] - 1) * 100
        print(f"\nplain layout: codeferry changes start-up by {overhead:+.1f} % (goal: <= +5 %)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
