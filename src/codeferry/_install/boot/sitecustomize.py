"""codeferry's boot: the ``sitecustomize`` of processes started by ``codeferry exec``.

Python imports the first ``sitecustomize`` on its path when it starts (the ``site`` module;
not under ``python -S`` or ``-I``, and ``-E`` ignores ``PYTHONPATH``). ``codeferry exec``
puts this file's folder first on ``PYTHONPATH``, so this one is found. It

1. reads ``CODEFERRY_INSTALL`` through codeferry's settings module, loaded from its file
   alone (the package would cost every process its imports); off: nothing more happens
   here but step 3, unless ``CODEFERRY_LOCK`` is set while ``CODEFERRY_INSTALL`` is set off
   (``_settings.lock_switched_off``): then importing ``transformers.dynamic_module_utils``
   raises ``PluginDisabledUnderLockError``, as the vLLM plugin refuses the same state;
2. on: puts a finder (``codeferry/_install/watch.py``, also loaded from its file alone) on
   ``sys.meta_path`` that reacts to a few modules only: right after
   ``transformers.dynamic_module_utils`` executes, codeferry is imported and routes it
   (``codeferry._install.switch.route``, what ``install()`` does); right after each module
   whose own attributes the Hub kernel gates and the ``generate()`` hook patch executes,
   codeferry patches it (``switch.completed``), so a native model's ``from_pretrained`` is
   gated too, though it never asks for a remote class;
3. runs the ``sitecustomize`` this folder hides (the next one on the path, such as a
   user's or the distribution's), which then stands as ``sitecustomize`` in
   ``sys.modules``, as it would without codeferry.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys

TYPE_CHECKING = False  # not typing's: every process imports this file, typing costs it
if TYPE_CHECKING:
    from types import ModuleType

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROUTE = "transformers.dynamic_module_utils"
#: The modules handed to codeferry once each has executed: ``_ROUTE`` first (it executes
#: before any of the others can), then those whose own attributes the Hub kernel gates and
#: the ``generate()`` hook patch (``codeferry._install.switch.WATCHED``; kept equal by
#: ``tests/install/test_exec.py``, since importing codeferry here would cost every process).
_WATCHED = frozenset({
    _ROUTE, "transformers.models.auto.auto_factory", "transformers.generation.utils",
    "transformers.modeling_utils", "transformers.models.auto.modeling_auto",
    "transformers.integrations.hub_kernels", "kernels",
})


def _own(name: str, *parts: str) -> ModuleType:
    """codeferry's file ``parts`` (from the package folder), executed alone under a name of its
    own, in ``sys.modules`` only while it executes (dataclasses looks there): importing the
    package would cost every process its imports."""
    path = os.path.join(os.path.dirname(os.path.dirname(_HERE)), *parts)
    loader = importlib.machinery.SourceFileLoader(name, path)
    module = type(sys)(name)
    module.__file__ = path
    sys.modules[name] = module
    try:
        loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


def _refuse(module: ModuleType) -> None:
    """A lock in the environment, and codeferry switched off in this process
    (``_settings.lock_switched_off``, the vLLM plugin's rule too): importing transformers'
    remote-code loader fails, typed, so nothing runs unlocked. Other processes are untouched."""
    if module.__name__ != _ROUTE:
        return
    lock, switched = _REFUSAL
    switch = switched.partition("=")[0]
    message = (f"CODEFERRY_LOCK={lock} asks every process to run only locked code, but "
               f"{switched} switches codeferry off in this one, which refuses to load remote "
               "code rather than run unchecked code.")
    fix = (f"unset {switch} (or set it to 1: the lock is then enforced), or unset "
           "CODEFERRY_LOCK to run without a lock.")
    try:
        from codeferry.errors import PluginDisabledUnderLockError
    except ImportError:  # as _route: no codeferry here, and still nothing runs unlocked
        raise ImportError(f"{message} Fix: {fix}") from None
    raise PluginDisabledUnderLockError(message, path=lock, switch=switch, fix=fix)


def _route(module: ModuleType) -> None:
    try:
        from codeferry._install.switch import completed, route
    except ImportError as exc:
        raise ImportError(
            f"CODEFERRY_INSTALL is on and codeferry's boot folder ({_HERE}) is on PYTHONPATH, "
            f"but this interpreter ({sys.executable}) cannot import codeferry: install "
            "codeferry here, or take the folder off PYTHONPATH (and unset CODEFERRY_INSTALL)"
        ) from exc
    if module.__name__ == _ROUTE:
        route(module)
    else:
        completed(module)


def _chain() -> None:
    """Run the ``sitecustomize`` that Python would have run without this folder."""
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    from importlib.util import module_from_spec

    mine = sys.modules.get(__name__)
    module = module_from_spec(spec)
    sys.modules["sitecustomize"] = module  # what `import sitecustomize` gives from now on
    try:
        spec.loader.exec_module(module)
    except BaseException:
        if mine is not None:
            sys.modules["sitecustomize"] = mine
        raise


_SETTINGS = _own("_codeferry_boot_settings", "_settings.py")  # CODEFERRY_INSTALL, CODEFERRY_LOCK
if _SETTINGS.sandbox_switch():  # boxed by `codeferry exec --sandbox`: refusals told, typed
    _own("_codeferry_boot_report", "_sandbox", "report.py").watch()
if _SETTINGS.install_switch():
    _watch = _own("_codeferry_boot_watch", "_install", "watch.py")
    if not _watch.watching(_WATCHED):
        sys.meta_path.insert(0, _watch.Watch(_WATCHED, _route))
elif _SETTINGS.lock_switched_off() is not None:
    _REFUSAL = (_SETTINGS.lock_file(), _SETTINGS.lock_switched_off())
    _watch = _own("_codeferry_boot_watch", "_install", "watch.py")
    sys.meta_path.insert(0, _watch.Watch(frozenset({_ROUTE}), _refuse))
_chain()
