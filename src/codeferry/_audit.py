"""What a model's code can do beyond computing: ``codeferry audit``.

Pure ``ast`` over the exact bytes ``resolve`` hashed (``Bundle.sources``): nothing is
imported or executed. Every finding names a category, a place (file, line, column), the
code, and why it matters:

* ``process``: runs programs or processes (``subprocess``, ``os.system``, ``os.exec*``,
  ``os.spawn*``, ``os.fork``, ``pty``, multiprocessing workers);
* ``network``: talks to the network (``socket``, ``requests``, ``urllib.request``,
  ``http.client``, ``httpx``, ``aiohttp``, Hub downloads, ``from_pretrained``, ``torch.hub``);
* ``dynamic-code``: runs code that is not in these files (``eval``, ``exec``, ``compile``,
  ``__import__``, ``importlib``, ``runpy``, another repo's remote code);
* ``native-code``: loads or builds native code (``ctypes``, ``cffi``,
  ``torch.utils.cpp_extension``, ``torch.ops.load_library``, compilers run as programs,
  shared library names);
* ``file-write``: writes, moves or deletes files outside the module's own folder (a
  target built from ``Path(__file__).parent`` and constant names without ``..`` is inside;
  so is what a ``save_pretrained``/``save_vocabulary`` hook writes into the folder its
  caller passes);
* ``unpickle``: deserialises objects that can run code (``pickle``, ``dill``, ``joblib``,
  ``torch.load`` without ``weights_only=True``, ``numpy.load(allow_pickle=True)``,
  ``marshal``, ``yaml.load`` without a safe loader);
* ``environment``: changes the process for everyone (``os.environ`` writes, ``sys.path``,
  ``sys.modules``, ``os.chdir``, signal handlers, patching ``builtins``, the standard
  library or transformers).

Names are resolved through imports and simple assignments in every scope
(``import subprocess as sp``, ``from os import system``, ``run = sp.run``,
``getattr(os, "system")``, ``__import__("os")``, ``importlib.import_module("os")``,
``sys.modules["os"]``, ``from subprocess import *``). Static analysis cannot see
everything (a name built at run time); ``dynamic-code`` findings mark where that happens.
"""

from __future__ import annotations

import ast
import builtins
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ._resolve import Bundle, resolve

__all__ = ["CATEGORIES", "AuditReport", "Finding", "audit", "audit_bundle", "audit_source",
           "render_audit"]  # fmt: skip

CATEGORIES: tuple[str, ...] = (
    "process",
    "network",
    "dynamic-code",
    "native-code",
    "file-write",
    "unpickle",
    "environment",
)

_CODE_WIDTH = 80
_T = TypeVar("_T")


@dataclass(frozen=True)
class Finding:
    """One thing the code can do: ``path`` is relative to its repo (``repo=None``: the model's)."""

    repo: str | None
    path: str
    line: int
    col: int
    category: str
    code: str
    reason: str

    @property
    def file(self) -> str:
        """The file as ``inspect`` shows it: ``org/repo--path`` for another repo's code."""
        return f"{self.repo}--{self.path}" if self.repo else self.path

    @property
    def location(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"

    def to_json(self) -> dict[str, Any]:
        return {
            "category": self.category,
            "file": self.path,
            "repo": self.repo,
            "line": self.line,
            "col": self.col,
            "code": self.code,
            "reason": self.reason,
        }


@dataclass(frozen=True)
class AuditReport:
    """The findings of one model; ``skipped`` lists files that are not Python (with why)."""

    model: str
    digest: str
    findings: tuple[Finding, ...]
    skipped: tuple[tuple[str, str], ...] = ()

    @property
    def counts(self) -> dict[str, int]:
        """Findings per category, every category included."""
        counts = dict.fromkeys(CATEGORIES, 0)
        for finding in self.findings:
            counts[finding.category] += 1
        return counts

    def in_categories(self, categories: Iterable[str]) -> tuple[Finding, ...]:
        wanted = set(categories)
        return tuple(f for f in self.findings if f.category in wanted)

    def to_json(self) -> dict[str, Any]:
        """The ``codeferry audit --json`` object."""
        return {
            "model": self.model,
            "digest": self.digest,
            "findings": [f.to_json() for f in self.findings],
            "counts": self.counts,
            "skipped": [{"file": file, "reason": why} for file, why in self.skipped],
        }


# -- rules ----------------------------------------------------------------------------------
#
# A rule maps a fully qualified name to (category, reason). ``name.*`` rules match any
# name below ``name`` and only when called (``subprocess.PIPE`` is harmless); exact rules
# also match a plain reference (``f = os.system`` hands the function on).

_EXEC = ("execl", "execle", "execlp", "execlpe", "execv", "execve", "execvp", "execvpe")
_SPAWN = ("spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe")
_MP = ("Process", "Pool", "get_context", "set_start_method", "Manager", "spawn", "start_processes")

_RULES: dict[str, list[tuple[str, str]]] = {}


def _rule(category: str, reason: str, *names: str) -> None:
    for name in names:
        _RULES.setdefault(name, []).append((category, reason))


_rule("process", "runs a program", "subprocess.*", "subprocess.run", "subprocess.call",
      "subprocess.check_call", "subprocess.check_output", "subprocess.Popen",
      "subprocess.getoutput", "subprocess.getstatusoutput", "asyncio.create_subprocess_exec",
      "os.posix_spawn", "os.posix_spawnp", "os.startfile", *(f"os.{n}" for n in _SPAWN))
_rule("process", "runs a shell command", "os.system", "os.popen",
      "asyncio.create_subprocess_shell")
_rule("process", "replaces this process with another program", *(f"os.{n}" for n in _EXEC))
_rule("process", "forks this process", "os.fork", "os.forkpty")
_rule("process", "sends a signal to another process", "os.kill", "os.killpg")
_rule("process", "runs a program on a pseudo-terminal", "pty.*", "pty.spawn", "pty.fork")
_rule("process", "starts worker processes", "concurrent.futures.ProcessPoolExecutor",
      "concurrent.futures.process.ProcessPoolExecutor", "multiprocessing.pool.Pool",
      *(f"multiprocessing.{n}" for n in _MP), *(f"torch.multiprocessing.{n}" for n in _MP))
_rule("process", "opens a web browser", "webbrowser.*")

_rule("network", "opens a network socket", "socket.*", "socket.socket",
      "socket.create_connection")
_rule("network", "makes HTTP requests", "requests.*", "urllib3.*", "httpx.*", "aiohttp.*",
      "http.client.*", "xmlrpc.client.*")
_rule("network", "opens a URL", "urllib.request.*", "urllib.request.urlopen",
      "urllib.request.urlretrieve")
_rule("network", "opens a network connection", "ftplib.*", "smtplib.*", "poplib.*",
      "imaplib.*", "telnetlib.*", "websocket.*", "websockets.*", "paramiko.*", "boto3.*")
_rule("network", "downloads a file", "wget.*", "torch.hub.*",
      "torch.hub.download_url_to_file", "torch.hub.load_state_dict_from_url")
_rule("network", "downloads a dataset", "datasets.load_dataset")

_rule("dynamic-code", "evaluates a string as code", "builtins.eval")
_rule("dynamic-code", "executes a string as code", "builtins.exec")
_rule("dynamic-code", "compiles a string to code", "builtins.compile")
_rule("dynamic-code", "imports a module chosen at run time", "builtins.__import__",
      "importlib.import_module", "importlib.__import__", "pydoc.locate")
_rule("dynamic-code", "re-executes a module", "importlib.reload", "imp.reload")
_rule("dynamic-code", "loads a module from a file path", "importlib.util.spec_from_file_location",
      "importlib.util.spec_from_loader", "importlib.util.module_from_spec",
      "importlib.machinery.SourceFileLoader", "importlib.machinery.SourcelessFileLoader",
      "imp.load_source", "imp.load_compiled", "imp.load_module", "zipimport.zipimporter")
_rule("dynamic-code", "runs a module or script", "runpy.*", "runpy.run_path", "runpy.run_module")
_rule("dynamic-code", "starts an interactive interpreter", "code.interact",
      "code.InteractiveConsole", "code.InteractiveInterpreter")
_rule("dynamic-code", "runs a hubconf.py downloaded from the internet", "torch.hub.load")

_rule("native-code", "calls into native code (ctypes)", "ctypes.*", "ctypes.CDLL", "ctypes.cdll",
      "ctypes.PyDLL", "ctypes.pydll", "ctypes.WinDLL", "ctypes.windll", "ctypes.OleDLL")
_rule("native-code", "compiles or loads native code (cffi)", "cffi.*", "cffi.FFI")
_rule("native-code", "compiles and loads a C++/CUDA extension", "torch.utils.cpp_extension.*",
      "torch.utils.cpp_extension.load", "torch.utils.cpp_extension.load_inline")
_rule("native-code", "loads a shared library of custom ops", "torch.ops.load_library",
      "torch.classes.load_library")
_rule("native-code", "loads a compiled extension module", "imp.load_dynamic",
      "importlib.machinery.ExtensionFileLoader")
_rule("native-code", "compiles a CUDA kernel", "cupy.RawKernel", "cupy.RawModule",
      "cupy.ElementwiseKernel", "cupy.ReductionKernel", "pycuda.compiler.*")

_rule("unpickle", "unpickles data, which can run any code", "pickle.load", "pickle.loads",
      "pickle.Unpickler", "_pickle.load", "_pickle.loads", "_pickle.Unpickler", "cPickle.*",
      "dill.load", "dill.loads", "cloudpickle.load", "cloudpickle.loads", "joblib.load",
      "pandas.read_pickle", "shelve.open", "jsonpickle.decode", "torch.serialization.load")
_rule("unpickle", "unmarshals code objects", "marshal.load", "marshal.loads")
_rule("unpickle", "loads a TorchScript archive (pickled code)", "torch.jit.load")
_rule("unpickle", "loads YAML with a loader that builds any Python object", "yaml.unsafe_load",
      "yaml.unsafe_load_all")

_rule("environment", "changes the environment of the whole process", "os.putenv", "os.unsetenv",
      *(f"os.{env}.{m}" for env in ("environ", "environb")
        for m in ("update", "pop", "popitem", "setdefault", "clear", "__setitem__", "__delitem__")))
_rule("environment", "changes where every import looks", "site.addsitedir",
      *(f"sys.{v}.{m}" for v in ("path", "meta_path", "path_hooks")
        for m in ("insert", "append", "extend", "remove", "pop", "clear", "__setitem__",
                  "__delitem__", "reverse", "sort")))
_rule("environment", "changes sys.modules, the module table of the whole process",
      *(f"sys.modules.{m}" for m in ("update", "pop", "popitem", "setdefault", "clear",
                                     "__setitem__", "__delitem__")))
_rule("environment", "changes the working directory of the whole process", "os.chdir", "os.fchdir")
_rule("environment", "changes the file creation mask of the whole process", "os.umask")
_rule("environment", "installs a signal handler", "signal.signal", "signal.set_wakeup_fd",
      "signal.setitimer", "signal.alarm")
_rule("environment", "changes interpreter-wide settings", "sys.settrace", "sys.setprofile",
      "threading.settrace", "threading.setprofile", "sys.setrecursionlimit",
      "sys.setswitchinterval", "sys.setdlopenflags")

#: Calls by their last name, whatever the receiver (their owners are unknowable statically).
_HUB_DOWNLOADS = frozenset({
    "hf_hub_download", "snapshot_download", "HfApi", "HfFileSystem", "InferenceClient",
    "AsyncInferenceClient", "cached_download", "upload_file", "upload_folder", "create_repo",
    "delete_repo", "create_commit", "login", "whoami", "model_info", "list_models",
    "list_repo_files", "list_repo_tree", "file_exists", "repo_exists", "get_hf_file_metadata",
    "Repository",
})  # fmt: skip
_TRANSFORMERS_DOWNLOADS = frozenset({
    "cached_file", "cached_files", "get_file_from_repo", "hf_hub_download", "snapshot_download",
    "download_url", "cached_path", "has_file", "get_checkpoint_shard_files", "http_get",
})  # fmt: skip
_TRANSFORMERS_DYNAMIC = frozenset({"get_class_from_dynamic_module", "get_cached_module_file"})

_SAFE_YAML_LOADERS = frozenset({"yaml.SafeLoader", "yaml.CSafeLoader", "yaml.BaseLoader",
                                "yaml.CBaseLoader", "yaml.loader.SafeLoader"})  # fmt: skip
_COMPILERS = frozenset({"nvcc", "gcc", "g++", "cc", "c++", "clang", "clang++", "ld", "make",
                        "cmake", "ninja", "hipcc", "icc", "icpx", "nvrtc", "cl"})  # fmt: skip
_SHARED_LIBRARY = re.compile(r"\.(so(\.\d+)*|dll|dylib|pyd)$", re.IGNORECASE)
_OPENERS = {  # qualified name -> index of the mode argument
    "builtins.open": 1, "io.open": 1, "codecs.open": 1, "gzip.open": 1, "bz2.open": 1,
    "lzma.open": 1, "tarfile.open": 1, "os.fdopen": 1, "zipfile.ZipFile": 1, "io.FileIO": 1,
}  # fmt: skip
_WRITE_FLAGS = ("O_WRONLY", "O_RDWR", "O_CREAT", "O_APPEND", "O_TRUNC")
# qualified name -> indexes (and keyword names) of the paths it writes.
_WRITERS: dict[str, tuple[tuple[int, str], ...]] = {
    **{f"shutil.{n}": ((1, "dst"),) for n in ("copy", "copy2", "copyfile", "copytree")},
    "shutil.move": ((0, "src"), (1, "dst")),
    "shutil.rmtree": ((0, "path"),),
    "shutil.make_archive": ((0, "base_name"),),
    "shutil.unpack_archive": ((1, "extract_dir"),),
    "shutil.chown": ((0, "path"),),
    **{f"os.{n}": ((0, "path"),) for n in ("remove", "unlink", "rmdir", "removedirs", "mkdir",
                                           "makedirs", "truncate", "chmod", "chown", "lchown",
                                           "mkfifo", "mknod", "utime")},
    **{f"os.{n}": ((0, "src"), (1, "dst")) for n in ("rename", "renames", "replace")},
    "os.link": ((1, "dst"),),
    "os.symlink": ((1, "dst"),),
    "torch.save": ((1, "f"),),
    **{f"numpy.{n}": ((0, "file"),) for n in ("save", "savez", "savez_compressed")},
    "numpy.savetxt": ((0, "fname"),),
    "safetensors.torch.save_file": ((1, "filename"),),
    "safetensors.numpy.save_file": ((1, "filename"),),
}
_TEMP_WRITERS = frozenset(f"tempfile.{n}" for n in (
    "NamedTemporaryFile", "TemporaryFile", "SpooledTemporaryFile", "mkstemp", "mkdtemp",
    "TemporaryDirectory", "mktemp"))  # fmt: skip
#: Methods of a path (``Path(...).write_text``): the receiver is the target.
_PATH_WRITE_METHODS = frozenset({"write_text", "write_bytes", "touch", "mkdir", "unlink", "rmdir",
                                 "symlink_to", "hardlink_to"})  # fmt: skip
_PATH_MAYBE_WRITE_METHODS = frozenset({"rename", "replace", "chmod"})  # only on a sure path
#: transformers hooks that write into the folder their caller passes.
_SAVE_HOOKS = frozenset({"save_vocabulary", "save_pretrained", "_save_pretrained", "save_config",
                         "to_json_file"})  # fmt: skip
#: Modules whose attributes, when assigned, change the whole process.
_PATCHABLE = frozenset(sys.stdlib_module_names) | {"transformers", "huggingface_hub"}
_PATCHABLE_CONTAINERS = {
    "os.environ": "writes an environment variable of the whole process",
    "os.environb": "writes an environment variable of the whole process",
    "sys.modules": "changes sys.modules, the module table of the whole process",
    "sys.path": "changes where every import looks",
    "sys.meta_path": "changes how every import is found",
    "sys.path_hooks": "changes how every import is found",
    "builtins.__dict__": "patches builtins for the whole process",
}
_BUILTINS = frozenset(dir(builtins))


def _match_rules(qual: str, *, called: bool) -> list[tuple[str, str]]:
    """The (category, reason) of every rule ``qual`` matches."""
    found = list(_RULES.get(qual, ()))
    if called:
        parts = qual.split(".")
        for end in range(len(parts) - 1, 0, -1):
            found += _RULES.get(".".join(parts[:end]) + ".*", ())
    top, last = qual.split(".", 1)[0], qual.rsplit(".", 1)[-1]
    if top == "huggingface_hub" and last in _HUB_DOWNLOADS:
        found.append(("network", "downloads from the Hugging Face Hub"))
    if top == "transformers" and last in _TRANSFORMERS_DOWNLOADS:
        found.append(("network", "downloads from the Hugging Face Hub"))
    if top == "transformers" and last in _TRANSFORMERS_DYNAMIC:
        found.append(("dynamic-code", "fetches and runs another repo's remote code"))
        found.append(("network", "downloads another repo's remote code"))
    return found


# -- scopes ---------------------------------------------------------------------------------


@dataclass
class _Scope:
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


def _build_scope(kind: str, name: str, body: Sequence[ast.AST], args: ast.arguments | None) -> _Scope:
    scope = _Scope(kind, name)
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


# -- the visitor ----------------------------------------------------------------------------


def _const_str(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _safe_part(text: str | None) -> bool:
    """A constant path piece that stays below the folder it is joined to."""
    if not text or text.startswith(("/", "~")) or "\\" in text or ":" in text:
        return False
    return ".." not in text.split("/")


def _arg(call: ast.Call, index: int, keyword: str) -> ast.expr | None:
    for kw in call.keywords:
        if kw.arg == keyword:
            return kw.value
    if index < len(call.args) and not any(isinstance(a, ast.Starred) for a in call.args[: index + 1]):
        return call.args[index]
    return None


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((kw.value for kw in call.keywords if kw.arg == name), None)


class _Auditor(ast.NodeVisitor):
    def __init__(self, text: str, repo: str | None, path: str, module: ast.Module) -> None:
        self.text = text
        self.repo = repo
        self.path = path
        self.findings: dict[tuple[int, int, str], Finding] = {}
        self.scopes: list[_Scope] = [_build_scope("module", "", module.body, None)]
        self.quiet: set[int] = set()  # ids of name chains already reported through a call
        self.resolving: set[int] = set()  # ids of expressions being resolved (cycle guard)
        self.statement: ast.stmt | None = None

    def visit(self, node: ast.AST) -> Any:
        if isinstance(node, ast.stmt):
            self.statement = node
        return super().visit(node)

    # -- reporting --------------------------------------------------------------------------

    def report(self, node: ast.AST, category: str, reason: str) -> None:
        line = getattr(node, "lineno", 1)
        col = getattr(node, "col_offset", 0) + 1
        key = (line, col, category)
        if key in self.findings:
            return
        segment = ast.get_source_segment(self.text, node) or ""
        code = " ".join(segment.split())
        if len(code) > _CODE_WIDTH:
            code = code[: _CODE_WIDTH - 3] + "..."
        self.findings[key] = Finding(self.repo, self.path, line, col, category, code, reason)

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
                if name not in _BUILTINS and _match_rules(candidate, called=True):
                    return candidate
        return f"builtins.{name}" if name in _BUILTINS else None

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
            first = _const_str(node.args[0]) if node.args else None
            if func == "builtins.getattr" and len(node.args) >= 2:
                base, attr = self.qualify(node.args[0]), _const_str(node.args[1])
                return f"{base}.{attr}" if base and attr else None
            if func in {"builtins.__import__", "importlib.import_module"} and first:
                if func == "builtins.__import__" and "." in first and not _keyword(node, "fromlist"):
                    return first.split(".", 1)[0]  # __import__("os.path") returns os
                return first
        if isinstance(node, ast.Subscript) and self.qualify(node.value) == "sys.modules":
            return _const_str(node.slice)
        return None

    # -- scopes -----------------------------------------------------------------------------

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        for deco in node.decorator_list:
            self.visit(deco)
        self.visit(node.args)  # defaults; annotations (``pool: Pool``) do nothing
        self.scopes.append(_build_scope("function", node.name, node.body, node.args))
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
        self.scopes.append(_build_scope("function", "<lambda>", [node.body], node.args))
        self.visit(node.body)
        self.scopes.pop()

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for expr in [*node.decorator_list, *node.bases, *node.keywords]:
            self.visit(expr)
        self.scopes.append(_build_scope("class", node.name, node.body, None))
        for stmt in node.body:
            self.visit(stmt)
        self.scopes.pop()

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
            if qual:
                self.report_rules(node, qual, called=False)
        elif not isinstance(node.ctx, ast.Load) and node.id == "__builtins__":
            self.report(self.target_node(node), "environment", "replaces __builtins__")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.ctx, ast.Load):
            if id(node) not in self.quiet:
                qual = self.qualify(node)
                if qual and self.report_rules(node, qual, called=False):
                    self.silence(node.value)
        else:
            self.check_patch(self.target_node(node), self.qualify(node.value), node.attr)
        self.visit(node.value)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        if not isinstance(node.ctx, ast.Load):
            container = self.qualify(node.value)
            if container in _PATCHABLE_CONTAINERS:
                self.report(self.target_node(node), "environment", _PATCHABLE_CONTAINERS[container])
            elif container == "builtins":
                self.report(self.target_node(node), "environment", "patches builtins for the whole process")
        self.generic_visit(node)

    def check_patch(self, node: ast.AST, owner: str | None, attr: str | None) -> None:
        """``builtins.open = ...``, ``setattr(sys, "path", ...)``, ``del os.environ``..."""
        if not owner:
            return
        target = f"{owner}.{attr}" if attr else owner
        if target in _PATCHABLE_CONTAINERS:
            self.report(node, "environment", _PATCHABLE_CONTAINERS[target])
        elif owner.split(".", 1)[0] in _PATCHABLE and self.is_module(owner):
            self.report(node, "environment", f"patches {target} for the whole process")

    def is_module(self, qual: str) -> bool:
        """Whether ``qual`` names a module (by its top name: imported, or ``builtins``)."""
        top = qual.split(".", 1)[0]
        return top == "builtins" or any(
            top == value.split(".", 1)[0] for scope in self.scopes for value in scope.imports.values()
        )

    def silence(self, node: ast.AST) -> None:
        """Do not report the rest of a name chain again (``ctypes.cdll`` of ``ctypes.cdll.X``)."""
        while isinstance(node, (ast.Attribute, ast.Name)):
            self.quiet.add(id(node))
            if isinstance(node, ast.Name):
                break
            node = node.value

    def report_rules(self, node: ast.AST, qual: str, *, called: bool) -> bool:
        matched = _match_rules(qual, called=called)
        if qual in {"torch.load", "torch.serialization.load", "yaml.load", "yaml.load_all"} and not called:
            matched.append(("unpickle", "passes on a loader that can unpickle"))
        for category, reason in matched:
            self.report(node, category, f"{reason} ({qual})")
        return bool(matched)

    # -- calls ------------------------------------------------------------------------------

    def visit_Call(self, node: ast.Call) -> None:
        qual = self.qualify(node.func)
        if qual:
            self.report_rules(node, qual, called=True)
            self.check_conditional(node, qual)
            if qual in {"builtins.setattr", "builtins.delattr"} and node.args:
                self.check_patch(node, self.qualify(node.args[0]), _const_str(_arg(node, 1, "")))
            if any(c == "process" for c, _ in _match_rules(qual, called=True)):
                self.check_command(node, qual)
        if isinstance(node.func, ast.Attribute):
            self.check_method(node, node.func)
        self.silence(node.func)  # judged as a call: not a reference handed on
        self.check_shared_library(node)
        self.generic_visit(node)

    def check_conditional(self, node: ast.Call, qual: str) -> bool:
        """Rules that depend on the arguments: loaders, ``open`` modes, writers."""
        if qual in {"torch.load", "torch.serialization.load"}:
            weights_only = _keyword(node, "weights_only")
            if not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
                self.report(node, "unpickle", f"unpickles without weights_only=True ({qual})")
                return True
        elif qual == "numpy.load":
            allow = _keyword(node, "allow_pickle")
            if allow is not None and not (isinstance(allow, ast.Constant) and not allow.value):
                self.report(node, "unpickle", "loads with allow_pickle=True (numpy.load)")
                return True
        elif qual in {"yaml.load", "yaml.load_all"}:
            loader = _arg(node, 1, "Loader")
            if loader is None or self.qualify(loader) not in _SAFE_YAML_LOADERS:
                self.report(node, "unpickle",
                            f"loads YAML without a safe loader, which can build any object ({qual})")
                return True
        elif qual in _OPENERS:
            return self.check_open(node, qual, _arg(node, _OPENERS[qual], "mode"), _arg(node, 0, "file"))
        elif qual == "os.open":
            flags = _arg(node, 1, "flags")
            names = {n.attr if isinstance(n, ast.Attribute) else n.id
                     for n in ast.walk(flags) if isinstance(n, (ast.Attribute, ast.Name))} if flags else set()
            value = flags.value if isinstance(flags, ast.Constant) else None
            if isinstance(value, int):
                writes = bool(value & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC))
            else:  # by the flag names; flags known only at run time count as writing
                writes = bool(names & set(_WRITE_FLAGS)) or (flags is not None and "O_RDONLY" not in names)
            if writes:
                return self.check_target(node, _arg(node, 0, "path"), f"opens a file for writing ({qual})")
        elif qual in _WRITERS:
            targets = [_arg(node, index, kw) for index, kw in _WRITERS[qual]]
            verb = "deletes" if qual.endswith(("rmtree", "remove", "unlink", "rmdir", "removedirs")) else "writes"
            return any(self.check_target(node, t, f"{verb} files ({qual})") for t in targets)
        elif qual in _TEMP_WRITERS:
            self.report(node, "file-write", f"creates files in the temporary folder ({qual})")
            return True
        return False

    def check_open(self, node: ast.Call, qual: str, mode: ast.expr | None, target: ast.expr | None) -> bool:
        if mode is None:
            return False  # read-only by default
        text = _const_str(mode)
        if text is not None and not set(text) & set("wax+"):
            return False
        why = f"opens a file for writing ({qual}, mode {text!r})" if text is not None else (
            f"opens a file with a mode known only at run time ({qual})")
        return self.check_target(node, target, why)

    def check_method(self, node: ast.Call, func: ast.Attribute) -> bool:
        """Calls known by their method name: path writes, loaders, downloads."""
        name, receiver = func.attr, func.value
        # ``os.mkdir(p)`` is a module's function (judged as such), ``p.mkdir()`` a path's method.
        on_object = self.qualify(receiver) is None
        if (name in _PATH_WRITE_METHODS and on_object) or (
            name in _PATH_MAYBE_WRITE_METHODS and self.is_path(receiver)
        ):
            return self.check_target(node, receiver, f"writes files (Path.{name})")
        if name == "open" and self.is_path(receiver):
            return self.check_open(node, f"Path.{name}", _arg(node, 0, "mode"), receiver)
        if name == "extractall":
            return self.check_target(node, _arg(node, 0, "path") or ast.Constant("."),
                                     "extracts an archive")
        if name in {"exec_module", "load_module"}:
            self.report(node, "dynamic-code", f"executes a module loaded at run time (.{name})")
            return True
        if name == "dlopen":
            self.report(node, "native-code", "loads a shared library (.dlopen)")
            return True
        if name == "from_pretrained" and not self.is_self(receiver):
            self.report(node, "network", "may download from the Hugging Face Hub (.from_pretrained)")
            return True
        return False

    def is_self(self, node: ast.expr) -> bool:
        if isinstance(node, ast.Name):
            return node.id in {"self", "cls"}
        return isinstance(node, ast.Call) and self.qualify(node.func) == "builtins.super"

    def check_command(self, node: ast.Call, qual: str) -> None:
        """A program run through ``subprocess``/``os.system``: a compiler, or pip."""
        first = _arg(node, 0, "args")
        words: list[str] = []
        if isinstance(first, (ast.List, ast.Tuple)):
            words = [w for w in (_const_str(e) for e in first.elts) if w is not None]
            program = _const_str(first.elts[0]) if first.elts else None
        else:
            command = _const_str(first)
            words = command.split() if command else []
            program = words[0] if words else None
        if (program and os.path.basename(program) in _COMPILERS) or "build_ext" in words:
            self.report(node, "native-code", f"runs a compiler ({program or 'build_ext'}, via {qual})")
        if "pip" in words and "install" in words:
            self.report(node, "network", f"installs packages with pip (via {qual})")

    def check_shared_library(self, node: ast.Call) -> None:
        for arg in [*node.args, *(kw.value for kw in node.keywords)]:
            for sub in ast.walk(arg):
                text = _const_str(sub)
                if text and _SHARED_LIBRARY.search(text):
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
        self.report(node, "file-write", why + where)
        return True

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
            return "inside" if base in {"folder", "inside"} and _safe_part(_const_str(node.right)) else None
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
            ok = base in {"folder", "inside"} and all(_safe_part(_const_str(a)) for a in args[1:])
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
                return "inside" if all(_safe_part(_const_str(a)) for a in args) else None
            if func.attr in {"with_name", "with_suffix", "with_stem"} and base in {"file", "inside"}:
                return "inside" if len(args) == 1 and _safe_part(_const_str(args[0])) else None
        return None

    def written_by_save_hook(self, target: ast.expr) -> bool:
        """A ``save_pretrained``-style hook writing into the folder its caller passed.

        The target must be built from a parameter of the hook: directly, or through local
        names every assignment of which is (``if isdir(d): f = join(d, x) else: f = d``).
        """
        scope = self.scopes[-1]
        if scope.kind != "function" or scope.name not in _SAVE_HOOKS:
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


# -- entry points ---------------------------------------------------------------------------


def audit_source(text: str, *, path: str, repo: str | None = None) -> list[Finding]:
    """Findings of one module's source (raises ``SyntaxError``, ``RecursionError``...)."""
    tree = ast.parse(text, filename=path)
    auditor = _Auditor(text, repo, path, tree)
    auditor.visit(tree)
    return sorted(auditor.findings.values(), key=lambda f: (f.line, f.col, CATEGORIES.index(f.category)))


def audit_bundle(bundle: Bundle) -> AuditReport:
    """Audit every Python file of a resolved model (its hashed bytes; nothing is executed)."""
    findings: list[Finding] = []
    skipped: list[tuple[str, str]] = []
    for (repo, path), data in sorted(bundle.sources.items(), key=lambda item: (item[0][0] or "", item[0][1])):
        if not path.endswith(".py"):
            continue  # assets: data the code reads
        shown = f"{repo}--{path}" if repo else path
        try:
            text = data.decode("utf-8")
            findings += audit_source(text, path=path, repo=repo)
        except UnicodeDecodeError:
            skipped.append((shown, "not UTF-8"))
        except SyntaxError as exc:
            skipped.append((shown, f"not valid Python (line {exc.lineno}), so it cannot run either"))
        except (RecursionError, MemoryError):
            skipped.append((shown, "nested too deeply to analyse"))
        except ValueError as exc:  # e.g. null bytes, on Pythons that report them so
            skipped.append((shown, f"not valid Python ({exc})"))
    return AuditReport(bundle.source.name, bundle.digest, tuple(findings), tuple(skipped))


def audit(model: str | os.PathLike[str], *, revision: str | None = None,
          cache_dir: str | os.PathLike[str] | None = None) -> AuditReport:
    """What the remote code of ``model`` can do beyond computing. Executes nothing.

    ``model`` is a folder or a repo id in the local hub cache, as for ``resolve``; its
    errors (``codeferry.errors``) propagate.
    """
    return audit_bundle(resolve(model, revision=revision, cache_dir=cache_dir))


def render_audit(report: AuditReport) -> str:
    """The human form of ``codeferry audit``: findings grouped by category, with counts."""
    files = {f.file for f in report.findings}
    total = len(report.findings)
    out = [
        f"model    {report.model}",
        f"digest   {report.digest}",
        f"findings {total} in {len(files)} file{'s' if len(files) != 1 else ''} "
        "(static analysis: nothing was executed)" if total else
        "findings none found (static analysis: nothing was executed)",
    ]
    counts = report.counts
    for category in CATEGORIES:
        if not counts[category]:
            out.append(f"{category}: none found")
            continue
        out.append(f"{category} ({counts[category]})")
        for f in report.findings:
            if f.category == category:
                out.append(f"  {f.location}: {f.code}")
                out.append(f"      {f.reason}")
    if report.skipped:
        out.append("not audited")
        out += [f"  {file}: {why}" for file, why in report.skipped]
    return "\n".join(out) + "\n"
