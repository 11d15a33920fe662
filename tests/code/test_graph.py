"""The import graph: scanning source, resolving relative imports, ordering, cycles."""

from __future__ import annotations

import ast

from hypothesis import given
from hypothesis import strategies as st

from codeferry._code.graph import RelativeImport, find_cycle, load_order, resolve_relative, scan

SOURCE = '''
"""Example: from .not_a_module import X"""
import os
import torch
from transformers import PreTrainedModel
from .configuration_x import XConfig
from .utils.rope import rope
from . import layers
from .consts import *
try:
    from .fast import kernel
    import flash_attn
except ImportError:
    kernel = None
if is_torch_available():
    import torchvision
TEXT = "from .fake import thing"

class Model(PreTrainedModel):
    def forward(self):
        from .norms import rms
        import numpy
'''


def test_scan_sees_every_form_and_nothing_in_strings() -> None:
    facts = scan(ast.parse(SOURCE))
    rel = {(r.module, r.names, r.deferred, r.guarded) for r in facts.relative}
    assert rel == {
        ("configuration_x", ("XConfig",), False, False),
        ("utils.rope", ("rope",), False, False),
        (None, ("layers",), False, False),
        ("consts", ("*",), False, False),
        ("fast", ("kernel",), False, True),
        ("norms", ("rms",), True, False),
    }
    ext = {(e.module, e.deferred, e.guarded) for e in facts.external}
    assert ext == {("os", False, False), ("torch", False, False), ("transformers", False, False),
                   ("flash_attn", False, True), ("torchvision", False, True), ("numpy", True, False)}
    assert {"Model", "XConfig", "rope", "layers", "TEXT", "kernel"} <= facts.defined
    assert "rms" not in facts.defined
    assert facts.star_relative == [(1, "consts")]


FILES = {"configuration_x.py", "modeling_x.py", "layers.py", "utils/__init__.py", "utils/rope.py",
         "nested/deep/mod.py"}


def rel(level: int, module: str | None, *names: str) -> RelativeImport:
    return RelativeImport(level, module, names or ("x",), 1, 1, False, False)


def test_resolve_relative_forms() -> None:
    assert resolve_relative("modeling_x", False, rel(1, "utils.rope", "rope"), FILES) == (
        ["utils", "utils.rope"], [])
    assert resolve_relative("modeling_x", False, rel(1, None, "layers"), FILES) == (["layers"], [])
    assert resolve_relative("modeling_x", False, rel(1, "utils", "rope"), FILES) == (
        ["utils", "utils.rope"], [])
    assert resolve_relative("utils.rope", False, rel(2, "layers"), FILES) == (["layers"], [])
    assert resolve_relative("utils", True, rel(1, "rope"), FILES) == (["utils.rope"], [])
    # namespace folder without __init__.py
    assert resolve_relative("modeling_x", False, rel(1, "nested.deep.mod"), FILES) == (
        ["nested", "nested.deep", "nested.deep.mod"], [])
    assert resolve_relative("modeling_x", False, rel(1, "absent"), FILES) == ([], ["absent"])
    assert resolve_relative("modeling_x", False, rel(1, None, "absent"), FILES) == ([], ["absent"])


def test_resolve_relative_refuses_climbing_out() -> None:
    import pytest
    with pytest.raises(ValueError):
        resolve_relative("modeling_x", False, rel(2, "x"), FILES)


def test_load_order_dependencies_first_whatever_the_input_order() -> None:
    edges = [("modeling", "configuration"), ("modeling", "layers"), ("layers", "utils.rope"),
             ("utils.rope", "utils")]
    for nodes in (["modeling", "layers", "configuration", "utils", "utils.rope"],
                  ["utils", "utils.rope", "configuration", "layers", "modeling"]):
        order = load_order(nodes, edges)
        for importer, imported in edges:
            assert order.index(imported) < order.index(importer)
    assert load_order(["b", "a"], []) == ["a", "b"]


def test_find_cycle() -> None:
    assert find_cycle(["a", "b", "c"], [("a", "b"), ("b", "c")]) is None
    assert find_cycle(["a", "b", "c"], [("a", "b"), ("b", "c"), ("c", "a")]) == ["a", "b", "c", "a"]


@given(st.lists(st.tuples(st.integers(0, 7), st.integers(0, 7)), max_size=30))
def test_load_order_is_a_topological_order_of_any_dag(pairs: list[tuple[int, int]]) -> None:
    edges = [(f"m{max(a, b)}", f"m{min(a, b)}") for a, b in pairs if a != b]  # acyclic
    nodes = [f"m{i}" for i in range(8)]
    order = load_order(nodes, edges)
    assert sorted(order) == sorted(nodes)
    for importer, imported in edges:
        assert order.index(imported) < order.index(importer)
    assert find_cycle(nodes, edges) is None
