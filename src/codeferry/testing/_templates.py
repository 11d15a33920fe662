"""Source text of the tiny remote-code models rendered by :mod:`codeferry.testing._contents`.

The templates live apart from the factory so that the factory stays readable: each one is the
literal text of a file a model repository ships, with ``$placeholders`` filled in by
:class:`string.Template`. Generated code never contains a dollar sign, so no escaping is needed.
The model code is written for the transformers versions codeferry supports: it imports only public
names (``PretrainedConfig``, ``PreTrainedModel``, ``PreTrainedTokenizer``...) and inherits neither
``GenerationMixin`` nor a backend class that older releases lack.

This module holds the code every model ships (configuration, modeling, helper modules); the
optional tokenizer, processors and cross-repository head are in ``_extra_templates``.
"""

from __future__ import annotations

# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------

CONFIGURATION = '''"""Configuration of the ``$name`` test model, written by ``codeferry.testing``."""

${marker_imports}from transformers import PretrainedConfig
$marker_block
$config_imports


class ${Name}Config(PretrainedConfig):
    """Hyper-parameters of the tiny ``$name`` causal LM."""

    model_type = "$name"
    # transformers' generation utilities (the KV cache) look for the standard name.
    attribute_map = {"num_hidden_layers": "num_layers"}

    def __init__(
        self,
        vocab_size=$d_vocab_size,
        hidden_size=$d_hidden_size,
        num_layers=$d_num_layers,
        max_position_embeddings=$d_max_position_embeddings,
        initializer_range=$d_initializer_range,$llm_param
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range$llm_body
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)
'''

CONFIG_DEFAULTS_IMPORT = "from .$module import DEFAULTS"

BIG_ASSET_BLOCK = '''from pathlib import Path

BIG_ASSET = "$big_asset"


def read_big_asset():
    """The big data file next to this module, read when called, through ``__file__``."""
    return (Path(__file__).parent / BIG_ASSET).read_bytes()'''

LLM_CONFIG_IMPORT = "from .$module import ${Name}LLMConfig"

LLM_PARAM = "\n        llm_config=None,"

LLM_BODY = """
        # Like InternVL: the language-model part has its own remote config class.
        if llm_config is None:
            llm_config = {}
        if isinstance(llm_config, dict):
            llm_config = ${Name}LLMConfig(**llm_config)
        self.llm_config = llm_config"""

CONFIG_DEFAULTS = '''"""Default hyper-parameters, imported by the configuration module of ``$name``."""

DEFAULTS = $defaults
'''

LLM_CONFIGURATION = '''"""Language-model sub-configuration of ``$name`` (a nested remote config, like InternVL)."""

from transformers import PretrainedConfig


class ${Name}LLMConfig(PretrainedConfig):
    """Sub-configuration that the main ``${Name}Config`` builds from its ``llm_config`` dict."""

    model_type = "${name}_llm"

    def __init__(self, vocab_size=$vocab_size, hidden_size=$hidden_size, num_layers=$num_layers, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)
'''

# --------------------------------------------------------------------------------------------
# Modeling
# --------------------------------------------------------------------------------------------

MARKER_IMPORTS = "import os\n\n"

MARKER_BLOCK = """
# Executed at import time: proves whether a command ran this module.
with open($marker, "a", encoding="utf-8") as _marker_file:
    _marker_file.write(f"{__name__} {os.getpid()}\\n")
"""

MODELING = '''"""Modeling code of the ``$name`` test model, written by ``codeferry.testing``.

A tiny causal LM: token embeddings, pre-norm blocks of single-head causal attention with rotary
positions and an MLP, a final norm and an untied LM head.

Example: from .not_a_real_module import Thing
"""

$std_imports

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutputWithPast
$marker_block
from .$config_module import ${Name}Config
$helper_imports

# A string that only looks like a relative import: nothing may try to resolve it.
NOT_AN_IMPORT = "import .fake"
$constants
$asset

def _rotate(x):
    """Apply rotary position embeddings over the sequence axis of ``x`` (batch, seq, dim)."""
$rotate_body


def _act(x):
$act_body


def _residual(x, y):
$residual_body


class ${Name}RMSNorm(nn.Module):
    def __init__(self, hidden_size):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x):
$norm_body
$mlp_class

class ${Name}Attention(nn.Module):
    def __init__(self, hidden_size):
        super().__init__()
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=False)
        self.out = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, x, mask):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k = _rotate(q), _rotate(k)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        return self.out(torch.softmax(scores, dim=-1) @ v)


class ${Name}Layer(nn.Module):
    def __init__(self, hidden_size):
        super().__init__()
        self.norm1 = ${Name}RMSNorm(hidden_size)
        self.attn = ${Name}Attention(hidden_size)
        self.norm2 = ${Name}RMSNorm(hidden_size)
        self.mlp = $mlp_new

    def forward(self, x, mask):
        x = _residual(x, self.attn(self.norm1(x), mask))
        return _residual(x, self.mlp(self.norm2(x)))


class ${Name}PreTrainedModel(PreTrainedModel):
    config_class = ${Name}Config
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["${Name}Layer"]

    def _init_weights(self, module):
        # Calls go through ``nn.init`` so that transformers can guard them while loading.
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, ${Name}RMSNorm):
            nn.init.ones_(module.weight)


class ${Name}Model(${Name}PreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(${Name}Layer(config.hidden_size) for _ in range(config.num_layers))
        self.norm = ${Name}RMSNorm(config.hidden_size)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, **kwargs):
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        hidden = _scale_positions(hidden)
        length = hidden.shape[1]
        mask = torch.ones(length, length, dtype=torch.bool, device=hidden.device).tril()[None]
        if attention_mask is not None:
            mask = mask & attention_mask.bool()[:, None, :]
        for layer in self.layers:
            hidden = layer(hidden, mask)
        return BaseModelOutput(last_hidden_state=self.norm(hidden))


class ${Name}ForCausalLM(${Name}PreTrainedModel):
    # No GenerationMixin here on purpose: transformers adds it to remote classes that define
    # ``prepare_inputs_for_generation``; codeferry has to reproduce that.

    def __init__(self, config):
        super().__init__(config)
        self.model = ${Name}Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def forward(self, input_ids=None, attention_mask=None, labels=None, inputs_embeds=None, **kwargs):
        hidden = self.model(input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds).last_hidden_state
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        # No KV cache: every step re-reads the whole sequence (the model is tiny).
        return {"input_ids": input_ids, "attention_mask": attention_mask}
'''

ROPE_INLINE = """\
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (ROPE_BASE ** (torch.arange(half, device=x.device, dtype=torch.float32) / half))
    angles = torch.arange(x.shape[-2], device=x.device, dtype=torch.float32)[:, None] * inv_freq
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)"""

ROPE_HELPER_CALL = "    return rope(x, ROPE_BASE)"

ROPE_OPTIONAL_CUDA = """\
    if fused_rope_cuda is not None and x.is_cuda:
        return fused_rope_cuda(x)
"""

ACT_INLINE = '    return nn.functional.gelu(x, approximate="tanh")'
ACT_HELPER_CALL = "    return activations.gelu(x)"

RESIDUAL_INLINE = "    return x + y"
RESIDUAL_HELPER_CALL = "    return fused_add(x, y) if fused_add is not None else x + y"

NORM_INLINE = """\
        variance = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(variance + RMS_EPS) * self.weight"""

NORM_HELPER_CALL = """\
        from .$module import rms_norm

        return rms_norm(x, self.weight, RMS_EPS)"""

#: The MLP block's class after its name: written inline (``${Name}MLP``) or in a helper
#: module (``Block``, ``FLAT_HELPER``), the same code either way.
_MLP_CLASS_BODY = """(nn.Module):
    def __init__(self, hidden_size, act):
        super().__init__()
        self.fc_in = nn.Linear(hidden_size, 2 * hidden_size, bias=False)
        self.fc_out = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.act = act

    def forward(self, x):
        return self.fc_out(self.act(self.fc_in(x)))
"""

MLP_INLINE = "\n\nclass ${Name}MLP" + _MLP_CLASS_BODY + "\n"

CONSTANTS_INLINE = """
RMS_EPS = 1e-6
ROPE_BASE = 10000.0
"""

CONSTANTS_STAR = "\n# RMS_EPS and ROPE_BASE come from a star import.\nfrom .$module import *\n"

TRY_EXCEPT_IMPORTS = """
try:
    from .$module import fused_add
except ImportError:
    fused_add = None

try:  # this module is deliberately absent: the import is optional
    from .optional_cuda_kernels import fused_rope_cuda
except ImportError:
    fused_rope_cuda = None
"""

ASSET_BLOCK = """
# A data file shipped next to the code, read at import time.
POSITION_TABLE = json.loads((Path(__file__).parent / "$asset").read_text(encoding="utf-8"))["scale"]


def _scale_positions(hidden):
    table = torch.tensor(POSITION_TABLE, dtype=hidden.dtype, device=hidden.device)
    index = torch.arange(hidden.shape[1], device=hidden.device).clamp(max=len(POSITION_TABLE) - 1)
    return hidden * table[index][None, :, None]
"""

NO_ASSET_BLOCK = """

def _scale_positions(hidden):
    return hidden
"""

# --------------------------------------------------------------------------------------------
# Helper modules
# --------------------------------------------------------------------------------------------

FLAT_HELPER = '''"""MLP block of ``$name``, imported with ``from .$module import Block``."""

from torch import nn


class Block''' + _MLP_CLASS_BODY

SUBPACKAGE_INIT = '''"""Helper sub-package of ``$name``: ``from .$package.rope import rope``."""

from .rope import rope

__all__ = ["rope"]
'''

SUBPACKAGE_ROPE = '''"""Rotary position embeddings, in a sub-package of ``$name``."""

import torch


def rope(x, base=10000.0):
    """Rotate the two halves of the last axis of ``x`` (batch, seq, dim) by position."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (base ** (torch.arange(half, device=x.device, dtype=torch.float32) / half))
    angles = torch.arange(x.shape[-2], device=x.device, dtype=torch.float32)[:, None] * inv_freq
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
'''

ACTIVATIONS = '''"""Activations of ``$name``, imported as a module with ``from . import activations``."""

import math

import torch


def gelu(x):
    """tanh approximation of GELU (same numbers as ``nn.functional.gelu(x, approximate="tanh")``)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
'''

NORMS = '''"""RMS norm of ``$name``, imported inside a method body."""

import torch


def rms_norm(x, weight, eps):
    variance = x.pow(2).mean(-1, keepdim=True)
    return x * torch.rsqrt(variance + eps) * weight
'''

FAST_KERNELS = '''"""Optional "fast" kernels of ``$name``, imported inside try/except (present here)."""


def fused_add(x, y):
    return x + y
'''

CONSTANTS = '''"""Constants of ``$name``, imported with ``from .$module import *``."""

__all__ = ["RMS_EPS", "ROPE_BASE"]

RMS_EPS = 1e-6
ROPE_BASE = 10000.0
_NOT_EXPORTED = "a star import does not bring this name"
'''


CUSTOM_GENERATE = '''"""The custom generate of the ``$name`` test model, written by ``codeferry.testing``.

transformers runs this file in place of ``generate()`` (``from_pretrained(...,
trust_remote_code=True)``, ``generate(custom_generate=...)``): a door besides ``auto_map``.
"""
${marker_imports}from .sampling import greedy
$marker_block

def generate(model, *args, **kwargs):
    return {"custom_generate": __name__, "picked": greedy([0.1, 0.7, 0.2])}
'''

CUSTOM_GENERATE_SAMPLING = '''"""A helper of ``custom_generate/generate.py``."""


def greedy(scores):
    return max(range(len(scores)), key=scores.__getitem__)
'''
