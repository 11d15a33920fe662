"""The resolved model as data: ``FileEntry``, ``Module``, ``RepoScan`` and ``Bundle``.

``resolve`` builds these and every layer above reads them (the loader, the trust decision,
the lock file, the commands), so they live apart from the resolver: reading a ``Bundle``
does not need the code that walks a model's imports. ``Bundle`` also answers which
problems block which class (``problems_for``, ``check_classes``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import CodeferryError, MissingTransformersNameError, ProblemsFound
from . import graph as _graph
from .automap import ClassRef, qualified
from .requirements import Requirement
from .source import ModelOrigin

__all__ = ["Door", "FileEntry", "Module", "RepoScan", "Bundle", "ref_scope"]


@dataclass(frozen=True)
class Door:
    """A way besides ``auto_map`` by which transformers executes a file of the model
    (``name``: ``"custom_generate"``), the file (``path``) and the line it takes code from."""

    name: str
    path: str
    line: int


@dataclass(frozen=True)
class FileEntry:
    """One needed file: ``repo`` is ``None`` for the model's own code."""

    repo: str | None
    path: str
    sha256: str
    size: int
    kind: str  # "module" | "package" | "asset"


@dataclass(frozen=True)
class Module:
    """A module of a unit: ``name`` is dotted from the unit root (``utils.rope``)."""

    repo: str | None
    name: str
    path: str
    is_package: bool

    @property
    def qualified(self) -> str:
        """Unique across units: cross-repo modules read ``org/repo--module``."""
        return qualified(self.repo, self.name)


@dataclass
class RepoScan:
    """One repo's worth of code as the resolver scans it from disk: the model's own
    (``repo=None``) or a cross-repo one. The first layer of a unit: ``Bundle`` gathers the
    scans, and ``_runtime.loader.units_of`` turns each into a ``unit.Unit``."""

    origin: ModelOrigin
    repo: str | None
    files: dict[str, Path]
    modules: dict[str, Module] = field(default_factory=dict)
    contents: dict[str, bytes] = field(default_factory=dict)
    scans: dict[str, _graph.ModuleScan] = field(default_factory=dict)
    assets: set[str] = field(default_factory=set)
    asset_data: dict[str, bytes] = field(default_factory=dict)  # read once (up to 1 GiB each)


@dataclass(frozen=True)
class Bundle:
    """The resolved remote code of one model. ``contents`` holds the exact hashed bytes."""

    origin: ModelOrigin
    classes: tuple[ClassRef, ...]
    files: tuple[FileEntry, ...]
    modules: tuple[Module, ...]
    load_order: tuple[str, ...]
    edges: tuple[tuple[str, str, bool], ...]
    requirements: tuple[Requirement, ...]
    problems: tuple[CodeferryError, ...]
    digest: str
    pins: Mapping[str, str]
    contents: Mapping[tuple[str | None, str], bytes]
    #: Per class: the modules its module-level imports reach (parent packages included),
    #: in load order. Only these execute when the class loads; the rest wait for an import.
    closures: Mapping[ClassRef, tuple[str, ...]] = field(default_factory=dict)
    #: Per problem (same index): what it blocks, as module names and ``ref_scope`` tokens;
    #: empty means the whole model.
    scopes: tuple[frozenset[str], ...] = ()
    #: child module -> parent package: an order constraint, not an import (not an edge).
    parents: tuple[tuple[str, str], ...] = ()
    #: The model's files that transformers executes through a door other than ``auto_map``
    #: (their modules and imports are in ``files``/``modules`` like any other code).
    doors: tuple[Door, ...] = ()

    @property
    def blocking(self) -> tuple[CodeferryError, ...]:
        return tuple(p for p in self.problems if p.blocking)

    def on_release(self) -> Bundle:
        """This bundle as a release environment's workers see it (``_code.removed.release_for``
        chose the release): without the problems of names the installed transformers lacks
        and that release has."""
        keep = [i for i, p in enumerate(self.problems)
                if not (isinstance(p, MissingTransformersNameError) and p.needs)]
        return replace(self, problems=tuple(self.problems[i] for i in keep),
                       scopes=tuple(self.scopes[i] for i in keep if i < len(self.scopes)))

    def problems_for(self, ref: ClassRef) -> tuple[CodeferryError, ...]:
        """The blocking problems that keep ``ref`` from loading: in its closure, or its own."""
        reach = set(self.closures.get(ref, ())) | {ref_scope(ref)}
        out = []
        for index, problem in enumerate(self.problems):
            scope = self.scopes[index] if index < len(self.scopes) else frozenset()
            if problem.blocking and (not scope or scope & reach):
                out.append(problem)
        return tuple(out)

    def check_classes(self, keys: set[str] | None = None) -> None:
        """Raise what keeps the classes ``keys`` (all when ``None``) from loading.

        Keys are ``load``'s (``"llm_config:AutoConfig"`` for a nested sub-config); keys the
        model does not name are plain transformers classes, with nothing to check. With
        ``keys=None`` a problem is raised only when it blocks *every* class: one class's
        missing package never takes the model down.
        """
        refs = [r for r in self.classes if keys is None or _key(r) in keys]
        blocked = [r for r in refs if self.problems_for(r)]
        if keys is None and len(blocked) < len(refs):
            return
        problems: dict[int, CodeferryError] = {}
        for ref in blocked:
            problems.update((id(p), p) for p in self.problems_for(ref))
        _raise(tuple(problems.values()), self.origin.name, self.origin.root)

    def check_class(self, ref: ClassRef) -> None:
        """Raise what keeps ``ref`` from loading: the problem alone, or ``ProblemsFound``."""
        _raise(self.problems_for(ref), f"{ref.key} ({ref.reference}) of {self.origin.name}",
               self.origin.root)

    def check(self) -> None:
        """Raise the blocking problems: alone when there is one, as ``ProblemsFound`` else."""
        _raise(self.blocking, self.origin.name, self.origin.root)

    def to_json(self) -> dict[str, Any]:
        """The ``codeferry inspect --json`` object."""
        return {
            "model": self.origin.name,
            "root": str(self.origin.root),
            "repo_id": self.origin.repo_id,
            "commit": self.origin.commit,
            "digest": self.digest,
            "classes": [
                {"source": c.declared_in, "key": c.key, "slot": c.slot, "repo": c.repo,
                 "module": c.module, "class": c.name, "reference": c.reference,
                 "closure": list(self.closures.get(c, ())),
                 "loadable": not self.problems_for(c),
                 "blocked_by": [self.problems.index(p) for p in self.problems_for(c)]}
                for c in self.classes
            ],
            "files": [
                {"path": f.path, "repo": f.repo, "sha256": f.sha256, "size": f.size, "kind": f.kind}
                for f in self.files
            ],
            "load_order": list(self.load_order),
            "edges": [{"importer": a, "imported": b, "deferred": d} for a, b, d in self.edges],
            "pins": dict(self.pins),
            "requirements": [r.to_json() for r in self.requirements],
            "doors": [{"door": d.name, "path": d.path, "line": d.line} for d in self.doors],
            "problems": [p.to_dict() for p in self.problems],
        }


def _key(ref: ClassRef) -> str:
    """``load``'s key of ``ref``: the ``auto_map`` key, prefixed for nested sub-configs."""
    return f"{ref.declared_in.split(':', 1)[1]}:{ref.key}" if ":" in ref.declared_in else ref.key


def ref_scope(ref: ClassRef) -> str:
    """The scope token of problems about one ``auto_map`` entry itself."""
    return f"ref:{ref.declared_in}:{ref.key}:{ref.slot}"


def _raise(blocking: tuple[CodeferryError, ...], what: str, root: Path) -> None:
    if len(blocking) == 1:
        raise blocking[0]
    if blocking:
        lines = "; ".join(str(p) for p in blocking)
        raise ProblemsFound(
            f"{len(blocking)} blocking problems in {what}: {lines}",
            problems=blocking,
            fix=f"run `codeferry inspect {root}` for the full report.",
        )
