"""Runtime gates for the doors beside ``auto_map``: Hub kernels.

transformers fetches and imports a Hub kernel (the ``kernels`` package) when a model's
config names one as its attention or experts implementation (``attn_implementation:
"org/repo"``, in 4.53 also the private ``_attn_implementation_internal`` copied from the file:
CVE-2026-4372), when the caller passes ``use_kernels=True`` / ``kernel_config``, or through
its own kernel mapping. None of it passes ``get_class_from_dynamic_module``, so neither
``install()``'s hook nor a lock saw it. These gates do, through the one patch registry
(``_hf.patches``):

* ``load_and_register_attn_kernel`` (where transformers turns an attention implementation
  into a kernel), every ``get_kernel`` (transformers' wrapper in ``integrations.hub_kernels`` and the
  ``kernels`` package's own, wherever a module bound it by name) and transformers'
  ``kernelize`` ask ``_trust.decide.kernel_refusal`` first, and raise
  ``HubKernelRefusedError`` before anything is downloaded or imported when it refuses;
  under a lock, the kernelization transformers 5.25+ applies to every model it loads is
  left out when the caller did not ask for it (``_trust.decide.kernelize_skipped``), and
  one whose mapping names no kernel (``reset_kernels()``) passes, since it fetches nothing
  (``kernelize_refused``);
* ``PreTrainedModel.from_pretrained`` and the Auto model classes' ``from_pretrained``
  record the caller's call (the outermost one: nested loads that transformers makes cannot
  add trust) so the decision knows the model, whether the caller trusts its code, and
  whether the caller named a kernel itself.

``adopt`` configures them once (``install()``, ``install_for_engine``, the boot of ``codeferry
exec``) and patches each module of ``MODULES`` with ``gate_module`` when it has executed,
importing none of them; ``uninstall()``'s ``restore_all`` undoes it.
"""

from __future__ import annotations

import contextvars
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._code.doors import kernel_references, kernel_repo, kernel_repos
from .._code.source import locate
from .._hf import patches
from .._trust.decide import kernel_refusal, kernelize_refused, kernelize_skipped
from ..errors import CodeferryError, HubKernelRefusedError

__all__ = ["MODULES", "configure", "gate_module"]

logger = logging.getLogger(__name__)

#: The keywords of ``from_pretrained`` by which a caller asks for kernels itself.
_KERNEL_KEYWORDS = ("attn_implementation", "experts_implementation", "use_kernels",
                    "kernel_config")


@dataclass(frozen=True)
class _Call:
    """One ``from_pretrained`` call: its model, and the keywords the gate decides on."""

    model: Any
    trust_remote_code: bool
    kernels: tuple[str, ...]  # kernel repos the caller named (attn/experts implementation)
    asked_kernels: bool  # use_kernels / kernel_config: the caller chose kernels itself
    revision: str | None
    cache_dir: Any


_calls: contextvars.ContextVar[tuple[_Call, ...]] = contextvars.ContextVar(
    "codeferry_from_pretrained", default=())
_kernelizing: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "codeferry_kernelizing", default=False)  # inside a gated kernelize that passed
_lock_in_force: Callable[[], bool] = lambda: False  # noqa: E731 - set by install()
_active: Callable[[], bool] = lambda: False  # noqa: E731 - set by install()


def _call_of(model: Any, kwargs: dict[str, Any]) -> _Call:
    named: list[str] = []
    for key in ("attn_implementation", "experts_implementation"):
        value = kwargs.get(key)
        values = value.values() if isinstance(value, dict) else [value]
        named += [kernel_repo(r) for v in values for r in kernel_references(v)]
    return _Call(model, bool(kwargs.get("trust_remote_code")), tuple(named),
                 bool(kwargs.get("use_kernels") or kwargs.get("kernel_config")),
                 kwargs.get("revision"), kwargs.get("cache_dir"))


def _recording(func: Any) -> Any:
    """``from_pretrained`` (the function of a classmethod) that records its call."""

    def from_pretrained(cls: Any, pretrained_model_name_or_path: Any, *args: Any,
                        **kwargs: Any) -> Any:
        token = _calls.set((*_calls.get(), _call_of(pretrained_model_name_or_path, kwargs)))
        try:
            return func(cls, pretrained_model_name_or_path, *args, **kwargs)
        finally:
            _calls.reset(token)

    from_pretrained.__doc__ = getattr(func, "__doc__", None)
    from_pretrained.__wrapped__ = func  # type: ignore[attr-defined]
    return from_pretrained


def _named_by_model(call: _Call | None, repo: str) -> tuple[bool, str | None, int | None]:
    """Whether the model of ``call`` names kernel ``repo`` in its files, and where."""
    if call is None or not isinstance(call.model, (str, Path)):
        return False, None, None
    try:
        root = locate(call.model, revision=call.revision, cache_dir=call.cache_dir).root
    except (CodeferryError, OSError, ValueError):
        return False, None, None
    door = kernel_repos(root).get(repo)
    if door is None:
        return False, None, None
    return True, str(root / door.file), door.line


def check_kernel(reference: str, *, asked: bool = False) -> None:
    """Raise ``HubKernelRefusedError`` unless Hub kernel ``reference`` may be fetched here.

    ``asked``: the call itself is one only a caller makes (``kernelize``)."""
    if not _active():  # only load() ran here: the process is not codeferry's to gate
        return
    repo = kernel_repo(str(reference))
    stack = _calls.get()
    outer = stack[0] if stack else None  # the caller's call; inner ones are transformers'
    named, path, line = _named_by_model(outer, repo)
    if outer is None:  # no from_pretrained: the caller's own code asks for it
        caller_named = True
    else:
        caller_named = asked or repo in outer.kernels or (outer.asked_kernels and not named)
    why = kernel_refusal(locked=_lock_in_force(), named_by_model=named,
                         caller_named=caller_named,
                         caller_trusts=outer is not None and outer.trust_remote_code)
    if why is None:
        return
    where = f" (named at {Path(path).name}:{line})" if path else ""
    raise HubKernelRefusedError(
        f"transformers was about to download and import the Hub kernel {repo}{where}: {why}; "
        "nothing was fetched or imported.",
        repo=repo, path=path, line=line,
        fix="drop the kernel (remove the field from the model's config, or pass "
        "attn_implementation='sdpa'), or, without a lock, pass trust_remote_code=True after "
        "reviewing the kernel repo; codeferry does not lock Hub kernels.",
    )


def _gated_get_kernel(original: Any) -> Any:
    def get_kernel(repo_id: Any, *args: Any, **kwargs: Any) -> Any:
        check_kernel(repo_id)
        return original(repo_id, *args, **kwargs)

    get_kernel.__wrapped__ = original  # type: ignore[attr-defined]
    return get_kernel


def _gated_attn_kernel(original: Any) -> Any:
    """transformers' ``load_and_register_attn_kernel``: it checks that ``kernels`` is
    installed before it calls ``get_kernel``, so the decision comes first here."""

    def load_and_register_attn_kernel(attn_implementation: Any, *args: Any, **kwargs: Any) -> Any:
        for reference in kernel_references(attn_implementation):  # as transformers reads it
            check_kernel(reference)
        return original(attn_implementation, *args, **kwargs)

    load_and_register_attn_kernel.__wrapped__ = original  # type: ignore[attr-defined]
    return load_and_register_attn_kernel


def _maps_kernels(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``kernelize(model, mode, kernel_config)`` may map a layer to a Hub kernel: its
    ``kernel_config`` (5.25; before, and when ``None``, the model's own) names one, or
    inherits the ``kernels`` package's global mapping (no config inherits it)."""
    config = kwargs.get("kernel_config", args[2] if len(args) > 2 else None)
    if config is None:
        model = kwargs.get("model", args[0] if args else None)
        config = getattr(model, "kernel_config", None)
    if config is None:
        return True
    inherits = not getattr(config, "use_local_kernel", False) and getattr(
        config, "inherit_mapping", True)
    return bool(getattr(config, "kernel_mapping", None)) or bool(inherits)


def _gated_kernelize(original: Any, *, returns_model: bool = False) -> Any:
    """transformers' ``kernelize`` (returns nothing), or with ``returns_model`` the ``kernels``
    package's own (transformers 4.53 and the GGUF layers call it directly; returns the model)."""

    def kernelize(*args: Any, **kwargs: Any) -> Any:
        if not _active() or (returns_model and _kernelizing.get()):
            return original(*args, **kwargs)  # inside transformers' gated one: decided there
        locked = _lock_in_force()
        stack = _calls.get()  # no from_pretrained around it: the caller's own call
        if kernelize_skipped(locked=locked, caller_asked=not stack or stack[0].asked_kernels):
            logger.info("a lock binds this process: transformers' default Hub "
                        "kernelization is left out; the model keeps its own layers")
            return kwargs.get("model", args[0] if args else None) if returns_model else None
        if kernelize_refused(locked=locked, maps_kernels=_maps_kernels(args, kwargs)):
            check_kernel("kernels/kernelize", asked=True)
        token = _kernelizing.set(True)
        try:
            return original(*args, **kwargs)
        finally:
            _kernelizing.reset(token)

    kernelize.__wrapped__ = original  # type: ignore[attr-defined]
    return kernelize


#: The modules whose own attributes the gates patch (``gate_module``).
MODULES = ("transformers.modeling_utils", "transformers.models.auto.auto_factory",
           "transformers.models.auto.modeling_auto", "transformers.integrations.hub_kernels",
           "kernels")


def configure(lock_in_force: Callable[[], bool], active: Callable[[], bool]) -> None:
    """``lock_in_force`` says whether a lock binds this process now, ``active`` whether the
    gates decide at all (``install()``, an engine, or a lock: not after a plain ``load()``,
    which answers only for its own models)."""
    global _lock_in_force, _active
    _lock_in_force, _active = lock_in_force, active


def gate_module(module: Any) -> None:
    """The gates that belong to ``module`` (one of ``MODULES``), from its own attributes
    alone: it is patched right after it executes, when the modules that import it may still
    be half imported (idempotent)."""
    name = getattr(module, "__name__", "")
    if name == "transformers.modeling_utils":
        _record(module.PreTrainedModel)
    elif name == "transformers.models.auto.auto_factory":
        _record(module._BaseAutoModelClass)
    elif name == "transformers.models.auto.modeling_auto":
        # Each Auto model class carries a copy of the base's from_pretrained (auto_class_update)
        base = getattr(module, "_BaseAutoModelClass", None)  # bound from auto_factory
        for owner in list(vars(module).values()):
            if base is not None and isinstance(owner, type) and issubclass(owner, base) and (
                    "from_pretrained" in vars(owner)):
                _record(owner)
    elif name == "transformers.integrations.hub_kernels":
        for attr, gate in (("get_kernel", _gated_get_kernel), ("kernelize", _gated_kernelize),
                           ("load_and_register_attn_kernel", _gated_attn_kernel),
                           ("load_and_register_kernel", _gated_attn_kernel)):  # 4.5x's name
            if hasattr(module, attr) and not patches.patched(module, attr):
                patches.patch(module, attr, gate(getattr(module, attr)), everywhere=True)
        kernels = sys.modules.get("kernels")  # executed before it, when the package is there
        if kernels is not None:
            gate_module(kernels)
    elif name == "kernels":  # transformers' wrappers call the package's own, 4.53 only these
        if hasattr(module, "get_kernel") and not patches.patched(module, "get_kernel"):
            patches.patch(module, "get_kernel", _gated_get_kernel(module.get_kernel),
                          everywhere=True)
        if hasattr(module, "kernelize") and not patches.patched(module, "kernelize"):
            patches.patch(module, "kernelize",
                          _gated_kernelize(module.kernelize, returns_model=True), everywhere=True)


def _record(owner: type) -> None:
    """``owner.from_pretrained`` records its call (``_recording``)."""
    if not patches.patched(owner, "from_pretrained"):
        func = patches.original(owner, "from_pretrained").__func__
        patches.patch(owner, "from_pretrained", classmethod(_recording(func)))
