"""The package's shape, pinned: layers that import only downward, no circle, small files, and
one reader of the environment.

A layer is a top-level module or subpackage of ``codeferry``. A module imports (at module level,
inside a function or for type checking alike) only its own layer or lower ones, never a name of
the package facade (``codeferry/__init__.py`` is for users), and the modules form no circle,
inside a layer either. What must call upward (``load`` reaching the hooks that answer
transformers for loaded models) does so through callbacks the upper layer subscribes.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from _helpers import SRC

#: Lowest first. A new module or subpackage gets a place here.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "_version", "_settings"),  # nothing of codeferry's below them
    ("_sandbox",),   # the box around processes that run model code: Landlock and seccomp
    ("_code",),      # static: auto_map, import graph, sources, Hub, digests, lock, audit, resolve
    ("_trust",),     # the one trust decision, the process policy, the options value
    ("_runtime", "_dyn"),  # store, private copies, finder and loader, pickling; _dyn: the
    # package that registered units are executed under (codeferry._dyn.u<token>)
    ("_hf",),        # every patch of transformers, through one registry
    ("_load",),      # load(): resolve, decide, register, execute
    ("_install",),   # install(), adoption, model_type guard, vLLM plugin: after-load callbacks
    ("_exec",),      # workers, engine, batching, transports, Ray, scheduler, Executor
    ("_commands",),  # run, doctor, render
    ("cli", "__main__", "__init__"),  # the command line and the facade
)
_RANK = {name: rank for rank, layer in enumerate(LAYERS) for name in layer}
#: The floors of ``_exec``, lowest first: generation (pure and torch), the two engines that
#: drive it, the worker processes that serve an engine, then the executor's own modules
#: (``""``: the modules directly in ``_exec``) that plan, batch and schedule across workers.
EXEC_FLOORS = ("generate", "engines", "workers", "")
#: Not layers of the library: the bundled demo model's code and the test-model factory.
_OUTSIDE = ("demo", "testing")
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    """Dotted name (below ``codeferry``) -> file, for every module of the library."""
    found = {}
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).with_suffix("")
        if rel.parts[0] in _OUTSIDE:
            continue
        parts = rel.parts[:-1] if rel.parts[-1] == "__init__" and len(rel.parts) > 1 else rel.parts
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[int, str]]:
    """``(line, target)`` of every import of codeferry in the module ``name``; ``"codeferry"``
    for a name of the facade."""
    is_package = path.name == "__init__.py" and name != "__init__"
    package = name.split(".") if is_package else name.split(".")[:-1]
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "codeferry":
                    out.append((node.lineno, "codeferry"))
                elif alias.name.startswith("codeferry."):
                    out.append((node.lineno, alias.name.partition(".")[2]))
            continue
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
            target = ".".join([*base, *([node.module] if node.module else [])])
        elif (node.module or "").split(".")[0] == "codeferry":
            target = (node.module or "").partition(".")[2]
        else:
            continue
        for alias in node.names:
            full = f"{target}.{alias.name}" if target else alias.name
            if full in modules:
                out.append((node.lineno, full))
            elif target:
                out.append((node.lineno, target))
            else:
                out.append((node.lineno, "codeferry"))  # `from codeferry import load`
    return out


def _layer(name: str) -> str:
    return name.split(".")[0]


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: {t for _, t in _imports(name, path, modules) if t in modules and t != name}
            for name, path in modules.items()}


def test_every_module_has_a_layer() -> None:
    assert sorted({_layer(n) for n in _modules()} - set(_RANK)) == []


def test_no_module_imports_upward_or_through_the_facade() -> None:
    modules = _modules()
    upward = []
    for name, path in sorted(modules.items()):
        for line, target in _imports(name, path, modules):
            where = f"{path.relative_to(SRC)}:{line}"
            if target == "codeferry" and name != "__init__":
                upward.append(f"{where} imports the package facade")
            elif _RANK.get(_layer(target), -1) > _RANK[_layer(name)]:
                upward.append(f"{where} imports {target}, a higher layer")
    assert upward == []


def _floor(name: str) -> int:
    """The rank of an ``_exec`` module's floor."""
    parts = name.split(".")
    return EXEC_FLOORS.index(parts[1] if len(parts) > 2 else "")


def test_exec_floors_import_only_downward() -> None:
    modules = _modules()
    assert {_floor(n) for n in modules if _layer(n) == "_exec"} == set(range(len(EXEC_FLOORS)))
    upward = []
    for name, path in sorted(modules.items()):
        if _layer(name) != "_exec":
            continue
        for line, target in _imports(name, path, modules):
            if _layer(target) == "_exec" and target in modules and _floor(target) > _floor(name):
                upward.append(f"{path.relative_to(SRC)}:{line} imports {target}, a higher floor")
    assert upward == []


def test_no_import_circle() -> None:
    graph = _graph()
    done: set[str] = set()

    def visit(name: str, stack: list[str]) -> None:
        if name in stack:
            pytest.fail("import circle: " + " -> ".join([*stack[stack.index(name):], name]))
        if name in done:
            return
        for target in sorted(graph[name]):
            visit(target, [*stack, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])


def test_the_check_sees_lazy_relative_and_facade_imports(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from .. import load\n    from .._load import load_with\n"
                     "    import codeferry.cli\n    from codeferry._exec import worker\n"
                     "    from . import batching\n")
    modules = {"_load": probe, "cli": probe, "_exec.worker": probe, "_exec.batching": probe}
    assert _imports("_exec.probe", probe, modules) == [
        (2, "codeferry"), (3, "_load"), (4, "cli"), (5, "_exec.worker"), (6, "_exec.batching")]


def test_no_source_file_is_longer_than_one_sitting() -> None:
    long = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py")
            if "demo" not in p.parts and p.name != "errors.py"
            and (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}


def test_only_settings_reads_the_environment() -> None:
    """``_settings`` is the table of every variable; a read elsewhere would bypass it."""
    reads = re.compile(r"\bos\.(?:environ|getenv|putenv)\b")
    found = []
    for name, path in sorted(_modules().items()):
        if name == "_settings" or name.startswith("_code.audit"):
            continue  # the audit's rules name os.environ as what *model code* may touch
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if reads.search(line) and not line.lstrip().startswith(("#", '"', "*", "``")):
                found.append(f"{path.relative_to(SRC)}:{number}")
    assert found == []
