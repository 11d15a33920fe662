"""Runs inside a vLLM environment for ``bench_generation.py``: one engine, served call by call.

``python _vllm_generation.py SPEC.json``. SPEC: ``model``, ``model_impl`` (``auto`` or
``transformers``), ``dtype``, ``max_model_len``, ``address`` and ``authkey`` (hex) of the
benchmark's ``multiprocessing.connection.Listener``. Starts ``LLM`` once, connects, and
sends ``{"startup_s": ...}`` (or ``{"error": ...}``); then answers each message:

- ``{"prompts": [...], "params": {...}}``: one ``LLM.generate`` of every prompt
  (``SamplingParams`` keywords; a ``seed`` is made per prompt, ``seed + index``); the reply
  has ``time``, ``texts`` and ``tokens`` (generated token ids per output);
- ``{"peak": true}``: the peak resident memory (VmHWM) of this process and of every process
  it started, by pid;
- ``{"stop": true}``: leaves at once (``os._exit``; the benchmark ends the process group).

Why a served engine and not one run of every workload: the machine is shared, so the
benchmark interleaves vLLM's calls with codeferry's (each rep runs every way once), and a
ratio compares calls made under the same load. ``LLM.generate`` hands back nothing before
all prompts are done: its time to first output is the call's. Standard library only at import.
"""

from __future__ import annotations

import json
import os
import sys
import time
from multiprocessing.connection import Client
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


def _generate(llm: Any, sampling: Any, message: dict[str, Any]) -> dict[str, Any]:
    prompts, params = message["prompts"], dict(message["params"])
    seed = params.pop("seed", None)
    every = [sampling(**params, seed=None if seed is None else seed + i)
             for i in range(len(prompts))]
    start = time.perf_counter()
    outputs = llm.generate(prompts, every, use_tqdm=False)
    return {"time": time.perf_counter() - start,
            "texts": [o.outputs[0].text for o in outputs],
            "tokens": [len(o.outputs[0].token_ids) for o in outputs]}


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    started = time.perf_counter()
    conn = Client(tuple(spec["address"]), authkey=bytes.fromhex(spec["authkey"]))
    try:
        from vllm import LLM, SamplingParams

        llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"],
                  seed=0, model_impl=spec["model_impl"],
                  trust_remote_code=spec.get("trust_remote_code", False))
    except Exception as exc:
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
        os._exit(1)
    conn.send({"startup_s": time.perf_counter() - started})
    while True:
        message = conn.recv()
        if message.get("stop"):
            break
        try:
            reply = ({"peak_rss": _peak_rss()} if message.get("peak")
                     else _generate(llm, SamplingParams, message))
        except Exception as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        conn.send(reply)
    sys.stdout.flush()
    os._exit(0)  # vLLM's shutdown of its processes is not what is measured


if __name__ == "__main__":
    main()
