"""The measuring half of ``bench_ray.py``: runs in the head node's namespace, prints JSON."""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

PROMPTS = [f"prompt number {i} " + "word " * (i % 9) for i in range(128)]


def sleep20(worker: Any, texts: list[str]) -> int:
    time.sleep(0.020)
    return len(texts)


def _throughput(ex: Any) -> float:
    ex.generate(PROMPTS, max_new_tokens=16, min_new_tokens=16)  # warm-up
    times = []
    for _ in range(3):
        start = time.perf_counter()
        ex.generate(PROMPTS, max_new_tokens=16, min_new_tokens=16)
        times.append(time.perf_counter() - start)
    return len(PROMPTS) / statistics.median(times)


def _overhead(ex: Any, n: int = 40) -> float:
    batch = PROMPTS[:8]
    list(ex.map(sleep20, [batch] * 4))  # warm-up
    start = time.perf_counter()
    list(ex.map(sleep20, [batch] * n))
    per_batch = (time.perf_counter() - start) / n
    return per_batch / 0.020 - 1


def main(model: str, llama: str, reps: int) -> None:
    import cloudpickle
    from transformers import AutoConfig

    # vLLM's way first, with transformers' own remote-code loading (before codeferry
    # loads anything): the config's modules pickled by value, in every message.
    config = AutoConfig.from_pretrained(model, trust_remote_code=True)
    cloudpickle.register_pickle_by_value(sys.modules[type(config).__module__])
    by_value = len(cloudpickle.dumps(config)) * 1000

    import codeferry
    from codeferry._exec.workers import ray_backend as _ray

    ways = {"spawn": {"start_method": "spawn"}, "warm": {"warm": True},
            "ray": {"backend": "ray"}}
    startup: dict[str, list[float]] = {k: [] for k in ways}
    thru: dict[str, list[float]] = {"local": [], "ray": []}
    over: dict[str, list[float]] = {"local": [], "ray": []}
    # The zygote up before "warm" is timed: warm means already warm.
    codeferry.Executor(model, workers=1, warm=True, trust_remote_code=True).close()
    for _ in range(reps):
        for way, options in ways.items():
            start = time.perf_counter()
            ex = codeferry.Executor(model, workers=2, trust_remote_code=True, **options)
            startup[way].append(time.perf_counter() - start)
            ex.close()
        for key, options in (("local", {}), ("ray", {"backend": "ray"})):
            with codeferry.Executor(llama, workers=2, **options) as ex:
                thru[key].append(_throughput(ex))
        for key, options in (("local", {}), ("ray", {"backend": "ray"})):
            with codeferry.Executor(model, workers=1, trust_remote_code=True, **options) as ex:
                over[key].append(_overhead(ex))
    bundle = codeferry.resolve(model)
    ferry = _ray.build_ferry(bundle)
    code = sum(size for rel, (_, size) in ferry.manifest.items() if rel.endswith(".py"))
    med = statistics.median
    print(json.dumps({
        "startup": {k: med(v) for k, v in startup.items()},
        "throughput": {k: med(v) for k, v in thru.items()},
        "overhead": {k: med(v) for k, v in over.items()},
        "bytes": {"codeferry": code, "by_value": by_value, "ferry_small": ferry.code_bytes},
    }))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
