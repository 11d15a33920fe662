"""The import graph of a model's code, built from ``ast`` alone: nothing is executed.

Pure code. ``scan`` turns one module's source into the facts we need (relative
imports with their line and context, third-party imports, module-level names, string
constants); ``resolve_relative`` maps a relative import onto the files that exist;
``load_order`` and ``find_cycle`` work on the resulting edges.

Why not transformers' scanner? In 5.23 it is a pair of regular expressions: it misses
``from . import x``, turns ``from .sub.mod import y`` into a file named ``sub.mod.py``
(transformers #36653), counts import-like text in docstrings, and requires imports
that sit in ``try/except ImportError``. Walking the syntax tree gets each case right.

Context matters for two flags on every import:

* *deferred*: inside a function body (or ``if TYPE_CHECKING``), so it runs later, if
  ever; it does not constrain module-level load order and cannot form a blocking cycle.
* *guarded*: inside ``try`` with an ``except ImportError`` (or broader) handler, or
  under ``if is_x_available()``: a missing target is optional, not an error.
"""

from __future__ import annotations

import ast
import heapq
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = [
    "RelativeImport",
    "NestingTooDeep",
    "ExternalImport",
    "ModuleScan",
    "scan",
    "module_path",
    "resolve_relative",
    "load_order",
    "find_cycle",
]

_IMPORT_ERRORS = frozenset({"ImportError", "ModuleNotFoundError", "Exception", "BaseException"})


@dataclass(frozen=True)
class RelativeImport:
    """``from .{module} import {names}`` (level dots) at ``line``."""

    level: int
    module: str | None
    names: tuple[str, ...]
    line: int
    col: int
    deferred: bool
    guarded: bool


@dataclass(frozen=True)
class ExternalImport:
    """An absolute import: ``module`` is the full dotted name, ``names`` what ``from`` takes."""

    module: str
    names: tuple[str, ...]
    line: int
    col: int
    deferred: bool
    guarded: bool

    @property
    def top(self) -> str:
        return self.module.split(".", 1)[0]


@dataclass
class ModuleScan:
    """What one module's source says, statically."""

    relative: list[RelativeImport] = field(default_factory=list)
    external: list[ExternalImport] = field(default_factory=list)
    #: Names bound at module level (classes, functions, assignments, imports).
    defined: set[str] = field(default_factory=set)
    #: Star imports at module level: relative ones as (level, module), external by name.
    star_relative: list[tuple[int, str | None]] = field(default_factory=list)
    star_external: list[str] = field(default_factory=list)
    #: True when names cannot be known statically (module ``__getattr__``, ``globals()`` writes).
    open_namespace: bool = False
    #: Every string constant, to spot assets the code reads (``"rope_table.json"``).
    strings: set[str] = field(default_factory=set)


def _catches_import_error(handlers: list[ast.ExceptHandler]) -> bool:
    for handler in handlers:
        if handler.type is None:
            return True
        kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        for kind in kinds:
            name = kind.id if isinstance(kind, ast.Name) else getattr(kind, "attr", "")
            if name in _IMPORT_ERRORS:
                return True
    return False


def _is_availability_test(test: ast.expr) -> bool:
    """``if is_torch_available():``, ``if TYPE_CHECKING:`` and friends."""
    for node in ast.walk(test):
        name = ""
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            if name.startswith("is_") and name.endswith("available"):
                return True
        if isinstance(node, (ast.Name, ast.Attribute)):
            name = node.id if isinstance(node, ast.Name) else node.attr
            if name == "TYPE_CHECKING":
                return True
    return False


class NestingTooDeep(ValueError):
    """The tree is too deep to walk recursively; ``line`` is where the walk gave up."""

    def __init__(self, line: int) -> None:
        super().__init__(f"nesting too deep to analyse near line {line}")
        self.line = line


class _Scanner(ast.NodeVisitor):
    def __init__(self) -> None:
        self.out = ModuleScan()
        self.line = 1  # of the node being visited: where a too deep walk gave up
        self.depth_function = 0
        self.depth_guard = 0
        self.depth_block = 0  # class bodies and the like: not module-level names

    def visit(self, node: ast.AST) -> None:
        self.line = getattr(node, "lineno", self.line)
        super().visit(node)

    @property
    def _module_level(self) -> bool:
        return self.depth_function == 0 and self.depth_block == 0

    def _visit_list(self, nodes: Iterable[ast.AST]) -> None:
        for node in nodes:
            self.visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        if self._module_level:
            self.out.defined.add(node.name)
            if node.name == "__getattr__":
                self.out.open_namespace = True
        self._visit_list(node.decorator_list)
        self.depth_function += 1
        self._visit_list(node.body)
        self.depth_function -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self.depth_function += 1
        self.generic_visit(node)
        self.depth_function -= 1

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        if self._module_level:
            self.out.defined.add(node.name)
        self._visit_list(node.bases)
        self._visit_list(node.keywords)
        self._visit_list(node.decorator_list)
        self.depth_block += 1
        self._visit_list(node.body)
        self.depth_block -= 1

    def visit_Try(self, node: ast.Try) -> None:
        guarded = _catches_import_error(node.handlers)
        self.depth_guard += guarded
        self._visit_list(node.body)
        self.depth_guard -= guarded
        self._visit_list(node.handlers)
        self._visit_list(node.orelse)
        self._visit_list(node.finalbody)

    visit_TryStar = visit_Try

    def visit_If(self, node: ast.If) -> None:
        self.visit(node.test)
        guarded = _is_availability_test(node.test)
        self.depth_guard += guarded
        self._visit_list(node.body)
        self.depth_guard -= guarded
        self._visit_list(node.orelse)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.out.external.append(
                ExternalImport(alias.name, (), node.lineno, node.col_offset + 1,
                               self.depth_function > 0, self.depth_guard > 0)
            )
            if self._module_level:
                self.out.defined.add(alias.asname or alias.name.split(".", 1)[0])

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        names = tuple(alias.name for alias in node.names)
        if node.level:
            self.out.relative.append(
                RelativeImport(node.level, node.module, names, node.lineno, node.col_offset + 1,
                               self.depth_function > 0, self.depth_guard > 0)
            )
        elif node.module:
            self.out.external.append(
                ExternalImport(node.module, names, node.lineno, node.col_offset + 1,
                               self.depth_function > 0, self.depth_guard > 0)
            )
        if not self._module_level:
            return
        for alias in node.names:
            if alias.name == "*":
                if node.level:
                    self.out.star_relative.append((node.level, node.module))
                elif node.module:
                    self.out.star_external.append(node.module)
            else:
                self.out.defined.add(alias.asname or alias.name)

    def _bind(self, target: ast.expr) -> None:
        if not self._module_level:
            return
        for node in ast.walk(target):
            if isinstance(node, ast.Name):
                self.out.defined.add(node.id)

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            self._bind(target)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._bind(node.target)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._bind(node.target)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name) and func.id in {"globals", "vars"}:
            self.out.open_namespace = True
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and 0 < len(node.value) < 256:
            self.out.strings.add(node.value)


def scan(tree: ast.Module) -> ModuleScan:
    """Scan a parsed module. Parsing (and its errors) is the caller's business.

    Raises ``NestingTooDeep`` for a tree deeper than Python's recursion limit.
    """
    scanner = _Scanner()
    try:
        scanner.visit(tree)
    except RecursionError:
        raise NestingTooDeep(scanner.line) from None
    return scanner.out


def module_path(name: str, files: Mapping[str, object] | set[str]) -> tuple[str, bool] | None:
    """The file of dotted module ``name`` among ``files`` (root-relative, ``/``-separated).

    Returns ``(path, is_package)``; a package without ``__init__.py`` (a namespace
    folder) returns ``("", True)``; ``None`` when nothing matches.
    """
    stem = name.replace(".", "/")
    if f"{stem}/__init__.py" in files:
        return f"{stem}/__init__.py", True
    if f"{stem}.py" in files:
        return f"{stem}.py", False
    prefix = f"{stem}/"
    if any(f.startswith(prefix) for f in files):
        return "", True
    return None


def resolve_relative(
    importer: str, is_package: bool, imp: RelativeImport, files: Mapping[str, object] | set[str]
) -> tuple[list[str], list[str]]:
    """Modules a relative import executes, and those it needs but cannot find.

    ``from .a.b import c`` in root module ``m`` executes package ``a``, module
    ``a.b``, and ``a.b.c`` too when that is a submodule rather than a name. Raises
    ``ValueError`` when the import climbs above the model root.
    """
    parts = importer.split(".") if importer else []
    package = parts if is_package else parts[:-1]
    if imp.level - 1 > len(package):
        raise ValueError("relative import climbs above the model folder")
    base = package[: len(package) - (imp.level - 1)]
    target = base + (imp.module.split(".") if imp.module else [])
    found: list[str] = []
    missing: list[str] = []
    for end in range(len(base) + 1, len(target) + 1):
        name = ".".join(target[:end])
        if module_path(name, files) is None:
            missing.append(name)
            return found, missing
        found.append(name)
    for alias in imp.names:
        if alias == "*":
            continue
        sub = ".".join([*target, alias])
        if module_path(sub, files) is not None:
            found.append(sub)
        elif not target and "__init__.py" not in files:
            # ``from . import x`` at the root: with no root __init__, x must be a file.
            missing.append(sub)
    return found, missing


def load_order(nodes: Iterable[str], edges: Iterable[tuple[str, str]]) -> list[str]:
    """Dependencies first (Kahn's algorithm), ties broken by name so the order is stable.

    ``edges`` are ``(importer, imported)``. Nodes on a cycle come last, in name order;
    callers report the cycle separately with ``find_cycle``.
    """
    node_set = set(nodes)
    deps: dict[str, set[str]] = {n: set() for n in node_set}
    users: dict[str, set[str]] = {n: set() for n in node_set}
    for importer, imported in edges:
        if importer in node_set and imported in node_set and importer != imported:
            deps[importer].add(imported)
            users[imported].add(importer)
    ready = [n for n, d in deps.items() if not d]
    heapq.heapify(ready)
    order: list[str] = []
    while ready:
        node = heapq.heappop(ready)
        order.append(node)
        for user in users[node]:
            deps[user].discard(node)
            if not deps[user]:
                heapq.heappush(ready, user)
    return order + sorted(node_set - set(order))


def find_cycle(nodes: Iterable[str], edges: Iterable[tuple[str, str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or ``None``."""
    graph: dict[str, list[str]] = {n: [] for n in sorted(set(nodes))}
    for importer, imported in sorted(set(edges)):
        if importer in graph and imported in graph:
            graph[importer].append(imported)
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    for root in graph:
        if root in state:
            continue
        stack: list[tuple[str, int]] = [(root, 0)]
        path: list[str] = [root]
        state[root] = 1
        while stack:
            node, index = stack[-1]
            if index < len(graph[node]):
                stack[-1] = (node, index + 1)
                nxt = graph[node][index]
                if state.get(nxt) == 1:
                    return [*path[path.index(nxt):], nxt]
                if nxt not in state:
                    state[nxt] = 1
                    stack.append((nxt, 0))
                    path.append(nxt)
            else:
                state[node] = 2
                stack.pop()
                path.pop()
    return None
