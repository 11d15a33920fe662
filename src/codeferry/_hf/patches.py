"""Every change codeferry makes to transformers' namespaces, in one registry.

codeferry answers transformers at six places: ``get_class_from_dynamic_module`` and
``get_class_in_module`` (remote classes, ``install()``; the second is also the gate every
door ends in, ``_install.lock_gate``), ``GenerationMixin.load_custom_generate`` (the
``custom_generate`` door), ``custom_object_save`` (saving a loaded model's code),
``add_generation_mixin_to_remote_model`` (``generate()`` on old remote heads) and
``AutoConfig.from_pretrained`` (one ``model_type``, many models); and the gates of
``_install.kernel_gates`` (Hub kernels: ``get_kernel``, ``load_and_register_attn_kernel``,
``kernelize``, and the models' ``from_pretrained`` that records the caller). Each patch is
made here, with its original recorded, so that:

* a patch is made once per process however often it is asked for (``patch`` is idempotent);
* ``uninstall()`` gives every original back (``restore_all``), and a later ``load`` or
  ``install()`` patches again from a clean state;
* no module keeps an original of its own, so none can restore the wrong one.

transformers' Auto classes (and vLLM, pipelines) bind functions of
``dynamic_module_utils`` by name at their import: a patch made with ``everywhere=True`` also
replaces the original wherever an imported module bound it, and ``restore`` undoes that too.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from typing import Any

__all__ = ["original", "patch", "patched", "rebind", "registered", "restore", "restore_all"]

_lock = threading.RLock()


@dataclass(frozen=True)
class _Patch:
    owner: Any
    name: str
    original: Any  # as found in the owner's namespace (a classmethod object stays one)
    new: Any
    rebound: bool


_patches: dict[tuple[int, str], _Patch] = {}


def _current(owner: Any, name: str) -> Any:
    """``owner.name`` as its namespace holds it (no descriptor unwrapped)."""
    namespace = vars(owner)
    return namespace[name] if name in namespace else getattr(owner, name)


def patch(owner: Any, name: str, new: Any, *, everywhere: bool = False) -> Any:
    """Set ``owner.name`` to ``new`` unless codeferry already did; the original is returned.

    ``everywhere``: modules that bound the original by name get ``new`` too.
    """
    with _lock:
        found = _patches.get((id(owner), name))
        if found is not None:
            return found.original
        old = _current(owner, name)
        setattr(owner, name, new)
        if everywhere:
            rebind(name, old, new)
        _patches[(id(owner), name)] = _Patch(owner, name, old, new, everywhere)
        return old


def patched(owner: Any, name: str) -> bool:
    with _lock:
        return (id(owner), name) in _patches


def registered() -> list[tuple[Any, str, Any]]:
    """``(owner, name, new)`` of every patch in force, oldest first."""
    with _lock:
        return [(p.owner, p.name, p.new) for p in _patches.values()]


def original(owner: Any, name: str) -> Any:
    """What ``owner.name`` was before codeferry patched it (itself when unpatched)."""
    with _lock:
        found = _patches.get((id(owner), name))
    return found.original if found is not None else _current(owner, name)


def restore(owner: Any, name: str) -> None:
    """Give ``owner.name`` its original back (nothing when it is not patched)."""
    with _lock:
        found = _patches.pop((id(owner), name), None)
        if found is None:
            return
        setattr(owner, name, found.original)
        if found.rebound:
            rebind(name, found.new, found.original)


def restore_all() -> None:
    """Every original back, newest patch first."""
    with _lock:
        for owner, name in [(p.owner, p.name) for p in reversed(list(_patches.values()))]:
            restore(owner, name)


def rebind(name: str, old: Any, new: Any) -> None:
    """Replace global ``name`` where it is ``old``, in every module imported so far.

    Reads each module's ``__dict__`` directly: some modules (torch's class namespaces)
    answer any attribute through a ``__getattr__`` that raises.
    """
    for module in list(sys.modules.values()):
        try:
            namespace = vars(module)
        except TypeError:  # no __dict__
            continue
        if namespace.get(name) is old:
            setattr(module, name, new)
