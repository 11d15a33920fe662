"""Modeling code of the ``charlm`` test model, written by ``codeferry.testing``.

A tiny causal LM: token embeddings, pre-norm blocks of single-head causal attention with rotary
positions and an MLP, a final norm and an untied LM head.

Example: from .not_a_real_module import Thing
"""

import math

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutputWithPast

from .configuration_charlm import CharlmConfig
from .layers import Block
from .charlm_ops.rope import rope

# A string that only looks like a relative import: nothing may try to resolve it.
NOT_AN_IMPORT = "import .fake"

RMS_EPS = 1e-6
ROPE_BASE = 10000.0


def _scale_positions(hidden):
    return hidden


def _rotate(x):
    """Apply rotary position embeddings over the sequence axis of ``x`` (batch, seq, dim)."""
    return rope(x, ROPE_BASE)


def _act(x):
    return nn.functional.gelu(x, approximate="tanh")


def _residual(x, y):
    return x + y


class CharlmRMSNorm(nn.Module):
    def __init__(self, hidden_size):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(variance + RMS_EPS) * self.weight


class CharlmAttention(nn.Module):
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


class CharlmLayer(nn.Module):
    def __init__(self, hidden_size):
        super().__init__()
        self.norm1 = CharlmRMSNorm(hidden_size)
        self.attn = CharlmAttention(hidden_size)
        self.norm2 = CharlmRMSNorm(hidden_size)
        self.mlp = Block(hidden_size, _act)

    def forward(self, x, mask):
        x = _residual(x, self.attn(self.norm1(x), mask))
        return _residual(x, self.mlp(self.norm2(x)))


class CharlmPreTrainedModel(PreTrainedModel):
    config_class = CharlmConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["CharlmLayer"]

    def _init_weights(self, module):
        # Calls go through ``nn.init`` so that transformers can guard them while loading.
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, CharlmRMSNorm):
            nn.init.ones_(module.weight)


class CharlmModel(CharlmPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(CharlmLayer(config.hidden_size) for _ in range(config.num_layers))
        self.norm = CharlmRMSNorm(config.hidden_size)
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


class CharlmForCausalLM(CharlmPreTrainedModel):
    # No GenerationMixin here on purpose: transformers adds it to remote classes that define
    # ``prepare_inputs_for_generation``; codeferry has to reproduce that.

    def __init__(self, config):
        super().__init__(config)
        self.model = CharlmModel(config)
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
