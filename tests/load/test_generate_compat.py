"""``generate()`` for remote causal LMs that transformers leaves without one.

Many real remote models neither inherit ``GenerationMixin`` nor define ``generate`` or
``prepare_inputs_for_generation``; whether transformers adds the mixin to such a class
changed between releases. codeferry gives every generative head ``generate()`` on every
supported release, and the executor (``codeferry run``) generates with it. CI runs this
module on the pinned transformers and on the newest release.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import codeferry
from codeferry.testing import write_real_world_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_real_world_model(tmp_path_factory.mktemp("nogen") / "m", "no_generation_hooks",
                                  name="nogen")


def test_the_variant_has_no_generation_hooks(model_dir: Path) -> None:
    text = (model_dir / "modeling_nogen.py").read_text()
    assert "def prepare_inputs_for_generation" not in text and "def generate" not in text
    assert "GenerationMixin" not in text.replace("No GenerationMixin here", "")


def test_loaded_causal_lm_generates_like_a_greedy_loop(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    classes = codeferry.load(model_dir, trust_remote_code=True)
    assert hasattr(classes["AutoModelForCausalLM"], "generate")
    assert not hasattr(classes["AutoModel"], "generate")  # only generative heads
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert type(model) is classes["AutoModelForCausalLM"]
    ids = torch.tensor([[5, 9, 12]])
    out = model.generate(ids, max_new_tokens=6, do_sample=False)
    expected = ids
    with torch.no_grad():
        for _ in range(6):
            step = model(expected).logits[:, -1].argmax(-1, keepdim=True)
            expected = torch.cat([expected, step], 1)
    assert out.tolist() == expected.tolist()
    # one class: the module, the Auto registry and pickling by name agree
    module = __import__("sys").modules[type(model).__module__]
    assert module.NogenForCausalLM is type(model)


def test_the_executor_generates_with_it(model_dir: Path) -> None:
    with codeferry.Executor(model_dir, workers=1, start_method="fork",
                            trust_remote_code=True) as ex:
        texts = ex.generate(["hello", "abc"], max_new_tokens=4)
    assert len(texts) == 2 and all(isinstance(t, str) for t in texts)


@pytest.fixture(scope="module")
def super_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_real_world_model(tmp_path_factory.mktemp("superfp") / "m",
                                  "super_from_pretrained", name="superfp")


def test_a_class_that_calls_super_by_its_own_name_builds_and_generates(super_dir: Path) -> None:
    """Baichuan2's pattern: ``from_pretrained`` overridden, calling ``super(ItsClass, cls)``
    by the module's name. The mixin joins the class itself, so that name is the class: a
    subclass bound to the name made ``super`` call the override again, without end."""
    from transformers import AutoModelForCausalLM

    text = (super_dir / "modeling_superfp.py").read_text()
    assert "super(SuperfpForCausalLM, cls).from_pretrained(" in text
    classes = codeferry.load(super_dir, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(super_dir).eval()
    assert type(model) is classes["AutoModelForCausalLM"]
    module = __import__("sys").modules[type(model).__module__]
    assert module.SuperfpForCausalLM is type(model)  # the module's own name, one class
    ids = torch.tensor([[5, 9, 12]])
    assert model.generate(ids, max_new_tokens=4, do_sample=False).shape == (1, 7)


def test_the_executor_generates_with_a_super_by_name_class(super_dir: Path) -> None:
    with codeferry.Executor(super_dir, workers=1, start_method="fork",
                            trust_remote_code=True) as ex:
        texts = ex.generate(["hello", "abc"], max_new_tokens=4)
    assert len(texts) == 2 and all(isinstance(t, str) for t in texts)
