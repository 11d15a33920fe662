"""``inspect`` and ``doctor`` say which transformers names a model's code uses that later
releases removed, with file and line, read statically, and what the code gets here: a shim,
or the last release that has the name.

The models are the corpus's ``headmask`` reproduction (shimmed names only) and a copy of it that
also imports ``DisjunctiveConstraint`` (transformers_stream_generator's pattern), which
transformers 5 removed and no shim covers (a release environment does).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import codeferry
from codeferry._code.removed import IMPORTS, applies, installed, scan

CORPUS = Path(__file__).resolve().parents[1] / "corpus" / "models"


def _codeferry(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "codeferry", *args], capture_output=True,
                          text=True, timeout=300, check=False)


@pytest.fixture(scope="module")
def headmask(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("report") / "headmask"
    shutil.copytree(CORPUS / "headmask", folder)
    demo = Path(codeferry.__file__).parent / "demo"
    for name in ("tokenization_charlm.py", "tokenizer_config.json", "vocab.json"):
        shutil.copy(demo / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def constrained(headmask: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("report") / "constrained"
    shutil.copytree(headmask, folder)
    path = folder / "modeling_headmask.py"
    path.write_text(path.read_text().replace(
        "from transformers.utils import logging\n",
        "from transformers.utils import logging\n"
        "from transformers.generation import DisjunctiveConstraint\n"))
    path.write_text(path.read_text() + (
        "\n\ndef update(self, outputs, model_kwargs):\n"
        "    model_kwargs['past_key_values'] = self._extract_past_from_model_output(outputs)\n"))
    return folder


def test_scan_reads_the_patterns_with_their_lines() -> None:
    source = (CORPUS / "legacycache" / "modeling_legacycache.py").read_text()
    lines = source.splitlines()
    found = {use.removed.name: use.line for use in scan(source)}
    assert "from_legacy_cache" in lines[found["DynamicCache.from_legacy_cache"] - 1]
    assert "is_torch_fx_available" in lines[found["transformers.utils.is_torch_fx_available"] - 1]
    assert "seen_tokens" in lines[found["DynamicCache.seen_tokens"] - 1]
    # a config attribute counts where a config is read, not on any object
    assert not scan("x.max_length\nself.max_length = 3\n")
    assert [u.removed.name for u in scan("y = self.config.max_length\n")] == [
        "PretrainedConfig.max_length"]


def test_post_init_is_looked_for_where_a_concrete_model_runs_its_init() -> None:
    """A base class whose ``__init__`` only calls ``super().__init__`` (Phi's remote code)
    is no model that skips ``post_init`` when each model built on it calls it; a model that
    inherits such an ``__init__`` without its own, or defines one without it, is."""
    names = [u.removed.name for u in scan(
        (CORPUS / "mixformer" / "modeling_phi.py").read_text())]
    assert "PreTrainedModel.all_tied_weights_keys (no post_init)" not in names
    base = ("class Base(PreTrainedModel):\n"
            "    def __init__(self, config):\n"
            "        super().__init__(config)\n")
    calls = "    def __init__(self, config):\n        super().__init__(config)\n        self.post_init()\n"
    built = base + "class Model(Base):\n" + calls
    assert not scan(built)
    inherits = built + "class Head(Base):\n    x = 1\n"
    assert [u.line for u in scan(inherits)] == [2]  # Head runs Base's __init__
    skips = "class Model(PreTrainedModel):\n    def __init__(self, config):\n        pass\n"
    assert [u.line for u in scan(skips)] == [2]
    assert [u.line for u in scan(base)] == [2]  # a model class nothing derives from


def test_the_table_is_true_of_the_installed_release() -> None:
    """Every import the table says the installed release lacks is really missing from it."""
    import importlib

    version = installed()
    for (module, name), removed in IMPORTS.items():
        if not applies(removed, version) or name == "DynamicCache":
            continue
        try:
            present = hasattr(importlib.import_module(module), name)
        except ImportError:
            present = False
        assert not present, removed.name


def test_inspect_names_each_removed_name_and_what_it_gets(headmask: Path, constrained: Path) -> None:
    done = _codeferry("inspect", str(headmask))
    assert done.returncode == 0, done.stderr
    text = done.stdout.split("transformers names later releases removed")[1]
    assert "PreTrainedModel.get_head_mask" in text and "shim" in text
    assert "modeling_headmask.py:108" in text  # the get_head_mask call
    assert "(no post_init)" in text and "PretrainedConfig.max_length" in text

    done = _codeferry("inspect", str(constrained), "--json")
    data = json.loads(done.stdout)
    # no shim serves the name: a release environment does, where the installed lacks it (the
    # code's own release, config.json's 4.x raised to the floor), and nothing blocks
    lacks = applies(IMPORTS[("transformers.generation", "DisjunctiveConstraint")], installed())
    assert done.returncode == 0 and data["release"] == ("4.53" if lacks else None)
    entry = next(e for e in data["removed_names"]
                 if e["name"] == "transformers.generation.DisjunctiveConstraint")
    assert entry == {"file": "modeling_headmask.py", "line": 17,
                     "name": "transformers.generation.DisjunctiveConstraint",
                     "last_with": "4.57", "first_without": "5.0",
                     "gets": "needs transformers <= 4.57"}
    chatglm = next(e for e in data["removed_names"] if "_extract_past" in e["name"])
    assert chatglm["gets"] == "shim" and chatglm["line"] > 17
    problem = next(p for p in data["problems"] if "DisjunctiveConstraint" in json.dumps(p))
    assert "transformers <= 4.57" in json.dumps(problem)
    assert {"name": "PreTrainedModel.get_head_mask", "gets": "shim"}.items() <= next(
        e for e in data["removed_names"] if e["name"] == "PreTrainedModel.get_head_mask").items()


def test_doctor_says_it_too(headmask: Path) -> None:
    done = _codeferry("doctor", str(headmask), "--trust-remote-code", "--workers", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    section = done.stdout.split("transformers names later releases removed")[1]
    assert "PreTrainedModel.get_head_mask" in section and "shim" in section
    assert "modeling_headmask.py:108" in section
    assert done.stdout.rstrip().endswith("ok")
