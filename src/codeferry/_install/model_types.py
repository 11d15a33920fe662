"""One ``model_type``, many models: never answer one model's files with another model's class.

transformers' registry holds one config class per ``model_type``, and a registered class wins
over remote code even with ``trust_remote_code=True`` (``AutoConfig.from_pretrained`` checks
``CONFIG_MAPPING`` first). Fine-tunes and revisions of one architecture share their
``model_type`` while their code may differ, so after ``codeferry.load(A)`` a plain
``AutoConfig.from_pretrained(B)`` would silently build A's class from B's ``config.json``,
and B's code would never run.

So codeferry records which model (folder and code digest) each ``model_type`` it registered
belongs to, and ``AutoConfig.from_pretrained`` of any other folder with that ``model_type``
is checked first:

* same code digest (a fine-tune that ships the code unchanged): the registered class *is*
  that code's class; transformers answers as usual;
* other code, ``trust_remote_code=True``: the caller trusts B's code, so codeferry loads B
  (its own classes, its own unit) and answers with B's config class;
* other code, no trust: ``ModelTypeConflictError`` names both models and both digests;
  transformers is never allowed to answer wrongly.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

from .. import _load
from .._code.resolve import resolve
from .._code.source import locate
from .._hf import patches
from .._trust.decide import caller_trusts
from ..errors import ModelNotFoundError, ModelTypeConflictError

__all__ = ["record", "owner_of", "install_config_guard", "on_load"]

_lock = threading.Lock()
_owners: dict[str, tuple[str, str]] = {}  # model_type -> (model root, code digest)
_by_root: dict[str, Any] = {}  # model root -> the config class codeferry loaded for it


def record(model_type: str, root: str, digest: str, config_class: Any) -> None:
    """``model_type`` is now registered to the code ``digest`` of the model at ``root``."""
    with _lock:
        _owners[model_type] = (root, digest)
        _by_root[root] = config_class


def owner_of(model_type: str) -> tuple[str, str] | None:
    with _lock:
        return _owners.get(model_type)


def _model_type_at(root: str) -> str | None:
    try:
        with open(os.path.join(root, "config.json"), encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return None
    value = data.get("model_type") if isinstance(data, dict) else None
    return value if isinstance(value, str) else None


def _conflict(model: Any, kwargs: dict[str, Any]) -> Any:
    """The config class that must answer for ``model``, or ``None`` to let transformers."""

    revision = kwargs.get("revision")
    try:
        origin = locate(model, revision=revision, cache_dir=kwargs.get("cache_dir"))
    except (ModelNotFoundError, OSError, ValueError):
        return None  # not on this machine: nothing of ours can be registered for it
    model_type = _model_type_at(str(origin.root))
    owner = owner_of(model_type) if model_type else None
    if owner is None or owner[0] == str(origin.root):
        return None
    with _lock:
        known = _by_root.get(str(origin.root))
    if known is not None:
        return known  # loaded by codeferry before another model took the model_type
    bundle = resolve(model, revision=revision, cache_dir=kwargs.get("cache_dir"),
                     requirements=False)
    if bundle.digest == owner[1]:
        return None  # the same code: the registered class is this model's class
    if not caller_trusts(kwargs):
        raise ModelTypeConflictError(
            f"{origin.name} has model_type {model_type!r}, which this process has registered to "
            f"the code of {owner[0]} (digest {owner[1]}); {origin.name}'s code differs "
            f"(digest {bundle.digest}), so transformers would build the other model's class.",
            model_type=model_type or "", path=str(origin.root / "config.json"),
            fix=f"load it with its own code: codeferry.load({str(model)!r}, "
            "trust_remote_code=True) (or pass trust_remote_code=True to from_pretrained).",
        )
    classes = _load.load(model, trust_remote_code=True, revision=revision,
                        cache_dir=kwargs.get("cache_dir"))
    return classes.get("AutoConfig")


def on_load(event: _load.Loaded) -> None:
    """After-load callback: transformers holds one class per ``model_type``, so the loaded
    model's config class owns it from now on, and no other model's files get that class."""
    config = event.classes.get("AutoConfig")
    model_type: Any = getattr(config, "model_type", None)
    if isinstance(config, type) and isinstance(model_type, str) and model_type:
        install_config_guard()
        record(model_type, event.root, event.digest, config)


def install_config_guard() -> None:
    """Check ``AutoConfig.from_pretrained`` against the registry's owners (idempotent)."""
    from transformers import AutoConfig

    with _lock:
        if patches.patched(AutoConfig, "from_pretrained"):
            return
        original = AutoConfig.__dict__["from_pretrained"].__func__

        def from_pretrained(cls: Any, pretrained_model_name_or_path: Any, *args: Any,
                            **kwargs: Any) -> Any:
            answer = _conflict(pretrained_model_name_or_path, kwargs)
            if answer is not None:
                kwargs = {k: v for k, v in kwargs.items()
                          if k not in ("trust_remote_code", "code_revision")}
                return answer.from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
            return original(cls, pretrained_model_name_or_path, *args, **kwargs)

        from_pretrained.__wrapped__ = original  # type: ignore[attr-defined]
        patches.patch(AutoConfig, "from_pretrained", classmethod(from_pretrained))
