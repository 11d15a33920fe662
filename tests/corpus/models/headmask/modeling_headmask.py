# ruff: noqa
"""The ``headmask`` corpus model: a GPT-like decoder written the way ChatGLM2/3, MPT and Falcon
RW's remote code were (a reproduction, see ../README.md): past keys and values as a tuple per
layer, ``self.get_head_mask`` in the forward pass, a base model whose ``__init__`` never calls
``post_init``, ``config.max_length`` and ``config.pad_token_id`` read from a config that does
not set them, ``prepare_inputs_for_generation`` that slices on ``if past_key_values:``."""

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import PreTrainedModel
from transformers.utils import logging

from .configuration_headmask import HeadMaskConfig

logger = logging.get_logger(__name__)


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.query_key_value = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.register_buffer("masked_bias", torch.tensor(-1e4), persistent=False)

    def forward(self, hidden_states, attention_mask, layer_past=None, head_mask=None, use_cache=False):
        bsz, q_len, _ = hidden_states.shape
        qkv = self.query_key_value(hidden_states).view(bsz, q_len, 3, self.num_heads, self.head_dim)
        query, key, value = [t.transpose(1, 2) for t in qkv.unbind(2)]
        if layer_past is not None:
            key = torch.cat((layer_past[0], key), dim=-2)
            value = torch.cat((layer_past[1], value), dim=-2)
        present = (key, value) if use_cache else None
        kv_len = key.shape[-2]
        scores = torch.matmul(query, key.transpose(-1, -2)) / math.sqrt(self.head_dim)
        causal = torch.ones(q_len, kv_len, dtype=torch.bool).tril(diagonal=kv_len - q_len)
        scores = torch.where(causal, scores, self.masked_bias.to(scores.dtype))
        if attention_mask is not None:
            scores = scores + attention_mask
        probs = F.softmax(scores, dim=-1)
        if head_mask is not None:
            probs = probs * head_mask
        out = torch.matmul(probs, value).transpose(1, 2).reshape(bsz, q_len, -1)
        return self.dense(out), present


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.attn = Attention(config)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mlp_fc = nn.Linear(config.hidden_size, 4 * config.hidden_size)
        self.mlp_proj = nn.Linear(4 * config.hidden_size, config.hidden_size)

    def forward(self, hidden_states, attention_mask, layer_past=None, head_mask=None, use_cache=False):
        attn, present = self.attn(self.ln_1(hidden_states), attention_mask, layer_past, head_mask, use_cache)
        hidden_states = hidden_states + attn
        hidden_states = hidden_states + self.mlp_proj(F.gelu(self.mlp_fc(self.ln_2(hidden_states))))
        return hidden_states, present


class HeadMaskPreTrainedModel(PreTrainedModel):
    config_class = HeadMaskConfig
    base_model_prefix = "transformer"
    is_parallelizable = False

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=0.02)
            if module.bias is not None:
                module.bias.data.zero_()


class HeadMaskModel(HeadMaskPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.max_length = config.max_length
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(256, config.hidden_size)
        self.h = nn.ModuleList([Block(config) for _ in range(config.num_layers)])
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, input_ids=None, past_key_values=None, attention_mask=None,
                position_ids=None, head_mask=None, use_cache=None, return_dict=None, **kwargs):
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        batch_size, seq_length = input_ids.shape
        if past_key_values is None:
            past_length = 0
            past_key_values = tuple([None] * len(self.h))
        else:
            past_length = past_key_values[0][0].size(-2)
        if position_ids is None:
            if attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, past_length:]
            else:
                position_ids = torch.arange(past_length, past_length + seq_length).unsqueeze(0)
        if attention_mask is not None:
            attention_mask = attention_mask[:, None, None, :].to(torch.float32)
            attention_mask = (1.0 - attention_mask) * torch.finfo(torch.float32).min
        head_mask = self.get_head_mask(head_mask, self.config.num_layers)
        hidden_states = self.wte(input_ids) + self.wpe(position_ids)
        presents = () if use_cache else None
        for block, layer_past, layer_head_mask in zip(self.h, past_key_values, head_mask):
            hidden_states, present = block(hidden_states, attention_mask, layer_past,
                                           layer_head_mask, use_cache)
            if use_cache:
                presents = presents + (present,)
        hidden_states = self.ln_f(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, past_key_values=presents)


class HeadMaskForCausalLM(HeadMaskPreTrainedModel):
    _tied_weights_keys = ["lm_head.weight"]

    def __init__(self, config):
        super().__init__(config)
        self.transformer = HeadMaskModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, attention_mask=None, **kwargs):
        if past_key_values:
            input_ids = input_ids[:, -1:]
        return {"input_ids": input_ids, "past_key_values": past_key_values,
                "attention_mask": attention_mask, "use_cache": kwargs.get("use_cache")}

    def forward(self, input_ids=None, past_key_values=None, attention_mask=None,
                position_ids=None, head_mask=None, labels=None, use_cache=None,
                return_dict=None, **kwargs):
        outputs = self.transformer(input_ids, past_key_values=past_key_values,
                                   attention_mask=attention_mask, position_ids=position_ids,
                                   head_mask=head_mask, use_cache=use_cache)
        logits = self.lm_head(outputs.last_hidden_state)
        return CausalLMOutputWithPast(logits=logits, past_key_values=outputs.past_key_values)

    @staticmethod
    def _reorder_cache(past, beam_idx):
        return tuple(tuple(p.index_select(0, beam_idx) for p in layer) for layer in past)
