"""Names transformers 5 removed, served to the remote code that uses them and to nothing else.

The model here imports and calls them the way real remote code of the transformers 4 years does
(InternLM2, DeepSeek, Baichuan, ChatGLM, MPT, Falcon RW): on the installed release it loads
and runs, while transformers, for every other module of the process, stays as installed. On
transformers 4.53, where these names exist, the code gets transformers' own objects. CI runs this
module on the newest transformers too, and ``test_a_name_the_release_has_is_transformers_own``
on the floors.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import codeferry

CONFIG = '''
from transformers import PretrainedConfig


class OldNamesConfig(PretrainedConfig):
    model_type = "oldnames"

    def __init__(self, hidden_size=8, num_layers=3, num_heads=2, **kwargs):
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.num_heads = num_heads
        super().__init__(**kwargs)
'''

MODELING = '''
import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicCache
from transformers.deepspeed import is_deepspeed_zero3_enabled
from transformers.generation.utils import BeamSearchOutput, GreedySearchOutput, SampleOutput
from transformers.modeling_utils import Conv1D, PreTrainedModel
from transformers.models.llama.modeling_llama import _expand_mask, _make_causal_mask
from transformers.pytorch_utils import find_pruneable_heads_and_indices
from transformers.utils import is_torch_fx_available, is_torch_sdpa_available

from .configuration_oldnames import OldNamesConfig

if is_torch_fx_available():
    FX = True


class OldNamesPreTrainedModel(PreTrainedModel):
    config_class = OldNamesConfig
    base_model_prefix = "oldnames"

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(std=0.02)


class OldNamesModel(OldNamesPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.max_length = config.max_length
        self.padding_idx = config.pad_token_id
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.register_buffer("table", torch.arange(4.0) * 0.5, persistent=False)

    def forward(self, hidden_states, head_mask=None, past_key_values=None):
        head_mask = self.get_head_mask(head_mask, self.config.num_layers)
        if not isinstance(past_key_values, Cache):
            past_key_values = DynamicCache.from_legacy_cache(past_key_values)
        return self.proj(hidden_states), head_mask, past_key_values


class OldNamesForCausalLM(OldNamesPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.model = OldNamesModel(config)

    def _update_model_kwargs_for_generation(self, outputs, model_kwargs, is_encoder_decoder=False,
                                            **kwargs):
        cache_name, cache = self._extract_past_from_model_output(outputs)
        model_kwargs[cache_name] = cache
        if "attention_mask" in model_kwargs:
            mask = model_kwargs["attention_mask"]
            model_kwargs["attention_mask"] = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], -1)
        return model_kwargs
'''

CONFIG_JSON = {
    "auto_map": {"AutoConfig": "configuration_oldnames.OldNamesConfig",
                 "AutoModel": "modeling_oldnames.OldNamesModel"},
    "model_type": "oldnames", "hidden_size": 8, "num_layers": 3, "num_heads": 2,
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("oldnames") / "oldnames"
    root.mkdir()
    (root / "configuration_oldnames.py").write_text(textwrap.dedent(CONFIG))
    (root / "modeling_oldnames.py").write_text(textwrap.dedent(MODELING))
    (root / "config.json").write_text(json.dumps(CONFIG_JSON))
    return root


@pytest.fixture(scope="module")
def loaded(folder: Path) -> tuple[type, type, object]:
    classes = codeferry.load(folder, trust_remote_code=True, strict=True)
    model_class = classes["AutoModel"]
    return classes["AutoConfig"], model_class, sys.modules[model_class.__module__]


def test_transformers_itself_is_left_as_installed(loaded: tuple[type, type, object]) -> None:
    """The names reach the model's module only: transformers, and any other module importing
    from it, still see the installed release (the test is for a release that lacks them)."""
    import transformers.utils
    from transformers import PretrainedConfig, PreTrainedModel
    from transformers.cache_utils import DynamicCache

    _, _, module = loaded
    assert module.FX is True and module.is_torch_sdpa_available() is True
    assert not hasattr(transformers.utils, "is_torch_fx_available")
    assert not hasattr(PreTrainedModel, "get_head_mask")
    assert not hasattr(DynamicCache, "from_legacy_cache")
    assert not hasattr(PretrainedConfig(), "max_length")
    with pytest.raises(ImportError):
        __import__("transformers.deepspeed")
    with pytest.raises(ImportError):
        exec("from transformers.utils import is_torch_fx_available", {})


def test_get_head_mask_as_transformers_4(loaded: tuple[type, type, object]) -> None:
    config_class, model_class, _ = loaded
    model = model_class(config_class())
    x = torch.zeros(1, 2, 8)
    _, head_mask, _ = model(x)
    assert head_mask == [None, None, None]
    _, head_mask, _ = model(x, head_mask=torch.tensor([1.0, 0.0]))
    assert head_mask.shape == (3, 1, 2, 1, 1) and head_mask[:, 0, 1].sum() == 0
    _, head_mask, _ = model(x, head_mask=torch.ones(3, 2))
    assert head_mask.shape == (3, 1, 2, 1, 1)


def test_a_model_without_post_init_saves_and_loads_with_its_buffers(loaded: tuple[type, type, object],
                                                   tmp_path: Path) -> None:
    """transformers 5 sets ``all_tied_weights_keys`` in ``post_init``, which old code never
    calls; ``from_pretrained`` reads it."""
    from transformers import AutoModel

    config_class, model_class, _ = loaded
    model = model_class(config_class())
    assert "post_init" not in Path(sys.modules[model_class.__module__].__file__).read_text()
    model.save_pretrained(tmp_path / "saved")
    again = AutoModel.from_pretrained(tmp_path / "saved")
    assert torch.equal(again.proj.weight, model.proj.weight)
    # a buffer __init__ computes and the checkpoint does not hold: what __init__ computes
    # (transformers 5 leaves such buffers as empty memory for remote code)
    assert torch.equal(again.table, torch.arange(4.0) * 0.5)


def test_the_legacy_cache_round_trips(loaded: tuple[type, type, object]) -> None:
    from transformers.cache_utils import DynamicCache

    config_class, model_class, module = loaded
    legacy = tuple((torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)) for _ in range(2))
    _, _, cache = model_class(config_class())(torch.zeros(1, 1, 8), past_key_values=legacy)
    assert isinstance(cache, DynamicCache) and type(cache) is module.DynamicCache
    assert cache.get_usable_length(1) == 3 and cache.seen_tokens == 3
    back = cache.to_legacy_cache()
    assert all(torch.equal(a, b) for pa, pb in zip(back, legacy, strict=True)
               for a, b in zip(pa, pb, strict=True))


def test_the_masks_are_transformers_4s(loaded: tuple[type, type, object]) -> None:
    """The same values as the static methods that transformers keeps on
    ``AttentionMaskConverter``."""
    from transformers.modeling_attn_mask_utils import AttentionMaskConverter as Converter

    _, _, module = loaded
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    assert torch.equal(module._expand_mask(mask, torch.float32, 3),
                       Converter._expand_mask(mask, torch.float32, 3))
    assert torch.equal(module._make_causal_mask((2, 3), torch.float32, "cpu", 2),
                       Converter._make_causal_mask((2, 3), torch.float32, "cpu", 2))


def test_the_other_names(loaded: tuple[type, type, object]) -> None:
    from transformers.generation.utils import GenerateDecoderOnlyOutput
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    from transformers.pytorch_utils import Conv1D

    _, _, module = loaded
    assert module.Conv1D is Conv1D
    assert module.is_deepspeed_zero3_enabled is is_deepspeed_zero3_enabled
    assert GenerateDecoderOnlyOutput in module.SampleOutput.__args__
    heads, index = module.find_pruneable_heads_and_indices([1], 2, 3, set())
    assert heads == {1} and index.tolist() == [0, 1, 2]


def test_config_defaults_are_transformers_4s_and_not_saved(loaded: tuple[type, type, object]) -> None:
    config_class, model_class, _ = loaded
    config = config_class()
    assert config.max_length == 20 and config.pad_token_id is None
    assert model_class(config).max_length == 20
    assert "max_length" not in config.to_dict()
    assert config_class(pad_token_id=7).pad_token_id == 7  # the config's own value wins


def test_the_files_removed_settings_are_read_and_saved_as_transformers_4_did(
        folder: Path, tmp_path: Path) -> None:
    """transformers 5 drops ``max_length`` (and every generation setting) from a config's
    keywords while it builds it; code that sizes its model by ``config.max_length`` gets the
    value config.json gave, and saves it back; transformers 5's check that refuses a config
    setting generation parameters of its own (in ``generate`` and ``save_pretrained``) finds none."""
    given = tmp_path / "given"
    shutil.copytree(folder, given)
    (given / "config.json").write_text(json.dumps({**CONFIG_JSON, "max_length": 64,
                                                    "top_k": 3}))
    classes = codeferry.load(given, trust_remote_code=True, strict=True)
    config = classes["AutoConfig"].from_pretrained(given)
    assert (config.max_length, config.top_k, config.num_beams) == (64, 3, 1)
    assert classes["AutoModel"](config).max_length == 64
    copied = copy.deepcopy(config)
    assert copied.max_length == 64 and copied == config
    saved = tmp_path / "saved"
    config.save_pretrained(saved)
    written = json.loads((saved / "config.json").read_text())
    assert (written["max_length"], written["top_k"]) == (64, 3)
    assert "_codeferry_given" not in written and "num_beams" not in written
    assert classes["AutoConfig"].from_pretrained(saved).max_length == 64
    if hasattr(config, "_get_generation_parameters"):  # transformers 5
        assert config._get_generation_parameters() == {}


def test_a_name_the_release_has_is_transformers_own(folder: Path) -> None:
    """Only what the installed release lacks is shimmed: on the floors (4.53, which has
    ``is_torch_fx_available``, ``get_head_mask`` and the legacy cache) nothing is; on
    transformers 5 each of them is. In a fresh interpreter: nothing loaded before."""
    child = Path(__file__).with_name("_oldnames_child.py")
    done = subprocess.run([sys.executable, str(child), str(folder)], capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    has = seen["has"]
    assert seen["version"].startswith("4.") == all(has.values()), seen
    assert seen["version"].startswith("5.") == (not any(has.values())), seen
    assert (seen["fx_is_transformers"], seen["cache_is_transformers"],
            seen["head_mask_is_transformers"]) == (has["fx"], has["cache"], has["head_mask"])
    assert seen["max_length"] == 20


def test_chatglms_generation_hook_gets_the_cache_in_the_shape_it_unpacks(
        loaded: tuple[type, type, object]) -> None:
    """ChatGLM2/3's ``_update_model_kwargs_for_generation``: ``(name, cache)`` from
    ``_extract_past_from_model_output`` (4.42 to 4.48), and a mask it extends when it is there
    (transformers 5 keeps the key with ``None``)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    config_class, _, module = loaded
    model = module.OldNamesForCausalLM(config_class())
    past = ((torch.ones(1, 1, 2, 4), torch.ones(1, 1, 2, 4)),)
    outputs = CausalLMOutputWithPast(past_key_values=past)
    assert model._update_model_kwargs_for_generation(outputs, {"attention_mask": None}) == {
        "past_key_values": past}
    kwargs = model._update_model_kwargs_for_generation(outputs, {"attention_mask": torch.ones(1, 2)})
    assert kwargs["attention_mask"].tolist() == [[1.0, 1.0, 1.0]]


def test_a_tied_list_saves_and_ties_as_transformers_4(tmp_path: Path) -> None:
    """``_tied_weights_keys = ["lm_head.weight"]`` (Baichuan2, InternLM2, DeepSeek): tied to
    the input embeddings when the config says so, and ``save_pretrained`` works."""
    from transformers import AutoModelForCausalLM

    root = tmp_path / "tied"
    shutil.copytree(Path(__file__).parents[1] / "corpus" / "models" / "legacycache", root)
    config = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    classes = codeferry.load(root, trust_remote_code=True)
    model_class = classes["AutoModelForCausalLM"]
    assert model_class._tied_weights_keys == ["lm_head.weight"]
    model = AutoModelForCausalLM.from_config(classes["AutoConfig"].from_pretrained(root))
    model.save_pretrained(tmp_path / "saved")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert again.lm_head.weight is again.model.embed_tokens.weight
    assert torch.equal(again.lm_head.weight, model.model.embed_tokens.weight)


MODERN = '''
from transformers import LlamaConfig, LlamaForCausalLM

BUILT = []


class ModernConfig(LlamaConfig):
    model_type = "modernllama"


class ModernForCausalLM(LlamaForCausalLM):
    config_class = ModernConfig

    def __init__(self, config):
        BUILT.append(1)
        super().__init__(config)
'''


def test_code_written_for_the_installed_release_keeps_transformers_ways(tmp_path: Path) -> None:
    """A remote class built on transformers' own model (its forward, its rotary embedding):
    ``generate`` makes the cache that forward takes, and ``from_pretrained`` builds it once
    (the buffers of transformers' own modules are filled by transformers' own init)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path / "modern"
    torch.manual_seed(0)
    reference = LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=16, pad_token_id=0)).eval()
    reference.save_pretrained(folder)
    (folder / "modeling_modern.py").write_text(textwrap.dedent(MODERN))
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="modernllama", auto_map={
        "AutoConfig": "modeling_modern.ModernConfig",
        "AutoModelForCausalLM": "modeling_modern.ModernForCausalLM"})
    (folder / "config.json").write_text(json.dumps(config))

    model_class = codeferry.load(folder, trust_remote_code=True)["AutoModelForCausalLM"]
    assert "_supports_default_dynamic_cache" not in vars(model_class)
    model = model_class.from_pretrained(folder).eval()
    assert sys.modules[model_class.__module__].BUILT == [1]  # no second build for buffers
    ids = torch.tensor([[5, 6, 7, 8]])
    mine = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    theirs = reference.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert mine.tolist() == theirs.tolist()



DEFERRING = '''
from transformers import GPT2Config, GPT2LMHeadModel


class DeferringConfig(GPT2Config):
    model_type = "deferringgpt2"


class DeferringLMHeadModel(GPT2LMHeadModel):
    config_class = DeferringConfig

    def prepare_inputs_for_generation(self, input_ids, **kwargs):
        return super().prepare_inputs_for_generation(input_ids, **kwargs)
'''


def test_a_prepare_that_calls_transformers_own_keeps_the_positions_generate_makes(
        tmp_path: Path) -> None:
    """Code written for transformers 4 (its config says 4.45) whose own
    ``prepare_inputs_for_generation`` calls ``super()``'s: since 5 that one makes no positions
    itself, so ``generate``'s stay. GPT-2's positions are absolute: without them a left-padded
    row would start after its padding, and its tokens would not be transformers' GPT-2's."""
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path / "deferring"
    torch.manual_seed(0)
    reference = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2,
                                           n_positions=64, pad_token_id=0)).eval()
    reference.save_pretrained(folder)
    (folder / "modeling_deferring.py").write_text(textwrap.dedent(DEFERRING))
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="deferringgpt2", transformers_version="4.45.0", auto_map={
        "AutoConfig": "modeling_deferring.DeferringConfig",
        "AutoModelForCausalLM": "modeling_deferring.DeferringLMHeadModel"})
    (folder / "config.json").write_text(json.dumps(config))

    model_class = codeferry.load(folder, trust_remote_code=True)["AutoModelForCausalLM"]
    assert "_prepare_position_ids_for_generation" not in vars(model_class)
    model = model_class.from_pretrained(folder).eval()
    ids = torch.tensor([[0, 0, 0, 0, 0, 5, 6], [9, 8, 7, 6, 5, 4, 3]])
    mask = (ids != 0).long()
    options = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    mine = model.generate(ids, attention_mask=mask, **options)
    assert mine.tolist() == reference.generate(ids, attention_mask=mask, **options).tolist()
