"""The models every context runs over: a flat layout, a sub-package layout and a repo id in
an offline hub cache, each with a remote tokenizer; written once per session."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _contexts import LAYOUT_SPECS

from codeferry.testing import write_hub_model, write_model


@pytest.fixture(scope="session")
def context_hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The offline hub cache of the ``hub`` layout (``HF_HUB_CACHE`` of every context run)."""
    cache = tmp_path_factory.mktemp("context_hub")
    for spec, repo_id in LAYOUT_SPECS.values():
        if repo_id is not None:
            write_hub_model(cache, repo_id, spec)
    return cache


@pytest.fixture(scope="session")
def context_layouts(tmp_path_factory: pytest.TempPathFactory, context_hub_cache: Path) -> Path:
    """A JSON file of ``[[layout, model], ...]``: the first argument of every context script."""
    root = tmp_path_factory.mktemp("context_models")
    pairs = []
    for layout, (spec, repo_id) in LAYOUT_SPECS.items():
        pairs.append([layout, repo_id or str(write_model(root / spec.name, spec))])
    path = root / "layouts.json"
    path.write_text(json.dumps(pairs), encoding="utf-8")
    return path
