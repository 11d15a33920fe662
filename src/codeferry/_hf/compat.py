"""Names of transformers 4 that transformers 5 removed, served to the remote modules that use them.

Why: most remote code was written for a transformers 4 release and imports or calls names
that transformers 5 removed (``get_head_mask``, ``DynamicCache.from_legacy_cache``,
``is_torch_fx_available``, ``config.max_length``...). Where such a name has one obvious
meaning, the remote module gets it, and nothing else does: transformers' own modules, and
every other module of the process, keep seeing the installed release unchanged.

How, without touching transformers:

* **Imports.** Before a remote module's code runs (``_runtime.loader.on_module_setup``), its
  namespace gets its own ``__builtins__`` whose ``__import__`` answers ``from transformers.x
  import y`` with the real module when it has every name asked for, else with a view of it
  that adds the missing names this module knows (``_code.removed.IMPORTS``). A module
  missing from the installed transformers (``transformers.deepspeed``) is answered the same way.
* **Classes.** After the module ran (``on_module_executed``), each ``PreTrainedModel``
  subclass it defines gets the removed methods it lacks, on that class; each
  ``PretrainedConfig`` subclass gets the removed settings, read as transformers 4 read them:
  the config's own attribute, else config.json's value (which transformers 5 drops while it
  builds the config), else transformers 4's default; a ``DynamicCache`` the model is handed
  by ``generate`` gets the legacy methods through its class, swapped for a subclass that
  only adds them, for that one object.

A name the installed release has is never shimmed (on transformers 4.53 nothing here applies
but the names 4.53 lacks as well). The static report of the same table is
``_code.removed``: ``inspect`` and ``doctor`` say which names a model uses and what it gets.
"""

from __future__ import annotations

import builtins
import functools
import importlib
import inspect
import re
import threading
import types
from collections.abc import Callable
from typing import Any

from .._code.removed import CONFIG_DEFAULTS, IMPORTS, written_for_4
from .._runtime import loader as _loader
from .legacy import METHODS, OBJECTS, legacy_dynamic_cache

__all__ = ["shimmed_imports", "shim_classes", "setup_module"]

_MARK = "__codeferry_compat__"


assert {key for key, entry in IMPORTS.items() if entry.shim} == set(OBJECTS)


def _lacks(module: Any, name: str) -> bool:
    if name == "DynamicCache":  # present, but without the legacy methods the code calls
        found = getattr(module, name, None)
        return found is not None and not hasattr(found, "from_legacy_cache")
    return not hasattr(module, name)


class _View(types.ModuleType):
    """A transformers module as one remote module sees it: the real one plus its shims."""

    def __init__(self, real: types.ModuleType | None, name: str, shims: dict[str, Any]) -> None:
        super().__init__(name)
        object.__setattr__(self, "_real", real)
        self.__dict__.update(shims)

    def __getattr__(self, name: str) -> Any:
        real = object.__getattribute__(self, "_real")
        if real is None:
            raise AttributeError(name)
        return getattr(real, name)


def shimmed_imports(module_name: str, names: tuple[str, ...]) -> dict[str, Any] | None:
    """The shims ``from module_name import names`` needs on the installed release; ``None``
    when the import works as it is (or no shim covers what it lacks)."""
    wanted = [n for n in names if (module_name, n) in OBJECTS]
    if not wanted:
        return None
    try:
        real: Any = importlib.import_module(module_name)
    except ImportError:
        real = None
    shims = {n: OBJECTS[(module_name, n)]() for n in wanted if real is None or _lacks(real, n)}
    return shims or None


def _importer(real_import: Callable[..., Any], used: set[str]) -> Callable[..., Any]:
    def __import__(name: str, globals: Any = None, locals: Any = None,
                   fromlist: Any = (), level: int = 0) -> Any:
        if level or not fromlist or not name.startswith("transformers"):
            return real_import(name, globals, locals, fromlist, level)
        try:
            found = real_import(name, globals, locals, fromlist, level)
        except ImportError:
            shims = shimmed_imports(name, tuple(fromlist))
            if shims is None:
                raise
            used.update(f"{name}.{n}" for n in shims)
            return _View(None, name, shims)
        shims = shimmed_imports(name, tuple(fromlist))
        if shims is None:
            return found
        used.update(f"{name}.{n}" for n in shims)
        return _View(found, name, shims)

    return __import__


def setup_module(module: types.ModuleType, source: bytes) -> None:
    """Give a remote module about to run an ``__import__`` that serves removed names.

    Only modules whose source names transformers get it (the others keep the shared
    builtins), and the shims themselves are made at the import that needs them."""
    if b"transformers" not in source:
        return
    used: set[str] = set()
    namespace = dict(vars(builtins))
    namespace["__import__"] = _importer(builtins.__import__, used)
    module.__dict__["__builtins__"] = namespace
    module.__dict__[_MARK] = used


# -- classes: methods and defaults on the remote classes themselves ----------------------------

class _TiedKeys:
    """``all_tied_weights_keys`` for a model whose ``__init__`` never calls ``post_init``
    (which sets it on transformers 5): computed on first read, then kept on the instance."""

    def __get__(self, instance: Any, owner: type) -> Any:
        if instance is None:
            return self
        keys = instance.get_expanded_tied_weights_keys(all_submodels=True)
        instance.__dict__["all_tied_weights_keys"] = keys
        return keys




class _TiedList:
    """transformers 4's list of the parameters tied to the input embeddings, as transformers 5
    reads the class attribute from a model: ``{target: source}``. Read from the class, it is
    the list the code wrote."""

    def __init__(self, keys: list[str] | tuple[str, ...]) -> None:
        self.keys = list(keys)

    def __get__(self, instance: Any, owner: type) -> Any:
        if instance is None:
            return self.keys
        try:
            embeddings = instance.get_input_embeddings()
        except (NotImplementedError, AttributeError):
            return {}
        source = next((f"{name}.weight" for name, module in instance.named_modules()
                       if module is embeddings), None)
        return {key: source for key in self.keys} if source else {}


def _without_none_mask(update: Callable[..., Any]) -> Callable[..., Any]:
    """transformers 5's ``generate`` keeps ``attention_mask: None`` where 4 kept the mask of
    ones, and ``position_ids: None`` where 4 had no key (``_positions_as_written_for``); code
    that extends ``model_kwargs["attention_mask"]`` or ``["position_ids"]`` when the key is
    there gets no key, as it would for a model called without them."""

    @functools.wraps(update)
    def _update_model_kwargs_for_generation(self: Any, outputs: Any, model_kwargs: Any,
                                            *args: Any, **kwargs: Any) -> Any:
        if any(model_kwargs.get(key, 0) is None for key in _NONE_KEYS):
            model_kwargs = {k: v for k, v in model_kwargs.items()
                            if not (k in _NONE_KEYS and v is None)}
        return update(self, outputs, model_kwargs, *args, **kwargs)

    _update_model_kwargs_for_generation.__codeferry_compat__ = True  # type: ignore[attr-defined]
    return _update_model_kwargs_for_generation


_PAIR = re.compile(r"\w+\s*,\s*\w+\s*=\s*self\._extract_past_from_model_output\(")
_PAST_NAMES = ("past_key_values", "mems", "past_buckets_states", "cache_params")


def _past_extractor(cls: type) -> Callable[..., Any] | None:
    """transformers 4's ``_extract_past_from_model_output`` for a class whose own code calls
    it (ChatGLM2/3's ``_update_model_kwargs_for_generation``), where the installed release
    lacks it. It returned the cache up to 4.41 and ``(name, cache)`` from 4.42 on: the shape
    is the one the class's code unpacks."""
    if hasattr(cls, "_extract_past_from_model_output"):
        return None
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return None
    if "._extract_past_from_model_output(" not in source:
        return None
    pair = _PAIR.search(source) is not None

    def _extract_past_from_model_output(self: Any, outputs: Any,
                                        standardize_cache_format: bool = False) -> Any:
        name = next((n for n in _PAST_NAMES if getattr(outputs, n, None) is not None),
                    "past_key_values")
        past = getattr(outputs, name, None)
        return (name, past) if pair else past

    return _extract_past_from_model_output


_NONE_KEYS = ("attention_mask", "position_ids")


def _positions_as_written_for(made: Callable[..., Any]) -> Callable[..., Any]:
    """``_prepare_position_ids_for_generation`` for a class with its own
    ``prepare_inputs_for_generation``: none made for a model whose config transformers 4
    wrote, as its ``generate`` made none, and such code computes them when none are given
    (ChatGLM-6B's 2-D positions from its mask tokens; StableLM's from the mask, the last one
    once a cache exists). transformers 5 makes every position before the first step and
    hands them in, which that code takes as given. A config written by 5: ``made``. Not for
    a ``prepare_inputs_for_generation`` that calls transformers' own (``_defers``): since 5,
    that one takes the positions ``generate`` made, and makes none itself."""

    @functools.wraps(made)
    def _prepare_position_ids_for_generation(self: Any, inputs_tensor: Any,
                                             model_kwargs: Any) -> Any:
        if written_for_4(getattr(self.config, "transformers_version", None)):
            return None
        return made(self, inputs_tensor, model_kwargs)

    setattr(_prepare_position_ids_for_generation, _MARK, True)
    return _prepare_position_ids_for_generation


def _no_default_cache(cls: type) -> bool:
    """transformers 4's answer for a class that does not declare it takes Cache objects: no
    ``DynamicCache`` made by ``generate``; the code's own tuples of tensors instead."""
    return False


_build_lock = threading.Lock()


def _keeping_buffers(moved: Callable[..., Any]) -> Callable[..., Any]:
    """transformers 5 builds a model on the meta device and then gives its non-persistent
    buffers (a rotary embedding's ``inv_freq``, computed in ``__init__``) empty memory,
    which only its own models' ``_init_weights`` fill; remote code's never does, and
    generates from garbage. This fills them with what the model's ``__init__`` computes."""

    @functools.wraps(moved)
    def _move_missing_keys_from_meta_to_device(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = moved(self, *args, **kwargs)
        # transformers' own modules (its rotary embeddings) are filled by its own init; only
        # the remote code's modules need the build below
        names = [name for name, _ in self.named_non_persistent_buffers()
                 if not type(self.get_submodule(name.rpartition(".")[0])).__module__
                 .startswith("transformers.")]
        if names:
            try:
                fresh = dict(_buffers_of_fresh(type(self), self.config))
            except Exception:  # noqa: BLE001 - a class built otherwise: left as transformers left it
                return result
            for name in names:
                value = fresh.get(name)
                owner, _, leaf = name.rpartition(".")
                module = self.get_submodule(owner) if owner else self
                current = module._buffers.get(leaf)
                if value is None or current is None or value.device.type == "meta":
                    continue
                module._buffers[leaf] = value.to(device=current.device, dtype=current.dtype)
        return result

    _move_missing_keys_from_meta_to_device.__codeferry_compat__ = True  # type: ignore[attr-defined]
    return _move_missing_keys_from_meta_to_device


def _buffers_of_fresh(cls: type, config: Any) -> Any:
    """The buffers of ``cls(config)`` built with its parameters on the meta device (no
    parameter memory), its buffers where ``__init__`` computes them."""
    import torch

    register = torch.nn.Module.register_parameter

    def on_meta(module: Any, name: str, param: Any) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = torch.nn.Parameter(param.to("meta"),
                                                          requires_grad=param.requires_grad)

    with _build_lock, torch.device("cpu"):
        setattr(torch.nn.Module, "register_parameter", on_meta)  # noqa: B010
        try:
            fresh = cls(config)
        finally:
            setattr(torch.nn.Module, "register_parameter", register)  # noqa: B010
    return fresh.named_buffers()


#: Keywords transformers 5's ``generate`` passes ``prepare_inputs_for_generation`` that
#: transformers 4's did not: code written for 4 that reads ``kwargs.get("position_ids")`` gets
#: the whole sequence's positions (the slicing it does is for positions it made itself).
_GENERATE_5_KWARGS = frozenset({"position_ids", "next_sequence_length", "is_first_iteration"})


def _with_legacy_cache(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` (or ``prepare_inputs_for_generation``) that hands the model's own code
    the cache ``generate`` made with the legacy methods."""

    named = set(inspect.signature(forward).parameters)
    unknown = () if forward.__name__ == "forward" else tuple(_GENERATE_5_KWARGS - named)

    @functools.wraps(forward)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        for name in unknown:  # what generate passes since transformers 5, where 4 did not
            kwargs.pop(name, None)
        cache = kwargs.get("past_key_values")
        legacy = legacy_dynamic_cache()
        if cache is not None and type(cache) is legacy.__mro__[1]:
            cache.__class__ = legacy  # this object only: the subclass adds methods, no state
        return forward(self, *args, **kwargs)

    wrapper.__codeferry_compat__ = True  # type: ignore[attr-defined]
    return wrapper


def shim_classes(module: types.ModuleType, registration: Any = None) -> None:
    """Add the removed methods and defaults to the remote classes ``module`` defines (the
    names added, as ``Class.name``, join the module's record of what it was served)."""
    used = module.__dict__.get(_MARK)
    if used is None:
        return
    try:
        from transformers import PretrainedConfig, PreTrainedModel
    except ImportError:
        return
    added: list[str] = []
    legacy_cache = any(name.endswith(".DynamicCache") for name in used)
    for value in list(vars(module).values()):
        if not isinstance(value, type) or value.__module__ != module.__name__:
            continue
        if issubclass(value, PreTrainedModel):
            for name, method in METHODS.items():
                if not hasattr(value, name):
                    setattr(value, name, method)
                    added.append(f"{value.__name__}.{name}")
            if not hasattr(value, "all_tied_weights_keys"):
                setattr(value, "all_tied_weights_keys", _TiedKeys())  # noqa: B010
                added.append(f"{value.__name__}.all_tied_weights_keys")
            if (not hasattr(PreTrainedModel, "_supports_cache_class")
                    and not getattr(value, "_supports_cache_class", False)
                    and "_supports_default_dynamic_cache" not in vars(value)
                    and not _transformers_model(value, "forward")):
                # code that predates Cache objects takes tuples: generate must not make one
                setattr(value, "_supports_default_dynamic_cache",  # noqa: B010
                        classmethod(_no_default_cache))
                added.append(f"{value.__name__}._supports_default_dynamic_cache")
            tied = vars(value).get("_tied_weights_keys")
            if (isinstance(tied, (list, tuple))
                    and hasattr(PreTrainedModel, "get_expanded_tied_weights_keys")):
                setattr(value, "_tied_weights_keys", _TiedList(tied))  # noqa: B010
                added.append(f"{value.__name__}._tied_weights_keys")
            made, prepare = _made_positions(), vars(value).get("prepare_inputs_for_generation")
            if (made is not None and callable(prepare) and not _defers(prepare)
                    and "_prepare_position_ids_for_generation" not in vars(value)):
                setattr(value, "_prepare_position_ids_for_generation",  # noqa: B010
                        _positions_as_written_for(made))
                added.append(f"{value.__name__}._prepare_position_ids_for_generation")
            update = vars(value).get("_update_model_kwargs_for_generation")
            if callable(update) and not hasattr(update, _MARK):
                setattr(value, "_update_model_kwargs_for_generation",  # noqa: B010
                        _without_none_mask(update))
                added.append(f"{value.__name__}._update_model_kwargs_for_generation")
            extract = _past_extractor(value)
            if extract is not None:
                setattr(value, "_extract_past_from_model_output", extract)  # noqa: B010
                added.append(f"{value.__name__}._extract_past_from_model_output")
            moved = getattr(value, "_move_missing_keys_from_meta_to_device", None)
            if moved is not None and not hasattr(moved, _MARK):
                setattr(value, "_move_missing_keys_from_meta_to_device",  # noqa: B010
                        _keeping_buffers(moved))
                added.append(f"{value.__name__}._move_missing_keys_from_meta_to_device")
            for name in ("forward", "prepare_inputs_for_generation") if legacy_cache else ():
                method = vars(value).get(name)
                if callable(method) and not hasattr(method, _MARK):
                    setattr(value, name, _with_legacy_cache(method))
                    added.append(f"{value.__name__}.{name}")
        elif issubclass(value, PretrainedConfig):
            probe = _probe_config(PretrainedConfig)
            defaults = [name for name in CONFIG_DEFAULTS
                        if not hasattr(probe, name) and name not in vars(value)]
            for name in defaults:
                setattr(value, name, _Setting(name, CONFIG_DEFAULTS[name]))
                added.append(f"{value.__name__}.{name}")
            if defaults and not hasattr(value.__init__, _MARK):
                setattr(value, "__init__", _keeping_given(value.__init__, frozenset(defaults)))  # noqa: B010
                setattr(value, "to_dict", _with_given(value.to_dict))  # noqa: B010
            if defaults and hasattr(value, "_get_generation_parameters"):
                setattr(value, "_get_generation_parameters",  # noqa: B010
                        _own_generation_parameters(value._get_generation_parameters,
                                                   frozenset(defaults)))
    used.update(added)


def _made_positions() -> Callable[..., Any] | None:
    """How the installed ``generate`` makes position ids itself (transformers 5), or None."""
    try:
        from transformers import GenerationMixin
    except ImportError:
        return None
    made: Callable[..., Any] | None = getattr(
        GenerationMixin, "_prepare_position_ids_for_generation", None)
    return made


def _defers(prepare: Callable[..., Any]) -> bool:
    """Whether a class's own ``prepare_inputs_for_generation`` calls another one (``super()``'s,
    transformers' own), or its source cannot be read (then it is left as installed)."""
    try:
        return ".prepare_inputs_for_generation(" in inspect.getsource(prepare)
    except (OSError, TypeError):
        return True


def _transformers_model(cls: type, name: str) -> bool:
    """Whether ``cls`` takes ``name`` from one of transformers' own models (a remote class
    that subclasses ``LlamaForCausalLM``): code the installed release wrote, which takes the
    caches its ``generate`` makes, so transformers 4's way must not replace it."""
    found = getattr(cls, name, None)
    return str(getattr(found, "__module__", "")).startswith("transformers.models.")


#: Where a config keeps the removed settings its file gave (``{"max_length": 64}``).
_GIVEN = "_codeferry_given"


class _Setting:
    """A setting transformers 4 kept on every config (``config.max_length``), read as it did:
    the value config.json gave, else transformers 4's default. An attribute the config sets
    itself is the instance's and wins (this descriptor only answers when there is none)."""

    def __init__(self, name: str, default: object) -> None:
        self.name, self.default = name, default

    def __get__(self, instance: Any, owner: type) -> Any:
        if instance is None:
            return self.default
        return instance.__dict__.get(_GIVEN, {}).get(self.name, self.default)


def _keeping_given(init: Callable[..., None], names: frozenset[str]) -> Callable[..., None]:
    """The config's ``__init__``, keeping the removed settings its file gave: transformers 5's
    own ``__init__`` drops them from the keywords, and code such as ChatGLM's sizes its model
    by ``config.max_length``."""

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        given = {name: kwargs[name] for name in names if name in kwargs}
        init(self, *args, **kwargs)
        if given:
            self.__dict__.setdefault(_GIVEN, {}).update(given)

    setattr(__init__, _MARK, True)
    return __init__


def _with_given(to_dict: Callable[[Any], dict[str, Any]]) -> Callable[[Any], dict[str, Any]]:
    """``to_dict`` with the file's removed settings under their own names, as transformers 4
    saved them (and built the generation config from them), not under the private record."""

    @functools.wraps(to_dict)
    def with_given(self: Any) -> dict[str, Any]:
        out = to_dict(self)
        given = out.pop(_GIVEN, None) or {}
        out.update({name: value for name, value in given.items() if name not in out})
        return out

    return with_given


def _own_generation_parameters(found: Callable[[Any], dict[str, Any]],
                               defaults: frozenset[str]) -> Callable[[Any], dict[str, Any]]:
    """transformers 5 refuses to generate with a config that sets generation parameters; the
    class defaults given here are not the config's own settings, so they are left out."""

    def _get_generation_parameters(self: Any) -> dict[str, Any]:
        params = found(self)
        return {k: v for k, v in params.items() if k not in defaults or k in vars(self)}

    return _get_generation_parameters


@functools.cache
def _probe_config(config_class: type) -> Any:
    """A plain ``PretrainedConfig``: the attributes every config has on the installed release."""
    return config_class()


_loader.on_module_setup.append(setup_module)
_loader.on_module_executed.append(shim_classes)
