"""A Ray driver on a 2-node cluster (``RAY_ADDRESS``) whose node 2 never saw the model files:
the driver loads config, tokenizer and model, and node 2 gets them from it.

Per layout: a task pinned to node 2 builds the model from the driver's config and model
class and sends config and classes back; the RL pattern (the driver is the trainer holding the
model; an actor on node 2 receives config, class and the trainer's weights, runs a forward and
returns its logits); ``ray.data`` ``map_batches`` with a callable class holding the driver's
tokenizer, its actor on node 2. Everything node 2 runs is defined here (cloudpickle ships it by
value): nothing of the test's folders is read there.
"""

import _ctx

_ctx.codeferry_if_asked()

import os  # noqa: E402

#: Seconds any answer may take (a cold worker on a loaded machine is slow to import torch).
WAIT = 180
#: A fraction of node 2's custom resource: several actors and tasks fit at once.
NODE2 = {"num_cpus": 0, "resources": {"node2": 0.01}}
TEXTS = ["hello world", "remote code", "ray on two nodes", "abc"]


def who(obj):
    """``codeferry`` or ``transformers_modules``: who loaded the class of ``obj`` (here, for
    what node 2 runs, which must not import the test's ``_ctx``)."""
    cls = obj if isinstance(obj, type) else type(obj)
    return "codeferry" if cls.__module__.startswith("codeferry._dyn") else cls.__module__.split(".")[0]


def build(config, model_cls):
    """On node 2: the model built from the driver's config and class; config and classes go
    back to the driver, which checks they are its own."""
    import ray
    import transformers.dynamic_module_utils as dmu

    model = model_cls(config)
    return {"node": ray.util.get_node_ip_address(), "config": who(config), "model": who(model),
            "same_config_class": type(model.config) is type(config),
            "hf_vars": sorted(k for k in os.environ if k.startswith("HF_")),
            # the runtime_env's switch: on, and transformers' remote-code door is codeferry's
            "switch": os.environ.get("CODEFERRY_INSTALL"),
            "door": dmu.get_class_from_dynamic_module.__module__.split(".")[0]}, \
        (model.config, type(model), type(config))


class Rollout:
    """The RL pattern's actor on node 2: the trainer's config, model class and weights in,
    logits out."""

    def __init__(self, config, model_cls, weights):
        import ray

        self.model = model_cls(config)
        self.model.load_state_dict(weights)
        self.model.eval()
        self.config_cls = type(config)
        self.node = ray.util.get_node_ip_address()

    def forward(self, ids):
        import torch

        with torch.no_grad():
            logits = self.model(input_ids=torch.tensor(ids)).logits
        return {"node": self.node, "model": who(self.model),
                "same_config_class": type(self.model.config) is self.config_cls}, logits


class Tokenize:
    """``map_batches``' callable class: holds the driver's remote tokenizer."""

    def __init__(self, tokenizer):
        import ray

        self.tokenizer = tokenizer
        self.node = ray.util.get_node_ip_address()

    def __call__(self, batch):
        ids = [self.tokenizer(text)["input_ids"] for text in batch["text"]]
        return {"text": batch["text"], "n_ids": [len(x) for x in ids],
                "tokenizer": [who(self.tokenizer)] * len(ids), "node": [self.node] * len(ids)}


def attempt(fn):
    """``_ctx.attempt``, and whether the error names the module node 2 lacks (Ray's error text
    is long: the message ``_ctx`` keeps may end before it)."""
    try:
        return fn()
    except Exception as exc:  # the report says what failed; the test decides
        return {**_ctx.error(exc),
                "no_transformers_modules": "No module named 'transformers_modules'" in str(exc)}


def task(ray, config, model_cls):
    facts, (config_back, model_cls_back, config_cls_back) = ray.get(
        ray.remote(**NODE2)(build).remote(config, model_cls), timeout=WAIT)
    return {**facts, "config_back_same_class": type(config_back) is type(config),
            "model_class_back_is_driver_class": model_cls_back is model_cls,
            "config_class_back_is_driver_class": config_cls_back is type(config)}


def rl(ray, config, model):
    """The trainer (this driver) holds ``model``; the actor's logits must equal its own."""
    import torch

    ids = [[1, 2, 3, 4], [4, 3, 2, 1]]
    actor = ray.remote(**NODE2)(Rollout).remote(config, type(model),
                                                 ray.put(model.state_dict()))
    try:
        facts, logits = ray.get(actor.forward.remote(ids), timeout=WAIT)
    finally:
        ray.kill(actor)
    with torch.no_grad():
        mine = model(input_ids=torch.tensor(ids)).logits
    return {**facts, "logits_shape": list(logits.shape),
            "logits_equal_trainer": bool(torch.allclose(logits, mine))}


def data(ray, tokenizer):
    rows = ray.data.from_items([{"text": t} for t in TEXTS]).map_batches(
        Tokenize, fn_constructor_args=(tokenizer,), batch_size=2, concurrency=1,
        **NODE2).take_all()
    expected = {t: len(tokenizer(t)["input_ids"]) for t in TEXTS}
    return {"rows": len(rows), "n_ids_match": all(r["n_ids"] == expected[r["text"]] for r in rows),
            "tokenizer": sorted({r["tokenizer"] for r in rows}),
            "node": sorted({r["node"] for r in rows})}


def layout(ray, model_id):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(model_id, trust_remote_code=True)
    tokenizer = AutoTokenizer.from_pretrained(model_id, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(model_id, trust_remote_code=True)
    return {"config": _ctx.module_of(config),
            "task": attempt(lambda: task(ray, config, type(model))),
            "rl": attempt(lambda: rl(ray, config, model)),
            "data": attempt(lambda: data(ray, tokenizer))}


if __name__ == "__main__":
    import ray

    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    found = {"runtime_env_vars": sorted(ray.get_runtime_context().runtime_env.get("env_vars", {}))}
    for name, model_id in _ctx.layouts():
        found[name] = _ctx.attempt(lambda: layout(ray, model_id))
    ray.shutdown()
    _ctx.report(found)
