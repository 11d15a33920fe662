"""Third-party packages the code imports, and names it takes from transformers.

Answers "will this code import here?" without executing it: a package is *installed*
when its import system spec exists (found, not imported); its version comes from the
distribution metadata. An import is *guarded* when a failure is handled (inside
``try/except ImportError``, under ``if is_x_available()``) or deferred (inside a
function), so a missing package only breaks the code path that needs it.

Names taken from transformers are checked against the installed transformers: real
remote code pins a transformers version implicitly (``from transformers.modeling_utils
import ...`` of a name that later moved), and this is where such code breaks first.
Checking imports transformers' own packages (which are lazy and cheap), never the model.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import importlib.util
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

from ..errors import CodeferryError, MissingPackageError, MissingTransformersNameError
from .graph import ModuleScan, scan
from .removed import IMPORTS as _REMOVED
from .removed import by_release

__all__ = [
    "Use",
    "Requirement",
    "collect_requirements",
    "check_transformers_names",
    "missing_packages",
    "pip_name",
]

#: Import names whose distribution (what ``pip install`` takes) has another name. Only
#: consulted for packages that are not installed, where no metadata can answer.
_PIP_NAMES = {
    "PIL": "pillow",
    "cv2": "opencv-python",
    "sklearn": "scikit-learn",
    "skimage": "scikit-image",
    "yaml": "pyyaml",
    "attr": "attrs",
    "bs4": "beautifulsoup4",
    "Crypto": "pycryptodome",
    "fitz": "pymupdf",
    "google": "protobuf",
    "flash_attn": "flash-attn",
    "sentencepiece": "sentencepiece",
    "tiktoken": "tiktoken",
    "dateutil": "python-dateutil",
    "jose": "python-jose",
    "docx": "python-docx",
    "magic": "python-magic",
    "Levenshtein": "levenshtein",
    "faiss": "faiss-cpu",
    "decord": "decord",
}


@dataclass(frozen=True)
class Use:
    """One import of a package: where, and whether its failure is handled."""

    path: str
    line: int
    guarded: bool

    def __str__(self) -> str:
        return f"{self.path}:{self.line}" + (" (guarded)" if self.guarded else "")


@dataclass(frozen=True)
class Requirement:
    """A third-party package (by import name) the code imports."""

    name: str
    installed: bool
    version: str | None
    distribution: str | None
    guarded: bool
    uses: tuple[Use, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "installed": self.installed,
            "version": self.version,
            "distribution": self.distribution,
            "guarded": self.guarded,
            "uses": [{"path": u.path, "line": u.line, "guarded": u.guarded} for u in self.uses],
        }


@lru_cache(maxsize=1)
def _distributions() -> dict[str, list[str]]:
    return dict(importlib.metadata.packages_distributions())


def _has_spec(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _installed(name: str) -> tuple[bool, str | None, str | None]:
    if not _has_spec(name):
        return False, None, None
    dists = _distributions().get(name, [])
    if not dists:
        return True, None, None
    try:
        return True, importlib.metadata.version(dists[0]), dists[0]
    except importlib.metadata.PackageNotFoundError:
        return True, None, dists[0]


def pip_name(package: str) -> str:
    """What ``pip install`` takes for import name ``package``."""
    dists = _distributions().get(package)
    if dists:
        return dists[0]
    return _PIP_NAMES.get(package, package.replace("_", "-"))


def missing_packages(
    path: str, module_scan: ModuleScan, *, skip: Iterable[str] = ()
) -> list[MissingPackageError]:
    """A problem per unguarded module-level import of a package that is not installed.

    Only the module's own imports: whether a *class* is blocked follows from the modules
    its import closure holds. Finding a spec imports nothing of the package.
    """
    ignored = set(sys.stdlib_module_names) | {"__future__"} | set(skip)
    problems: list[MissingPackageError] = []
    seen: set[str] = set()
    for imp in module_scan.external:
        if imp.top in ignored or imp.guarded or imp.deferred or imp.top in seen:
            continue
        seen.add(imp.top)
        if _has_spec(imp.top):
            continue
        dist = pip_name(imp.top)
        problems.append(MissingPackageError(
            f"imports {imp.module!r} at module level, but the package {imp.top!r} is not "
            "installed.",
            path=path, line=imp.line, col=imp.col, package=imp.top, distribution=dist,
            fix=f"`pip install {dist}` (or use a class of the model that does not need it).",
        ))
    return problems


def collect_requirements(
    scans: Iterable[tuple[str, ModuleScan]], *, skip: Iterable[str] = ()
) -> list[Requirement]:
    """One ``Requirement`` per third-party top-level package, with every use."""
    ignored = set(sys.stdlib_module_names) | {"__future__"} | set(skip)
    uses: dict[str, list[Use]] = {}
    for path, module_scan in scans:
        for imp in module_scan.external:
            if imp.top in ignored:
                continue
            uses.setdefault(imp.top, []).append(Use(path, imp.line, imp.guarded or imp.deferred))
    result = []
    for name in sorted(uses):
        installed, version, dist = _installed(name)
        found = tuple(sorted(uses[name], key=lambda u: (u.path, u.line)))
        result.append(Requirement(name, installed, version, dist, all(u.guarded for u in found), found))
    return result



def _exported(module: Any) -> frozenset[str]:
    """``dir(module)``, in linear time for transformers' lazy modules.

    ``_LazyModule.__dir__`` returns the module's ``__dict__`` keys plus ``__all__``, but
    tests each of ``__all__``'s ~6,400 names against a growing list: about 0.15 s for
    the top-level ``transformers``, paid by every ``load`` in every fresh process.
    """
    if type(module).__name__ == "_LazyModule" and "__dir__" not in vars(module):
        return frozenset(vars(module)) | frozenset(getattr(module, "__all__", ()))
    return frozenset(dir(module))

@cache
def _module_names(module: str) -> frozenset[str] | None:
    """Names module ``module`` of transformers offers; ``None`` when unknowable statically."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return frozenset()
    if spec is None:
        return frozenset()
    if spec.submodule_search_locations is not None or not spec.origin or not spec.origin.endswith(".py"):
        # transformers' packages are lazy modules whose __dir__ lists what they export.
        try:
            return _exported(importlib.import_module(module))
        except Exception:  # noqa: BLE001 - a broken transformers install: say nothing
            return None
    try:
        tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None
    facts = scan(tree)
    if facts.open_namespace or facts.star_external or facts.star_relative:
        return None
    return frozenset(facts.defined)


def check_transformers_names(scans: Iterable[tuple[str, ModuleScan]]) -> list[CodeferryError]:
    """A problem per unguarded ``from transformers... import name`` that does not exist here."""
    wanted = [
        (path, imp)
        for path, module_scan in scans
        for imp in module_scan.external
        if imp.top == "transformers" and imp.names and not imp.guarded
    ]
    if not wanted or not _has_spec("transformers"):
        return []
    version = importlib.metadata.version("transformers")
    problems: list[CodeferryError] = []
    for path, imp in wanted:
        names = _module_names(imp.module)
        if names is None:
            continue
        for name in imp.names:
            if name == "*" or name in names:
                continue
            if names and _has_spec(f"{imp.module}.{name}"):
                continue  # a submodule
            removed = _REMOVED.get((imp.module, name))
            if removed is not None and removed.shim:
                continue  # served to the module by a shim (_hf.compat)
            where = "does not exist" if not names else f"has no {name!r}"
            fix = ("install the transformers version the model was written for "
                   "(see its README or config.json 'transformers_version').")
            needs = ""
            if removed is not None and removed.last_with != "-":
                fix = (f"install transformers <= {removed.last_with} (the last release checked "
                       f"that has it; {removed.first_without} has not).")
            if removed is not None and by_release(removed):
                needs = removed.last_with
                fix = ("run it through codeferry.Executor or `codeferry run`: their workers "
                       "run it on a transformers release that has it (`codeferry inspect` "
                       f"names which); or {fix}")
            problems.append(MissingTransformersNameError(
                f"imports {name!r} from {imp.module}, which {where} in the installed "
                f"transformers {version}.",
                path=path, line=imp.line, col=imp.col, fix=fix, needs=needs,
            ))
    return problems
