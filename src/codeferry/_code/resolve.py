"""Resolve a model's remote code statically: classes, files, load order, digest, problems.

This is what ``codeferry inspect`` prints and what every loader starts from. It reads
bytes and parses them; it never imports or executes model code. The bytes it hashed
are kept in the result (``Bundle.contents``), so whoever executes the code later runs
exactly the bytes that were checked, not a file read again after the check.

Phases, in order:

1. locate the model (``_hub``: on disk, ``_source``, after downloading a repo id the
   cache lacks) and read every ``auto_map`` (``_automap``);
2. from the ``auto_map`` modules, walk relative imports to every needed file, per
   *unit*: the model's own code, plus each repo a cross-repo reference names, pinned
   at the commit its revision resolves to;
3. order modules dependencies-first, find cycles, collect problems and requirements;
4. hash: one sha256 per file and one digest over (unit, path, sha256) of all files,
   so it is stable across machines, folder names and file times.
"""

from __future__ import annotations

import ast
import io
import json
import os
import sys
import tokenize
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import (
    AbsoluteSiblingImportError,
    CodeferryError,
    ConfigNotFoundError,
    HubRepoNotFoundError,
    ImportCycleError,
    InvalidConfigError,
    LFSPointerError,
    MissingClassError,
    MissingModuleError,
    ModelNotFoundError,
    OptionalModuleMissing,
    OptionalPackageMissing,
    ProblemsFound,
    SourceDecodeError,
    SourceSyntaxError,
    SourceTooDeepError,
    UnsafePathError,
)
from . import graph as _graph
from . import hub as _hub
from .automap import AUTO_MAP_FILES, ClassRef, parse_auto_maps, qualified
from .digest import bundle_digest, file_sha256
from .requirements import (
    Requirement,
    check_transformers_names,
    collect_requirements,
    missing_packages,
)
from .source import WEIGHT_SUFFIXES, ModelOrigin, list_files, read_bytes

__all__ = ["FileEntry", "Module", "RepoScan", "Bundle", "resolve"]

_LFS_HEADER = b"version https://git-lfs.github.com/spec/v1"


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
    scans, and ``_loader.units_of`` turns each into a ``_store.Unit``."""

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

    @property
    def blocking(self) -> tuple[CodeferryError, ...]:
        return tuple(p for p in self.problems if p.blocking)

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


def _display(unit: RepoScan, rel: str) -> str:
    return str(unit.origin.root / rel)


def _busiest_line(text: str) -> int:
    """The line with the most tokens: where a too deeply nested expression sits."""
    counts: dict[int, int] = {}
    try:
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            counts[token.start[0]] = counts.get(token.start[0], 0) + 1
    except (tokenize.TokenError, SyntaxError, RecursionError, MemoryError):
        pass
    if not counts:
        lines = text.splitlines() or [""]
        return max(range(len(lines)), key=lambda i: len(lines[i])) + 1
    return max(counts, key=lambda line: counts[line])


def _too_deep(unit: RepoScan, rel: str, line: int, consequence: str) -> SourceTooDeepError:
    return SourceTooDeepError(
        f"{rel} nests code too deeply: {consequence}.", path=_display(unit, rel), line=line,
        fix="split that expression into smaller ones (intermediate variables, or a loop).",
    )


def _load_json(path: Path) -> tuple[Any, str]:
    try:
        raw = path.read_bytes()
    except OSError:
        raw = b""
    if raw.startswith(_LFS_HEADER):
        raise LFSPointerError(
            f"{path.name} is a Git LFS pointer, not JSON: the real file was never downloaded.",
            path=str(path), line=1,
            fix="fetch the real file (`git lfs pull` in the model's clone, or download the "
            "repo again with huggingface_hub).",
        )
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidConfigError(
            f"{path.name} is not UTF-8 ({exc.reason}).", path=str(path),
            fix=f"save {path.name} as UTF-8 JSON.",
        ) from None
    try:
        return json.loads(text), text
    except json.JSONDecodeError as exc:
        raise InvalidConfigError(
            f"{path.name} is not valid JSON: {exc.msg}.", path=str(path), line=exc.lineno,
            col=exc.colno, fix=f"correct {path.name} at that position (a JSON linter shows it).",
        ) from None
    except (ValueError, RecursionError) as exc:  # a number too long, nesting too deep
        why = "it nests arrays or objects too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise InvalidConfigError(
            f"{path.name} cannot be read as JSON: {why}.", path=str(path),
            fix=f"correct {path.name}; no model config needs such values.",
        ) from None


def read_class_refs(origin: ModelOrigin) -> list[ClassRef]:
    """Every ``auto_map`` entry of the model, file by file."""
    config = origin.root / "config.json"
    if not config.is_file():
        raise ConfigNotFoundError(
            f"{origin.root} has no config.json, so it is not a model folder.",
            path=str(config),
            fix="pass the folder that holds config.json (for a hub snapshot, the snapshot folder).",
        )
    refs: list[ClassRef] = []
    for name in AUTO_MAP_FILES:
        path = origin.root / name
        if path.is_file():
            data, text = _load_json(path)
            refs += parse_auto_maps(data, filename=name, path=str(path), text=text)
    return refs


class _Resolver:
    def __init__(
        self, origin: ModelOrigin, cache_dir: str | os.PathLike[str] | None = None,
        token: str | bool | None = None, local_files_only: bool | None = None,
    ) -> None:
        self.main = RepoScan(origin, None, list_files(origin))
        self.cache_dir = cache_dir  # where cross-repo code is looked up, like the model
        self.token = token  # and how it is downloaded when it is not there
        self.local_files_only = local_files_only
        self.units: dict[str | None, RepoScan] = {None: self.main}
        self.problems: list[CodeferryError] = []
        self.scopes: list[frozenset[str]] = []  # per problem: the modules/refs it blocks
        self.edges: set[tuple[str, str, bool]] = set()
        # child -> parent package: Python runs the parent first, and a parent that
        # imports its own submodules (``from .rope import rope`` in __init__) is fine.
        self.parent_edges: set[tuple[str, str]] = set()
        self.pins: dict[str, str] = {}
        self.siblings: set[str] = set()  # absolute imports that are really model files
        self.pending: deque[tuple[RepoScan, Module]] = deque()  # registered, not read yet

    def report(self, problem: CodeferryError, *scope: str) -> None:
        """Record ``problem``; it blocks the classes whose closure meets ``scope``."""
        self.problems.append(problem)
        self.scopes.append(frozenset(scope))

    # -- units ------------------------------------------------------------------------

    def unit_for(self, repo: str | None) -> RepoScan | None:
        if repo in self.units:
            return self.units[repo]
        assert repo is not None
        # A cross-repo reference is pinned, never floated: transformers fetches it at
        # ``code_revision``, which defaults to the other repo's main branch whatever
        # revision the model was asked at. We resolve ``main`` once, to a commit, and
        # record it.
        origin = _hub.locate(repo, is_repo_id=True, cache_dir=self.cache_dir, token=self.token,
                             local_files_only=self.local_files_only)
        assert origin.commit is not None
        self.pins[repo] = origin.commit
        unit = RepoScan(origin, repo, list_files(origin))
        self.units[repo] = unit
        return unit

    # -- modules ----------------------------------------------------------------------

    def add_module(self, unit: RepoScan, name: str, *, where: str, line: int | None) -> Module | None:
        """Register module ``name`` of ``unit`` and its parent packages (once each).

        Reading, parsing and walking their imports happens in ``drain``, from a work
        list: a chain of a thousand imports, or a package a thousand folders deep, takes
        no more stack than one file (recursion would run out of it, and the parser,
        called at that depth, would call a one-line file too deeply nested).
        """
        module = unit.modules.get(name) or self._register(unit, name, where=where, line=line)
        # Parent packages execute first: ``utils.rope`` needs ``utils/__init__.py``.
        child = module
        while child is not None and "." in child.name:
            parent_name = child.name.rsplit(".", 1)[0]
            parent = unit.modules.get(parent_name)
            known = parent is not None
            if parent is None:
                parent = self._register(unit, parent_name, where=where, line=line)
            if parent is not None:
                self.parent_edges.add((child.qualified, parent.qualified))
            child = None if known else parent
        return module

    def _register(self, unit: RepoScan, name: str, *, where: str, line: int | None) -> Module | None:
        found = _graph.module_path(name, unit.files)
        full_name = qualified(unit.repo, name)
        if found is None or (found[0] == "" and not found[1]):
            self.report(MissingModuleError(
                f"module {name!r} is not in {unit.origin.name} (no {name.replace('.', '/')}.py).",
                path=where, line=line,
                fix=f"add {name.replace('.', '/')}.py to the model folder, or correct the name.",
            ), full_name)
            return None
        rel, is_package = found
        module = Module(unit.repo, name, rel, is_package)
        unit.modules[name] = module
        if rel:  # a namespace folder has nothing to read
            self.pending.append((unit, module))
        return module

    def drain(self) -> None:
        """Read and scan every registered module not read yet, and the ones they import."""
        while self.pending:
            unit, module = self.pending.popleft()
            self.read_module(unit, module)

    def read_module(self, unit: RepoScan, module: Module) -> None:
        """Read, parse and scan one module, and register what it imports."""
        name, rel = module.name, module.path
        data = read_bytes(unit.origin, rel)
        unit.contents[rel] = data
        if data.startswith(_LFS_HEADER):
            self.report(LFSPointerError(
                f"{rel} is a Git LFS pointer, not Python code.", path=_display(unit, rel), line=1,
                fix="fetch the real file (`git lfs pull`, or download the repo again).",
            ), module.qualified)
            return
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            line_no = data[: exc.start].count(b"\n") + 1
            raise SourceDecodeError(
                f"{rel} is not UTF-8 (byte 0x{data[exc.start]:02x} at offset {exc.start}).",
                path=_display(unit, rel), line=line_no,
                fix=f"re-save {rel} as UTF-8.",
            ) from None
        try:
            tree = ast.parse(text, filename=rel)
        except SyntaxError as exc:
            self.report(SourceSyntaxError(
                f"{rel} is not valid Python: {exc.msg}.", path=_display(unit, rel),
                line=exc.lineno, col=exc.offset, fix=f"correct the syntax of {rel} at that position.",
            ), module.qualified)
            return
        except (RecursionError, MemoryError):  # the parser's own stack ran out
            self.report(_too_deep(unit, rel, _busiest_line(text), "Python cannot compile it"),
                        module.qualified)
            return
        try:
            scan = _graph.scan(tree)
        except _graph.NestingTooDeep as exc:
            self.report(_too_deep(unit, rel, exc.line, "codeferry cannot analyse it"),
                        module.qualified)
            return
        unit.scans[name] = scan
        self.walk_imports(unit, module, scan)
        self.find_assets(unit, module, scan)

    def walk_imports(self, unit: RepoScan, module: Module, scan: _graph.ModuleScan) -> None:
        where = _display(unit, module.path)
        for imp in scan.relative:
            try:
                found, missing = _graph.resolve_relative(module.name, module.is_package, imp, unit.files)
            except ValueError:
                raise UnsafePathError(
                    f"{module.path} imports {'.' * imp.level}{imp.module or ''}, "
                    "which climbs above the model folder.",
                    path=where, line=imp.line, col=imp.col,
                    fix="import only modules inside the model folder.",
                ) from None
            for name in found:
                target = self.add_module(unit, name, where=where, line=imp.line)
                if target is not None and target.name != module.name:
                    self.edges.add((module.qualified, target.qualified, imp.deferred))
            if missing:
                stem = missing[0].replace(".", "/")
                text = (f"{module.path} imports {'.' * imp.level}{imp.module or ''}, "
                        f"but {stem}.py is not in the model folder")
                if imp.guarded or imp.deferred:
                    how = "guarded" if imp.guarded else "inside a function"
                    self.report(OptionalModuleMissing(
                        f"{text}; the import is {how}, so only the code path that needs it fails.",
                        path=where, line=imp.line, col=imp.col,
                        fix=f"nothing, unless that path is used: then add {stem}.py.",
                    ), module.qualified)
                else:
                    self.report(MissingModuleError(
                        f"{text}.", path=where, line=imp.line, col=imp.col,
                        fix=f"add {stem}.py, or wrap the import in try/except ImportError if it "
                        "is optional.",
                    ), module.qualified)
        for ext in scan.external:
            top_file = _graph.module_path(ext.top, unit.files)
            if top_file is not None and ext.top not in sys.stdlib_module_names:
                self.siblings.add(ext.top)
                rel_form = f"from .{ext.module} import ..." if ext.names else f"from . import {ext.top}"
                self.report(AbsoluteSiblingImportError(
                    f"{module.path} imports {ext.module!r} absolutely, but it is a file of "
                    "the model; that only works when the model folder is on sys.path.",
                    path=where, line=ext.line, col=ext.col,
                    fix=f"use a relative import: `{rel_form}`.",
                ), module.qualified)
                target = self.add_module(unit, ext.module if _graph.module_path(
                    ext.module, unit.files) else ext.top, where=where, line=ext.line)
                if target is not None:
                    self.edges.add((module.qualified, target.qualified, ext.deferred))

    def find_assets(self, unit: RepoScan, module: Module, scan: _graph.ModuleScan) -> None:
        """Non-Python files the code names in a string, next to it or at the root."""
        here = module.path.rsplit("/", 1)[0] + "/" if "/" in module.path else ""
        for text in scan.strings:
            if text.endswith(".py") or "\n" in text:
                continue
            for candidate in (here + text, text):
                if candidate in unit.files and candidate not in unit.assets:
                    if candidate.endswith(WEIGHT_SUFFIXES):
                        continue  # weights are data, not code
                    # fenced, size-checked, and the bytes that get hashed: read once
                    unit.asset_data[candidate] = read_bytes(unit.origin, candidate, asset=True)
                    unit.assets.add(candidate)

    # -- classes ----------------------------------------------------------------------

    def add_class(self, ref: ClassRef) -> None:
        where = str(self.main.origin.root / ref.declared_in.split(":", 1)[0])
        try:
            unit = self.unit_for(ref.repo)
        except ModelNotFoundError as exc:
            why = (f"cannot be fetched ({exc.message.rstrip('.')})."
                   if isinstance(exc, HubRepoNotFoundError)
                   else "is not in the local Hugging Face cache.")
            self.report(MissingModuleError(
                f"auto_map[{ref.key!r}] names {ref.reference!r}, but repo {ref.repo!r} {why}",
                path=where, fix=exc.fix,
            ), ref_scope(ref))
            return
        assert unit is not None
        module = self.add_module(unit, ref.module, where=where, line=None)
        self.drain()
        if module is None:
            return
        if not self.defines(unit, ref.module, ref.name):
            self.report(MissingClassError(
                f"auto_map[{ref.key!r}] names {ref.reference!r}, but {module.path} defines "
                f"no {ref.name!r}.", path=where,
                fix=f"define class {ref.name} in {module.path}, or correct the auto_map entry.",
            ), ref_scope(ref))

    def defines(self, unit: RepoScan, name: str, attr: str) -> bool:
        """Whether module ``name`` binds ``attr`` at module level (following star imports).

        A work list rather than recursion, for the same reason as ``add_module``.
        """
        todo, seen = [name], set()
        while todo:
            current = todo.pop()
            scan = unit.scans.get(current)
            module = unit.modules.get(current)
            if scan is None or module is None or current in seen:
                return True  # unreadable modules are reported on their own
            seen.add(current)
            if attr in scan.defined or scan.open_namespace or scan.star_external:
                return True
            for level, sub in reversed(scan.star_relative):
                imp = _graph.RelativeImport(level, sub, ("*",), 0, 0, False, False)
                found, _ = _graph.resolve_relative(current, module.is_package, imp, unit.files)
                if found:
                    todo.append(found[-1])
        return False


def resolve(
    model: str | os.PathLike[str],
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    requirements: bool = True,
    token: str | bool | None = None,
    local_files_only: bool | None = None,
    fetch: _hub.Need = "code",
) -> Bundle:
    """Resolve ``model`` (a folder, or a repo id of the Hugging Face Hub) without executing it.

    A repo id the hub cache lacks is downloaded first, unless ``HF_HUB_OFFLINE`` is set or
    ``local_files_only=True``: ``fetch="code"`` takes every file but the weights,
    ``fetch="model"`` everything (what loaders need). ``token`` is sent to the Hub
    (default: ``HF_TOKEN``, or the saved login).

    ``requirements=False`` skips the third-party package report (installed versions come
    from scanning every installed distribution, a third of a second): loaders do not
    need it.

    Raises a ``codeferry.errors`` error for input that cannot be analysed at all;
    everything else is reported in ``Bundle.problems``.
    """
    origin = _hub.locate(model, revision=revision, cache_dir=cache_dir, token=token,
                         local_files_only=local_files_only, need=fetch)
    refs = read_class_refs(origin)
    if cache_dir is None and origin.repo_id:
        # Cross-repo code of a cached repo (also one given as its snapshot folder, as
        # workers get it) comes from the cache that holds it.
        cache_dir = origin.fence.parent
    resolver = _Resolver(origin, cache_dir, token, local_files_only)
    for ref in refs:
        resolver.add_class(ref)

    modules = [m for unit in resolver.units.values() for m in unit.modules.values()]
    names = [m.qualified for m in modules]
    eager = [(a, b) for a, b, deferred in resolver.edges if not deferred]
    cycle = _graph.find_cycle(names, eager)
    if cycle:
        by_name = {m.qualified: m for m in modules}
        paths = " -> ".join(by_name[n].path or n for n in cycle)
        resolver.report(ImportCycleError(
            f"modules import each other at module level: {paths}.",
            cycle=tuple(cycle), path=str(origin.root / by_name[cycle[0]].path),
            fix="move one of these imports into the function that uses it.",
        ), *cycle)
    # Parent packages and deferred imports still order modules where they can (a
    # function-level import of a config module is happier when the config exists), but
    # never create a cycle: try the richest edge set first.
    parents = sorted(resolver.parent_edges)
    candidates = [[(a, b) for a, b, _ in resolver.edges] + parents, eager + parents, eager]
    order_edges = next((c for c in candidates if not _graph.find_cycle(names, c)), eager)
    order = _graph.load_order(names, order_edges)

    files: list[FileEntry] = []
    contents: dict[tuple[str | None, str], bytes] = {}
    for unit in resolver.units.values():
        for rel, data in unit.contents.items():
            kind = "package" if rel.endswith("__init__.py") else "module"
            files.append(FileEntry(unit.repo, rel, file_sha256(data), len(data), kind))
            contents[(unit.repo, rel)] = data
        for rel in unit.assets:
            asset = unit.asset_data.get(rel)
            if asset is None:
                asset = read_bytes(unit.origin, rel, asset=True)
            files.append(FileEntry(unit.repo, rel, file_sha256(asset), len(asset), "asset"))
            contents[(unit.repo, rel)] = asset
    files.sort(key=lambda f: (f.repo or "", f.path))
    digest = bundle_digest(files)

    scans = [
        (qualified(unit.repo, unit.modules[name].path), scan)
        for unit in resolver.units.values()
        for name, scan in unit.scans.items()
    ]
    found_requirements = collect_requirements(scans, skip=resolver.siblings) if requirements else []
    located = [
        (str(unit.origin.root / unit.modules[name].path), scan)
        for unit in resolver.units.values()
        for name, scan in unit.scans.items()
    ]
    module_at = {
        str(unit.origin.root / unit.modules[name].path): unit.modules[name].qualified
        for unit in resolver.units.values()
        for name in unit.scans
    }
    closures = _closures(refs, resolver.edges, resolver.parent_edges, order)
    at_load = {name for closure in closures.values() for name in closure}
    for path, scan in located:
        for problem in missing_packages(path, scan, skip=resolver.siblings):
            note: CodeferryError = problem
            if module_at[path] not in at_load:  # only ever imported inside a function
                note = OptionalPackageMissing(
                    f"{problem.message[:-1]}; nothing imports this module at load, so only "
                    "the code that imports it fails.", path=problem.path, line=problem.line,
                    col=problem.col, package=problem.package,
                    distribution=problem.distribution, fix=problem.fix,
                )
            resolver.report(note, module_at[path])
    for found in check_transformers_names(located):
        resolver.report(found, module_at.get(found.path or "", ""))
    problems = resolver.problems
    return Bundle(
        origin=origin,
        classes=tuple(refs),
        files=tuple(files),
        modules=tuple(sorted(modules, key=lambda m: m.qualified)),
        load_order=tuple(order),
        edges=tuple(sorted(resolver.edges)),
        requirements=tuple(found_requirements),
        problems=tuple(problems),
        digest=digest,
        pins=dict(resolver.pins),
        contents=contents,
        closures=closures,
        scopes=tuple(resolver.scopes),
        parents=tuple(parents),
    )


def _closures(
    refs: list[ClassRef],
    edges: set[tuple[str, str, bool]],
    parent_edges: set[tuple[str, str]],
    order: list[str],
) -> dict[ClassRef, tuple[str, ...]]:
    """Per class, what executes when it loads: module-level imports and parent packages.

    Deferred imports (inside a function) are not followed: plain transformers does not
    execute those at load either, and a helper that needs a missing package there must
    not take the class down.
    """
    follows: dict[str, set[str]] = {}
    for a, b, deferred in edges:
        if not deferred:
            follows.setdefault(a, set()).add(b)
    for child, parent in parent_edges:
        follows.setdefault(child, set()).add(parent)
    rank = {name: i for i, name in enumerate(order)}
    out: dict[ClassRef, tuple[str, ...]] = {}
    for ref in refs:
        start = qualified(ref.repo, ref.module)
        seen = {start}
        todo = [start]
        while todo:
            for nxt in follows.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        out[ref] = tuple(sorted(seen, key=lambda n: (rank.get(n, len(rank)), n)))
    return out
