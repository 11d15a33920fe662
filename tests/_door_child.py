"""What a fresh process does at each door transformers opens to a repo's Python
(``tests/install/test_doors.py`` runs each function in a new spawned, forkserver or forked
process: a lock binds a process for good). Each returns plain data: what was refused, as
the error's type name, and what ran, as the lines the model's ``marker`` file got."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def ran(marker: str, what: str = "custom_generate") -> list[str]:
    """The modules of this process that wrote to ``marker`` (the models of a test module
    share one) whose name holds ``what``."""
    path = Path(marker)
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    mine = [line.rsplit(" ", 1) for line in lines if line.endswith(f" {os.getpid()}")]
    return [name for name, _ in mine if what in name]


def _outcome(call: Any) -> str:
    try:
        value = call()
    except Exception as exc:  # the type is the answer
        return type(exc).__name__
    return f"ok {value['custom_generate'] if isinstance(value, dict) else value}"


def _generate_with(model: Any, repo: str, trust: bool) -> Any:
    """``generate(custom_generate=repo)`` as transformers' own ``GenerationMixin`` runs it
    (the instance's ``generate`` may already be a custom one)."""
    from transformers.generation.utils import GenerationMixin

    return GenerationMixin.generate(model, custom_generate=repo, trust_remote_code=trust)


def without_lock(model: str, plain: str, other: str, marker: str) -> dict[str, Any]:
    """``install()``, no lock: trust decides at every door, and trusted code is codeferry's."""
    import codeferry

    codeferry.install()
    from transformers import AutoModelForCausalLM

    out: dict[str, Any] = {}
    # a model with no auto_map, only custom_generate/: transformers 4.x ran it untrusted
    untrusted = AutoModelForCausalLM.from_pretrained(plain)
    out["plain_untrusted_generate"] = getattr(untrusted.generate, "func", untrusted.generate).__qualname__
    out["plain_untrusted_ran"] = ran(marker)
    out["generate_untrusted"] = _outcome(lambda: _generate_with(untrusted, plain, False))
    out["generate_untrusted_ran"] = ran(marker)
    trusted = AutoModelForCausalLM.from_pretrained(model, trust_remote_code=True)
    out["from_pretrained_trusted"] = _outcome(lambda: trusted.generate())
    out["generate_other_trusted"] = _outcome(lambda: _generate_with(trusted, other, True))
    out["ran"] = ran(marker)
    return out


def engine_lock(lock: str, model: str, other: str, marker: str) -> dict[str, Any]:
    """``CODEFERRY_LOCK`` and the vLLM plugin's ``register()``, as in every vLLM process."""
    os.environ["CODEFERRY_LOCK"] = lock
    from codeferry._install import vllm as _vllm

    _vllm.register()
    import transformers.dynamic_module_utils as dmu
    from transformers import AutoModelForCausalLM

    out: dict[str, Any] = {}
    loaded: list[Any] = []

    def load() -> Any:
        loaded.append(AutoModelForCausalLM.from_pretrained(model, trust_remote_code=True))
        return loaded[-1].generate()

    out["from_pretrained"] = _outcome(load)

    def by_hand() -> Any:  # what transformers' load_custom_generate does, called directly
        path = dmu.get_cached_module_file(model, "custom_generate/generate.py")
        return dmu.get_class_in_module("generate", path)(None)

    out["get_class_in_module"] = _outcome(by_hand)
    out["ran"] = ran(marker)
    if loaded:
        out["generate_other"] = _outcome(lambda: _generate_with(loaded[-1], other, True))
        out["other_ran"] = ran(marker)[len(out["ran"]):]
    return out


def load_lock(lock: str, model: str, other: str, marker: str) -> dict[str, Any]:
    """``codeferry.load(model, lock=...)``, then a library that hard-codes trust (CVE-2026-27893's
    pattern) loads another model through plain transformers, and then through ``install()``."""
    import codeferry

    codeferry.load(model, lock=lock)
    from transformers import AutoConfig

    out: dict[str, Any] = {}
    out["other_transformers"] = _outcome(
        lambda: type(AutoConfig.from_pretrained(other, trust_remote_code=True)).__module__)
    codeferry.install()
    out["other_installed"] = _outcome(
        lambda: type(AutoConfig.from_pretrained(other, trust_remote_code=True)).__module__)
    out["locked_model"] = _outcome(
        lambda: type(AutoConfig.from_pretrained(model, trust_remote_code=True)).__module__)
    out["ran"] = ran(marker, "onfiguration")
    return out


def untrusted_startup(model: str, marker: str) -> dict[str, Any]:
    """CVE-2026-22807's pattern: code executed at start-up, before anyone trusted it."""
    import codeferry

    codeferry.install()
    from transformers import AutoConfig, AutoModelForCausalLM

    out: dict[str, Any] = {}
    out["config"] = _outcome(lambda: type(AutoConfig.from_pretrained(model)).__module__)
    out["model"] = _outcome(lambda: type(AutoModelForCausalLM.from_pretrained(model)).__module__)
    out["ran"] = ran(marker, "")
    return out


def hub_repo(cache: str, lock: str | None, model: str, repo: str, marker: str) -> dict[str, Any]:
    """``generate(custom_generate="org/repo")`` and ``from_pretrained("org/repo")`` of a repo in
    a hub cache, offline; with ``lock`` (``CODEFERRY_LOCK``) as in a vLLM process."""
    os.environ.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=cache)
    if lock:
        os.environ["CODEFERRY_LOCK"] = lock
        from codeferry._install import vllm as _vllm

        _vllm.register()
    else:
        import codeferry

        codeferry.install()
    from transformers import AutoModelForCausalLM

    out: dict[str, Any] = {}
    local = AutoModelForCausalLM.from_pretrained(model, trust_remote_code=True)
    before = len(ran(marker))  # the model's own custom_generate, loaded with it
    out["repo_untrusted"] = _outcome(lambda: _generate_with(local, repo, False))
    out["repo_trusted"] = _outcome(lambda: _generate_with(local, repo, True))
    out["repo_ran"] = ran(marker)[before:]
    return out
