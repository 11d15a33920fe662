"""docs/architecture.md names every module of the tree, in layer order, and no module that
is gone.

Each module is one list line, ``- `dotted.name`: what it is for``, its name below
``codeferry``; the lines follow ``LAYERS`` and ``EXEC_FLOORS`` of ``test_layers`` (``testing``,
outside the layers, last). Anywhere on the page, a backticked dotted name whose first part
starts with ``_`` or is a top-level module of the package must name a module or package of
the tree."""

from __future__ import annotations

import re
from itertools import pairwise

from _helpers import ROOT, SRC
from test_layers import EXEC_FLOORS, LAYERS

PAGE = ROOT / "docs" / "architecture.md"
ITEM = re.compile(r"^- `([\w.]+)`:", re.M)
NAME = re.compile(r"`([A-Za-z_]\w*(?:\.\w+)*)`")
_RANK = {name: rank for rank, layer in enumerate(LAYERS) for name in layer}


def _tree() -> set[str]:
    """Every module and package below ``codeferry`` but the demo, as test_layers names them."""
    found = set()
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        if parts[0] == "demo":
            continue
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        found.add(".".join(parts))
    return found


def _rank(name: str) -> tuple[int, int]:
    parts = name.split(".")
    layer = _RANK.get(parts[0], len(LAYERS))  # testing: after every layer
    if parts[0] != "_exec" or len(parts) == 1:
        return layer, -1  # a layer's package first
    return layer, EXEC_FLOORS.index(parts[1] if parts[1] in EXEC_FLOORS else "")


def test_every_module_is_on_the_page_once() -> None:
    items = ITEM.findall(PAGE.read_text(encoding="utf-8"))
    assert sorted(_tree() - set(items)) == [], "add these to docs/architecture.md"
    assert sorted({n for n in items if items.count(n) > 1}) == []


def test_the_page_names_no_module_that_is_gone() -> None:
    tree = _tree()
    tops = {name.split(".")[0] for name in tree}
    spans = {n.removesuffix(".py") for n in NAME.findall(PAGE.read_text(encoding="utf-8"))}
    named = {n for n in spans if n.strip("_") and (n.split(".")[0] in tops or n.startswith("_"))}
    assert sorted(named - tree) == [], "docs/architecture.md names modules the tree lacks"


def test_the_modules_are_in_layer_order() -> None:
    items = [n for n in ITEM.findall(PAGE.read_text(encoding="utf-8")) if n in _tree()]
    out_of_order = [f"{a} before {b}" for a, b in pairwise(items) if _rank(a) > _rank(b)]
    assert out_of_order == [], "order: tests/house/test_layers.py's LAYERS and EXEC_FLOORS"
