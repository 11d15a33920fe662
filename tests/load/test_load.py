"""codeferry.load in one process: order, helpers, one class identity, Auto classes, trust."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _helpers import unique_name
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import codeferry
from codeferry.errors import RemoteCodeExecutionError, TrustRequiredError
from codeferry.testing import HELPER_KINDS, ModelSpec, write_model


def fresh(tmp_path_factory: pytest.TempPathFactory, **kw: Any) -> Path:
    """A model with code of its own (a unique digest), so no earlier test loaded it."""
    name = unique_name("l")
    return write_model(tmp_path_factory.mktemp(name) / "model", ModelSpec(name=name, **kw))


def test_every_helper_kind_loads_in_dependency_order(tmp_path_factory: pytest.TempPathFactory) -> None:
    path = fresh(tmp_path_factory, helpers=HELPER_KINDS, model_keys_first=True, config_helper=True,
                 asset=True, tokenizer=True)
    classes = codeferry.load(path, trust_remote_code=True)
    config_cls = classes["AutoConfig"]
    model_cls = classes["AutoModelForCausalLM"]
    assert isinstance(classes["AutoTokenizer"], tuple) and classes["AutoTokenizer"][1] is None
    config = AutoConfig.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert type(config) is config_cls
    assert type(model) is model_cls
    assert type(tokenizer) is classes["AutoTokenizer"][0]
    assert model.config_class is type(config) is type(model.config)
    ids = tokenizer("abc", return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 3)


def test_loading_twice_gives_the_same_classes(tmp_path_factory: pytest.TempPathFactory) -> None:
    path = fresh(tmp_path_factory, helpers=("flat",))
    first = codeferry.load(path, trust_remote_code=True)
    second = codeferry.load(path, trust_remote_code=True)
    assert first == second
    # the same bytes in another folder are the same code: the same classes
    copy = path.parent / "copy of it"
    import shutil

    shutil.copytree(path, copy)
    assert codeferry.load(copy, trust_remote_code=True) == first
    config = AutoConfig.from_pretrained(path)
    model = AutoModelForCausalLM.from_config(config)
    assert model.config_class is type(config)


def test_models_sharing_file_names_stay_apart(tmp_path_factory: pytest.TempPathFactory) -> None:
    a = fresh(tmp_path_factory, generic_names=True, helpers=("flat",))
    b = fresh(tmp_path_factory, generic_names=True, helpers=("flat",), hidden_size=16)
    ca = codeferry.load(a, trust_remote_code=True)
    cb = codeferry.load(b, trust_remote_code=True)
    assert ca["AutoConfig"].__module__.endswith(".configuration")
    assert ca["AutoConfig"] is not cb["AutoConfig"]
    assert type(AutoConfig.from_pretrained(a)) is ca["AutoConfig"]
    assert type(AutoConfig.from_pretrained(b)) is cb["AutoConfig"]


def test_nested_sub_config_classes_are_keyed_by_their_path(tmp_path_factory: pytest.TempPathFactory) -> None:
    path = fresh(tmp_path_factory, nested_subconfig=True)
    classes = codeferry.load(path, trust_remote_code=True)
    sub = classes["llm_config:AutoConfig"]
    config = AutoConfig.from_pretrained(path)
    assert type(config.llm_config) is sub


def test_without_trust_nothing_runs_and_the_error_lists_the_files(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    marker = tmp_path / "executed"
    path = fresh(tmp_path_factory, helpers=("flat",), marker=str(marker))
    with pytest.raises(TrustRequiredError) as info:
        codeferry.load(path)
    assert not marker.exists()
    assert "layers.py" in info.value.files and "modeling_" in str(info.value)
    assert "trust_remote_code=True" in str(info.value)
    codeferry.load(path, trust_remote_code=True)
    assert marker.exists()


def test_code_that_raises_becomes_a_typed_error_with_the_cause(tmp_path: Path) -> None:
    path = write_model(tmp_path / "model", ModelSpec(name="boom"))
    modeling = path / "modeling_boom.py"
    modeling.write_text(modeling.read_text() + "\nraise RuntimeError('kaput')\n")
    # The config does not import the modeling file: it still loads, the models do not.
    result = codeferry.load(path, trust_remote_code=True)
    assert set(result) == {"AutoConfig"}
    assert set(result.failed) == {"AutoModel", "AutoModelForCausalLM"}
    error = result.failed["AutoModel"]
    assert isinstance(error, RemoteCodeExecutionError)
    assert isinstance(error.__cause__, RuntimeError) and error.digest
    assert error.path is not None and error.path.endswith("modeling_boom.py")
    assert error.line == modeling.read_text().splitlines().index("raise RuntimeError('kaput')") + 1
    # Asking for the broken class (or strict loading) raises its typed error.
    with pytest.raises(RemoteCodeExecutionError) as info:
        codeferry.load(path, trust_remote_code=True, classes=["AutoModel"])
    assert isinstance(info.value.__cause__, RuntimeError)
    assert "modeling_boom.py" in str(info.value)
    with pytest.raises(RemoteCodeExecutionError):
        codeferry.load(path, trust_remote_code=True, strict=True)


def test_model_outputs_match_a_direct_forward(tmp_path_factory: pytest.TempPathFactory) -> None:
    path = fresh(tmp_path_factory)
    codeferry.load(path, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape[-1] == model.config.vocab_size
