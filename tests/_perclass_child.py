"""Run in spawned children by ``test_per_class.py``: load a model there, report plain data."""

from __future__ import annotations

import os
import pickle
import sys
from typing import Any


def load_and_report(path: str, marker: str | None = None) -> dict[str, Any]:
    """``codeferry.load`` in this process; which classes loaded, and why the others did not."""
    if marker:
        os.environ["CODEFERRY_TEST_MARKER"] = marker
    import codeferry

    result = codeferry.load(path, trust_remote_code=True)
    out: dict[str, Any] = {
        "loaded": sorted(result),
        "failed": {k: [type(e).__name__, e.path, e.line, e.fix] for k, e in result.failed.items()},
        "marker_after_load": os.path.exists(marker) if marker else None,
    }
    model_class = result.get("AutoModel")
    if model_class is not None and hasattr(sys.modules[model_class.__module__], "lazy_double"):
        module = sys.modules[result["AutoModel"].__module__]
        out["lazy_double"] = module.lazy_double(21)
        with open(marker or os.devnull, encoding="utf-8") as handle:
            out["marker_lines"] = handle.read().splitlines()
        try:
            module.quantize_weights(1)
        except ImportError as exc:
            out["quantize_error"] = [type(exc).__name__, getattr(exc, "name", None)]
    return out


def receive(data: bytes) -> dict[str, Any]:
    """Unpickle a config and a model sent from a process that loaded only some classes."""
    import torch

    config, model = pickle.loads(data)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]])).logits
    return {
        "config_module": type(config).__module__,
        "config_class_is_type_config": model.config_class is type(config),
        "same_config_class": type(model.config) is type(config),
        "logits": logits.flatten()[:8].tolist(),
    }
