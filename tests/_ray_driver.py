"""Drivers of the Ray cluster tests: run inside namespace A, print one JSON line.

``python _ray_driver.py SCENARIO ARGS...``; the cluster is ``RAY_ADDRESS``. Kept apart
from the tests (and out of what node2 can see) so that nothing reaches node2 but what
codeferry ships.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

PROMPTS = [f"prompt {i} " + "ab" * (i % 5) for i in range(12)]


def _print(result: dict[str, Any]) -> None:
    print(json.dumps(result), flush=True)


def nodes() -> None:
    import ray

    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    _print({"ids": [n["NodeID"] for n in ray.nodes() if n["Alive"]]})


def _reference(model: str, kind: str, texts: list[str], cache_dir: str | None = None,
               **options: Any) -> list[Any]:
    """What a worker computes, computed here, in this process, one text at a time."""
    from codeferry._exec.engines.hf_engine import TransformersEngine
    from codeferry._exec.workers.worker import WorkerSpec
    from codeferry._trust.options import ModelOptions

    engine = TransformersEngine(WorkerSpec(
        model, ModelOptions(cache_dir=cache_dir, trust_remote_code=True), "cpu", None, 1, ()))
    if kind == "generate":
        return [engine.generate([t], {"max_new_tokens": 4, **options})[0] for t in texts]
    if kind == "embed":
        return [engine.embed([t], "mean")[0] for t in texts]
    return [engine.score([t])[0] for t in texts]


def _vanishing(model: str) -> str:
    """A copy of ``model`` that is deleted right after the driver shipped it."""
    import codeferry._exec.workers.ray_backend as cray

    copy = Path(os.environ["CF_SCRATCH"]) / f"shipped-{os.getpid()}-{Path(model).name}"
    shutil.copytree(model, copy)
    real = cray.build_ferry

    def build_then_delete(bundle: Any, model: Any = None) -> Any:
        ferry = real(bundle, model)
        shutil.rmtree(copy)
        return ferry

    cray.build_ferry = build_then_delete  # type: ignore[assignment]
    return str(copy)


def across(model: str, cache_dir: str = "") -> None:
    """generate/embed/score on 2 actors spread over the 2 nodes; the folder is gone.
    ``cache_dir``: the hub cache of the cross-repo code the model names, if any."""
    import codeferry

    cache = cache_dir or None
    expected = {kind: _reference(model, kind, PROMPTS, cache)
                for kind in ("generate", "embed", "score")}
    shipped = _vanishing(model)
    with codeferry.Executor(shipped, backend="ray", workers=2, trust_remote_code=True,
                            preload=("generate", "embed"), batch_size=3, cache_dir=cache) as ex:
        assert not Path(shipped).exists()
        got = {"generate": ex.generate(PROMPTS, max_new_tokens=4),
               "embed": ex.embed(PROMPTS), "score": ex.score(PROMPTS)}
        info = ex.worker_info
        per_node = ex.collective_rpc(_where)
        heads = ex.collective_rpc(_cross_repo_head)
    same = {kind: _close(got[kind], expected[kind]) for kind in got}
    _print({"same": same, "nodes": sorted({i["node_ip"] for i in info}),
            "ferry": [i["ferry"] for i in info], "classes": info[0]["classes"],
            "rpc": per_node, "cross_repo_heads": heads})


def _cross_repo_head(worker: Any) -> str | None:
    """The other repo's head class, loaded on this node from the code the driver sent."""
    cls = worker.classes.get("AutoModelForSequenceClassification")
    return None if cls is None else f"{cls.__module__}.{cls.__qualname__}"


def once_per_node(model: str) -> None:
    """Four actors on two nodes: each node gets the code and weights once, not per actor."""
    import codeferry

    with codeferry.Executor(model, backend="ray", workers=4, trust_remote_code=True) as ex:
        texts = ex.generate(PROMPTS, max_new_tokens=2)
        info = ex.worker_info
    _print({"n": len(texts), "per_actor": [(i["node_ip"], i["ferry"]) for i in info]})


def _where(worker: Any) -> dict[str, Any]:
    import transformers

    return {"pid": os.getpid(), "model": worker.spec.model, "home": os.path.expanduser("~"),
            "hf": sorted(k for k in os.environ if k.startswith("HF_")),
            "modules": transformers.__name__}


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-4 * max(1.0, abs(b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    return bool(a == b)


def locked(model: str, other: str) -> None:
    """An actor pinned to node2 given a lock for other code refuses to run this code."""
    import codeferry
    from codeferry._exec.plan import prepare
    from codeferry._exec.scheduler import Scheduler
    from codeferry._exec.workers.ray_backend import RayTransport
    from codeferry._exec.workers.worker import WorkerSpec
    from codeferry._trust.options import ModelOptions

    bundle = codeferry.resolve(model)
    lock = codeferry.Lock.from_bundle(codeferry.resolve(other))
    spec = WorkerSpec(str(bundle.origin.root), ModelOptions(lock=lock), "cpu", None, 1,
                      ("generate",), bundle.digest)
    # the parent's plan trusts this code; the actor's spec carries a lock for other code
    plan = prepare(model, ModelOptions(trust_remote_code=True), local_device=False)
    transport = RayTransport(plan.bundle, weights=plan.separate_weights, resources={"num_cpus": 0, "resources": {"node2": 0.01}})
    scheduler = Scheduler(transport, [spec], max_retries=0, startup_timeout=120)
    try:
        scheduler.start()
    except codeferry.errors.WorkerStartupError as exc:
        cause = exc.__cause__
        _print({"error": type(exc).__name__, "cause": type(cause).__name__, "text": str(exc)})
        return
    _print({"error": None})


def _slow_generate(ex: Any, kill: Any, copies: int = 3) -> tuple[list[Any], list[Any]]:
    """Outcomes of a run long enough to kill something in the middle of it."""
    prompts = [f"{p} {i}" for i in range(copies) for p in PROMPTS]
    outcomes = []
    for outcome in ex.generate_iter(prompts, max_new_tokens=24, batch_size=2):
        outcomes.append(outcome)
        if len(outcomes) == 2:
            kill()
    return prompts, outcomes


def actor_kill(model: str) -> None:
    import codeferry

    with codeferry.Executor(model, backend="ray", workers=2, trust_remote_code=True,
                            max_retries=2) as ex:
        before = [(i["node_ip"], i["pid"]) for i in ex.worker_info]
        victim = next(pid for ip, pid in before if ip == "10.200.0.2")
        prompts, outcomes = _slow_generate(ex, lambda: os.kill(victim, signal.SIGKILL))
        deadline = time.monotonic() + 90
        while (victim in ex.pids or None in ex.pids) and time.monotonic() < deadline:
            time.sleep(0.2)  # the replacement is ready (it may be, already)
        after = [(i["node_ip"], i["pid"]) for i in ex.worker_info]
        again = ex.generate(prompts, max_new_tokens=24, batch_size=2)
    _print({"indices": sorted(o.index for o in outcomes),
            "errors": [repr(o.error) for o in outcomes if o.error is not None],
            "same": {o.index: o.value for o in outcomes} == dict(enumerate(again)),
            "n": len(prompts), "before": before, "after": after, "victim": victim})


def node_kill(model: str, node2_session: str, pinned: str) -> None:
    """Node2 loses power mid-run: every process of its session SIGKILLed at once.
    ``pinned``: '1' pins every actor to node2, so no feasible node is left; '0' lets the
    run finish on the head node."""
    import _raycluster

    import codeferry

    # 60 s: the first start of both actors on node2 took over 30 s once under CI's load
    # (WorkerStartupError before any kill); a replacement no node can place still waits
    # one timeout, not max_retries + 1 of them.
    options: dict[str, Any] = {"backend": "ray", "workers": 2, "trust_remote_code": True,
                               "startup_timeout": 60}
    said: list[str] = []  # the scheduler's warnings: replacements tried again, workers down
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("codeferry._exec.scheduler").addHandler(handler)
    if pinned == "1":
        options["ray_resources"] = {"num_cpus": 0, "resources": {"node2": 0.01}}
    start = time.monotonic()
    with codeferry.Executor(model, **options) as ex:
        nodes_before = sorted(i["node_ip"] for i in ex.worker_info)
        killed_at: list[float] = []

        def kill() -> None:
            killed_at.append(time.monotonic())
            _raycluster.kill_session(int(node2_session))

        prompts, outcomes = _slow_generate(ex, kill)
        done = time.monotonic()
        deadline = time.monotonic() + 120
        while pinned == "0" and time.monotonic() < deadline and (
                None in ex.pids or _raycluster.NODE2_IP in {i.get("node_ip")
                                                            for i in ex.worker_info}):
            time.sleep(0.2)  # node2's actor is replaced on the head (it may be, already)
        nodes_after = sorted(i.get("node_ip", "?") for i in ex.worker_info)
        broken = repr(ex._scheduler.failure)
    _print({"indices": sorted(o.index for o in outcomes), "n": len(prompts),
            "errors": sorted({type(o.error).__name__ for o in outcomes if o.error}),
            "ok": sum(1 for o in outcomes if o.error is None),
            "nodes_before": nodes_before, "nodes_after": nodes_after, "broken": broken,
            "said": said,
            "seconds_after_kill": done - killed_at[0], "total": done - start})


def hub_weights(model: str) -> None:
    """A hub-cache model: the head node reads the weights from its own cache; node2 gets
    them shipped, or, over CODEFERRY_RAY_SHIP_LIMIT, refuses with WeightsTooLargeError."""
    import codeferry

    try:
        with codeferry.Executor(model, backend="ray", workers=2, trust_remote_code=True) as ex:
            out = ex.generate(PROMPTS[:4], max_new_tokens=2)
            _print({"ferry": {i["node_ip"]: i["ferry"] for i in ex.worker_info},
                    "n": len(out)})
    except codeferry.errors.WorkerStartupError as exc:
        cause = exc.__cause__
        _print({"error": type(exc).__name__, "cause": type(cause).__name__, "text": str(exc)})


if __name__ == "__main__":
    scenario, *args = sys.argv[1:]
    threading.excepthook = lambda info: None  # reader threads of a killed cluster
    globals()[scenario](*args)
