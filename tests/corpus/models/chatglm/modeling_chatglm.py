# ruff: noqa
"""The ``chatglm`` corpus model: a decoder written the way ChatGLM2/3 and CodeGeeX2's remote
code were (a reproduction, see ../README.md): sequence-first tensors, past keys and values as
a tuple per layer, ``skip_init`` and no ``post_init``, a rotary cache computed in the forward
pass from an ``inv_freq`` buffer, and ``_update_model_kwargs_for_generation`` that unpacks
``self._extract_past_from_model_output(outputs)`` (transformers 4.42 to 4.48)."""

from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import PreTrainedModel
from transformers.utils import ModelOutput, logging

from .configuration_chatglm import ChatGLMConfig

logger = logging.get_logger(__name__)


def default_init(cls, *args, **kwargs):
    return cls(*args, **kwargs)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, device=None, dtype=None):
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=device).to(dtype=dtype) / dim))
        self.register_buffer("inv_freq", inv_freq)
        self.dim = dim

    def forward(self, max_seq_len):
        seq_idx = torch.arange(max_seq_len, dtype=torch.float)
        idx_theta = torch.outer(seq_idx, self.inv_freq.float()).float()
        return torch.stack([torch.cos(idx_theta), torch.sin(idx_theta)], dim=-1)


def apply_rotary_pos_emb(x, rope_cache):
    sq, b, np, hn = x.size(0), x.size(1), x.size(2), x.size(3)
    rot_dim = rope_cache.shape[-2] * 2
    x, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    rope_cache = rope_cache[:sq]
    xshaped = x.reshape(sq, -1, np, rot_dim // 2, 2)
    rope_cache = rope_cache.view(sq, -1, 1, xshaped.size(3), 2)
    x_out2 = torch.stack([
        xshaped[..., 0] * rope_cache[..., 0] - xshaped[..., 1] * rope_cache[..., 1],
        xshaped[..., 1] * rope_cache[..., 0] + xshaped[..., 0] * rope_cache[..., 1],
    ], -1)
    return torch.cat((x_out2.flatten(3), x_pass), dim=-1)


class SelfAttention(nn.Module):
    def __init__(self, config, layer_number, device=None):
        super().__init__()
        self.layer_number = layer_number
        self.heads = config.num_attention_heads
        self.groups = config.multi_query_group_num
        self.head_dim = config.kv_channels
        self.query_key_value = nn.Linear(config.hidden_size, (self.heads + 2 * self.groups) * self.head_dim,
                                         bias=True, device=device)
        self.dense = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False, device=device)

    def forward(self, hidden_states, attention_mask, rotary_pos_emb, kv_cache=None, use_cache=True):
        sq, b, _ = hidden_states.shape
        mixed = self.query_key_value(hidden_states)
        q, k, v = mixed.split([self.heads * self.head_dim, self.groups * self.head_dim,
                               self.groups * self.head_dim], dim=-1)
        q = q.view(sq, b, self.heads, self.head_dim)
        k = k.view(sq, b, self.groups, self.head_dim)
        v = v.view(sq, b, self.groups, self.head_dim)
        q = apply_rotary_pos_emb(q, rotary_pos_emb)
        k = apply_rotary_pos_emb(k, rotary_pos_emb)
        if kv_cache is not None:
            k = torch.cat((kv_cache[0], k), dim=0)
            v = torch.cat((kv_cache[1], v), dim=0)
        kv_cache = (k, v) if use_cache else None
        rep = self.heads // self.groups
        k = k.unsqueeze(-2).expand(-1, -1, -1, rep, -1).reshape(k.size(0), b, self.heads, self.head_dim)
        v = v.unsqueeze(-2).expand(-1, -1, -1, rep, -1).reshape(v.size(0), b, self.heads, self.head_dim)
        q, k, v = [t.permute(1, 2, 0, 3) for t in (q, k, v)]
        if attention_mask is None and q.shape[2] == k.shape[2]:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            if attention_mask is not None:
                attention_mask = ~attention_mask
            out = F.scaled_dot_product_attention(q, k, v, attention_mask)
        out = out.permute(2, 0, 1, 3).reshape(sq, b, -1)
        return self.dense(out), kv_cache


class GLMBlock(nn.Module):
    def __init__(self, config, layer_number, device=None):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon, device=device)
        self.self_attention = SelfAttention(config, layer_number, device=device)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon, device=device)
        self.dense_h_to_4h = nn.Linear(config.hidden_size, config.ffn_hidden_size * 2, bias=False, device=device)
        self.dense_4h_to_h = nn.Linear(config.ffn_hidden_size, config.hidden_size, bias=False, device=device)

    def forward(self, hidden_states, attention_mask, rotary_pos_emb, kv_cache=None, use_cache=True):
        attention_output, kv_cache = self.self_attention(self.input_layernorm(hidden_states), attention_mask,
                                                         rotary_pos_emb, kv_cache=kv_cache, use_cache=use_cache)
        hidden_states = hidden_states + attention_output
        x = self.dense_h_to_4h(self.post_attention_layernorm(hidden_states))
        x = torch.chunk(x, 2, dim=-1)
        return hidden_states + self.dense_4h_to_h(F.silu(x[0]) * x[1]), kv_cache


class ChatGLMPreTrainedModel(PreTrainedModel):
    is_parallelizable = False
    supports_gradient_checkpointing = True
    config_class = ChatGLMConfig
    base_model_prefix = "transformer"
    _no_split_modules = ["GLMBlock"]

    def _init_weights(self, module: nn.Module):
        return

    def get_masks(self, input_ids, past_key_values, padding_mask=None):
        batch_size, seq_length = input_ids.shape
        full_attention_mask = torch.ones(batch_size, seq_length, seq_length, device=input_ids.device)
        full_attention_mask.tril_()
        past_length = 0
        if past_key_values:
            past_length = past_key_values[0][0].shape[0]
        if past_length:
            full_attention_mask = torch.cat((torch.ones(batch_size, seq_length, past_length,
                                                        device=input_ids.device), full_attention_mask), dim=-1)
        if padding_mask is not None:
            full_attention_mask = full_attention_mask * padding_mask.unsqueeze(1)
        if not past_length and padding_mask is not None:
            full_attention_mask -= padding_mask.unsqueeze(-1) - 1
        full_attention_mask = (full_attention_mask < 0.5).bool()
        full_attention_mask.unsqueeze_(1)
        return full_attention_mask

    def get_position_ids(self, input_ids, device):
        batch_size, seq_length = input_ids.shape
        return torch.arange(seq_length, dtype=torch.long, device=device).unsqueeze(0).repeat(batch_size, 1)


class ChatGLMModel(ChatGLMPreTrainedModel):
    def __init__(self, config: ChatGLMConfig, device=None, empty_init=True):
        super().__init__(config)
        init_method = skip_init if empty_init else default_init
        init_kwargs = {}
        if device is not None:
            init_kwargs["device"] = device
        self.embedding = init_method(nn.Embedding, config.padded_vocab_size, config.hidden_size, **init_kwargs)
        self.num_layers = config.num_layers
        self.seq_length = config.seq_length
        self.rotary_pos_emb = RotaryEmbedding(config.kv_channels // 2, device=device)
        self.layers = nn.ModuleList([GLMBlock(config, i + 1, device=device) for i in range(config.num_layers)])
        self.final_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon, device=device)
        self.output_layer = init_method(nn.Linear, config.hidden_size, config.padded_vocab_size, bias=False,
                                        **init_kwargs)

    def forward(self, input_ids, position_ids=None, attention_mask=None, full_attention_mask=None,
                past_key_values=None, inputs_embeds=None, use_cache=None, output_hidden_states=None,
                return_dict=None):
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        batch_size, seq_length = input_ids.shape
        inputs_embeds = self.embedding(input_ids).transpose(0, 1).contiguous()
        if full_attention_mask is None:
            if (attention_mask is not None and not attention_mask.all()) or (past_key_values and seq_length != 1):
                full_attention_mask = self.get_masks(input_ids, past_key_values, padding_mask=attention_mask)
        rotary_pos_emb = self.rotary_pos_emb(self.seq_length)
        if position_ids is not None:
            rotary_pos_emb = rotary_pos_emb[position_ids]
        else:
            rotary_pos_emb = rotary_pos_emb[None, :seq_length]
        rotary_pos_emb = rotary_pos_emb.transpose(0, 1).contiguous()
        if not past_key_values:
            past_key_values = [None for _ in range(self.num_layers)]
        presents = () if use_cache else None
        hidden_states = inputs_embeds
        for index, layer in enumerate(self.layers):
            hidden_states, kv_cache = layer(hidden_states, full_attention_mask, rotary_pos_emb,
                                            kv_cache=past_key_values[index], use_cache=use_cache)
            if use_cache:
                presents = presents + (kv_cache,)
        hidden_states = self.final_layernorm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, past_key_values=presents)


class ChatGLMForConditionalGeneration(ChatGLMPreTrainedModel):
    def __init__(self, config: ChatGLMConfig, empty_init=True, device=None):
        super().__init__(config)
        self.max_sequence_length = config.max_length
        self.transformer = ChatGLMModel(config, empty_init=empty_init, device=device)
        self.config = config

    def _update_model_kwargs_for_generation(self, outputs: ModelOutput, model_kwargs: Dict[str, Any],
                                            is_encoder_decoder: bool = False, **kwargs) -> Dict[str, Any]:
        cache_name, cache = self._extract_past_from_model_output(outputs)
        model_kwargs[cache_name] = cache
        if "attention_mask" in model_kwargs:
            attention_mask = model_kwargs["attention_mask"]
            model_kwargs["attention_mask"] = torch.cat(
                [attention_mask, attention_mask.new_ones((attention_mask.shape[0], 1))], dim=-1)
        if "position_ids" in model_kwargs:
            position_ids = model_kwargs["position_ids"]
            new_position_id = position_ids[..., -1:].clone()
            new_position_id += 1
            model_kwargs["position_ids"] = torch.cat([position_ids, new_position_id], dim=-1)
        model_kwargs["is_first_forward"] = False
        return model_kwargs

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, attention_mask=None,
                                      position_ids=None, use_cache=None, is_first_forward=True, **kwargs):
        if position_ids is None:
            position_ids = self.get_position_ids(input_ids, device=input_ids.device)
        if not is_first_forward:
            if past_key_values is not None:
                position_ids = position_ids[..., -1:]
                input_ids = input_ids[:, -1:]
        return {"input_ids": input_ids, "past_key_values": past_key_values, "position_ids": position_ids,
                "attention_mask": attention_mask, "return_last_logit": True, "use_cache": use_cache}

    def forward(self, input_ids=None, position_ids=None, attention_mask=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, output_attentions=None,
                output_hidden_states=None, return_dict=None, return_last_logit=False):
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        transformer_outputs = self.transformer(input_ids=input_ids, position_ids=position_ids,
                                               attention_mask=attention_mask, past_key_values=past_key_values,
                                               use_cache=use_cache)
        hidden_states = transformer_outputs[0]
        if return_last_logit:
            hidden_states = hidden_states[-1:]
        lm_logits = self.transformer.output_layer(hidden_states)
        lm_logits = lm_logits.transpose(0, 1).contiguous().float()
        return CausalLMOutputWithPast(logits=lm_logits, past_key_values=transformer_outputs.past_key_values)
