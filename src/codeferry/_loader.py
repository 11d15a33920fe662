"""Executing verified bytes as modules: the only place that touches ``sys.modules``.

Each unit of code lives in one package per process, by default
``codeferry._dyn.u<token>`` where ``token`` is the start of the unit's content digest::

    codeferry._dyn.u3f9c.../               (the unit's root: a package)
        configuration_x                    (configuration_x.py)
        utils / utils.rope                 (utils/__init__.py, utils/rope.py)

Why a package named by content: two models whose files share names
(``configuration.py``) never collide, the same code loaded twice is the same modules
(one class identity per process, where transformers 5.23 executes a configuration file
twice, transformers #38476), and a name alone tells any process on the machine which
bytes it stands for. A finder at the front of ``sys.meta_path`` serves these names: from
units registered in this process, else from the store by token. So a child that
unpickles ``codeferry._dyn.u<token>.modeling_x.XConfig`` needs nothing but codeferry
installed: importing ``codeferry._dyn`` installs the finder.

Modules are executed from the bytes held in memory, which were verified against the
digest, never re-read from disk after the check. ``__file__`` still points at the
store copy so code can find its assets (``Path(__file__).parent / "table.json"``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ._policy import check_allowed
from ._store import UnitData, read_unit, write_unit
from .errors import CodeUnavailableError

__all__ = ["Runtime", "PREFIX", "register", "runtime_for", "import_module", "on_module_executed"]

PREFIX = "codeferry._dyn"

_lock = threading.RLock()
_runtimes: dict[str, Runtime] = {}  # package name -> runtime
#: Called after each module executes (``_pickling`` marks its classes there).
on_module_executed: list[Callable[[types.ModuleType, Runtime], None]] = []


@dataclass
class Runtime:
    """A unit registered in this process, under ``package``."""

    unit: UnitData
    package: str
    files_dir: Path
    extras: dict[str, object] = field(default_factory=dict)  # per-unit caches of other layers

    def module_name(self, name: str) -> str:
        return f"{self.package}.{name}" if name else self.package

    def locate(self, name: str) -> tuple[str | None, bool] | None:
        """(file, is_package) of dotted module ``name`` of the unit; file None for a namespace."""
        stem = name.replace(".", "/")
        if not name:
            return ("__init__.py" if "__init__.py" in self.unit.files else None), True
        if f"{stem}/__init__.py" in self.unit.files:
            return f"{stem}/__init__.py", True
        if f"{stem}.py" in self.unit.files:
            return f"{stem}.py", False
        if name in self.unit.packages or any(p.startswith(stem + "/") for p in self.unit.files):
            return None, True
        return None


def default_package(unit: UnitData) -> str:
    return f"{PREFIX}.u{unit.token}"


def register(unit: UnitData, package: str | None = None) -> Runtime:
    """Make ``unit`` importable under ``package`` (default: its content-named package).

    Verifies the bytes against the digest and writes them to the store (for
    ``__file__`` and for processes that get only the digest). Idempotent.
    """
    package = package or default_package(unit)
    with _lock:
        existing = _runtimes.get(package)
        if existing is not None and existing.unit.digest == unit.digest:
            return existing
        check_allowed(unit.digest, unit.label)
        unit.verify()
        files_dir = write_unit(unit)
        runtime = Runtime(unit, package, files_dir)
        _runtimes[package] = runtime
        _ensure_parents(package)
        return runtime


def registered(package: str) -> Runtime | None:
    """The runtime registered under ``package`` in this process, if any."""
    with _lock:
        return _runtimes.get(package)


def _ensure_parents(package: str) -> None:
    """Give an alias package (``transformers_modules.x.<hash>``) parents to hang from.

    Parents that import normally are imported; the others become empty packages. For
    ``transformers_modules`` their ``__path__`` is where transformers would put them,
    so transformers' own loading in this process keeps working beside ours.
    """
    parts = package.split(".")
    for end in range(1, len(parts)):
        name = ".".join(parts[:end])
        if name in sys.modules or name in ("codeferry", PREFIX):
            continue
        try:
            importlib.import_module(name)
            continue
        except ImportError:
            pass
        parent = types.ModuleType(name)
        parent.__path__ = []
        if parts[0] == "transformers_modules":
            import os

            cache = os.environ.get("HF_MODULES_CACHE") or os.path.join(
                os.environ.get("HF_HOME") or os.path.expanduser("~/.cache/huggingface"), "modules"
            )
            parent.__path__ = [os.path.join(cache, *parts[:end])]
        sys.modules[name] = parent


def runtime_for(fullname: str) -> tuple[Runtime, str] | None:
    """The runtime serving module ``fullname``, and the module's name inside its unit."""
    with _lock:
        for package, runtime in _runtimes.items():
            if fullname == package or fullname.startswith(package + "."):
                return runtime, fullname[len(package) + 1:]
        if not fullname.startswith(PREFIX + ".u"):
            return None
        head = fullname.split(".")[2]
        token = head[1:]
        unit = read_unit(token)
        if unit is None:
            raise CodeUnavailableError(
                f"no code with digest {token}... is loaded in this process or stored in "
                "its codeferry store, and none came with the message.",
                digest=token,
                fix="load the model in this process first (codeferry.load), or send an "
                "instance of a codeferry class (it carries its code) before sending classes "
                "by name; a store shared by all processes (CODEFERRY_HOME) also works.",
            )
        runtime = register(unit)
        return runtime, fullname[len(runtime.package) + 1:]


class _Loader(importlib.abc.Loader):
    def __init__(self, runtime: Runtime, name: str, rel: str | None) -> None:
        self.runtime, self.name, self.rel = runtime, name, rel

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        if self.rel is None:
            return  # a namespace folder
        source = self.runtime.unit.files[self.rel]
        filename = str(self.runtime.files_dir / self.rel)
        code = compile(source, filename, "exec", dont_inherit=True)
        exec(code, module.__dict__)  # noqa: S102 - running the verified bytes is the point
        for hook in on_module_executed:
            hook(module, self.runtime)

    def get_source(self, fullname: str) -> str | None:
        """For tracebacks: ``linecache`` asks the loader, so lines show the verified bytes."""
        if self.rel is None:
            return None
        return self.runtime.unit.files[self.rel].decode("utf-8", "replace")


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        found = runtime_for(fullname)
        if found is None:
            return None
        runtime, name = found
        where = runtime.locate(name)
        if where is None:
            return None  # ImportError "No module named ..." from importlib, as usual
        rel, is_package = where
        spec = importlib.machinery.ModuleSpec(
            fullname,
            _Loader(runtime, name, rel),
            origin=str(runtime.files_dir / rel) if rel else None,
            is_package=is_package,
        )
        if rel:
            spec.has_location = True
        if is_package:
            # Empty: submodules come from this finder only, never from files on disk.
            spec.submodule_search_locations = []
        return spec


_FINDER = _Finder()


def install_finder() -> None:
    """Put the finder first on ``sys.meta_path`` (idempotent)."""
    with _lock:
        if not any(isinstance(f, _Finder) for f in sys.meta_path):
            sys.meta_path.insert(0, _FINDER)


def import_module(runtime: Runtime, name: str) -> types.ModuleType:
    """Import module ``name`` of the unit (dotted, relative to the unit root)."""
    return importlib.import_module(runtime.module_name(name))


install_finder()
