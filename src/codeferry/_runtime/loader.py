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
installed: importing ``codeferry._dyn`` installs the finder. Importing codeferry itself
does not: the finder is installed by the first unit registered (``load``, ``install()``,
an arriving ticket) or by that import of ``codeferry._dyn``.

Modules are executed from the bytes held in memory, which were verified against the
digest, never re-read from disk after the check. Everything else that reads "the
file" after the check gets those same bytes too:

* ``__file__`` (and ``co_filename``, ``__spec__.origin``) point into a *private copy*
  of the unit (``private``): a folder under a fresh ``mkdtemp`` (mode 0700, in a
  temporary folder held to the store's permission rule, so no other user can reach or
  swap it) written from the verified bytes in memory, read back and compared, then
  made read-only (files 0400, folders 0500). Code that reads its assets through
  ``Path(__file__).parent / "table.json"``, or compiles or ``exec``-s a file next to
  it, reads the checked bytes, whatever happens to the store or the model folder.
  One copy per process and unit, made when the unit's first module is imported,
  removed when the process exits (and, for a process that was killed, by the next
  process that makes one: each process holds a ``flock`` on its folder while it lives);
* ``linecache`` holds each module's verified source from the moment it executes, in
  an entry without an mtime, which ``linecache.checkcache`` never evicts. So
  tracebacks, ``inspect.getsource`` and ``torch.jit.script`` (which parses the source
  that ``inspect`` returns) see the bytes that run, never a disk copy.

The store copy stays for processes that get only a digest (they verify it on read).

Under a lock, the modules transformers executes from its own module cache
(``get_class_in_module``, gated by ``_install.lock_gate``) are served the same way: the gate
hands the bytes it checked to ``serve_checked`` and executes them with ``exec_checked``;
from then on this finder answers for those names (and their packages, as empty packages)
before any file on disk, so no ``__pycache__/*.pyc`` beside them is ever run, and a module
of their folder that was not checked is refused.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import linecache
import sys
import threading
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .. import _settings
from .._code.digest import unit_digest
from .._code.resolve import Bundle
from .._trust.policy import check_allowed
from ..errors import CodeUnavailableError
from .private import verified_dir
from .store import Unit, read_unit, unit_path, write_unit

__all__ = [
    "Registration", "PREFIX", "units_of", "register", "registration_for", "import_module",
    "on_module_executed", "on_module_setup", "verified_dir", "serve_checked", "exec_checked",
]

PREFIX = "codeferry._dyn"

_lock = threading.RLock()
_registrations: dict[str, Registration] = {}  # package name -> its registration
#: Modules of transformers' module cache whose bytes a lock's gate checked: name -> (file,
#: bytes); their packages (name -> folder), served empty; and the folders' own packages,
#: where a module that was not checked is refused.
_checked: dict[str, tuple[str, bytes]] = {}
_checked_packages: dict[str, str] = {}
_checked_folders: set[str] = set()
#: Called after each module executes (``pickling`` marks its classes there).
on_module_executed: list[Callable[[types.ModuleType, Registration], None]] = []
#: Called with each module's namespace before its code runs, with the module's verified
#: source (``_hf.compat`` gives it the names of transformers 4 its code imports there).
on_module_setup: list[Callable[[types.ModuleType, bytes], None]] = []


@dataclass
class Registration:
    """A unit registered in this process, under ``package``.

    The run-time layer of a unit: a ``_code.unit.Unit`` given a package name (``register``),
    whose modules this process imports from its verified bytes.
    """

    unit: Unit
    package: str
    files_dir: Path
    extras: dict[str, object] = field(default_factory=dict)  # per-unit caches of other layers

    def verified_dir(self) -> Path:
        """This process's private, read-only copy of the unit's verified bytes (made once)."""
        return verified_dir(self.unit)

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


def units_of(bundle: Bundle) -> dict[str | None, Unit]:
    """The bundle's code split by repo (``None``: the model's own), ready to register."""
    units: dict[str | None, Unit] = {}
    # a cross-repo reference whose repo is not at hand has no unit (its class cannot load)
    repos = {f.repo for f in bundle.files} | {
        c.repo for c in bundle.classes if c.repo is None or c.repo in bundle.pins}
    for repo in sorted(repos, key=lambda r: r or ""):
        files = {path: data for (r, path), data in bundle.contents.items() if r == repo}
        prefix = f"{repo}--" if repo else ""
        order = tuple(
            name[len(prefix):] for name in bundle.load_order
            if (name.startswith(prefix) if repo else "--" not in name)
        )
        packages = frozenset(m.name for m in bundle.modules if m.repo == repo and m.is_package)
        label = f"{repo}@{bundle.pins[repo]}" if repo else bundle.origin.name
        units[repo] = Unit(unit_digest(files), files, order, packages, label)
    return units


def default_package(unit: Unit) -> str:
    return f"{PREFIX}.u{unit.token}"


def register(unit: Unit, package: str | None = None, *, stored: bool = False) -> Registration:
    """Make ``unit`` importable under ``package`` (default: its content-named package).

    Verifies the bytes against the digest and writes them to the store (for processes
    that get only the digest). Idempotent. ``stored=True``: the unit was just read from
    the store by ``read_unit``, which verified it; hashing a big asset three more times
    and reading it back again would only repeat that check.
    """
    package = package or default_package(unit)
    install_finder()  # the first unit of the process: from now on its names must resolve
    with _lock:
        existing = _registrations.get(package)
        if existing is not None and existing.unit.digest == unit.digest:
            return existing
        check_allowed(unit.digest, unit.label)
        if stored:
            files_dir = unit_path(unit)
        else:
            unit.verify()
            files_dir = write_unit(unit)
        registration = Registration(unit, package, files_dir)
        _registrations[package] = registration
        _ensure_parents(package)
        return registration


def registered(package: str) -> Registration | None:
    """The registration under ``package`` in this process, if any."""
    with _lock:
        return _registrations.get(package)


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
            parent.__path__ = [str(_settings.modules_cache().joinpath(*parts[:end]))]
        sys.modules[name] = parent


def registration_for(fullname: str) -> tuple[Registration, str] | None:
    """The registration serving module ``fullname``, and the module's name inside its unit."""
    with _lock:
        for package, registration in _registrations.items():
            if fullname == package or fullname.startswith(package + "."):
                return registration, fullname[len(package) + 1:]
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
        registration = register(unit, stored=True)
        return registration, fullname[len(registration.package) + 1:]


class _Loader(importlib.abc.Loader):
    def __init__(self, registration: Registration, name: str, rel: str | None) -> None:
        self.registration, self.name, self.rel = registration, name, rel

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        if self.rel is None:
            return  # a namespace folder
        data = self.registration.unit.files[self.rel]
        filename = str(self.registration.verified_dir() / self.rel)
        _remember_lines(filename, data)
        code = compile(data, filename, "exec", dont_inherit=True)
        for setup in on_module_setup:
            setup(module, data)
        exec(code, module.__dict__)  # noqa: S102 - running the verified bytes is the point
        for hook in on_module_executed:
            hook(module, self.registration)

    def get_source(self, fullname: str) -> str | None:
        """The verified source, for ``inspect`` and anyone who asks the loader."""
        if self.rel is None:
            return None
        return _decode(self.registration.unit.files[self.rel])


def _decode(data: bytes) -> str:
    """Source text as Python reads it (its coding cookie, universal newlines)."""
    try:
        return importlib.util.decode_source(data)
    except (SyntaxError, UnicodeDecodeError, LookupError):
        return data.decode("utf-8", "replace")


def _remember_lines(filename: str, data: bytes) -> None:
    """Put the verified source in ``linecache`` under the module's file name.

    ``linecache`` reads a file that exists from disk, and asks the loader only for one
    that does not; an entry whose mtime is ``None`` is never checked against the disk
    (``checkcache`` skips it), so this entry is what tracebacks, ``inspect`` and
    ``torch.jit`` get. After a ``linecache.clearcache()`` they read the private copy,
    which holds the same bytes.
    """
    text = _decode(data)
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    linecache.cache[filename] = (len(text), None, lines, filename)


class _CheckedLoader(importlib.abc.Loader):
    """Executes a module of ``serve_checked`` from its checked bytes (``None``: a package)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        with _lock:
            found = _checked.get(self.name)
        if found is None:
            return  # a package holding checked modules: its __init__.py is never run
        filename, data = found
        _remember_lines(filename, data)
        code = compile(data, filename, "exec", dont_inherit=True)
        exec(code, module.__dict__)  # noqa: S102 - the bytes the gate checked

    def get_source(self, fullname: str) -> str | None:
        with _lock:
            found = _checked.get(fullname)
        return None if found is None else _decode(found[1])


def _checked_spec(fullname: str) -> importlib.machinery.ModuleSpec | None:
    """The spec of a module or package of ``serve_checked``; ``None`` for other names.

    Raises ``ImportError`` for a module of a checked module's folder that was not checked."""
    with _lock:
        found = _checked.get(fullname)
        folder = _checked_packages.get(fullname)
        parent = fullname.rpartition(".")[0]
        unchecked = found is None and folder is None and parent in _checked_folders
    if unchecked:
        raise ImportError(f"{fullname} is not a file the lock's gate checked: under a lock, "
                          f"no other module of {parent} is read from disk", name=fullname)
    if found is not None:
        spec = importlib.machinery.ModuleSpec(fullname, _CheckedLoader(fullname),
                                              origin=found[0])
        spec.has_location = True
        return spec
    if folder is not None:
        spec = importlib.machinery.ModuleSpec(fullname, _CheckedLoader(fullname),
                                              is_package=True)
        spec.submodule_search_locations = [folder]
        return spec
    return None


def serve_checked(modules: Mapping[str, tuple[str, bytes]]) -> None:
    """From now on, module ``name`` of ``modules`` (name -> (file, checked bytes)) imports
    from those bytes, and its packages as empty packages, before any file or ``.pyc``."""
    install_finder()
    with _lock:
        for name, (filename, data) in modules.items():
            _checked[name] = (filename, data)
            package, folder = name.rpartition(".")[0], Path(filename).parent
            _checked_folders.add(package)
            while package:
                _checked_packages.setdefault(package, str(folder))
                package, folder = package.rpartition(".")[0], folder.parent


def exec_checked(name: str) -> types.ModuleType:
    """Execute module ``name`` of ``serve_checked`` from its checked bytes, in the module
    ``sys.modules`` holds (as transformers re-executes one) or a new one."""
    spec = _checked_spec(name)
    if spec is None or spec.loader is None:
        raise ImportError(f"{name} holds no checked bytes", name=name)
    module = sys.modules.get(name)
    if module is None:
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
    else:
        module.__spec__, module.__loader__, module.__file__ = spec, spec.loader, spec.origin
    spec.loader.exec_module(module)
    return module


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        checked = _checked_spec(fullname)
        if checked is not None:
            return checked
        found = registration_for(fullname)
        if found is None:
            return None
        registration, name = found
        where = registration.locate(name)
        if where is None:
            return None  # ImportError "No module named ..." from importlib, as usual
        rel, is_package = where
        spec = importlib.machinery.ModuleSpec(
            fullname,
            _Loader(registration, name, rel),
            origin=str(registration.verified_dir() / rel) if rel else None,
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
    """Put the finder first on ``sys.meta_path`` (idempotent).

    Not at import: importing codeferry changes nothing global. ``register`` (every
    ``load``, ``install()``, arriving ticket) and importing ``codeferry._dyn`` (what
    unpickling a class by name does first) call it.
    """
    with _lock:
        if not any(isinstance(f, _Finder) for f in sys.meta_path):
            sys.meta_path.insert(0, _FINDER)


def import_module(registration: Registration, name: str) -> types.ModuleType:
    """Import module ``name`` of the unit (dotted, relative to the unit root)."""
    return importlib.import_module(registration.module_name(name))
