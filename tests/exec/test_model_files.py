"""What every worker will need is checked in the parent, before any worker starts.

A model folder without weights, or without the files of its tokenizer, used to fail only
once the workers had started (transformers' traceback from each of them, seconds later).
``prepare`` now refuses it with ``ModelFilesMissingError`` naming the folder, what is missing
and the fix; every model that works (the demo, the factory's models, a plain Llama with a
``tokenizer.json``) still passes.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import time
from pathlib import Path

import pytest
from _helpers import unique_model

import codeferry
from codeferry import cli
from codeferry._exec.plan import prepare
from codeferry._trust.options import ModelOptions
from codeferry.errors import ModelFilesMissingError
from codeferry.testing import LARGEST_SPEC, ModelSpec, write_model

TRUST = ModelOptions(trust_remote_code=True)


def refused(path: Path, **kw: object) -> ModelFilesMissingError:
    """The error of an executor over ``path``, raised before any worker started."""
    before = {child.pid for child in multiprocessing.active_children()}
    started = time.monotonic()
    with pytest.raises(ModelFilesMissingError) as info:
        codeferry.Executor(path, workers=2, start_method="fork", trust_remote_code=True, **kw)
    assert {child.pid for child in multiprocessing.active_children()} <= before
    assert time.monotonic() - started < 30
    err = info.value
    assert err.path is not None and Path(err.path).resolve() == path.resolve()
    assert err.fix and err.__cause__ is None
    return err


def test_a_folder_without_weights_is_refused_before_any_worker_starts(tmp_path: Path) -> None:
    path = unique_model(tmp_path, "nw", tokenizer=True)
    (path / "model.safetensors").unlink()
    err = refused(path)
    assert err.missing == ("weights",)
    assert "no weights" in str(err) and ".safetensors" in str(err)
    # A task that builds no model needs no weights.
    prepare(path, TRUST, tasks=())


def test_sharded_weights_are_weights(tmp_path: Path) -> None:
    path = unique_model(tmp_path, "sh", tokenizer=True)
    (path / "model.safetensors").rename(path / "model-00001-of-00001.safetensors")
    prepare(path, TRUST)
    index = {"metadata": {}, "weight_map": {}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    (path / "model-00001-of-00001.safetensors").unlink()
    prepare(path, TRUST)  # the index names them: transformers' message is the better one


def test_a_folder_without_a_tokenizer_is_refused_before_any_worker_starts(tmp_path: Path) -> None:
    path = unique_model(tmp_path, "nt")  # no tokenizer of any kind
    err = refused(path)
    assert err.missing == ("tokenizer",)
    assert "tokenizer" in str(err) and "tokenizer.json" in str(err)
    assert "save_pretrained" in (err.fix or "")


def test_a_tokenizer_without_its_vocabulary_is_refused(tmp_path: Path) -> None:
    """The remote tokenizer class names ``vocab.json`` (its ``vocab_files_names``); without it,
    AutoTokenizer would fail in every worker."""
    path = unique_model(tmp_path, "nv", tokenizer=True)
    (path / "vocab.json").unlink()
    (path / "model.safetensors").unlink()
    err = refused(path)
    assert err.missing == ("weights", "tokenizer")
    assert "vocab.json" in str(err)


def test_a_transformers_tokenizer_without_its_files_is_refused(tmp_path: Path) -> None:
    """A tokenizer class of transformers' own (``GPT2Tokenizer``) whose files are missing."""
    path = unique_model(tmp_path, "gp", tokenizer=True)
    (path / "vocab.json").unlink()
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))
    err = refused(path)
    assert err.missing == ("tokenizer",)
    assert "vocab.json" in str(err) and "merges.txt" in str(err)


def test_models_that_work_pass(tmp_path: Path) -> None:
    prepare(cli._demo(), ModelOptions(), demo=True, tasks=("generate", "embed", "score"))
    specs = [ModelSpec(name="okplain", tokenizer=True),
             ModelSpec(name="okproc", processor=True, helpers=("flat", "star")),
             ModelSpec(name="oknest", tokenizer=True, nested_subconfig=True, asset=True),
             ModelSpec(name="okbig", tokenizer=True, big_asset=4096),
             dataclasses.replace(LARGEST_SPEC, name="oklarge", cross_repo=None)]
    for spec in specs:
        prepare(write_model(tmp_path / spec.name, spec), TRUST, tasks=("generate", "embed"))
    from test_generate_paths import write_llama  # tokenizer.json only, a plain architecture

    prepare(write_llama(tmp_path / "llama"), ModelOptions(), tasks=("generate",))
