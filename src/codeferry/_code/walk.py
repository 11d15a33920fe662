"""The import walker: from the ``auto_map`` classes to every file their code needs.

Phase 2 of ``resolve``, kept apart from the phases around it: ``Walker`` registers the
module each class names, reads, parses and scans it (``graph``), follows its relative
imports (and absolute imports of the model's own files) with a work list, finds the data
files the code names, and fetches each cross-repo unit at a pinned commit. It records
problems with the classes they block; ``resolve`` orders, hashes and reports the result.
"""

from __future__ import annotations

import ast
import io
import os
import sys
import tokenize
from collections import deque

from ..errors import (
    AbsoluteSiblingImportError,
    CodeferryError,
    HubRepoNotFoundError,
    LFSPointerError,
    MissingClassError,
    MissingModuleError,
    ModelNotFoundError,
    OptionalModuleMissing,
    SourceDecodeError,
    SourceSyntaxError,
    SourceTooDeepError,
    UnsafePathError,
)
from . import graph as _graph
from . import hub as _hub
from .automap import ClassRef, qualified
from .bundle import Module, RepoScan, ref_scope
from .source import WEIGHT_SUFFIXES, ModelOrigin, list_files, read_bytes

__all__ = ["DOORS", "LFS_HEADER", "Walker"]

#: The first line of a Git LFS pointer file: a file that was never downloaded.
LFS_HEADER = b"version https://git-lfs.github.com/spec/v1"

#: Doors besides ``auto_map`` through which transformers executes a repo's Python, as
#: (door, the module file it executes, the data files it reads beside it). transformers'
#: ``load_custom_generate`` runs ``custom_generate/generate.py`` (and what it imports
#: relatively) in ``from_pretrained`` and in ``generate(custom_generate=...)``, after
#: checking ``custom_generate/requirements.txt``; code it runs is code the lock must list.
DOORS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("custom_generate", "custom_generate/generate.py", ("custom_generate/requirements.txt",)),
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


def _needed_file(module: Module, imp: _graph.RelativeImport, missing: str) -> str:
    """The file a relative import that ``resolve_relative`` found ``missing`` needs: its whole
    target (``utils/rope.py`` for ``from .utils.rope import x``, where ``utils`` is missing)."""
    parts = module.name.split(".") if module.name else []
    package = parts if module.is_package else parts[:-1]
    base = package[: len(package) - (imp.level - 1)]
    target = ".".join(base + (imp.module.split(".") if imp.module else []))
    whole = target if imp.module and (target + ".").startswith(missing + ".") else missing
    return whole.replace(".", "/") + ".py"


def _def_line(data: bytes, name: str) -> int:
    """The line of the top-level ``def name`` in ``data`` (1 when there is none)."""
    for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
        if line.startswith((f"def {name}(", f"async def {name}(", f"{name} =")):
            return number
    return 1


class Walker:
    """Phase 2 of ``resolve``: the units, modules, edges and problems found so far."""

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
        #: Per unit (``None``: the model's own), files its code imports at load that are not
        #: there: a hub snapshot that lacks them may have been fetched in part.
        self.absent: dict[str | None, set[str]] = {}

    def snapshot_gaps(self) -> list[tuple[str | None, ModelOrigin, tuple[str, ...]]]:
        """``(repo, origin, files)`` of each unit from the hub cache whose code imports, at
        load, files its snapshot lacks."""
        return [(repo, unit.origin, tuple(sorted(self.absent[repo])))
                for repo, unit in self.units.items()
                if self.absent.get(repo) and unit.origin.repo_id and unit.origin.commit]

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
            self.absent.setdefault(unit.repo, set()).add(name.replace(".", "/") + ".py")
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
        if data.startswith(LFS_HEADER):
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
                    self.absent.setdefault(unit.repo, set()).add(_needed_file(module, imp, missing[0]))
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

    # -- doors ------------------------------------------------------------------------

    def add_doors(self) -> list[tuple[str, str, int]]:
        """Walk the model's own files that a door other than ``auto_map`` executes, as
        ``add_class`` walks a class's module; ``(door, path, line)`` of each one found (the
        line of the function transformers takes from it, else 1)."""
        found: list[tuple[str, str, int]] = []
        unit = self.main
        for door, rel, data_files in DOORS:
            if rel not in unit.files:
                continue
            name = rel.removesuffix(".py").replace("/", ".")
            self.add_module(unit, name, where=_display(unit, rel), line=1)
            self.drain()
            for extra in data_files:
                if extra in unit.files and extra not in unit.assets:
                    unit.asset_data[extra] = read_bytes(unit.origin, extra, asset=True)
                    unit.assets.add(extra)
            found.append((door, rel, _def_line(unit.contents.get(rel, b""), "generate")))
        return found

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
