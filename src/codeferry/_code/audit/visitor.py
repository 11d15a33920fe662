"""The audit's checks: one ``ast`` walk of a module that reports what its code can do.

``Auditor`` is a ``NameResolver`` (``names``) that looks at every reference,
assignment target and call, matches their qualified names against ``rules``, and
checks what depends on arguments (``open`` modes, loaders, write targets). A write is
reported unless its target is provably inside the module's own folder, or a
``save_pretrained``-style hook writes into the folder its caller passes; a read only where
its target is known to be outside what the box lets code read (``sandbox``), and an
environment read where it takes a credential the box removes, or the whole environment.
"""

from __future__ import annotations

import ast
import os
from typing import Any

from . import sandbox as box
from .findings import Finding
from .names import NameResolver, call_arg, call_keyword, const_str
from .rules import (
    COMPILERS,
    ENV_KEY_READS,
    ENV_WHOLE_READS,
    OPENERS,
    PATCHABLE,
    PATCHABLE_CONTAINERS,
    PATH_MAYBE_WRITE_METHODS,
    PATH_READ_METHODS,
    PATH_WRITE_METHODS,
    READERS,
    SAFE_YAML_LOADERS,
    SAVE_HOOKS,
    SHARED_LIBRARY,
    TEMP_WRITERS,
    WRITE_FLAGS,
    WRITERS,
    match_rules,
)

__all__ = ["Auditor"]

_CODE_WIDTH = 80


class Auditor(NameResolver):
    """Collects the ``Finding``s of one module (``findings``, one per place and category)."""

    def __init__(self, text: str, repo: str | None, path: str, module: ast.Module,
                 roots: tuple[str, ...] = ()) -> None:
        super().__init__(module)
        self.text = text
        self.repo = repo
        self.path = path
        self.roots = roots  # the model's folders: the box lets code read them
        self.findings: dict[tuple[int, int, str], Finding] = {}
        self.quiet: set[int] = set()  # ids of name chains already reported through a call
        self.statement: ast.stmt | None = None

    def visit(self, node: ast.AST) -> Any:
        if isinstance(node, ast.stmt):
            self.statement = node
        return super().visit(node)

    # -- reporting --------------------------------------------------------------------------

    def report(self, node: ast.AST, category: str, reason: str, under_box: str = "") -> None:
        line = getattr(node, "lineno", 1)
        col = getattr(node, "col_offset", 0) + 1
        key = (line, col, category)
        if key in self.findings:
            return
        segment = ast.get_source_segment(self.text, node) or ""
        code = " ".join(segment.split())
        if len(code) > _CODE_WIDTH:
            code = code[: _CODE_WIDTH - 3] + "..."
        self.findings[key] = Finding(self.repo, self.path, line, col, category, code, reason,
                                     under_box)

    # -- references and targets -------------------------------------------------------------

    def visit_Assign(self, node: ast.Assign) -> None:
        # ``run = sp.run`` in a function only makes an alias: each use of ``run`` is
        # reported instead. (A module-level alias may be imported by another module: kept.)
        target = node.targets[0]
        local = self.scopes[-1].kind == "function" and len(node.targets) == 1
        if local and isinstance(target, ast.Name) and self.single_value(target.id) is node.value:
            self.silence(node.value)
        self.generic_visit(node)

    def target_node(self, node: ast.AST) -> ast.AST:
        """What a write to ``node`` reports: the whole statement when it is a plain one."""
        plain = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)
        return self.statement if isinstance(self.statement, plain) else node

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load) and id(node) not in self.quiet:
            qual = self.lookup(node.id)
            if qual in box.ENVIRON:
                self.report_environ(node)
            elif qual:
                self.report_rules(node, qual, called=False)
        elif not isinstance(node.ctx, ast.Load) and node.id == "__builtins__":
            self.report(self.target_node(node), "environment", "replaces __builtins__")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.ctx, ast.Load):
            if id(node) not in self.quiet:
                qual = self.qualify(node)
                if qual in box.ENVIRON:
                    self.report_environ(node)
                    self.silence(node.value)
                elif qual and self.report_rules(node, qual, called=False):
                    self.silence(node.value)
        else:
            self.check_patch(self.target_node(node), self.qualify(node.value), node.attr)
        self.visit(node.value)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        container = self.qualify(node.value)
        if container in box.ENVIRON:
            self.silence(node.value)  # one variable, not the whole environment
            if isinstance(node.ctx, ast.Load):
                self.check_variable(node, node.slice)
        if not isinstance(node.ctx, ast.Load):
            if container in PATCHABLE_CONTAINERS:
                self.report(self.target_node(node), "environment", PATCHABLE_CONTAINERS[container])
            elif container == "builtins":
                self.report(self.target_node(node), "environment", "patches builtins for the whole process")
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        """``"HF_TOKEN" in os.environ``: a test for one variable."""
        left = node.left
        for op, right in zip(node.ops, node.comparators, strict=True):
            if isinstance(op, (ast.In, ast.NotIn)) and self.qualify(right) in box.ENVIRON:
                self.silence(right)
                self.check_variable(node, left)
            left = right
        self.generic_visit(node)

    # -- the environment ----------------------------------------------------------------------

    def check_variable(self, node: ast.AST, key: ast.expr | None) -> None:
        """A read of one variable: a finding when the box removes it (a credential)."""
        name = const_str(key)
        if isinstance(key, ast.Constant) and isinstance(key.value, bytes):
            name = key.value.decode("latin-1")
        if name is not None and box.credential(name):
            self.report(node, "environment", f"reads the credential {name} from the environment",
                        box.ENV_REMOVED.format(name=name))

    def report_environ(self, node: ast.AST) -> None:
        """``os.environ`` handed on whole: copied, iterated, passed to a call."""
        self.report(node, "environment", "reads the whole environment, credentials included",
                    box.ENV_SCRUBBED)

    def check_patch(self, node: ast.AST, owner: str | None, attr: str | None) -> None:
        """``builtins.open = ...``, ``setattr(sys, "path", ...)``, ``del os.environ``..."""
        if not owner:
            return
        target = f"{owner}.{attr}" if attr else owner
        if target in PATCHABLE_CONTAINERS:
            self.report(node, "environment", PATCHABLE_CONTAINERS[target])
        elif owner.split(".", 1)[0] in PATCHABLE and self.is_module(owner):
            self.report(node, "environment", f"patches {target} for the whole process")

    def silence(self, node: ast.AST) -> None:
        """Do not report the rest of a name chain again (``ctypes.cdll`` of ``ctypes.cdll.X``)."""
        while isinstance(node, (ast.Attribute, ast.Name)):
            self.quiet.add(id(node))
            if isinstance(node, ast.Name):
                break
            node = node.value

    def report_rules(self, node: ast.AST, qual: str, *, called: bool) -> bool:
        matched = match_rules(qual, called=called)
        if qual in {"torch.load", "torch.serialization.load", "yaml.load", "yaml.load_all"} and not called:
            matched.append(("unpickle", "passes on a loader that can unpickle"))
        for category, reason in matched:
            note = box.NETWORK if category == "network" else ""
            if category == "process":
                note = self.process_note(node if called else None, qual)
            self.report(node, category, f"{reason} ({qual})", note)
        return bool(matched)

    def process_note(self, node: ast.AST | None, qual: str) -> str:
        """What the box does with a process: it runs the interpreter (workers, forks and
        their children stay inside), no other program, and signals nothing outside it."""
        if qual in {"os.system", "os.popen", "asyncio.create_subprocess_shell"}:
            return box.SHELL_REFUSED
        if qual in {"os.kill", "os.killpg"}:
            return box.SIGNAL_UNLESS
        if not any(reason.startswith(("runs a", "replaces this", "opens a web"))
                   for _, reason in match_rules(qual, called=True)):
            return ""  # forks and worker processes: the interpreter, boxed too
        if not isinstance(node, ast.Call):
            return box.RUN_UNLESS
        shell = call_keyword(node, "shell")
        if isinstance(shell, ast.Constant) and shell.value:
            return box.SHELL_REFUSED
        index = 1 if qual.startswith("os.spawn") else 0
        first = call_arg(node, index, "path" if qual.startswith("os.") else "args")
        program = first.elts[0] if isinstance(first, (ast.List, ast.Tuple)) and first.elts else first
        if program is not None and self.qualify(program) == "sys.executable":
            return ""
        return box.RUN_REFUSED if const_str(program) is not None else box.RUN_UNLESS

    # -- calls ------------------------------------------------------------------------------

    def visit_Call(self, node: ast.Call) -> None:
        qual = self.qualify(node.func)
        if qual:
            self.report_rules(node, qual, called=True)
            self.check_conditional(node, qual)
            self.check_environ_call(node, qual)
            self.check_reader(node, qual)
            if qual in {"builtins.setattr", "builtins.delattr"} and node.args:
                self.check_patch(node, self.qualify(node.args[0]), const_str(call_arg(node, 1, "")))
            if any(c == "process" for c, _ in match_rules(qual, called=True)):
                self.check_command(node, qual)
        if isinstance(node.func, ast.Attribute):
            self.check_method(node, node.func)
        self.silence(node.func)  # judged as a call: not a reference handed on
        self.check_shared_library(node)
        self.generic_visit(node)

    def check_environ_call(self, node: ast.Call, qual: str) -> None:
        """``os.getenv("HF_TOKEN")``, ``os.environ.get(...)``, ``os.environ.copy()``..."""
        owner, _, method = qual.rpartition(".")
        if qual in {"os.getenv", "os.getenvb"} or (owner in box.ENVIRON and method in ENV_KEY_READS):
            self.check_variable(node, call_arg(node, 0, "key"))
        elif owner in box.ENVIRON and method in ENV_WHOLE_READS:
            self.report_environ(node)

    def check_reader(self, node: ast.Call, qual: str) -> bool:
        """Functions that read the path they are given (``READERS``), or a default one."""
        if qual not in READERS:
            return False
        index, keyword, default = READERS[qual]
        target = call_arg(node, index, keyword)
        if target is None and default is not None:  # netrc.netrc() reads ~/.netrc
            return self.report_read(node, qual, box.refused_read(("home", default)))
        return self.check_read(node, qual, target)

    def check_conditional(self, node: ast.Call, qual: str) -> bool:
        """Rules that depend on the arguments: loaders, ``open`` modes, writers."""
        if qual in {"torch.load", "torch.serialization.load"}:
            weights_only = call_keyword(node, "weights_only")
            if not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
                self.report(node, "unpickle", f"unpickles without weights_only=True ({qual})")
                return True
        elif qual == "numpy.load":
            allow = call_keyword(node, "allow_pickle")
            if allow is not None and not (isinstance(allow, ast.Constant) and not allow.value):
                self.report(node, "unpickle", "loads with allow_pickle=True (numpy.load)")
                return True
        elif qual in {"yaml.load", "yaml.load_all"}:
            loader = call_arg(node, 1, "Loader")
            if loader is None or self.qualify(loader) not in SAFE_YAML_LOADERS:
                self.report(node, "unpickle",
                            f"loads YAML without a safe loader, which can build any object ({qual})")
                return True
        elif qual in OPENERS:
            return self.check_open(node, qual, call_arg(node, OPENERS[qual], "mode"), call_arg(node, 0, "file"))
        elif qual == "os.open":
            flags = call_arg(node, 1, "flags")
            names = {n.attr if isinstance(n, ast.Attribute) else n.id
                     for n in ast.walk(flags) if isinstance(n, (ast.Attribute, ast.Name))} if flags else set()
            value = flags.value if isinstance(flags, ast.Constant) else None
            if isinstance(value, int):
                writes = bool(value & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC))
            else:  # by the flag names; flags known only at run time count as writing
                writes = bool(names & set(WRITE_FLAGS)) or (flags is not None and "O_RDONLY" not in names)
            if writes:
                return self.check_target(node, call_arg(node, 0, "path"), f"opens a file for writing ({qual})")
            return self.check_read(node, qual, call_arg(node, 0, "path"))
        elif qual in WRITERS:
            targets = [call_arg(node, index, kw) for index, kw in WRITERS[qual]]
            verb = "deletes" if qual.endswith(("rmtree", "remove", "unlink", "rmdir", "removedirs")) else "writes"
            return any(self.check_target(node, t, f"{verb} files ({qual})") for t in targets)
        elif qual in TEMP_WRITERS:
            self.report(node, "file-write", f"creates files in the temporary folder ({qual})")
            return True  # the box's own scratch folder: allowed
        return False

    def check_open(self, node: ast.Call, qual: str, mode: ast.expr | None, target: ast.expr | None) -> bool:
        text = const_str(mode)
        if mode is None or (text is not None and not set(text) & set("wax+")):
            return self.check_read(node, qual, target)  # read-only
        why = f"opens a file for writing ({qual}, mode {text!r})" if text is not None else (
            f"opens a file with a mode known only at run time ({qual})")
        return self.check_target(node, target, why)

    def check_method(self, node: ast.Call, func: ast.Attribute) -> bool:
        """Calls known by their method name: path writes, loaders, downloads."""
        name, receiver = func.attr, func.value
        # ``os.mkdir(p)`` is a module's function (judged as such), ``p.mkdir()`` a path's method.
        on_object = self.qualify(receiver) is None
        if (name in PATH_WRITE_METHODS and on_object) or (
            name in PATH_MAYBE_WRITE_METHODS and self.is_path(receiver)
        ):
            return self.check_target(node, receiver, f"writes files (Path.{name})")
        if name == "open" and self.is_path(receiver):
            return self.check_open(node, f"Path.{name}", call_arg(node, 0, "mode"), receiver)
        if name in PATH_READ_METHODS and on_object:
            return self.check_read(node, f"Path.{name}", receiver)
        if name == "extractall":
            return self.check_target(node, call_arg(node, 0, "path") or ast.Constant("."),
                                     "extracts an archive")
        if name in {"exec_module", "load_module"}:
            self.report(node, "dynamic-code", f"executes a module loaded at run time (.{name})")
            return True
        if name == "dlopen":
            self.report(node, "native-code", "loads a shared library (.dlopen)")
            return True
        if name == "from_pretrained" and not self.is_self(receiver):
            self.report(node, "network", "may download from the Hugging Face Hub (.from_pretrained)",
                        box.NETWORK)
            return True
        return False

    def is_self(self, node: ast.expr) -> bool:
        if isinstance(node, ast.Name):
            return node.id in {"self", "cls"}
        return isinstance(node, ast.Call) and self.qualify(node.func) == "builtins.super"

    def check_command(self, node: ast.Call, qual: str) -> None:
        """A program run through ``subprocess``/``os.system``: a compiler, or pip."""
        first = call_arg(node, 0, "args")
        words: list[str] = []
        if isinstance(first, (ast.List, ast.Tuple)):
            words = [w for w in (const_str(e) for e in first.elts) if w is not None]
            program = const_str(first.elts[0]) if first.elts else None
        else:
            command = const_str(first)
            words = command.split() if command else []
            program = words[0] if words else None
        if (program and os.path.basename(program) in COMPILERS) or "build_ext" in words:
            self.report(node, "native-code", f"runs a compiler ({program or 'build_ext'}, via {qual})",
                        self.process_note(node, qual))
        if "pip" in words and "install" in words:
            self.report(node, "network", f"installs packages with pip (via {qual})", box.NETWORK)

    def check_shared_library(self, node: ast.Call) -> None:
        for arg in [*node.args, *(kw.value for kw in node.keywords)]:
            for sub in ast.walk(arg):
                text = const_str(sub)
                if text and SHARED_LIBRARY.search(text):
                    self.report(node, "native-code", f"names a shared library ({text})")
                    return

    # -- file targets -----------------------------------------------------------------------

    def check_target(self, node: ast.Call, target: ast.expr | None, why: str) -> bool:
        """Report a write unless its target is provably inside the module's own folder."""
        if target is not None and self.place(target) in {"file", "folder", "inside"}:
            return False
        if target is not None and self.written_by_save_hook(target):
            return False
        shown = ast.get_source_segment(self.text, target) if target is not None else None
        where = f"; target {' '.join(shown.split())[:40]} is not provably inside the module's folder" if shown else ""
        allowed = box.allowed_write(box.fold(self, target))
        note = "" if allowed else box.WRITE_REFUSED if allowed is False else box.WRITE_UNLESS
        self.report(node, "file-write", why + where, note)
        return True

    def check_read(self, node: ast.Call, qual: str, target: ast.expr | None) -> bool:
        """Report a read whose target is known to be outside what the box lets code read
        (the home, an absolute path it does not grant); any other read is left alone."""
        if target is None or self.place(target) is not None:
            return False
        return self.report_read(node, qual, box.refused_read(box.fold(self, target), self.roots))

    def report_read(self, node: ast.Call, qual: str, path: str | None) -> bool:
        if path is None:
            return False
        where = "in the home" if path.startswith("~") else "outside the model's folder"
        self.report(node, "file-read", f"reads {path}, {where} ({qual})", box.READ_REFUSED)
        return True

    def written_by_save_hook(self, target: ast.expr) -> bool:
        """A ``save_pretrained``-style hook writing into the folder its caller passed.

        The target must be built from a parameter of the hook: directly, or through local
        names every assignment of which is (``if isdir(d): f = join(d, x) else: f = d``).
        """
        scope = self.scopes[-1]
        if scope.kind != "function" or scope.name not in SAVE_HOOKS:
            return False
        params = scope.params - {"self", "cls"}
        visiting: set[str] = set()

        def from_param(expr: ast.AST) -> bool:
            for node in ast.walk(expr):
                if not isinstance(node, ast.Name):
                    continue
                if node.id in params:
                    return True
                values = scope.assigned.get(node.id)
                if not values or node.id in visiting or any(v is None for v in values):
                    continue
                visiting.add(node.id)
                try:
                    if all(from_param(v) for v in values if v is not None):
                        return True
                finally:
                    visiting.discard(node.id)
            return False

        try:
            return from_param(target)
        except RecursionError:
            return False
