"""Models that are deep rather than big: a long import chain, a deeply nested package.

The resolver keeps its own work lists, so depth costs no stack: no ``RecursionError``, and
no file blamed for nesting it does not have. Every file is written at test time.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from codeferry._code.resolve import resolve
from codeferry.cli import main

CHAIN = 1000
FOLDERS = 1200


def _config(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(
        {"model_type": "x", "auto_map": {"AutoConfig": "configuration_x.XConfig"}}))


def test_a_thousand_module_import_chain_resolves(tmp_path: Path) -> None:
    _config(tmp_path)
    (tmp_path / "configuration_x.py").write_text(
        "from .m0 import VALUE\n\n\nclass XConfig:\n    value = VALUE\n")
    for i in range(CHAIN):
        (tmp_path / f"m{i}.py").write_text(
            f"from .m{i + 1} import VALUE\n" if i < CHAIN - 1 else "VALUE = 1\n")
    bundle = resolve(tmp_path, requirements=False)
    assert bundle.problems == ()
    assert len(bundle.files) == CHAIN + 1
    # Dependencies first: the end of the chain loads first, the config last.
    assert bundle.load_order[0].endswith(f"m{CHAIN - 1}")
    assert bundle.load_order[-1].endswith("configuration_x")


def test_a_thousand_star_imports_find_the_class(tmp_path: Path) -> None:
    """``auto_map`` names a class that only a long chain of ``import *`` defines."""
    _config(tmp_path)
    (tmp_path / "configuration_x.py").write_text("from .s0 import *\n")
    for i in range(CHAIN):
        (tmp_path / f"s{i}.py").write_text(
            f"from .s{i + 1} import *\n" if i < CHAIN - 1 else "class XConfig:\n    pass\n")
    assert resolve(tmp_path, requirements=False).problems == ()
    (tmp_path / f"s{CHAIN - 1}.py").write_text("class Other:\n    pass\n")
    problems = resolve(tmp_path, requirements=False).problems
    assert [type(p).__name__ for p in problems] == ["MissingClassError"]


def _unnest(root: Path, depth: int) -> None:
    """Remove what ``_nest`` made, deepest first, without recursion: pytest's own clean-up
    of old temporary folders (``shutil.rmtree``) recurses and would fail on it later."""
    for level in range(depth, 0, -1):
        folder = os.path.join(str(root), *(["d"] * level))
        for entry in os.scandir(folder):
            if not entry.is_dir(follow_symlinks=False):
                os.unlink(entry.path)
            elif entry.name != "d":
                shutil.rmtree(entry.path)  # __pycache__ and the like: shallow
        os.rmdir(folder)


def _nest(root: Path, depth: int) -> str:
    """``depth`` folders ``d/d/...``; returns the deepest (built by hand: ``mkdir -p`` and
    ``Path.mkdir(parents=True)`` recurse too)."""
    folder = str(root)
    for _ in range(depth):
        folder = os.path.join(folder, "d")
        os.mkdir(folder)
    return folder


@pytest.mark.parametrize("imported", [False, True], ids=["beside", "imported"])
def test_twelve_hundred_nested_folders_resolve(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], imported: bool
) -> None:
    model = tmp_path / "model"
    _config(model)
    deepest = _nest(model, FOLDERS)
    try:
        with open(os.path.join(deepest, "leaf.py"), "w", encoding="utf-8") as handle:
            handle.write("VALUE = 1\n")
        head = "from ." + ".".join(["d"] * FOLDERS) + ".leaf import VALUE\n" if imported else ""
        (model / "configuration_x.py").write_text(head + "\n\nclass XConfig:\n    pass\n")
        bundle = resolve(model, requirements=False)
        assert bundle.problems == ()
        assert sorted(f.path for f in bundle.files) == sorted(
            ["configuration_x.py"] + (["d/" * FOLDERS + "leaf.py"] if imported else []))
        assert main(["inspect", str(model)]) == 0
        assert "RecursionError" not in capsys.readouterr().err
    finally:
        _unnest(model, FOLDERS)
