"""``codeferry.install()``: codeferry under code written for plain transformers.

Inference engines are written against transformers: they call
``AutoConfig.from_pretrained(..., trust_remote_code=True)`` and send the config to their
workers. After ``install()`` every remote class transformers asks for goes through
codeferry: ``get_class_from_dynamic_module`` (which every Auto class, pipelines and other
libraries call) is answered by codeferry's resolver and loader for any model it can
locate (a folder, or a repo in the local hub cache, matched on model *and* revision),
so sub-package helpers, ``from . import x``, config-first order, one class identity,
per-class loading and travel all hold. transformers keeps deciding *whether* code runs:
it calls that function only after its own ``trust_remote_code`` check. ``uninstall()``
restores transformers' own functions.

``codeferry.load`` installs a narrower form of the same hook: it answers only for the
models this process loaded, so a later ``from_pretrained(..., trust_remote_code=True)``
of such a model returns codeferry's classes instead of executing the code a second time.

``install_for_engine`` is ``install`` for engines that call transformers in processes of
their own and swallow its exceptions (vLLM, through ``codeferry._install.vllm``): it logs why a
class cannot load, and can bind every answer to a lock.

What codeferry cannot locate (a repo that is not downloaded yet) is left to transformers,
and what transformers then loads is *adopted*:

transformers keeps remote code in its module cache, one folder per model and version::

    $HF_MODULES_CACHE/transformers_modules/<model>/<hash or commit>/configuration_x.py

and executes it as ``transformers_modules.<model>.<hash>.configuration_x``. Adopting
reads that folder's files into a unit (hashed like any other), registers the unit under
the *same* package name without executing anything again, and marks the classes the
modules define. A receiver then registers the unit under that name too, so the class
names in the pickle resolve there to exactly one class each. The hook is a wrapper
around ``get_class_in_module``, the one function every remote class passes through
(``get_class_from_dynamic_module`` and every Auto class call it). The same wrapper is the
gate of every door (``lock_gate``): under a lock it executes nothing the lock does not list.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import _load
from .._code.digest import unit_digest
from .._code.resolve import read_class_refs, resolve
from .._code.source import locate
from .._code.unit import Unit
from .._hf import patches
from .._hf.classes import hook_auto_factory
from .._runtime import loader as _loader
from .._runtime import pickling as _pickling
from .._trust.decide import locked_files, transformers_ran
from .._trust.policy import locked
from ..errors import CodeferryError, LockMismatchError, ModelNotFoundError
from . import kernel_gates, lock_gate, watch

if TYPE_CHECKING:
    from .._code.lockfile import Lock

__all__ = ["install", "uninstall", "adopt_module", "answer_for_loaded", "install_for_engine",
           "install_while_importing", "module_completed", "on_load"]

logger = logging.getLogger(__name__)

_PREFIX = "transformers_modules."
_lock = threading.RLock()
_installed = False  # install(): answer for every model codeferry can locate
# install_for_engine(): the lock every answer must match (None: transformers' trust decides),
# and whether a failed answer is logged at error level (engines swallow the exception).
_engine_lock: Lock | None = None
_error_log: logging.Logger | None = None
_logged: set[tuple[str, str]] = set()  # (reference, error): said once per process
_loaded_roots: set[str] = set()  # load(): answer for these model folders only
_watching = False  # install() or load(): the modules of WATCHED get their patches
_watcher: watch.Watch | None = None  # the finder install() put on sys.meta_path
_generation_pending = False  # a module of WATCHED was executing: patched at the first class


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
    if os.path.basename(file) == "__init__.py":
        return  # a package transformers made to hold model folders, not a model's module
    package = name.rsplit(".", 1)[0]
    if package.count(".") < 1:
        return  # directly under transformers_modules: no model folder of its own
    folder = Path(file).parent
    files = _unit_files(folder)
    packages = frozenset(
        p.rsplit("/", 1)[0].replace("/", ".") for p in files if p.endswith("/__init__.py")
    )
    unit = Unit(unit_digest(files), files, (), packages, package)
    transformers_ran(unit.digest)
    with _lock:
        registration = _loader.register(unit, package)
        for mod_name, mod in list(sys.modules.items()):
            if mod is not None and (mod_name == package or mod_name.startswith(package + ".")):
                _pickling.mark_module(mod, registration)


def _split_reference(reference: str) -> tuple[str | None, str, str] | None:
    """``[repo--]module.Class`` as (repo, module, class); ``None`` for another shape."""
    repo: str | None = None
    if "--" in reference:
        repo, reference = reference.split("--", 1)
    module, _, name = reference.rpartition(".")
    if not module or not name:
        return None
    return repo, module, name


def _answer(
    reference: str, model: Any, revision: str | None, cache_dir: Any
) -> type | None:
    """codeferry's class for ``reference`` of ``model`` at ``revision``, or ``None`` to pass."""

    parts = _split_reference(reference)
    if parts is None:
        return None
    try:
        origin = locate(model, revision=revision, cache_dir=cache_dir)
    except (ModelNotFoundError, OSError, ValueError):
        return None  # not on this machine yet: transformers downloads it (and we adopt)
    with _lock:
        if not _installed and str(origin.root) not in _loaded_roots:
            return None
    repo, module, name = parts
    key = None
    for ref in read_class_refs(origin):
        if (ref.repo, ref.module, ref.name) == (repo, module, name):
            key = _load.class_key(ref.declared_in, ref.key)
            break
    if key is None:
        return None  # not a class this model's auto_map names: transformers' business
    # transformers asked only after its own trust check passed: that is the decision
    # (an engine's lock narrows it to exactly the locked code, and so does a lock this
    # process used in ``load``: a library's hard-coded trust_remote_code=True is no decision).
    used = locked_files() if _engine_lock is None else None
    if used is not None:
        lock_gate.check_bundle(resolve(origin.root if origin.repo_id is None else model,
                                   revision=revision, cache_dir=cache_dir, requirements=False),
                           used, where=None)
    classes = _load.load(origin.root if origin.repo_id is None else model,
                        trust_remote_code=True, revision=revision, classes=[key],
                        cache_dir=cache_dir, lock=_engine_lock)
    value: Any = classes[key]
    if isinstance(value, tuple):  # a [slow, fast] pair: the slot this reference names
        value = next(c for c in value if c is not None and c.__name__ == name)
    return value if isinstance(value, type) else None


def _unlocked(reference: str, model: Any) -> LockMismatchError:
    """A lock binds this process, and this remote class is not code codeferry could check."""
    where = _engine_lock.read_from if _engine_lock is not None else None
    return LockMismatchError(
        f"{reference} of {model} is remote code codeferry cannot check against the lock "
        f"{where or ''} (the model is not on this machine, or its auto_map does not name "
        "it); with a lock in force nothing unchecked runs.",
        path=where,
        fix="download the model first and lock it (`codeferry lock MODEL -o FILE`), or "
        "unset CODEFERRY_LOCK to let transformers' trust_remote_code decide.",
    )


def _log_error(reference: str, model: Any, exc: CodeferryError) -> None:
    """In an engine, say why a class cannot load (its wrapper would say only "cannot find")."""
    with _lock:
        log = _error_log
        if log is None or (reference, str(exc)) in _logged:
            return
        _logged.add((reference, str(exc)))
    log.error("codeferry: %s of %s cannot load: %s", reference, model, exc)


def _hooked(original: Any) -> Any:
    def get_class_from_dynamic_module(
        class_reference: str, pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any
    ) -> Any:
        if _generation_pending:
            with _lock:
                _patch_executed()
        found = None
        try:
            if not args:  # positional cache_dir and friends: leave such calls alone
                found = _answer(class_reference, pretrained_model_name_or_path,
                                kwargs.get("code_revision") or kwargs.get("revision"),
                                kwargs.get("cache_dir"))
            if found is None and _engine_lock is not None:
                raise _unlocked(class_reference, pretrained_model_name_or_path)
        except CodeferryError as exc:
            _log_error(class_reference, pretrained_model_name_or_path, exc)
            raise
        if found is not None:
            return found
        return original(class_reference, pretrained_model_name_or_path, *args, **kwargs)

    get_class_from_dynamic_module.__wrapped__ = original  # type: ignore[attr-defined]
    get_class_from_dynamic_module.__codeferry__ = True  # type: ignore[attr-defined]
    return get_class_from_dynamic_module


def _gates_lock() -> bool:
    return _engine_lock is not None or locked()


def _gates_active() -> bool:
    return _installed or _engine_lock is not None or locked()


#: The modules whose own attributes codeferry patches (``_patch``): the ``generate()`` hook
#: of remote models, ``custom_generate`` and the Hub kernel gates.
WATCHED = ("transformers.models.auto.auto_factory", "transformers.generation.utils",
           *kernel_gates.MODULES)


def _patch(module: Any) -> None:
    """The patches that belong to ``module`` (one of ``WATCHED``), from its own attributes
    alone: the modules that import it may still be half imported (idempotent)."""
    name = getattr(module, "__name__", "")
    if name == "transformers.models.auto.auto_factory":
        hook_auto_factory(module)
    elif name == "transformers.generation.utils":
        lock_gate.custom_generate_in(module, lambda: _engine_lock)
    kernel_gates.gate_module(module)


def _patch_executed() -> None:
    """``_patch`` each module of ``WATCHED`` that has executed. One still executing (``install()``
    called inside an import, or the boot routing while transformers imports) is handed over by
    the finder at the first import after it finishes (``watch.Watch.pending``), and at the
    latest at the first remote class asked for (caller holds ``_lock``)."""
    global _generation_pending
    pending = False
    for name in WATCHED:
        module = sys.modules.get(name)
        if module is None:
            continue
        if watch.executing(module):
            pending = True
        else:
            _patch(module)
    _generation_pending = pending


def module_completed(module: Any) -> None:
    """Right after a module of ``WATCHED`` executes (the finder ``install()`` put on
    ``sys.meta_path``, or ``codeferry exec``'s boot): its patches go in now, before any model
    of it can load. A native model never asks for a remote class, and its config may name a
    Hub kernel: the gates must be in place before its ``from_pretrained``. Nothing happens
    where codeferry is not installed."""
    with _lock:
        if _watching:
            _patch(module)


def _hook(dmu: Any = None) -> None:
    """Route ``get_class_from_dynamic_module`` through codeferry, wherever it was imported, and
    patch the modules of ``WATCHED``: those executed now, the others as each one executes.

    ``dmu``: ``transformers.dynamic_module_utils`` while it is being imported (its package
    does not hold it yet). Nothing of ``WATCHED`` is imported here: a process that only
    tokenizes never pays for ``generation.utils`` (torch) or ``modeling_utils``.
    """
    global _watching, _watcher
    if dmu is None:
        import transformers.dynamic_module_utils as dmu

    with _lock:
        if not patches.patched(dmu, "get_class_from_dynamic_module"):
            _patch_dynamic_modules(dmu)
        kernel_gates.configure(_gates_lock, _gates_active)
        _watching = True
        if _watcher is None and not watch.watching(frozenset(WATCHED)):
            _watcher = watch.Watch(frozenset(WATCHED), module_completed)
            sys.meta_path.insert(0, _watcher)
        _patch_executed()


def _patch_dynamic_modules(dmu: Any) -> None:
    # The Auto classes (and vLLM, pipelines) bind the name at their import: replace it
    # in every module already imported; modules imported later take dmu's.
    patches.patch(dmu, "get_class_from_dynamic_module",
                  _hooked(dmu.get_class_from_dynamic_module), everywhere=True)
    original_in_module = patches.original(dmu, "get_class_in_module")

    def get_class_in_module(class_name: str, module_path: Any, **kwargs: Any) -> Any:
        # The gate every door ends in (auto_map, custom_generate, whatever transformers
        # adds): under a lock, only locked bytes execute.
        allowed = locked_files(_engine_lock)
        if allowed is not None:
            where = _engine_lock.read_from if _engine_lock is not None else None
            try:
                checked = lock_gate.check_module(module_path, dmu, allowed, where=where)
            except CodeferryError as exc:
                _log_error(class_name, module_path, exc)
                raise
            # the class of the module the gate ran: transformers would execute the file
            # again, and its pyc, on force_reload (force_download)
            cls = getattr(checked, class_name)
        else:
            cls = original_in_module(class_name, module_path, **kwargs)
        module = sys.modules.get(getattr(cls, "__module__", ""))
        if module is not None:
            adopt_module(module)
        return cls

    # ``transformers.generation.utils`` binds it by name at its import (``load()`` imports it
    # before any lock binds the process): the gate must stand there too
    patches.patch(dmu, "get_class_in_module", get_class_in_module, everywhere=True)


def on_load(event: _load.Loaded) -> None:
    """After-load callback: later ``from_pretrained(..., trust_remote_code=True)`` of the loaded
    model gets these classes, not a second execution of its files under transformers_modules."""
    answer_for_loaded(event.root)


def answer_for_loaded(root: str) -> None:
    """``load`` calls this: later remote-code lookups of the model at ``root`` get its classes."""
    with _lock:
        _loaded_roots.add(root)
    try:
        _hook()
    except ImportError:  # no transformers: nothing to answer
        pass


def install() -> None:
    """Route every remote-code load that transformers performs through codeferry.

    After this, ``AutoConfig/AutoModel*/AutoTokenizer/AutoProcessor/...from_pretrained(
    ..., trust_remote_code=True)`` and ``get_class_from_dynamic_module`` (also when other
    libraries call them) return codeferry's classes for any model codeferry can locate.
    Idempotent; ``uninstall()`` undoes it. Remote modules that plain transformers loaded
    (before, or for models codeferry cannot locate) are adopted so they travel too.
    """
    _install()


def _install(dmu: Any = None) -> None:
    global _installed
    _loader.install_finder()  # what importing codeferry leaves alone, install() installs
    _pickling.install_cloudpickle_support()
    with _lock:
        _hook(dmu)
        _installed = True
    for mod in list(sys.modules.values()):
        if mod is not None and getattr(mod, "__name__", "").startswith(_PREFIX):
            adopt_module(mod)


def install_for_engine(lock: Lock | None = None, *, log: logging.Logger = logger) -> None:
    """``install()`` for an engine that calls transformers and swallows its errors (vLLM).

    A class codeferry cannot load is logged at error level on ``log`` with its typed
    error (file, line, fix), once per process, before the exception goes on, since the
    engine's own wrapper reduces it to "cannot find". With ``lock``, every answer is
    checked against it (a mismatch raises ``LockMismatchError``; remote code codeferry
    cannot check is refused, not passed on to transformers), and the process runs only
    locked code from then on.
    """
    global _engine_lock, _error_log
    with _lock:
        _engine_lock = lock
        _error_log = log
    install()


def install_while_importing(dmu: Any, lock: Lock | None, *, log: logging.Logger = logger) -> None:
    """``install()`` (``install_for_engine(lock)`` with a lock) from inside the import of
    transformers' ``dynamic_module_utils``, the module ``dmu`` that has just executed (the
    boot of ``codeferry exec``). The modules of ``WATCHED`` that transformers is still
    importing get their patches from the boot's finder as each one finishes executing."""
    global _engine_lock, _error_log
    with _lock:
        if lock is not None:
            _engine_lock = lock
            _error_log = log
    _install(dmu)


def uninstall() -> None:
    """Give transformers every function codeferry patched back (classes already loaded stay;
    a later ``load`` patches what it needs again)."""
    global _installed, _engine_lock, _error_log, _generation_pending, _watching, _watcher
    with _lock:
        _installed = False
        _watching = False
        _generation_pending = False
        if _watcher is not None and _watcher in sys.meta_path:
            sys.meta_path.remove(_watcher)
        _watcher = None
        _engine_lock = None
        _error_log = None
        _loaded_roots.clear()
        patches.restore_all()
