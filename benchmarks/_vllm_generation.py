"""Runs inside a vLLM environment for ``bench_generation.py``: one engine, every workload.

``python _vllm_generation.py SPEC.json OUT.json``. SPEC: ``model``, ``model_impl``
(``auto`` or ``transformers``), ``max_model_len``, ``reps`` and ``workloads``, each with
``name``, ``prompts`` and ``params`` (``SamplingParams`` keywords; a ``seed`` is made
per prompt, ``seed + index``). Starts ``LLM`` once (fp32, its defaults otherwise), then per
workload one warm-up ``generate`` of every prompt and ``reps`` timed calls. Writes start-up
seconds, per workload the call times, texts and token counts of the last call, and the peak
resident memory (VmHWM) of this process and of every process it started. ``LLM.generate``
hands back nothing before all prompts are done: its time to first output is the call's.
Standard library only at import.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def _peak_rss() -> dict[str, int]:
    """VmHWM (bytes) of this process and its descendants, by pid."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    ours, frontier = {os.getpid()}, [os.getpid()]
    while frontier:
        pid = frontier.pop()
        for child, parent in parents.items():
            if parent == pid and child not in ours:
                ours.add(child)
                frontier.append(child)
    peaks: dict[str, int] = {}
    for pid in ours:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peaks[str(pid)] = int(line.split()[1]) * 1024
        except OSError:
            continue
    return peaks


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    result: dict[str, Any] = {"workloads": {}}
    started = time.perf_counter()
    try:
        from vllm import LLM, SamplingParams

        llm = LLM(model=spec["model"], dtype="float32", max_model_len=spec["max_model_len"],
                  seed=0, model_impl=spec["model_impl"])
        result["startup_s"] = time.perf_counter() - started
        for work in spec["workloads"]:
            prompts, params = work["prompts"], dict(work["params"])
            seed = params.pop("seed", None)
            every = [SamplingParams(**params, seed=None if seed is None else seed + i)
                     for i in range(len(prompts))]
            llm.generate(prompts, every, use_tqdm=False)  # warm-up
            times = []
            for _ in range(spec["reps"]):
                start = time.perf_counter()
                outputs = llm.generate(prompts, every, use_tqdm=False)
                times.append(time.perf_counter() - start)
            result["workloads"][work["name"]] = {
                "times": times, "texts": [o.outputs[0].text for o in outputs],
                "tokens": [len(o.outputs[0].token_ids) for o in outputs]}
        result["peak_rss"] = _peak_rss()
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    out.write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # vLLM's shutdown of its processes is not what is measured


if __name__ == "__main__":
    main()
