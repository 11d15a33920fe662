"""Telling transformers about loaded classes, so its Auto classes return exactly them.

transformers only consults its per-process registries (``AutoConfig.register``,
``AutoModel*.register``, ...) and, failing those, executes remote code again. A class
registered by the caller wins over remote code (transformers >= 5.5), so after
registration ``AutoConfig.from_pretrained(model)`` and friends build instances of
codeferry's classes, with no second execution and no ``trust_remote_code`` needed.

One behaviour transformers gives remote models only on its own remote path is kept
here: a causal LM whose class predates the ``GenerationMixin`` split gets the mixin
added (``add_generation_mixin_to_remote_model``), so ``generate()`` works. The mixin
joins the class's own bases, so its module's name, pickling by reference, the Auto
registries and the model's own code all agree on one class.

And the files transformers reads for these classes are the checked ones: a tokenizer
class's ``from_pretrained`` of a loaded model (its folder, or its repo id at the
loaded commit) opens the listed assets it names in ``vocab_files_names``
(``vocab.json``, ``tokenizer.json``...) from this process's private verified copy
(``loader.verified_dir``), not from the model folder. transformers gives an explicit
keyword (``vocab_file=...``) precedence over the file it resolves, so this is a
keyword, not a patch of transformers. A ``vocab.json`` swapped in the folder after
``load(lock=...)`` then has no effect.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .._code.source import locate
from .._runtime import loader as _loader
from .._runtime import pickling as _pickling
from ..errors import CodeferryError
from . import patches
from .saving import install_save_hook, save_as

__all__ = ["register_with_transformers", "serve_verified_files", "with_generation_mixin"]



def _add_mixin() -> Any:
    """transformers' own ``add_generation_mixin_to_remote_model`` (never codeferry's hook)."""
    from transformers.models.auto import auto_factory

    return patches.original(auto_factory, "add_generation_mixin_to_remote_model")


#: ``auto_map`` keys of heads that generate: they get ``generate()`` whatever they define.
GENERATIVE_KEYS = frozenset({"AutoModelForCausalLM", "AutoModelForSeq2SeqLM"})


def _needs_generate(cls: type, generative: bool) -> bool:
    """A generative head that has no ``generate``: transformers adds the mixin only to
    classes that define ``prepare_inputs_for_generation`` or ``generate``, and which
    classes get it changed between releases; many real remote models define neither."""
    if not generative or hasattr(cls, "generate"):
        return False
    return any(k.__name__ == "Module" and k.__module__.startswith("torch.") for k in cls.__mro__)


def with_generation_mixin(
    cls: type, registration: _loader.Registration | None = None, *, generative: bool = False
) -> type:
    """``cls`` with ``GenerationMixin`` where transformers would add it, added in place.

    ``generative`` (a causal or seq2seq LM head) adds the mixin to a class without
    ``generate`` too, so ``generate()`` works on every supported transformers release.
    transformers builds a new subclass on every call (so two models loaded one after the
    other have two classes of one name, and neither pickles by name). Here the mixin joins
    the class's own bases: one class, the module's own, so pickling by reference, the Auto
    registries and the model's own ``super(ItsClass, cls)`` calls all see the same class.
    A class whose bases Python will not extend in place gets transformers' subclass, cached,
    and its module's name is left as the model's code bound it.
    """
    from transformers import GenerationMixin

    mixin: type = GenerationMixin
    if issubclass(cls, mixin):
        return cls
    cached = cls.__dict__.get("__codeferry_mixed__")
    if isinstance(cached, type):
        return cached
    theirs: object = _add_mixin()(cls)  # transformers' answer: a new class when it adds it
    if theirs is cls and not _needs_generate(cls, generative):
        return cls
    try:
        cls.__bases__ = (*cls.__bases__, mixin)
        return cls
    except TypeError:
        pass
    new: type = type(cls.__name__, (cls, mixin), {"__module__": cls.__module__})
    new.__qualname__ = cls.__qualname__
    type.__setattr__(cls, "__codeferry_mixed__", new)
    if registration is None and _pickling.is_ferried(cls):
        registration = _pickling.registration_of(cls)
    if registration is not None:
        _pickling.mark_class(new, registration)
    return new


def hook_auto_factory(auto_factory: Any) -> None:
    """Route transformers' own remote path through ``with_generation_mixin`` too, on the module
    ``auto_factory`` and from its own attributes alone: it is patched right after it executes,
    when transformers' package may still be half imported (idempotent)."""
    if patches.patched(auto_factory, "add_generation_mixin_to_remote_model"):
        return

    def add_generation_mixin_to_remote_model(model_class: type) -> type:
        name = getattr(model_class, "__name__", "")
        return with_generation_mixin(
            model_class, generative=name.endswith(("ForCausalLM", "ForConditionalGeneration")))

    patches.patch(auto_factory, "add_generation_mixin_to_remote_model",
                  add_generation_mixin_to_remote_model)


def _auto_class(key: str) -> Any:
    import transformers

    return getattr(transformers, key, None)


def register_with_transformers(
    classes: Mapping[str, Any], registrations: Mapping[type, _loader.Registration]
) -> dict[str, Any]:
    """Register ``key -> class`` (pairs as tuples) with transformers' Auto classes.

    ``classes`` keys are ``auto_map`` keys; a nested sub-config's ``AutoConfig`` comes as
    ``"<path>:AutoConfig"``. Returns the mapping with classes replaced where a mixin was
    added. Registrations that transformers refuses (a head whose ``config_class`` names
    another config) are skipped: transformers then loads that class its own way.
    """
    out = dict(classes)
    config_cls = classes.get("AutoConfig")
    install_save_hook()
    for key, value in classes.items():
        for cls in value if isinstance(value, tuple) else (value,):
            if isinstance(cls, type):
                save_as(cls, key.rsplit(":", 1)[-1])
        if key == "AutoConfig" or key.endswith(":AutoConfig"):
            model_type = getattr(value, "model_type", "")
            if model_type:
                _auto_class("AutoConfig").register(model_type, value, exist_ok=True)
            continue
        auto = _auto_class(key)
        if auto is None or config_cls is None:
            continue
        try:
            if key == "AutoTokenizer":
                slow, fast = (*tuple(value), None, None)[:2]
                auto.register(config_cls, slow_tokenizer_class=slow, fast_tokenizer_class=fast,
                              exist_ok=True)
            elif key == "AutoImageProcessor":
                auto.register(config_cls, slow_image_processor_class=value, exist_ok=True)
            elif key in ("AutoProcessor", "AutoFeatureExtractor"):
                auto.register(config_cls, value, exist_ok=True)
            elif key == "AutoVideoProcessor":
                auto.register(config_cls, video_processor_class=value, exist_ok=True)
            elif key.startswith("AutoModel") and isinstance(value, type):
                value = with_generation_mixin(value, registrations.get(value),
                                              generative=key in GENERATIVE_KEYS)
                out[key] = value
                auto.register(config_cls, value, exist_ok=True)
        except (ValueError, TypeError) as exc:
            # A degraded mode the caller can see coming: load() still returns the class,
            # but transformers' Auto class will load that one its own way.
            warnings.warn(
                f"codeferry: transformers refused to register {value!r} as {key} of "
                f"{config_cls.__name__} ({exc}); codeferry.load returns it, but "
                f"{key}.from_pretrained will load its code through transformers instead.",
                RuntimeWarning, stacklevel=2)
    return out


# -- the files transformers reads --------------------------------------------------------

_served_lock = threading.Lock()
_served: dict[Path, _loader.Registration] = {}  # model root -> the registration of its own code


def _model_registration(model: Any, kwargs: Mapping[str, Any]) -> _loader.Registration | None:
    """The loaded unit whose model folder ``model`` (a path or a repo id) names, if any."""
    if not isinstance(model, (str, os.PathLike)):
        return None
    try:
        found = locate(model, revision=kwargs.get("revision"), cache_dir=kwargs.get("cache_dir"))
        root = found.root.resolve()  # a repo id and its snapshot's path name one folder
    except (CodeferryError, OSError, ValueError, RuntimeError):
        return None
    with _served_lock:
        return _served.get(root)


def verified_file_kwargs(cls: type, model: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` plus ``<arg>=<verified copy>`` for each listed asset ``cls`` would open."""
    names = getattr(cls, "vocab_files_names", None)
    if not isinstance(names, Mapping) or not names:
        return kwargs
    registration = _model_registration(model, kwargs)
    if registration is None:
        return kwargs
    sub = str(kwargs.get("subfolder") or "").strip("/")
    out = dict(kwargs)
    for arg, name in names.items():
        rel = f"{sub}/{name}" if sub else str(name)
        if out.get(arg) is None and rel in registration.unit.files and not rel.endswith(".py"):
            out[arg] = str(registration.verified_dir() / rel)
    return out


def _serve_class(cls: type) -> None:
    """Wrap ``cls.from_pretrained`` (once) to pass the verified copies of its files."""
    if "__codeferry_serves__" in cls.__dict__ or not isinstance(
        getattr(cls, "vocab_files_names", None), Mapping
    ):
        return
    original = cls.__dict__.get("from_pretrained")
    inherited = getattr(cls, "from_pretrained", None)
    func = getattr(original if original is not None else inherited, "__func__", None)
    if func is None:
        return

    def from_pretrained(klass: type, pretrained_model_name_or_path: Any, *args: Any,
                        **kwargs: Any) -> Any:
        kwargs = verified_file_kwargs(klass, pretrained_model_name_or_path, kwargs)
        return func(klass, pretrained_model_name_or_path, *args, **kwargs)

    from_pretrained.__doc__ = getattr(func, "__doc__", None)
    type.__setattr__(cls, "from_pretrained", classmethod(from_pretrained))
    type.__setattr__(cls, "__codeferry_serves__", True)


def serve_verified_files(classes: Mapping[str, Any], root: Path, registration: _loader.Registration) -> None:
    """Make the tokenizer classes of the model at ``root`` read its assets' checked bytes."""
    with _served_lock:
        _served[root.resolve()] = registration
    for value in classes.values():
        for cls in value if isinstance(value, tuple) else (value,):
            if isinstance(cls, type):
                _serve_class(cls)
