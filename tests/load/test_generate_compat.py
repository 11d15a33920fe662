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


@pytest.mark.parametrize("folder", ["model_dir", "super_dir"])
def test_the_executor_generates_with_it(folder: str, request: pytest.FixtureRequest) -> None:
    """Without hooks of its own (``model_dir``) or calling ``super`` by its name
    (``super_dir``): the executor's workers generate with the class as it is."""
    with codeferry.Executor(request.getfixturevalue(folder), workers=1, start_method="fork",
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


@pytest.fixture(scope="module")
def automodel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_real_world_model(tmp_path_factory.mktemp("amonly") / "m", "automodel_only",
                                  name="amonly")


def test_a_model_mapped_only_by_automodel_generates_as_its_users_call_it(
        automodel_dir: Path) -> None:
    """ChatGLM-6B's map (``AutoModel`` and ``AutoModelForSeq2SeqLM``, no causal LM key): the
    executor generates with the mapped class that has ``generate``, the same greedy text
    as ``AutoModel.from_pretrained(...).generate``, the way its users call it."""
    import json

    from transformers import AutoModel, AutoTokenizer

    assert "AutoModelForCausalLM" not in json.loads(
        (automodel_dir / "config.json").read_text())["auto_map"]
    prompts = ["hello", "abc def"]
    with codeferry.Executor(automodel_dir, workers=1, start_method="fork",
                            trust_remote_code=True) as ex:
        texts = ex.generate(prompts, max_new_tokens=5, do_sample=False)
    codeferry.load(automodel_dir, trust_remote_code=True)
    model = AutoModel.from_pretrained(automodel_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(automodel_dir)
    expected = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        out = model.generate(ids, max_new_tokens=5, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        expected.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    assert texts == expected


def test_a_class_that_did_not_load_is_a_typed_error_naming_it(tmp_path: Path) -> None:
    """``load()`` leaves out a class whose import fails, in ``.failed``; asking for it is
    that failure, typed, naming the class: never a bare ``KeyError``."""
    from codeferry.errors import ClassNotLoadedError

    root = write_real_world_model(tmp_path / "m", "vision_missing_package", name="vis")
    classes = codeferry.load(root, trust_remote_code=True)
    failed = next(iter(classes.failed))
    with pytest.raises(ClassNotLoadedError, match=f"{failed} did not load") as info:
        classes[failed]
    assert info.value.__cause__ is classes.failed[failed] and info.value.key == failed
    with pytest.raises(KeyError, match="names no AutoModelForSeq2SeqLM"):
        classes["AutoModelForSeq2SeqLM"]


@pytest.fixture(scope="module")
def embeds_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``embeds_generate`` variant with its wrapper's own seeded weights saved."""
    from transformers import AutoConfig, AutoModelForCausalLM

    root = write_real_world_model(tmp_path_factory.mktemp("embeds") / "m", "embeds_generate",
                                  name="vlm")
    codeferry.load(root, trust_remote_code=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(root)).save_pretrained(root)
    return root


def test_a_generate_that_returns_the_new_tokens_only_gives_them_all(embeds_dir: Path) -> None:
    """A vision-language wrapper's ``generate`` (InternVL 2's, Florence-2's) embeds the ids
    and returns only the new tokens: the executor takes every one of them, and its logits
    processors (minimum length, penalties) count from the first new token, not from the
    prompt's width."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from codeferry import Request, SamplingParams

    prompts, new = ["hello", "abc def ghi"], 6
    with codeferry.Executor(embeds_dir, workers=1, trust_remote_code=True) as ex:
        greedy = ex.complete([Request(p) for p in prompts],
                             SamplingParams(temperature=0.0, max_tokens=new))
        at_least = ex.complete([Request(p) for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=new, min_tokens=new))
        penalized = ex.complete([Request(prompts[0])], SamplingParams(
            temperature=0.0, max_tokens=new, presence_penalty=2.0))
    codeferry.load(embeds_dir, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(embeds_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(embeds_dir)
    # the tokenizer's end of sequence, which the executor stops at and which the language
    # model's generate, built without one, does not
    eos = tokenizer.eos_token_id
    for prompt, result in zip(prompts, greedy, strict=True):
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        own = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=new, do_sample=False, pad_token_id=0)[0].tolist()
        assert len(own) == new  # the new tokens only: the prompt is not in them
        expected = own[:own.index(eos) + 1] if eos in own else own  # an end ends the row
        assert list(result.completions[0].token_ids) == expected, prompt
    assert [len(r.completions[0].token_ids) for r in at_least] == [new, new]
    first = list(greedy[0].completions[0].token_ids)
    assert len(set(first)) < len(first)  # greedy repeats itself here...
    again = list(penalized[0].completions[0].token_ids)
    assert len(again) == new and again[:2] == first[:2] and again != first  # ...penalized not
