"""Functions that run in child processes. Imports nothing of codeferry at module level:
receivers must work without anyone importing codeferry for them."""

from __future__ import annotations

import io
import multiprocessing as mp
import pickle
import sys
from typing import Any

TEXT = "hello world"
IDS = [[5, 9, 12, 7, 3, 22]]


def describe(obj: Any) -> dict[str, Any]:
    """A plain-data summary of a received object, comparable with the sender's."""
    cls = obj if isinstance(obj, type) else type(obj)
    module = sys.modules.get(cls.__module__)
    canonical = module
    for part in cls.__qualname__.split("."):
        canonical = getattr(canonical, part, None)
    out: dict[str, Any] = {
        "module": cls.__module__,
        "qualname": cls.__qualname__,
        "canonical": canonical is cls,
        "isinstance": isinstance(obj, canonical) if isinstance(canonical, type) else None,
    }
    if isinstance(obj, type):
        out["kind"] = "class"
    elif hasattr(obj, "to_diff_dict") and hasattr(obj, "model_type"):
        out["kind"] = "config"
        out["state"] = obj.to_dict()
    elif hasattr(obj, "forward"):
        import torch

        out["kind"] = "model"
        out["config_class_is_type_config"] = obj.config_class is type(obj.config)
        with torch.no_grad():
            out["logits"] = obj(torch.tensor(IDS)).logits.flatten()[:32].tolist()
    elif hasattr(obj, "encode"):
        out["kind"] = "tokenizer"
        out["ids"] = obj(TEXT)["input_ids"]
    return out


def describe_all(objs: Any) -> list[dict[str, Any]]:
    return [describe(o) for o in objs]


def describe_bytes(data: bytes) -> list[dict[str, Any]]:
    return describe_all(pickle.loads(data))


def child_main(objs: Any, queue: Any, grandchild_method: str | None) -> None:
    """A ``Process`` target: describe what arrived as arguments, and relay to a grandchild."""
    try:
        result: dict[str, Any] = {"child": describe_all(objs)}
        if grandchild_method:
            ctx = mp.get_context(grandchild_method)
            inner = ctx.Queue()
            proc = ctx.Process(target=child_main, args=(objs, inner, None))
            proc.start()
            result["grandchild"] = inner.get(timeout=120)["child"]
            proc.join(30)
        queue.put(result)
    except BaseException as exc:  # report, never hang the parent
        import traceback

        queue.put({"error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()})


def ray_describe(objs: Any) -> list[dict[str, Any]]:
    return describe_all(objs)


def code_and_weights(worker: Any) -> dict[str, Any]:
    """Runs in a worker (``collective_rpc``): which code built its model, and a checksum of the
    weights it holds (``_helpers.checksum`` computes it from the files)."""
    model = worker.models["AutoModelForCausalLM"]
    config_module = sys.modules[type(model.config).__module__]
    return {"config_has_defaults": hasattr(config_module, "DEFAULTS"),
            "config_class": type(model.config).__qualname__,
            "checksum": float(sum(p.double().sum() for p in model.state_dict().values()))}


if __name__ == "__main__":
    # Fresh-interpreter receiver: nothing but pickle on stdin, JSON on stdout.
    import json

    assert "codeferry" not in sys.modules
    data = sys.stdin.buffer.read()
    received = pickle.load(io.BytesIO(data))
    json.dump(describe_all(received), sys.stdout)
