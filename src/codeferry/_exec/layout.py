"""How many workers an executor starts, how many threads each, and their cores: one decision.

A CPU machine gets two workers (one on a one-core machine), the cores shared between them.
Decoding reads every weight once per step for all the rows of a batch, so one worker with
every core reads the weights half as often as two; but a worker of several threads meets
its threads at a barrier in every op, and anything else running on the machine (the
parent, another program) stalls all of them at once, where single-threaded workers just
share the cores. Measured with ``benchmarks/bench_generation.py`` (2 cores, a 71M Llama, 32
prompts, up to 128 new tokens ending at their own lengths; ratios to vLLM CPU, both
layouts in one run, 2026-12-02), one worker of 2 threads against two of one thread:
float32 greedy 1.23x against 1.07x, 16 forced tokens 1.10x against 1.04x; bfloat16 greedy
0.82x against 0.85x, 16 forced tokens 0.63x against 0.99x (0.95x against 1.00x with no
vLLM engine in the run); a 217M Llama in bfloat16, greedy 1.15x against 0.97x, 16 forced
tokens level. Again on another machine, with codeferry's attention and prefill groups
(``docs/benchmarks.md``, 2026-12-02 afternoon): float32 greedy 1.07x against 0.95x, 16
forced tokens 1.01x against 1.22x; bfloat16 greedy 0.82x against 0.80x, 16 forced tokens
0.70x against 0.97x; 217M greedy level (0.99x). Neither wins everywhere; two workers
never fall far, so they stay. Beside a process spinning on one core (``bench_generation.py
--neighbour``, 2026-12-06), one vLLM worker of two threads kept 19% of its quiet speed and
two of one thread 63%: the vLLM engine gets this layout too. Nor do the decode loop's rows
gather on one worker of one thread when a neighbour takes cores (tried, 2026-12-06, 64
prompts capped at 128, remote code, transformers 5.25): one worker made 328, 308 and 332
tokens/s quiet, beside a busy core and beside two half-busy ones, two workers 515, 349 and
382: a step of 64 rows 70 tokens long reads as many bytes of KV cache as of weights, so
rows stop paying (one worker: 268 tokens/s at 24 rows, 283 at 32, 298 at 64).

Each local CPU worker of the transformers engine is bound to cores of its own (``cores``)
when the workers' threads fit the cores this process may use. Unbound, a neighbour on one
core gets the kernel's fair third of both, and every thread migrates between cores, its
cache left behind; bound, one worker shares its core with the neighbour and the other keeps
its own. Measured (``bench_generation.py``, 2026-12-07, 2 cores, 64 prompts, up to 128
greedy tokens ending at their own lengths, remote code, 3 rounds alternated, tokens/s
median): quiet 396 bound against 408 unbound; beside a busy core 284 against 255; beside
two half-busy ones 264 against 252 (vLLM CPU 302, 299, 277). The vLLM engine binds its own
threads. ``CODEFERRY_CPU_BIND=0`` turns it off (``_settings``).

An accelerator: one worker per visible device (more would share a device's memory).
Ray: two actors; the cluster's shape is not known until it is reached, so ``workers`` and
``ray_resources`` say it. ``workers=N`` always wins; the threads are then the cores shared
out (at least one each).

``layout`` is pure: counts in, counts out. What it is given is asked at the edge, below:
``cpus`` (the cores this process may use), ``devices`` (the accelerators visible, asked
only for a local ``cuda`` executor, the one case that imports torch in the parent).
"""

from __future__ import annotations

import os

from .. import _settings

__all__ = ["CPU_WORKERS", "RAY_WORKERS", "affinity", "bindings", "cores", "cpus", "device_for", "devices",
           "layout", "reason"]

#: Workers on a CPU machine (at most one a core), and actors a Ray executor starts, when
#: ``workers`` is not given.
CPU_WORKERS = RAY_WORKERS = 2


def layout(device: str, backend: str, workers: int | None, threads: int | None, *,
           cpus: int, devices: int = 0, ray_cpus: float = 1) -> tuple[int, int]:
    """``(workers, threads per worker)``: ``workers``/``threads`` where given."""
    if workers is not None and workers < 1:
        raise ValueError("workers must be at least 1")
    if threads is not None and threads < 1:
        raise ValueError("threads_per_worker must be at least 1")
    if backend == "ray":
        count = workers or RAY_WORKERS
        return count, threads or max(1, int(ray_cpus))
    accelerator = device.split(":")[0] not in ("cpu", "mps")
    if workers is not None:
        count = workers
    elif accelerator:
        count = max(1, devices) if ":" not in device else 1
    else:
        count = max(1, min(CPU_WORKERS, cpus))
    return count, threads or max(1, cpus // count)


def cores(count: int, threads: int, usable: list[int], *, bind: bool) -> list[tuple[int, ...]]:
    """The cores each of ``count`` local CPU workers of ``threads`` threads binds to:
    consecutive runs of ``usable`` (the cores this process may use), one run a worker;
    empty for each (every core) when ``bind`` is off or the runs would not fit."""
    if not bind or count * threads > len(usable):
        return [() for _ in range(count)]
    ordered = sorted(usable)
    return [tuple(ordered[i * threads:(i + 1) * threads]) for i in range(count)]


def reason(device: str, backend: str, workers: int | None, threads: int | None, *,
           cpus: int, devices: int = 0, bound: bool = False) -> str:
    """Why ``layout`` gives what it gives for these arguments, in one clause (``codeferry
    doctor`` prints it beside the counts)."""
    given = [name for name, value in (("workers", workers), ("threads_per_worker", threads))
             if value is not None]
    if given:
        return " and ".join(given) + " given"
    if backend == "ray":
        return "Ray: two actors; the cluster's shape is known only once it is reached"
    if device.split(":")[0] not in ("cpu", "mps"):
        return f"one worker per visible accelerator ({devices} here)" if ":" not in device \
            else f"one worker on {device}"
    if cpus == 1:
        return "one core: one worker"
    # the measurements behind it are this module's docstring's, not repeated here
    return (f"{cpus} cores shared by {CPU_WORKERS} workers, whichever engine"
            f"{' (the transformers engine binds each to cores of its own)' if bound else ''}: "
            "beside other work, a worker of every thread stalls at each op")


def device_for(device: str, slot: int) -> str:
    """The device of worker ``slot``: ``cuda`` spread over the visible devices."""
    if device == "cuda":
        import torch

        count = torch.cuda.device_count()
        return f"cuda:{slot % count}" if count else "cpu"
    return device


def cpus() -> int:
    """The cores this process may run on (its affinity, where the OS has one)."""
    getter = getattr(os, "sched_getaffinity", None)
    return len(getter(0)) if getter is not None else (os.cpu_count() or 1)


def affinity() -> list[int]:
    """The cores this process may run on, by number; empty where the OS cannot bind."""
    getter = getattr(os, "sched_getaffinity", None)
    if getter is None or not hasattr(os, "sched_setaffinity"):
        return []
    return sorted(getter(0))


def bindings(device: str, backend: str, count: int, threads: int) -> list[tuple[int, ...]]:
    """``cores`` for an executor's workers here: local CPU workers only (a Ray actor's cores
    are its node's), and not under ``CODEFERRY_CPU_BIND=0``."""
    bind = backend == "local" and device.split(":")[0] == "cpu" and _settings.cpu_bind()
    return cores(count, threads, affinity(), bind=bind)


def devices(device: str, backend: str) -> int:
    """The accelerators visible here, for a local ``cuda`` executor (0 otherwise)."""
    if device != "cuda" or backend != "local":
        return 0
    import torch

    return int(torch.cuda.device_count())
