# ruff: noqa
"""The ``hybridcache`` corpus model: a decoder built the way remote code derived from Gemma 2
was (a reproduction, see ../README.md): ``from transformers.cache_utils import Cache,
HybridCache`` at import, ``isinstance(past_key_values, HybridCache)`` where the causal mask
is made, sliding-window attention on every other layer, Gemma's ``1 + weight`` norms around
attention and MLP, and logits soft-capped. transformers 5 removed ``HybridCache``; nothing
stands in for it with one obvious meaning, so this code runs on 4.57 at the newest."""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache, DynamicCache, HybridCache
from transformers.generation import GenerationMixin
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import PreTrainedModel

from .configuration_hybridcache import HybridCacheConfig


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000.0):
        super().__init__()
        self.dim, self.base = dim, base

    def forward(self, position_ids):
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2).float() / self.dim))
        freqs = position_ids[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos()[:, None], emb.sin()[:, None]


class Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.sliding_window = config.sliding_window if not layer_idx % 2 else None
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.rotary_emb = RotaryEmbedding(self.head_dim, config.rope_theta)

    def forward(self, hidden_states, attention_mask, position_ids, past_key_value=None,
                cache_position=None):
        bsz, q_len, _ = hidden_states.size()
        shape = (bsz, q_len, self.num_heads, self.head_dim)
        query = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        key = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        value = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        cos, sin = self.rotary_emb(position_ids)
        query = query * cos + rotate_half(query) * sin
        key = key * cos + rotate_half(key) * sin
        if past_key_value is not None:
            key, value = past_key_value.update(key, value, self.layer_idx,
                                               {"cache_position": cache_position})
        mask = attention_mask[:, :, :, : key.shape[-2]]
        if self.sliding_window is not None:
            # Gemma 2: a sliding layer sees the last ``sliding_window`` positions only
            distance = cache_position.reshape(-1, 1) - torch.arange(key.shape[-2])
            mask = mask.masked_fill(distance >= self.sliding_window, torch.finfo(mask.dtype).min)
        weights = torch.matmul(query, key.transpose(2, 3)) / math.sqrt(self.head_dim)
        weights = F.softmax(weights + mask, dim=-1, dtype=torch.float32).to(query.dtype)
        out = torch.matmul(weights, value).transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask, position_ids, past_key_value=None,
                cache_position=None):
        residual = hidden_states
        hidden_states = self.self_attn(self.input_layernorm(hidden_states), attention_mask,
                                       position_ids, past_key_value, cache_position)
        hidden_states = residual + self.post_attention_layernorm(hidden_states)
        residual = hidden_states
        hidden_states = self.pre_feedforward_layernorm(hidden_states)
        hidden_states = self.down_proj(F.gelu(self.gate_proj(hidden_states), approximate="tanh")
                                       * self.up_proj(hidden_states))
        return residual + self.post_feedforward_layernorm(hidden_states)


class HybridCachePreTrainedModel(PreTrainedModel):
    config_class = HybridCacheConfig
    base_model_prefix = "model"
    _no_split_modules = ["DecoderLayer"]
    _supports_cache_class = True
    _supports_static_cache = True

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(mean=0.0, std=0.02)


class HybridCacheModel(HybridCachePreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None,
                past_key_values=None, inputs_embeds=None, use_cache=None, cache_position=None,
                output_attentions=None, output_hidden_states=None, return_dict=None, **kwargs):
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if cache_position is None:
            past_seen = past_key_values.get_seq_length() if past_key_values is not None else 0
            cache_position = torch.arange(past_seen, past_seen + inputs_embeds.shape[1])
        if position_ids is None:
            position_ids = cache_position.unsqueeze(0)
        causal_mask = self._update_causal_mask(attention_mask, inputs_embeds, cache_position,
                                               past_key_values)
        hidden_states = inputs_embeds * torch.tensor(self.config.hidden_size ** 0.5,
                                                     dtype=inputs_embeds.dtype)
        for layer in self.layers:
            hidden_states = layer(hidden_states, causal_mask, position_ids,
                                  past_key_values if use_cache else None, cache_position)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states),
                                       past_key_values=past_key_values if use_cache else None)

    def _update_causal_mask(self, attention_mask, input_tensor, cache_position, past_key_values):
        dtype, sequence_length = input_tensor.dtype, input_tensor.shape[1]
        if isinstance(past_key_values, HybridCache):
            target_length = past_key_values.get_max_cache_shape()
        else:
            target_length = (attention_mask.shape[-1] if attention_mask is not None
                             else cache_position[-1] + 1)
        min_value = torch.finfo(dtype).min
        causal = torch.full((sequence_length, target_length), min_value, dtype=dtype)
        causal = causal * (torch.arange(target_length) > cache_position.reshape(-1, 1))
        causal = causal[None, None].expand(input_tensor.shape[0], 1, -1, -1).clone()
        if attention_mask is not None:
            padding = attention_mask[:, None, None, :target_length] == 0
            causal = causal.masked_fill(padding, min_value)
        return causal


class HybridCacheForCausalLM(HybridCachePreTrainedModel, GenerationMixin):
    def __init__(self, config):
        super().__init__(config)
        self.model = HybridCacheModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids=None, attention_mask=None, position_ids=None,
                past_key_values=None, inputs_embeds=None, labels=None, use_cache=None,
                cache_position=None, output_attentions=None, output_hidden_states=None,
                return_dict=None, logits_to_keep=0, **kwargs):
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask,
                             position_ids=position_ids, past_key_values=past_key_values,
                             inputs_embeds=inputs_embeds, use_cache=use_cache,
                             cache_position=cache_position)
        hidden_states = outputs.last_hidden_state
        if logits_to_keep:
            hidden_states = hidden_states[:, -logits_to_keep:]
        logits = self.lm_head(hidden_states).float()
        cap = self.config.final_logit_softcapping
        logits = torch.tanh(logits / cap) * cap
        return CausalLMOutputWithPast(logits=logits, past_key_values=outputs.past_key_values)
