"""Every place the installed transformers binds a gated function by name is gated.

A module that did ``from ..dynamic_module_utils import get_class_in_module`` at its import
keeps the original unless codeferry replaces that binding too (``generation.utils`` did:
``generate(custom_generate=...)`` then ran unlocked code under ``load(lock=...)``). This test
reads the installed transformers' source (ast), finds each ``from X import NAME [as ALIAS]``
of a gated function, imports the modules that bind one at their top level *before*
``install()`` (as ``load()`` does), and checks against the patch registry (``_hf.patches``)
that each binding is codeferry's gate afterwards, failing with the module, line and name when
a release adds one that is not. Runs on whichever transformers is installed (CI: the floors'
4.53 and the newest release too); without the ``kernels`` package a stand-in takes its place.
"""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import importlib.util
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import codeferry
from codeferry._hf import patches

#: Functions whose call fetches or executes a repo's code (``lazy_load_kernel`` fetches
#: through ``get_kernel``, looked up in its module at call time).
GATED = ("get_class_in_module", "get_class_from_dynamic_module", "get_kernel", "kernelize",
         "load_and_register_attn_kernel", "load_and_register_kernel", "lazy_load_kernel")


@dataclass(frozen=True)
class Binding:
    module: str  # the module that binds the name
    source: str  # the module it imports from
    name: str
    alias: str
    line: int
    top_level: bool  # bound at import (else inside a function, read at call time)

    def __str__(self) -> str:
        return f"{self.module}:{self.line} from {self.source} import {self.name} as {self.alias}"


def scan(root: Path) -> list[Binding]:
    """The bindings of ``GATED`` names imported from transformers or ``kernels`` in the
    package at ``root`` (``.../transformers``)."""
    found: list[Binding] = []
    for file in sorted(root.rglob("*.py")):
        text = file.read_text(encoding="utf-8", errors="replace")
        if not any(name in text for name in GATED):
            continue
        parts = list(file.relative_to(root.parent).with_suffix("").parts)
        package = parts[:-1]
        if parts[-1] == "__init__":
            parts = package
        tree = ast.parse(text)
        inner = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for n in ast.walk(f) if isinstance(n, ast.ImportFrom)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = [node.module] if node.module else []
            source = (".".join(package[:len(package) - node.level + 1] + base) if node.level
                      else node.module or "")
            if source.split(".")[0] not in ("transformers", "kernels"):
                continue
            found += [Binding(".".join(parts), source, a.name, a.asname or a.name, node.lineno,
                              id(node) not in inner) for a in node.names if a.name in GATED]
    return found


def _gates() -> dict[int, tuple[Any, str]]:
    """id(gate) -> (owner, name), from the patch registry."""
    return {id(new): (owner, name) for owner, name, new in patches.registered()}


def _passes_through(value: Any) -> bool:
    """A function that calls a gate by its module-global name (``lazy_load_kernel``)."""
    code, globs = getattr(value, "__code__", None), getattr(value, "__globals__", {})
    gates = _gates()
    return code is not None and any(id(globs.get(n)) in gates for n in code.co_names)


def _used_only_in_gates(module: types.ModuleType, alias: str) -> bool:
    """Every use of ``alias`` in ``module`` is inside one of its functions codeferry gates
    (``hub_kernels.get_kernel`` calling ``kernels.get_kernel`` as ``get_kernel_hub``)."""
    tree = ast.parse(Path(module.__file__ or "").read_text(encoding="utf-8"))
    gated = {name for owner, name, _ in patches.registered() if owner is module}
    inside: set[int] = set()
    for f in ast.walk(tree):
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.name in gated:
            inside |= {id(n) for n in ast.walk(f)}
    uses = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == alias]
    return all(id(n) in inside for n in uses)


def _covered(binding: Binding) -> str | None:
    """Why ``binding`` is not gated after ``install()``, or ``None`` when it is."""
    gates = _gates()
    if not binding.top_level:  # read from the source module at call time
        value = getattr(sys.modules[binding.source], binding.name)
        if id(value) in gates or _passes_through(value):
            return None
        return f"{binding.source}.{binding.name} is not gated"
    module = sys.modules[binding.module]
    if binding.alias not in vars(module):
        return None  # a branch this environment did not take (checked where it does)
    value = vars(module)[binding.alias]
    if id(value) in gates or _passes_through(value) or _used_only_in_gates(module, binding.alias):
        return None
    return f"{binding.module}.{binding.alias} is still transformers' own function"


def _stand_in_kernels() -> types.ModuleType:
    kernels = types.ModuleType("kernels")
    kernels.__spec__ = importlib.machinery.ModuleSpec("kernels", None)  # no distribution

    def get_kernel(repo_id: str, *args: Any, **kwargs: Any) -> Any:
        raise LookupError(repo_id)

    def kernelize(model: Any, **kwargs: Any) -> Any:
        return model

    kernels.get_kernel, kernels.kernelize = get_kernel, kernelize  # type: ignore[attr-defined]
    return kernels


def test_the_scan_finds_the_known_bindings() -> None:
    import transformers

    found = {(b.module, b.alias) for b in scan(Path(transformers.__file__).parent)}
    assert ("transformers.generation.utils", "get_class_in_module") in found
    assert ("transformers.models.auto.auto_factory", "get_class_from_dynamic_module") in found


def test_every_binding_of_a_gated_function_is_gated_after_install(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    if importlib.util.find_spec("kernels") is None:
        monkeypatch.setitem(sys.modules, "kernels", _stand_in_kernels())
    bindings = scan(Path(transformers.__file__).parent)
    unimportable: list[str] = []
    for module in sorted({b.module for b in bindings} | {b.source for b in bindings}):
        try:  # imported before install(), as load() imports generation.utils
            importlib.import_module(module)
        except ImportError as exc:  # a model's optional dependency
            unimportable.append(f"{module}: {exc}")
    codeferry.install()
    try:
        problems = [f"{b}: {why}" for b in bindings
                    if b.module in sys.modules and b.source in sys.modules
                    and (why := _covered(b)) is not None]
    finally:
        codeferry.uninstall()
    assert not problems, "\n".join(problems)
    assert len(unimportable) <= 2, unimportable  # the scan checked (nearly) everything
