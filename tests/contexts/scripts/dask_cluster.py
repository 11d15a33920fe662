"""``dask.distributed.LocalCluster(processes=True)``, started before any load: the config
goes to a worker by ``submit`` and by ``scatter``; the worker builds the model from it."""

import _ctx

_ctx.codeferry_if_asked()
# transformers is imported where it is used: imported at the top of this script, dask's
# LocalCluster(processes=True) never got its workers up here (dask 2026.8, Python 3.11).

#: Seconds to wait for an answer. With plain transformers a worker that cannot unpickle the
#: config loses its connection and the call never answers: this bounds the wait.
WAIT = 20


def build(config, model):
    """In a worker: the model built from the config the parent sent."""
    from transformers import AutoModelForCausalLM

    built = AutoModelForCausalLM.from_pretrained(model, config=config, trust_remote_code=True)
    return {"config": _ctx.module_of(config), "model": _ctx.module_of(built),
            "same_config_class": type(built.config) is type(config)}


def dask(client, model):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model, trust_remote_code=True)
    out = {"submit": _ctx.attempt(lambda: client.submit(build, config, model, pure=False)
                                  .result(timeout=WAIT))}
    out["scatter"] = _ctx.attempt(lambda: client.submit(
        build, client.scatter(config, timeout=WAIT), model, pure=False).result(timeout=WAIT))
    return out


if __name__ == "__main__":
    from dask.distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None) as cluster, Client(cluster) as client:
        client.wait_for_workers(2, timeout=120)  # started before any load
        report = {layout: _ctx.attempt(lambda: dask(client, model))
                  for layout, model in _ctx.layouts()}
    _ctx.report(report)
