"""``codeferry.install()``: the same travel guarantees for code that plain transformers loaded.

Inference engines are written against transformers: they call
``AutoConfig.from_pretrained(..., trust_remote_code=True)`` and send the config to their
workers. ``install()`` adopts what transformers loads, so those objects carry their
code like codeferry's own, with no other change to the program.

transformers keeps remote code in its module cache, one folder per model and version::

    $HF_MODULES_CACHE/transformers_modules/<model>/<hash or commit>/configuration_x.py

and executes it as ``transformers_modules.<model>.<hash>.configuration_x``. Adopting
reads that folder's files into a unit (hashed like any other), registers the unit under
the *same* package name without executing anything again, and marks the classes the
modules define. A receiver then registers the unit under that name too, so the class
names in the pickle resolve there to exactly one class each. The hook is a wrapper
around ``get_class_in_module``, the one function every remote class passes through
(``get_class_from_dynamic_module`` and every Auto class call it).
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Any

from . import _loader, _pickling, _policy, _transformers
from ._store import UnitData, unit_digest

__all__ = ["install", "adopt_module"]

_PREFIX = "transformers_modules."
_lock = threading.Lock()
_installed = False


def _unit_files(folder: Path) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    for dirpath, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
        for name in names:
            if name.endswith((".pyc", ".lock")):
                continue
            path = Path(dirpath) / name
            files[path.relative_to(folder).as_posix()] = path.read_bytes()
    return files


def adopt_module(module: Any) -> None:
    """Adopt the unit that holds transformers-loaded ``module``, and mark its classes."""
    name = getattr(module, "__name__", "")
    file = getattr(module, "__file__", None)
    if not name.startswith(_PREFIX) or not file or "." not in name:
        return
    package = name.rsplit(".", 1)[0]
    folder = Path(file).parent
    files = _unit_files(folder)
    packages = frozenset(
        p.rsplit("/", 1)[0].replace("/", ".") for p in files if p.endswith("/__init__.py")
    )
    unit = UnitData(unit_digest(files), files, (), packages, package)
    # transformers ran this code because the caller passed trust_remote_code=True:
    # that decision is this process's trust in exactly these bytes.
    _policy.allow({unit.digest}, from_lock=False)
    with _lock:
        runtime = _loader.register(unit, package)
        for mod_name, mod in list(sys.modules.items()):
            if mod is not None and (mod_name == package or mod_name.startswith(package + ".")):
                _pickling.mark_module(mod, runtime)


def install() -> None:
    """Make classes that transformers loads with ``trust_remote_code=True`` travel.

    Idempotent. Adopts the remote modules already loaded, and every one loaded later.
    """
    global _installed
    import transformers.dynamic_module_utils as dmu

    with _lock:
        if not _installed:
            original = dmu.get_class_in_module

            def get_class_in_module(class_name: str, module_path: Any, **kwargs: Any) -> Any:
                cls = original(class_name, module_path, **kwargs)
                module = sys.modules.get(getattr(cls, "__module__", ""))
                if module is not None:
                    adopt_module(module)
                return cls

            dmu.get_class_in_module = get_class_in_module
            _transformers.install_generation_mixin_hook()
            _installed = True
    for mod in list(sys.modules.values()):
        if mod is not None and getattr(mod, "__name__", "").startswith(_PREFIX):
            adopt_module(mod)
