"""What names and expressions stand for, statically: the audit's scopes and name resolution.

Each function, lambda, class body and the module get a ``Scope`` of the names they bind
(imports, assignments, parameters, star imports). ``NameResolver`` walks the tree keeping
the stack of scopes, and answers what a name or an expression is: a qualified name
(``sp.run`` -> ``subprocess.run``, ``getattr(os, "system")`` -> ``os.system``), the one value
a local name is ever given, whether it is surely a path, and where a path points relative
to the module's own file. The checks themselves are ``visitor.Auditor``'s.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from .rules import BUILTINS, match_rules

__all__ = ["Scope", "build_scope", "NameResolver", "const_str", "safe_part", "call_arg",
           "call_keyword"]

_T = TypeVar("_T")


@dataclass
class Scope:
    """Names one function (or the module, or a class body) binds."""

    kind: str  # "module" | "function" | "class"
    name: str = ""
    params: set[str] = field(default_factory=set)
    imports: dict[str, str] = field(default_factory=dict)
    assigned: dict[str, list[ast.expr | None]] = field(default_factory=dict)
    stars: list[str] = field(default_factory=list)


def _own_nodes(body: Sequence[ast.AST]) -> Iterator[ast.AST]:
    """Nodes of a scope's body, not descending into nested functions, lambdas or classes."""
    stack = list(reversed(body))
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        stack.extend(reversed(list(ast.iter_child_nodes(node))))


def build_scope(kind: str, name: str, body: Sequence[ast.AST], args: ast.arguments | None) -> Scope:
    scope = Scope(kind, name)
    if args is not None:
        every = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
        scope.params = {a.arg for a in every if a is not None}

    direct: set[int] = set()  # Name targets bound with their value

    def bind(target: str, value: ast.expr | None) -> None:
        scope.assigned.setdefault(target, []).append(value)

    for node in _own_nodes(body):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    scope.imports[alias.asname] = alias.name
                else:
                    top = alias.name.split(".", 1)[0]
                    scope.imports[top] = top
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            for alias in node.names:
                if alias.name == "*":
                    if not node.level and node.module:
                        scope.stars.append(node.module)
                    continue
                scope.imports[alias.asname or alias.name] = (
                    f"{base}.{alias.name}" if node.module else f"{base}{alias.name}"
                )
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    bind(target.id, node.value if len(node.targets) == 1 else None)
                    direct.add(id(target))
                else:
                    for sub in ast.walk(target):
                        if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                            bind(sub.id, None)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            if isinstance(node.target, ast.Name):
                plain = isinstance(node, ast.AnnAssign) and node.value is not None
                bind(node.target.id, node.value if plain else None)
                direct.add(id(node.target))
        elif isinstance(node, ast.NamedExpr):
            bind(node.target.id, node.value)
            direct.add(id(node.target))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bind(node.name, None)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            if id(node) not in direct:
                    bind(node.id, None)  # for targets, with items, comprehension variables, del
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bind(node.name, None)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            for ident in node.names:
                bind(ident, None)
    return scope


def const_str(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def safe_part(text: str | None) -> bool:
    """A constant path piece that stays below the folder it is joined to."""
    if not text or text.startswith(("/", "~")) or "\\" in text or ":" in text:
        return False
    return ".." not in text.split("/")


def call_arg(call: ast.Call, index: int, keyword: str) -> ast.expr | None:
    for kw in call.keywords:
        if kw.arg == keyword:
            return kw.value
    if index < len(call.args) and not any(isinstance(a, ast.Starred) for a in call.args[: index + 1]):
        return call.args[index]
    return None


def call_keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((kw.value for kw in call.keywords if kw.arg == name), None)


class NameResolver(ast.NodeVisitor):
    """Walks a module keeping its scopes; resolves names and expressions in the current one."""

    def __init__(self, module: ast.Module) -> None:
        self.scopes: list[Scope] = [build_scope("module", "", module.body, None)]
        self.resolving: set[int] = set()  # ids of expressions being resolved (cycle guard)

    # -- names ------------------------------------------------------------------------------

    def lookup(self, name: str) -> str | None:
        """The qualified name a plain name stands for here, if static analysis can tell."""
        innermost = len(self.scopes) - 1
        for depth in range(innermost, -1, -1):
            scope = self.scopes[depth]
            if scope.kind == "class" and depth != innermost:
                continue  # class bodies do not enclose their methods
            if name in scope.params:
                return None
            if name in scope.imports:
                return scope.imports[name]
            if name in scope.assigned:
                values = scope.assigned[name]
                if len(values) == 1 and values[0] is not None:
                    return self.qualify(values[0])
                return None
            for module in scope.stars:
                candidate = f"{module}.{name}"
                if name not in BUILTINS and match_rules(candidate, called=True):
                    return candidate
        return f"builtins.{name}" if name in BUILTINS else None

    def qualify(self, node: ast.AST) -> str | None:
        """``sp.run`` -> ``subprocess.run``, ``getattr(os, "system")`` -> ``os.system``..."""
        if id(node) in self.resolving:
            return None
        self.resolving.add(id(node))
        try:
            return self._qualify(node)
        finally:
            self.resolving.discard(id(node))

    def _qualify(self, node: ast.AST) -> str | None:
        if isinstance(node, ast.Name):
            if node.id == "__builtins__":
                return "builtins"
            return self.lookup(node.id)
        if isinstance(node, ast.Attribute):
            base = self.qualify(node.value)
            return f"{base}.{node.attr}" if base else None
        if isinstance(node, ast.Call):
            func = self.qualify(node.func)
            first = const_str(node.args[0]) if node.args else None
            if func == "builtins.getattr" and len(node.args) >= 2:
                base, attr = self.qualify(node.args[0]), const_str(node.args[1])
                return f"{base}.{attr}" if base and attr else None
            if func in {"builtins.__import__", "importlib.import_module"} and first:
                if func == "builtins.__import__" and "." in first and not call_keyword(node, "fromlist"):
                    return first.split(".", 1)[0]  # __import__("os.path") returns os
                return first
        if isinstance(node, ast.Subscript) and self.qualify(node.value) == "sys.modules":
            return const_str(node.slice)
        return None

    # -- scopes -----------------------------------------------------------------------------

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        for deco in node.decorator_list:
            self.visit(deco)
        self.visit(node.args)  # defaults; annotations (``pool: Pool``) do nothing
        self.scopes.append(build_scope("function", node.name, node.body, node.args))
        for stmt in node.body:
            self.visit(stmt)
        self.scopes.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_arg(self, node: ast.arg) -> None:
        pass  # a parameter: only its annotation is below it

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self.visit(node.target)
        if node.value is not None:
            self.visit(node.value)

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self.visit(node.args)
        self.scopes.append(build_scope("function", "<lambda>", [node.body], node.args))
        self.visit(node.body)
        self.scopes.pop()

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for expr in [*node.decorator_list, *node.bases, *node.keywords]:
            self.visit(expr)
        self.scopes.append(build_scope("class", node.name, node.body, None))
        for stmt in node.body:
            self.visit(stmt)
        self.scopes.pop()

    # -- modules and paths ------------------------------------------------------------------

    def is_module(self, qual: str) -> bool:
        """Whether ``qual`` names a module (by its top name: imported, or ``builtins``)."""
        top = qual.split(".", 1)[0]
        return top == "builtins" or any(
            top == value.split(".", 1)[0] for scope in self.scopes for value in scope.imports.values()
        )

    def is_path(self, node: ast.expr) -> bool:
        """Surely a path object: ``Path(...)``, ``p / "x"``, ``Path(...).parent``..."""
        if isinstance(node, ast.Call):
            qual = self.qualify(node.func)
            return qual in {"pathlib.Path", "pathlib.PurePath", "pathlib.PosixPath"} or (
                isinstance(node.func, ast.Attribute) and self.is_path(node.func.value))
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            return self.is_path(node.left)
        if isinstance(node, ast.Attribute):
            return node.attr in {"parent", "parents"} and self.is_path(node.value)
        if isinstance(node, ast.Name):
            value = self.single_value(node.id)
            return value is not None and id(value) not in self.resolving and self._guarded(value, self.is_path)
        return False

    def _guarded(self, node: ast.expr, check: Callable[[ast.expr], _T]) -> _T:
        self.resolving.add(id(node))
        try:
            return check(node)
        finally:
            self.resolving.discard(id(node))

    def single_value(self, name: str) -> ast.expr | None:
        """The one expression ``name`` is ever assigned in the scope that binds it."""
        innermost = len(self.scopes) - 1
        for depth in range(innermost, -1, -1):
            scope = self.scopes[depth]
            if scope.kind == "class" and depth != innermost:
                continue
            if name in scope.params or name in scope.imports:
                return None
            if name in scope.assigned:
                values = scope.assigned[name]
                return values[0] if len(values) == 1 else None
        return None

    def place(self, node: ast.expr) -> str | None:
        """``file`` (this module), ``folder`` (its folder), ``inside`` (below it), or ``None``."""
        if id(node) in self.resolving:
            return None
        return self._guarded(node, self._place)

    def _place(self, node: ast.expr) -> str | None:
        if isinstance(node, ast.Name):
            if node.id == "__file__":
                return "file"
            value = self.single_value(node.id)
            return self.place(value) if value is not None else None
        if isinstance(node, ast.Attribute):
            base = self.place(node.value)
            return "folder" if node.attr == "parent" and base == "file" else None
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            base = self.place(node.left)
            return "inside" if base in {"folder", "inside"} and safe_part(const_str(node.right)) else None
        if not isinstance(node, ast.Call):
            return None
        func = node.func
        args = node.args
        qual = self.qualify(func)
        if node.keywords or any(isinstance(a, ast.Starred) for a in args):
            return None
        if qual in {"pathlib.Path", "pathlib.PurePath", "pathlib.PosixPath", "os.path.join"} and args:
            base = self.place(args[0])
            if len(args) == 1:
                return base
            ok = base in {"folder", "inside"} and all(safe_part(const_str(a)) for a in args[1:])
            return "inside" if ok else None
        if qual in {"os.path.abspath", "os.path.realpath", "os.fspath", "builtins.str"} and len(args) == 1:
            return self.place(args[0])
        if qual == "os.path.dirname" and len(args) == 1:
            return "folder" if self.place(args[0]) == "file" else None
        if isinstance(func, ast.Attribute):
            base = self.place(func.value)
            if func.attr in {"resolve", "absolute", "expanduser"} and not args:
                return base
            if func.attr == "joinpath" and base in {"folder", "inside"}:
                return "inside" if all(safe_part(const_str(a)) for a in args) else None
            if func.attr in {"with_name", "with_suffix", "with_stem"} and base in {"file", "inside"}:
                return "inside" if len(args) == 1 and safe_part(const_str(args[0])) else None
        return None
