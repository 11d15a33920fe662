"""``dask.distributed.LocalCluster(processes=True)``, started before any load: the config
goes to a worker by ``submit`` and by ``scatter``; the worker builds the model from it."""

import _ctx

_ctx.codeferry_if_asked()

import time  # noqa: E402

#: Seconds to wait for an answer (a loaded machine is slow to import in a worker).
WAIT = 300
WORKERS = 2


def build(config, model):
    """In a worker: the model built from the config the parent sent."""
    from transformers import AutoModelForCausalLM

    built = AutoModelForCausalLM.from_pretrained(model, config=config, trust_remote_code=True)
    return {"config": _ctx.module_of(config), "model": _ctx.module_of(built),
            "same_config_class": type(built.config) is type(config)}


def lost(cluster):
    """A worker that cannot unpickle the config (plain transformers: ``No module named
    'transformers_modules'``) loses its connection and the scheduler (in this process)
    drops it; a call waiting on it would never answer."""
    if len(cluster.scheduler.workers) < WORKERS:
        return {"error": "WorkerLost", "message": "a worker left; the call never answers"}
    return None


def answer(cluster, future):
    """The future's result, or ``lost(cluster)`` as soon as a worker is gone."""
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        if future.done():
            return future.result()
        if lost(cluster):
            return lost(cluster)
        time.sleep(0.1)
    return {"error": "TimeoutError", "message": f"no answer in {WAIT} s"}


def scattered(cluster, client, config, model):
    if lost(cluster):  # scatter would wait for a worker
        return lost(cluster)
    return answer(cluster, client.submit(build, client.scatter(config, timeout=WAIT), model,
                                         pure=False))


def dask(cluster, client, model):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model, trust_remote_code=True)
    if lost(cluster):
        return {"submit": lost(cluster), "scatter": lost(cluster)}
    out = {"submit": _ctx.attempt(lambda: answer(cluster, client.submit(
        build, config, model, pure=False)))}
    out["scatter"] = _ctx.attempt(lambda: scattered(cluster, client, config, model))
    return out


if __name__ == "__main__":
    from dask.distributed import Client, LocalCluster

    with LocalCluster(n_workers=WORKERS, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None) as cluster, Client(cluster) as client:
        client.wait_for_workers(WORKERS, timeout=120)  # started before any load
        report = {layout: _ctx.attempt(lambda: dask(cluster, client, model))
                  for layout, model in _ctx.layouts()}
    _ctx.report(report)
