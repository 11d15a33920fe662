"""Pools users start before they load: ``concurrent.futures.ProcessPoolExecutor`` and
``multiprocessing.Pool`` (spawn, forkserver, fork), and ``joblib.Parallel(backend="loky")``.
The stdlib pools start once, before any load; then, layout by layout, the parent loads the
config and sends it; each worker builds the model from it and compares the classes. A pool
broken by one layout stays broken for the next, as it would for a user. (dask: ``dask_cluster.py``.)"""

import _ctx

_ctx.codeferry_if_asked()

import concurrent.futures as cf  # noqa: E402
import multiprocessing as mp  # noqa: E402
import time  # noqa: E402

from transformers import AutoConfig  # noqa: E402

METHODS = ("spawn", "forkserver", "fork")


def build(config, model):
    """In a worker: the model built from the config the parent sent."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto import auto_factory

    built = AutoModelForCausalLM.from_pretrained(model, config=config, trust_remote_code=True)
    # codeferry's generate() hook for remote classes, set by install() at the first class
    hook = auto_factory.add_generation_mixin_to_remote_model.__module__
    return {"config": _ctx.module_of(config), "model": _ctx.module_of(built),
            "same_config_class": type(built.config) is type(config),
            "generate_hook": "codeferry" if hook.startswith("codeferry.") else hook.split(".")[0]}


def pool_result(pool, config, model):
    """``Pool.apply_async(...).get()``, except that a worker that dies unpickling the task
    (the pool replaces it and the call never returns) is reported, not waited for."""
    workers = {p.pid for p in pool._pool}
    pending = pool.apply_async(build, (config, model))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if pending.ready():
            return pending.get()
        if {p.pid for p in pool._pool} != workers:
            return {"error": "WorkerDied", "message": "a worker died; Pool.apply would hang"}
        time.sleep(0.05)
    return {"error": "TimeoutError", "message": "no answer in 120 s"}


def started(method):
    """A ProcessPoolExecutor and a Pool, each with a live worker."""
    ctx = mp.get_context(method)
    executor, pool = cf.ProcessPoolExecutor(1, mp_context=ctx), ctx.Pool(1)
    executor.submit(abs, 1).result(120)
    pool.apply_async(abs, (1,)).get(120)
    return executor, pool


def stdlib_pools(pools, model):
    config = AutoConfig.from_pretrained(model, trust_remote_code=True)
    out = {"parent": _ctx.module_of(config)}
    for method, (executor, pool) in pools.items():
        out[f"executor-{method}"] = _ctx.attempt(
            lambda: executor.submit(build, config, model).result(120))
        out[f"pool-{method}"] = _ctx.attempt(lambda: pool_result(pool, config, model))
    return out


def loky(model):
    from joblib import Parallel, delayed

    config = AutoConfig.from_pretrained(model, trust_remote_code=True)
    results = Parallel(n_jobs=2, backend="loky")(delayed(build)(config, model) for _ in range(2))
    return results[0] if results[0] == results[1] else {"error": "Differ", "message": str(results)}


if __name__ == "__main__":
    pools = {method: started(method) for method in METHODS}  # before any load
    report = {}
    for layout, model in _ctx.layouts():
        report[layout] = {"stdlib": _ctx.attempt(lambda: stdlib_pools(pools, model)),
                          "loky": _ctx.attempt(lambda: loky(model))}
    for executor, pool in pools.values():
        executor.shutdown(cancel_futures=True)
        pool.terminate()
    _ctx.report(report)
