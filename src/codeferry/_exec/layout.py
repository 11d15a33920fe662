"""How many workers an executor starts, and how many threads each: one decision.

Decoding reads every weight of the model once per step, for all the rows of the batch at
once. On a CPU, one worker with every core reads them once per step; two workers with half
the cores each read them twice, each for half the rows, and a small-batch matrix multiply
is bound by those reads. So a CPU machine gets one worker with all its cores, as vLLM runs
one engine. Measured with ``benchmarks/bench_generation.py`` (2 cores, a 71M Llama, 32
prompts, up to 128 new tokens, outputs that end at their own lengths; ratios to vLLM CPU in
one run): one worker of 2 threads against two of one thread, greedy float32 1.06x against
0.90x, greedy bfloat16 0.82x against 0.62x, 16 forced tokens bfloat16 0.75x against 0.44x.

An accelerator: one worker per visible device (more would share a device's memory).
Ray: two actors, as before; the cluster's shape is not known until it is reached, so
``workers`` and ``ray_resources`` say it. ``workers=N`` always wins; the threads are then
the cores shared out (at least one each).

``layout`` is pure: counts in, counts out. What it is given is asked at the edge, below:
``cpus`` (the cores this process may use), ``devices`` (the accelerators visible, asked
only for a local ``cuda`` executor, the one case that imports torch in the parent).
"""

from __future__ import annotations

import os

__all__ = ["RAY_WORKERS", "cpus", "device_for", "devices", "layout"]

#: Actors a Ray executor starts when ``workers`` is not given.
RAY_WORKERS = 2


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
    count = workers or (max(1, devices) if accelerator and ":" not in device else 1)
    return count, threads or max(1, cpus // count)


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


def devices(device: str, backend: str) -> int:
    """The accelerators visible here, for a local ``cuda`` executor (0 otherwise)."""
    if device != "cuda" or backend != "local":
        return 0
    import torch

    return int(torch.cuda.device_count())
