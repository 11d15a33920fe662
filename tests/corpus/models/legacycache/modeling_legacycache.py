# ruff: noqa
"""The ``legacycache`` corpus model: a Llama-like decoder written the way InternLM2,
DeepSeek-V2/V3, MiniCPM and Phi-3's custom code were (a reproduction, see ../README.md):
``is_torch_fx_available`` at import, ``DynamicCache.from_legacy_cache`` /
``get_usable_length`` / ``to_legacy_cache`` and ``seen_tokens`` in the forward pass and in
``prepare_inputs_for_generation``, ``config.pad_token_id`` read in ``__init__``."""

import math
from typing import List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import PreTrainedModel
from transformers.utils import is_torch_fx_available, logging

from .configuration_legacycache import LegacyCacheConfig

logger = logging.get_logger(__name__)


def _prepare_4d_causal_attention_mask(attention_mask, input_shape, dtype, past_key_values_length):
    bsz, tgt_len = input_shape
    src_len = tgt_len + past_key_values_length
    causal = torch.full((tgt_len, src_len), torch.finfo(dtype).min, dtype=dtype)
    causal = torch.triu(causal, diagonal=past_key_values_length + 1)
    causal = causal[None, None].expand(bsz, 1, tgt_len, src_len).clone()
    if attention_mask is not None:
        padding = (1.0 - attention_mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min
        causal = (causal + padding).clamp(min=torch.finfo(dtype).min)
    return causal


if is_torch_fx_available():
    _prepare_4d_causal_attention_mask = torch.fx.wrap(_prepare_4d_causal_attention_mask)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos()[:, None], emb.sin()[:, None]


class Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.rotary_emb = RotaryEmbedding(self.head_dim, config.rope_theta)

    def forward(self, hidden_states, attention_mask, position_ids, past_key_value=None):
        bsz, q_len, _ = hidden_states.size()
        qkv = self.qkv(hidden_states).view(bsz, q_len, 3, self.num_heads, self.head_dim)
        query, key, value = qkv.unbind(2)
        query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        cos, sin = self.rotary_emb(position_ids)
        query = query * cos + rotate_half(query) * sin
        key = key * cos + rotate_half(key) * sin
        if past_key_value is not None:
            key, value = past_key_value.update(key, value, self.layer_idx)
        weights = torch.matmul(query, key.transpose(2, 3)) / math.sqrt(self.head_dim)
        weights = weights + attention_mask
        weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
        out = torch.matmul(weights, value).transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(out), past_key_value


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp_up = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.mlp_down = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask, position_ids, past_key_value=None):
        residual = hidden_states
        hidden_states, present = self.self_attn(self.input_layernorm(hidden_states),
                                                attention_mask, position_ids, past_key_value)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.mlp_down(F.silu(self.mlp_up(self.post_attention_layernorm(hidden_states))))
        return residual + hidden_states, present


class LegacyCachePreTrainedModel(PreTrainedModel):
    config_class = LegacyCacheConfig
    base_model_prefix = "model"
    _no_split_modules = ["DecoderLayer"]
    _supports_cache_class = True

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=0.02)
        elif isinstance(module, nn.Embedding):
            module.weight.data.normal_(mean=0.0, std=0.02)


class LegacyCacheModel(LegacyCachePreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None,
                past_key_values=None, inputs_embeds=None, use_cache=None,
                output_attentions=None, output_hidden_states=None, return_dict=None, **kwargs):
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        batch_size, seq_length = input_ids.shape[:2]
        past_key_values_length = 0
        use_legacy_cache = False
        if use_cache:
            use_legacy_cache = not isinstance(past_key_values, Cache)
            if use_legacy_cache:
                past_key_values = DynamicCache.from_legacy_cache(past_key_values)
            past_key_values_length = past_key_values.get_usable_length(seq_length)
        if position_ids is None:
            position_ids = torch.arange(past_key_values_length, seq_length + past_key_values_length,
                                        dtype=torch.long).unsqueeze(0)
        hidden_states = self.embed_tokens(input_ids)
        attention_mask = _prepare_4d_causal_attention_mask(
            attention_mask, (batch_size, seq_length), hidden_states.dtype, past_key_values_length)
        next_decoder_cache = None
        for layer in self.layers:
            hidden_states, next_decoder_cache = layer(
                hidden_states, attention_mask, position_ids, past_key_values if use_cache else None)
        hidden_states = self.norm(hidden_states)
        next_cache = None
        if use_cache:
            next_cache = next_decoder_cache.to_legacy_cache() if use_legacy_cache else next_decoder_cache
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, past_key_values=next_cache)


class LegacyCacheForCausalLM(LegacyCachePreTrainedModel):
    _tied_weights_keys = ["lm_head.weight"]

    def __init__(self, config):
        super().__init__(config)
        self.model = LegacyCacheModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids=None, attention_mask=None, position_ids=None,
                past_key_values=None, inputs_embeds=None, labels=None, use_cache=None,
                output_attentions=None, output_hidden_states=None, return_dict=None, **kwargs):
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask,
                             position_ids=position_ids, past_key_values=past_key_values,
                             use_cache=use_cache)
        logits = self.lm_head(outputs.last_hidden_state).float()
        return CausalLMOutputWithPast(logits=logits, past_key_values=outputs.past_key_values)

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, attention_mask=None,
                                      inputs_embeds=None, **kwargs):
        if past_key_values is not None:
            if isinstance(past_key_values, Cache):
                past_length = past_key_values.seen_tokens
            else:
                past_length = past_key_values[0][0].shape[2]
            if attention_mask is not None and attention_mask.shape[1] > input_ids.shape[1]:
                input_ids = input_ids[:, -(attention_mask.shape[1] - past_length):]
            elif past_length < input_ids.shape[1]:
                input_ids = input_ids[:, past_length:]
        position_ids = kwargs.get("position_ids", None)
        if attention_mask is not None and position_ids is None:
            position_ids = attention_mask.long().cumsum(-1) - 1
            position_ids.masked_fill_(attention_mask == 0, 1)
            if past_key_values is not None:
                position_ids = position_ids[:, -input_ids.shape[1]:]
        return {"input_ids": input_ids, "position_ids": position_ids,
                "past_key_values": past_key_values, "use_cache": kwargs.get("use_cache"),
                "attention_mask": attention_mask}

    @staticmethod
    def _reorder_cache(past_key_values, beam_idx):
        return tuple(tuple(p.index_select(0, beam_idx) for p in layer) for layer in past_key_values)
