"""``codeferry.load``: resolve, decide trust, register, execute in order, tell transformers."""

from __future__ import annotations

import logging
import os
import threading
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._code.automap import ClassRef
from ._code.lockfile import Lock
from ._code.requirements import pip_name
from ._code.resolve import Bundle
from ._hf import compat as _compat  # noqa: F401 - serves removed names to remote modules
from ._hf.classes import register_with_transformers, serve_verified_files
from ._runtime import loader as _loader
from ._runtime import pickling as _pickling
from ._trust.decide import code_changed, decide_door, record
from ._trust.options import ModelOptions
from .errors import (
    ClassNotLoadedError,
    CodeferryError,
    ConfigUnavailableError,
    MissingClassError,
    ProblemsFound,
    RemoteCodeExecutionError,
)

__all__ = ["load", "load_door", "load_pinned", "load_with", "LoadResult", "Loaded", "after_load",
           "class_key"]

logger = logging.getLogger(__name__)

_lock = threading.Lock()


@dataclass(frozen=True)
class Loaded:
    """What one ``load`` made here, as after-load callbacks receive it."""

    root: str  # the model's folder
    digest: str  # its code's digest
    classes: Mapping[str, Any]  # auto_map key -> class, as registered with transformers


#: Called after every ``load`` that loaded a class. ``_install`` subscribes the hooks that
#: answer transformers for loaded models (the load never names them: no import runs back up).
_after_load: list[Callable[[Loaded], None]] = []


def after_load(callback: Callable[[Loaded], None]) -> None:
    """Call ``callback`` after each load from now on (once, however often subscribed)."""
    with _lock:
        if callback not in _after_load:
            _after_load.append(callback)


def class_key(declared_in: str, key: str) -> str:
    """The key of ``load``'s mapping: ``auto_map`` key, prefixed for nested sub-configs."""
    if ":" in declared_in:
        return f"{declared_in.split(':', 1)[1]}:{key}"
    return key


class LoadResult(dict[str, Any]):
    """What ``load`` returns: ``auto_map`` key -> class, for every class that loaded.

    ``failed`` maps each key that could not load to its typed error (file:line and the
    fix), so one missing package takes down only the classes that import it.
    """

    failed: dict[str, CodeferryError]

    def __init__(self, classes: Mapping[str, Any], failed: Mapping[str, CodeferryError]) -> None:
        super().__init__(classes)
        self.failed = dict(failed)

    def __missing__(self, key: str) -> Any:
        """``result[key]`` for a class that is not here: a typed error naming it, its own
        failure as the cause (never a bare ``KeyError``)."""
        cause = self.failed.get(key)
        if cause is not None:
            error = ClassNotLoadedError(
                f"{key} did not load: {cause.message}", key=key, path=cause.path,
                line=cause.line, fix=cause.fix or "see the cause above.")
            raise error from cause
        names = ", ".join(sorted(self)) or "none"
        raise ClassNotLoadedError(
            f"the model's auto_map names no {key} (loaded: {names}).", key=key,
            fix="use one of the loaded keys, or transformers' own class for a native head.")


def _first_line_in(exc: BaseException, folders: tuple[str, ...]) -> int | None:
    """The line of the innermost traceback frame inside the unit's files: where it broke."""
    line = None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.startswith(folders):
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def _execution_error(
    exc: Exception, registration: _loader.Registration, name: str, bundle: Bundle, repo: str | None
) -> RemoteCodeExecutionError:
    path = registration.locate(name)
    where = (path[0] if path else None) or name
    missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
    if missing and not missing.startswith(("codeferry.", "transformers_modules")):
        top = missing.split(".", 1)[0]
        fix = f"`pip install {pip_name(top)}` (the package {top!r} is not installed)."
    else:
        fix = ("see the cause above; a missing package is listed by "
               f"`codeferry inspect {bundle.origin.root}` under requirements.")
    err = RemoteCodeExecutionError(
        f"executing {where} of {registration.unit.label} raised {type(exc).__name__}: {exc}",
        digest=registration.unit.digest, model=registration.unit.label,
        path=str(bundle.origin.root / where) if repo is None else where,
        line=_first_line_in(exc, (str(registration.verified_dir()), str(registration.files_dir))), fix=fix,
    )
    err.__cause__ = exc
    return err


def _is_model_key(ref: ClassRef) -> bool:
    """An ``auto_map`` entry whose class is built from the model's config class."""
    return ref.declared_in == "config.json" and ref.key.startswith(("AutoModel", "AutoBackbone"))


def load(
    model: str | os.PathLike[str],
    *,
    trust_remote_code: bool = False,
    revision: str | None = None,
    lock: Lock | str | os.PathLike[str] | None = None,
    classes: Sequence[str] | None = None,
    strict: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    token: str | bool | None = None,
    local_files_only: bool | None = None,
    code_revision: str | None = None,
) -> LoadResult:
    """Load the ``auto_map`` classes of ``model``, each with just the code it imports.

    Returns ``auto_map`` key -> class (a ``[slow, fast]`` pair maps to a tuple; a nested
    sub-config's entries are keyed ``"llm_config:AutoConfig"``). The classes are
    registered with transformers' Auto classes, so ``AutoConfig/AutoModel*/AutoTokenizer
    .from_pretrained(model)`` return instances of exactly these classes afterwards, and
    objects of them pickle with their code, so any process can receive them.

    Each class executes only its own import closure (module-level imports and parent
    packages, dependencies first); a module imported only inside a function executes
    when that import runs, still from the verified bytes. A class whose closure cannot
    execute (a package that is not installed, a name the installed transformers lacks,
    an exception at import, a static problem in one of its files) does not take the
    others down: it is left out, its typed error is in ``result.failed`` and is logged
    once as a warning. ``classes=[...]`` loads only those keys and raises the error of
    any that cannot load; ``strict=True`` raises if any class cannot load. If no class
    can load at all, the error is raised.

    ``from_pretrained``'s vocabulary means what it means there. ``cache_dir`` is the Hugging
    Face hub cache to find ``model`` (a repo id) and the repos of cross-repo references in.
    A repo id the cache lacks is downloaded whole (weights included, so that
    ``from_pretrained`` finds them) with huggingface_hub, sending ``token`` (default:
    ``HF_TOKEN`` or the saved login), unless ``local_files_only=True`` or ``HF_HUB_OFFLINE``
    is set (then: ``ModelNotCachedError``). ``code_revision`` is the revision whose code
    is loaded (default: ``revision``), as in transformers; when it differs from
    ``revision``, only its code is downloaded.

    Code runs only with ``trust_remote_code=True`` or a ``lock`` (a ``Lock`` or the path
    of a lock file) that lists exactly this code; once a lock was used in a process, that
    process runs (and accepts from other processes) only code some lock of it lists.
    """
    return load_with(model, ModelOptions.of(locals()), classes=classes, strict=strict)


def load_pinned(model: str | os.PathLike[str], digest: str, options: ModelOptions, *,
                strict: bool = False) -> LoadResult:
    """``load``, only if the code found now is ``digest``: what a parent checked for its workers.

    Trust is a decision about one digest, not about a folder: a worker started (or
    replaced, or resumed) after the folder changed raises ``CodeChangedError`` naming
    both digests before it executes anything.
    """
    return load_with(model, options, expected=digest, strict=strict)


def load_with(
    model: str | os.PathLike[str],
    options: ModelOptions,
    *,
    classes: Sequence[str] | None = None,
    strict: bool = False,
    expected: str | None = None,
) -> LoadResult:
    """``load`` with its options as one value (``expected``: the digest, as ``load_pinned``)."""
    # What importing codeferry leaves alone, the first load installs (idempotent).
    _loader.install_finder()
    _pickling.install_cloudpickle_support()
    bundle = options.resolve_code(model, whole=True, requirements=False)
    if expected is not None and bundle.digest != expected:
        raise code_changed(bundle, expected)
    refs = list(bundle.classes)
    if classes is not None:
        wanted = set(classes)
        unknown = wanted - {class_key(r.declared_in, r.key) for r in refs}
        if unknown:
            raise MissingClassError(
                f"{bundle.origin.name} names no class {sorted(unknown)[0]!r} in its auto_map "
                f"(it has {', '.join(sorted({class_key(r.declared_in, r.key) for r in refs}))}).",
                path=str(bundle.origin.root / "config.json"),
                fix="ask for one of the auto_map keys the model has.",
            )
        refs = [r for r in refs if class_key(r.declared_in, r.key) in wanted]
    decision = options.decide(bundle)
    failed: dict[str, CodeferryError] = {}
    for ref in refs:  # static problems first: refused code is never registered
        if bundle.problems_for(ref):
            try:
                bundle.check_class(ref)
            except CodeferryError as exc:
                failed.setdefault(class_key(ref.declared_in, ref.key), exc)
    config_ref = next((r for r in refs if r.declared_in == "config.json"
                       and r.key == "AutoConfig"), None)
    if config_ref is not None and "AutoConfig" in failed:
        for ref in refs:
            if _is_model_key(ref):
                key = class_key(ref.declared_in, ref.key)
                failed[key] = _needs_config(key, ref, config_ref, failed["AutoConfig"])
    if failed and (strict or classes is not None or len(failed) == len(
            {class_key(r.declared_in, r.key) for r in refs})):
        _raise_failed(bundle, failed)
    units = _loader.units_of(bundle)
    record(decision, units.values())
    loaded: dict[ClassRef, Any] = {}
    with _lock:
        registrations = {repo: _loader.register(unit) for repo, unit in units.items()}
        for registration in registrations.values():
            # The private copies now, before any code runs: a temporary folder that is not
            # safe for them is refused as itself (StorePermissionError), not as a failed import.
            registration.verified_dir()
        broken: dict[str, CodeferryError] = {}  # module -> why it cannot execute
        for ref in sorted(refs, key=lambda r: r is not config_ref):  # the config first
            key = class_key(ref.declared_in, ref.key)
            if key in failed:
                continue
            error: CodeferryError | None
            if config_ref is not None and _is_model_key(ref) and "AutoConfig" in failed:
                error = _needs_config(key, ref, config_ref, failed["AutoConfig"])
            else:
                error = _execute_closure(bundle, ref, registrations, broken)
            if error is not None:
                failed[key] = error
                continue
            registration = registrations[ref.repo]
            loaded[ref] = getattr(_loader.import_module(registration, ref.module), ref.name)
    for key, error in failed.items():
        _warn_once(bundle.digest, key, error)
    if failed and (strict or classes is not None or not loaded):
        _raise_failed(bundle, failed)
    result = _as_mapping(loaded, registrations, bundle.origin.root)
    if loaded:
        event = Loaded(str(bundle.origin.root), bundle.digest, result)
        for callback in list(_after_load):
            callback(event)
    return LoadResult(result, failed)


def load_door(model: str | os.PathLike[str], path: str, options: ModelOptions) -> types.ModuleType:
    """Execute the module at ``path`` of ``model`` (``custom_generate/generate.py``: a door
    transformers runs besides ``auto_map``) from the resolved, verified bytes, under the same
    decision as ``load``: ``options.trust_remote_code``, or ``options.lock``, or a lock this
    process used before. Raises what refuses it (``TrustRequiredError``, ``LockMismatchError``)
    before anything of it runs."""
    _loader.install_finder()
    _pickling.install_cloudpickle_support()
    bundle = options.resolve_code(model, requirements=False)
    lock = options.lock
    decision = decide_door(bundle, trust_remote_code=options.trust_remote_code,
                           lock=lock if isinstance(lock, Lock) or lock is None else None)
    name = path.removesuffix(".py").replace("/", ".")
    top = name.split(".", 1)[0]  # the door's folder: what its module imports lives there
    for index, problem in enumerate(bundle.problems):
        scope = bundle.scopes[index] if index < len(bundle.scopes) else frozenset()
        if problem.blocking and (not scope or any(s == top or s.startswith(top + ".")
                                                  for s in scope)):
            raise problem
    units = _loader.units_of(bundle)
    if decision is not None:
        record(decision, units.values())
    with _lock:
        registration = _loader.register(units[None])
        registration.verified_dir()
        try:
            return _loader.import_module(registration, name)
        except Exception as exc:  # model code may raise anything
            raise _execution_error(exc, registration, name, bundle, None) from exc


def _needs_config(
    key: str, ref: ClassRef, config_ref: ClassRef, cause: CodeferryError
) -> ConfigUnavailableError:
    error = ConfigUnavailableError(
        f"{key} ({ref.reference}) needs the model's config class {config_ref.reference}, "
        f"which cannot load: {cause.message}",
        key=key, config_error=cause, path=cause.path, line=cause.line, fix=cause.fix,
    )
    error.__cause__ = cause
    return error


def _raise_failed(bundle: Bundle, failed: Mapping[str, CodeferryError]) -> None:
    errors = list({id(e): e for e in failed.values()}.values())  # one cause, once
    if len(errors) == 1:
        raise errors[0]
    raise ProblemsFound(
        f"{len(failed)} classes of {bundle.origin.name} cannot load: "
        + "; ".join(f"{k}: {e}" for k, e in failed.items()),
        problems=tuple(errors),
        fix=f"run `codeferry inspect {bundle.origin.root}`: it shows each class's status.",
    )


def _execute_closure(
    bundle: Bundle,
    ref: ClassRef,
    registrations: Mapping[str | None, _loader.Registration],
    broken: dict[str, CodeferryError],
) -> CodeferryError | None:
    """Execute the modules ``ref`` needs, dependencies first; the error if one raises."""
    for qualified in bundle.closures.get(ref, ()):
        if qualified in broken:
            return broken[qualified]
        repo, _, name = qualified.rpartition("--") if "--" in qualified else (None, "", qualified)
        registration = registrations[repo or None]
        try:
            _loader.import_module(registration, name)
        except Exception as exc:  # noqa: BLE001 - model code may raise anything
            error = _execution_error(exc, registration, name, bundle, repo or None)
            broken[qualified] = error
            return error
    return None


_warned: set[tuple[str, str]] = set()


def _warn_once(digest: str, key: str, error: CodeferryError) -> None:
    with _lock:
        if (digest, key) in _warned:
            return
        _warned.add((digest, key))
    logger.warning("codeferry: %s cannot load: %s", key, error)


def _as_mapping(
    loaded: Mapping[ClassRef, Any], registrations: Mapping[str | None, _loader.Registration], root: Path,
) -> dict[str, Any]:
    classes: dict[str, Any] = {}
    owners: dict[type, _loader.Registration] = {}
    pairs: dict[str, list[Any]] = {}
    for ref, cls in loaded.items():
        owners[cls] = registrations[ref.repo]
        key = class_key(ref.declared_in, ref.key)
        if ref.slot is None:
            classes[key] = cls
        else:
            slots = pairs.setdefault(key, [])
            slots.extend([None] * (ref.slot + 1 - len(slots)))
            slots[ref.slot] = cls
    for key, slots in pairs.items():
        classes[key] = tuple(slots + [None] * (2 - len(slots)))
    try:
        import transformers  # noqa: F401
    except ImportError:
        return classes
    registered = register_with_transformers(classes, owners)
    if None in registrations:  # transformers reads the model's own files: the checked copies
        serve_verified_files(registered, root, registrations[None])
    return registered
