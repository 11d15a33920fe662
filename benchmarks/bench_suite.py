"""Where the test suite's time goes: the CPU seconds of each test file, its tests' own and
those of every process they start.

Run (Linux: it reads ``/proc``), from the repository root, in the dev environment:

    HF_HUB_OFFLINE=1 python benchmarks/bench_suite.py [--top 30] [-- PYTEST ARGUMENTS]

Without pytest arguments it runs the README's ``python -m pytest -q`` (``-n 3`` from
pyproject's addopts). Set ``CODEFERRY_VLLM_PYTHON`` and ``CI=true`` as ``.ci/run`` does, or
the vLLM files skip and the table leaves them out.

Why: on CI's 2 cores the CPU is busy from the first test to the last, so the wall time is
about the CPU time over two, and the CPU goes mostly to fresh interpreters that import
torch and transformers (7-9 s each on the machine of 2026-12-04's day; 3.3 s idle at 23:05
UTC, when the machine ran about twice as fast) - processes the tests start, which pytest's
``--durations`` does not count (it shows wall seconds, shared with whatever ran beside).
This says which files cost the CPU, and so what a budget would cost in coverage.

How: pytest runs with this file as a plugin (``-p bench_suite``): each test's start, end,
and its worker's own CPU time at both, go to a log. Meanwhile the script reads every
process's parent and CPU time from ``/proc`` every 0.2 s. A process is charged to the test
that was running on the pytest worker it descends from when it was first seen (between
tests: to the file of the worker's next test, its fixtures). Its CPU is what it had used
when last seen (up to 0.2 s short). A process whose ancestry is lost (a daemon reparented
before it was first seen: Ray's) is counted apart, as is every process started before
the run.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

#: The plugin's log: set by the script for the pytest it starts.
LOG = "CODEFERRY_BENCH_SUITE_LOG"
TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


# -- the plugin, in pytest's processes ------------------------------------------------------

def _cpu() -> float:
    times = os.times()
    return times.user + times.system


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: Any, nextitem: Any) -> Any:
    """Runs only where the test runs (an xdist worker, or pytest itself with ``-n 0``)."""
    path = os.environ.get(LOG)
    start, cpu = time.time(), _cpu()
    result = yield
    if path:
        record = {"pid": os.getpid(), "test": item.nodeid, "t0": start, "t1": time.time(),
                  "cpu": _cpu() - cpu}
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
    return result


# -- the script ----------------------------------------------------------------------------

@dataclass
class Proc:
    pid: int
    ppid: int
    first: float
    cpu: float
    command: str


def _read(pid: str) -> tuple[int, float, int] | None:
    """``(parent pid, CPU seconds, start ticks)`` of a process, or ``None`` once gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as handle:
            stat = handle.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK, int(fields[19])


def _command(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode(errors="replace")[:160]
    except OSError:
        return ""


def watch(proc: subprocess.Popen[bytes]) -> tuple[dict[tuple[int, int], Proc], set[tuple[int, int]]]:
    """Every process seen while ``proc`` runs, and those that were there before it."""
    seen: dict[tuple[int, int], Proc] = {}
    before: set[tuple[int, int]] = set()
    first_pass = True
    while True:
        now = time.time()
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            got = _read(pid)
            if got is None:
                continue
            ppid, cpu, start = got
            key = (int(pid), start)
            if first_pass and int(pid) != proc.pid:
                before.add(key)
            known = seen.get(key)
            if known is None:
                seen[key] = Proc(int(pid), ppid, now, cpu, _command(pid))
            else:
                known.cpu = cpu
        first_pass = False
        if proc.poll() is not None:
            return seen, before
        time.sleep(0.2)


def charge(seen: dict[tuple[int, int], Proc], before: set[tuple[int, int]], root: int,
           tests: list[dict[str, Any]]) -> tuple[dict[str, list[float]], dict[str, float]]:
    """``{file: [tests, their own CPU, processes, the processes' CPU]}``, and the rest."""
    workers = {t["pid"] for t in tests}
    by_worker: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
    for test in sorted(tests, key=lambda t: t["t0"]):
        by_worker[test["pid"]].append(test)
    files: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0, 0.0])
    for test in tests:
        row = files[test["test"].split("::")[0]]
        row[0] += 1
        row[1] += test["cpu"]
    latest: dict[int, Proc] = {}
    for key, found in sorted(seen.items(), key=lambda item: item[1].first):
        if key not in before:
            latest[found.pid] = found
    rest = {"pytest and its workers, outside tests": 0.0, "ancestry lost (daemons)": 0.0,
            "running before the run": sum(seen[k].cpu for k in before)}
    for key, found in seen.items():
        if key in before:
            continue
        if found.pid in workers or found.pid == root:
            own = sum(t["cpu"] for t in by_worker.get(found.pid, []))
            rest["pytest and its workers, outside tests"] += max(0.0, found.cpu - own)
            continue
        worker, hops = None, 0
        cursor: Proc | None = found
        while cursor is not None and hops < 64:
            if cursor.pid in workers:
                worker = cursor.pid
                break
            parent = latest.get(cursor.ppid)
            cursor = parent if parent is not None and parent.first <= cursor.first else None
            hops += 1
        if worker is None:
            rest["ancestry lost (daemons)"] += found.cpu
            continue
        runs = by_worker[worker]
        during = [t for t in runs if t["t0"] <= found.first <= t["t1"] + 0.2]
        after = [t for t in runs if t["t0"] > found.first]
        test = during[0] if during else after[0] if after else runs[-1]
        row = files[test["test"].split("::")[0]]
        row[2] += 1
        row[3] += found.cpu
    return files, rest


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=30, help="files to list (the rest summed)")
    parser.add_argument("pytest", nargs="*", help="pytest's arguments (after --)")
    args = parser.parse_args()
    if not Path("/proc/self/stat").exists():
        print("bench_suite reads /proc: Linux only", file=sys.stderr)
        return 2
    log = Path(tempfile.mkdtemp(prefix="codeferry-bench-suite-")) / "tests.jsonl"
    here = str(Path(__file__).resolve().parent)
    env = {**os.environ, LOG: str(log),
           "PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)}
    argv = [sys.executable, "-m", "pytest", "-p", "bench_suite", *(args.pytest or ["-q"])]
    started = time.time()
    proc = subprocess.Popen(argv, env=env)
    seen, before = watch(proc)
    wall = time.time() - started
    tests = ([json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]
             if log.exists() else [])
    if not tests:
        print(f"pytest ran no test (exit {proc.returncode})", file=sys.stderr)
        return 1
    files, rest = charge(seen, before, proc.pid, tests)
    total = sum(r[1] + r[3] for r in files.values())
    counted = total + rest["pytest and its workers, outside tests"] + rest["ancestry lost (daemons)"]
    print(f"\n`{' '.join(['python -m pytest', *(args.pytest or ['-q'])])}`: exit {proc.returncode}, "
          f"{len(tests)} tests, {wall:.0f} s wall, {counted:.0f} CPU s ({counted / wall:.2f} "
          f"cores busy on average; {os.cpu_count()} here)\n")
    print("| file | tests | tests' own CPU s | processes | their CPU s | CPU s | share |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    ranked = sorted(files.items(), key=lambda item: -(item[1][1] + item[1][3]))
    shown, others = ranked[:args.top], ranked[args.top:]
    for name, (n, own, procs, theirs) in shown:
        print(f"| {name} | {n:.0f} | {own:.0f} | {procs:.0f} | {theirs:.0f} | {own + theirs:.0f} "
              f"| {(own + theirs) / counted:.1%} |")
    if others:
        sums = [sum(r[1][i] for r in others) for i in range(4)]
        print(f"| {len(others)} other files | {sums[0]:.0f} | {sums[1]:.0f} | {sums[2]:.0f} | "
              f"{sums[3]:.0f} | {sums[1] + sums[3]:.0f} | {(sums[1] + sums[3]) / counted:.1%} |")
    for what in ("pytest and its workers, outside tests", "ancestry lost (daemons)"):
        print(f"| {what} | | | | | {rest[what]:.0f} | {rest[what] / counted:.1%} |")
    heavy = sum(1 for k, p in seen.items() if k not in before and p.cpu >= 5.0)
    print(f"\n{heavy} processes used 5 CPU s or more (about what importing torch and "
          "transformers costs); processes running before the run are not counted.")
    return 0 if proc.returncode == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
