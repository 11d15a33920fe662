"""The gate at every door: transformers executes no module of a repo that a lock does not list.

transformers runs a repo's Python by more than ``auto_map``: ``custom_generate/generate.py``
(``load_custom_generate``, called by ``from_pretrained`` and by ``generate(custom_generate=
"org/repo" or a folder)``) is fetched with ``get_cached_module_file`` and executed with
``get_class_in_module``, without passing ``get_class_from_dynamic_module``, the function
``install()`` answers. Every such door ends in ``get_class_in_module``: that is where the
gate stands (``check_module``). Under a lock (``CODEFERRY_LOCK``, ``load(..., lock=...)``)
the module file and every file of the module cache it imports relatively must be locked
bytes (same sha256, same path inside the model); anything else raises
``UnlockedCodeError`` before a line of it runs, whoever passed ``trust_remote_code=True``.
What passes is executed by the gate from the bytes it hashed (``runtime.loader``), never
from the file again nor from a ``.pyc`` someone put in the module cache.

``custom_generate`` itself (``custom_generate_in``) goes through codeferry like
``auto_map`` code when codeferry can locate the repo: resolved, decided (``decide_door``:
the caller's trust, or the lock), executed from the verified bytes. A repo codeferry cannot
locate goes on to transformers, whose own trust check and this gate then apply.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import types
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import _load
from .._code.digest import file_sha256
from .._code.source import locate
from .._code.walk import DOORS
from .._hf import patches
from .._runtime import loader as _loader
from .._trust.options import ModelOptions
from ..errors import LockMismatchError, ModelNotFoundError, UnlockedCodeError

if TYPE_CHECKING:
    from .._code.bundle import Bundle
    from .._code.lockfile import Lock

__all__ = ["check_bundle", "check_module", "custom_generate_in", "door_of"]

_CUSTOM_GENERATE = next(rel for door, rel, _ in DOORS if door == "custom_generate")


def door_of(path: str) -> str:
    """The door a file of transformers' module cache came in by (``auto_map`` by default)."""
    posix = path.replace(os.sep, "/")
    for door, rel, _ in DOORS:
        if posix == rel or posix.endswith("/" + rel):
            return door
    return "auto_map"


def check_module(module_path: str | os.PathLike[str], dmu: Any,
                 allowed: frozenset[tuple[str, str]], *, where: str | None) -> types.ModuleType:
    """Raise ``UnlockedCodeError`` unless ``module_path`` (relative to transformers' module
    cache, as ``get_class_in_module`` gets it) and every file it imports relatively are
    files the lock lists, byte for byte; then execute the module from those very bytes.
    Unreadable is refused too: the gate fails closed.

    Each file is read once: the relative imports are found in the bytes read (as
    transformers' ``get_relative_imports`` finds them), and the bytes hashed are the bytes
    executed, by codeferry's loader (``loader.serve_checked``), never a ``.pyc`` of the
    module cache, which transformers' ``SourceFileLoader`` would run without comparing it
    with the source (an unchecked-hash pyc; a timestamp pyc only by mtime and size). The
    module then carries a hash transformers takes for its own (``_Executed``), so
    ``get_class_in_module`` returns its class without reading the file again; and the
    module is returned, for a caller that must not let transformers execute it again at all
    (``force_reload``)."""
    root = Path(dmu.HF_MODULES_CACHE)
    module_file = root / module_path
    door = door_of(str(module_path))
    by_sha: dict[str, set[str]] = {}
    for path, sha in allowed:
        by_sha.setdefault(sha, set()).add(path)
    name = os.path.normpath(module_path).removesuffix(".py").replace(os.sep, ".")
    package = name.rpartition(".")[0]
    files = {name: module_file}
    checked: dict[str, tuple[str, bytes]] = {}
    pending = [name]
    while pending:
        module = pending.pop()
        file = files[module]
        try:
            data = file.read_bytes()
            text = data.decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise _refused(file, door, where, f"cannot be read ({exc})") from None
        sha = file_sha256(data)
        rel = file.as_posix()
        if not any(rel.endswith("/" + p) for p in by_sha.get(sha, ())):
            raise _refused(file, door, where, f"(sha256:{sha}) is not a file the lock lists")
        checked[module] = (str(file), data)
        for imported in sorted(_relative_imports(text)):
            other = f"{package}.{imported}" if package else imported
            if other not in files:
                files[other] = module_file.parent / f"{imported}.py"
                pending.append(other)
    return _execute(name, checked)


#: transformers' ``get_relative_imports``: ``import .x`` and ``from .x import ...``.
_RELATIVE = (re.compile(r"^\s*import\s+\.(\S+)\s*$", re.MULTILINE),
             re.compile(r"^\s*from\s+\.(\S+)\s+import", re.MULTILINE))
_executing = threading.RLock()


def _relative_imports(text: str) -> set[str]:
    return {found for pattern in _RELATIVE for found in pattern.findall(text)}


class _Executed(str):
    """``__transformers_module_hash__`` of a module the gate executed: equal to any hash.

    transformers executes a module again (from the file, through its ``.pyc``) when this
    differs from the hash of the files it reads again after the gate; under a lock the gate
    decides that instead (it runs before transformers, every call), so a file swapped after
    the check is never executed by transformers."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, str)

    def __ne__(self, other: object) -> bool:
        return not isinstance(other, str)

    __hash__ = str.__hash__


def _execute(name: str, checked: dict[str, tuple[str, bytes]]) -> types.ModuleType:
    """Execute module ``name`` from ``checked`` (its bytes and its relative imports'),
    unless the module ``sys.modules`` holds was executed by the gate from the same bytes."""
    digest = file_sha256(b"".join(
        f"{module}\0{file_sha256(data)}\n".encode() for module, (_, data) in sorted(checked.items())))
    with _executing:
        _loader.serve_checked(checked)
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__codeferry_checked__", None) == digest:
            return module
        module = _loader.exec_checked(name)
        module.__codeferry_checked__ = digest  # type: ignore[attr-defined]
        module.__transformers_module_hash__ = _Executed(digest)  # type: ignore[attr-defined]
        return module


def check_bundle(bundle: Bundle, allowed: frozenset[tuple[str, str]], *,
                 where: str | None) -> None:
    """Raise ``UnlockedCodeError`` unless every file of ``bundle`` is a locked file: what a
    process bound by ``load(..., lock=...)`` asks of a model a library then loads with
    ``trust_remote_code=True`` written into its own code (CVE-2026-27893's pattern)."""
    for entry in bundle.files:
        if (entry.path, entry.sha256) not in allowed:
            door = next((d.name for d in bundle.doors if d.path == entry.path), "auto_map")
            raise _refused(bundle.origin.root / entry.path, door, where,
                           f"(sha256:{entry.sha256}) is not a file the lock lists")


def _refused(file: Path, door: str, where: str | None, what: str) -> UnlockedCodeError:
    return UnlockedCodeError(
        f"transformers was about to execute {file} (door: {door}), which {what}; with a "
        f"lock in force ({where or 'load(..., lock=...) in this process'}) nothing unlocked "
        "runs, and none of it ran.",
        path=str(file), door=door,
        fix="review the model's code (`codeferry inspect MODEL`, `codeferry audit MODEL`), "
        "then lock it with every door it has: `codeferry lock MODEL -o FILE`.",
    )


def custom_generate_in(generation: Any, current_lock: Callable[[], Lock | None]) -> None:
    """Answer transformers' ``load_custom_generate`` with codeferry's loader, on the module
    ``transformers.generation.utils`` and from its own attributes alone: it is patched right
    after it executes, when transformers' package may still be half imported (idempotent).

    ``current_lock``: the engine's lock at call time (``install_for_engine``), if any."""
    import transformers.dynamic_module_utils as dmu  # executed before any module imports it

    GenerationMixin = generation.GenerationMixin
    if patches.patched(GenerationMixin, "load_custom_generate"):
        return
    original = patches.original(GenerationMixin, "load_custom_generate")

    def load_custom_generate(self: Any, pretrained_model_name_or_path: Any = None,
                             trust_remote_code: bool | None = None, **kwargs: Any) -> Any:
        model = pretrained_model_name_or_path
        revision = kwargs.get("revision")
        try:
            origin = locate(model, revision=revision, cache_dir=kwargs.get("cache_dir"))
        except (ModelNotFoundError, OSError, ValueError, TypeError):
            # not on this machine: transformers fetches it, checks trust, and the gate
            # in get_class_in_module checks the bytes under a lock
            return original(self, model, trust_remote_code=trust_remote_code, **kwargs)
        if not (origin.root / _CUSTOM_GENERATE).is_file():
            # transformers' own answer: from_pretrained reads it as "no custom generate"
            raise OSError(f"`{model}` does not contain a `custom_generate` subdirectory with a "
                          "`generate.py` file, can't load the custom generate function.")
        requirements = getattr(dmu, "check_python_requirements", None)
        if requirements is not None:  # read, never executed: transformers' own check
            requirements(str(origin.root), requirements_file="custom_generate/requirements.txt")
        lock = current_lock()
        options = ModelOptions(revision=revision, cache_dir=kwargs.get("cache_dir"),
                               token=kwargs.get("token"), local_files_only=True,
                               trust_remote_code=bool(trust_remote_code), lock=lock)
        target = origin.root if origin.repo_id is None else model
        try:
            module = _load.load_door(target, _CUSTOM_GENERATE, options)
        except LockMismatchError as exc:
            # a PermissionError, which from_pretrained takes for "no custom generate"
            raise UnlockedCodeError(
                f"{origin.root / _CUSTOM_GENERATE} (door: custom_generate) is not locked code: "
                f"{exc.message}", path=str(origin.root / _CUSTOM_GENERATE),
                door="custom_generate", fix=exc.fix,
            ) from exc
        return module.generate

    load_custom_generate.__wrapped__ = original  # type: ignore[attr-defined]
    patches.patch(GenerationMixin, "load_custom_generate", load_custom_generate)
