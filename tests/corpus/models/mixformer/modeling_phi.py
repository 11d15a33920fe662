# ruff: noqa
# A reproduction of the patterns of Phi-1.5 / Phi-2's own remote code (MixFormer, before
# transformers had Phi): its own cache object, ``InferenceParams``, carried as
# ``past_key_values`` between steps and made by ``prepare_inputs_for_generation``; a rotary
# ``inv_freq`` buffer and plain cos/sin tensors computed in ``__init__``; a ``PreTrainedModel``
# subclass without ``GenerationMixin``. Written for this project's corpus.
import math
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple, Union

import torch
import torch.nn as nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_phi import PhiConfig


@dataclass
class InferenceParams:
    """Inference parameters passed to the model to store its key-value cache."""

    max_seqlen: int
    max_batch_size: int
    seqlen_offset: int = 0
    batch_size_offset: int = 0
    key_value_memory_dict: Dict[str, Any] = field(default_factory=dict)
    lengths_per_sample: torch.Tensor = None


class Embedding(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.drop = nn.Dropout(config.embd_pdrop)

    def forward(self, input_ids: torch.LongTensor) -> torch.FloatTensor:
        input_shape = input_ids.size()
        input_ids = input_ids.view(-1, input_shape[-1])
        return self.drop(self.wte(input_ids))


def _apply_rotary_emb(x, cos, sin):
    _, seqlen, _, _ = x.shape
    _, rotary_dim = cos.shape
    rotary_dim *= 2
    x_rot = x[:, :, :, :rotary_dim]
    x_pass = x[:, :, :, rotary_dim:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    c, s = cos[:seqlen].unsqueeze(1), sin[:seqlen].unsqueeze(1)
    x1, x2, c, s = [t.to(dtype=torch.float32) for t in [x1, x2, c, s]]
    x_rot = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1).to(x.dtype)
    return torch.cat([x_rot, x_pass], axis=-1)


def _apply_rotary_emb_kv(kv, cos, sin):
    _, seqlen, _, _, _ = kv.shape
    _, rotary_dim = cos.shape
    rotary_dim *= 2
    k_rot = kv[:, :, 0, :, :rotary_dim]
    k_pass = kv[:, :, 0, :, rotary_dim:]
    k1, k2 = k_rot.chunk(2, dim=-1)
    c, s = cos[:seqlen].unsqueeze(1), sin[:seqlen].unsqueeze(1)
    k1, k2, c, s = [t.to(dtype=torch.float32) for t in [k1, k2, c, s]]
    k_rot = torch.cat([k1 * c - k2 * s, k1 * s + k2 * c], axis=-1).to(kv.dtype)
    return torch.cat([torch.cat([k_rot, k_pass], axis=-1).unsqueeze(2), kv[:, :, 1:2, :, :]], axis=2)


class RotaryEmbedding(nn.Module):
    """Rotary positional embedding (RoPE)."""

    def __init__(self, dim: int, base: int = 10000, max_position_embeddings: int = 2048,
                 device: Optional[str] = None, **kwargs) -> None:
        super().__init__()
        self.dim = dim
        self.base = float(base)
        self.max_position_embeddings = max_position_embeddings
        self.device = device
        inv_freq = self._compute_inv_freq(device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._seq_len_cached = 0
        self._cos_cached = None
        self._sin_cached = None
        self._update_cos_sin_cache(max_position_embeddings, device=device, dtype=torch.float32)

    def _compute_inv_freq(self, device=None) -> torch.FloatTensor:
        return 1.0 / (self.base ** (torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) / self.dim))

    def _update_cos_sin_cache(self, seqlen, device=None, dtype=None) -> None:
        self._seq_len_cached = seqlen
        t = torch.arange(seqlen, device=device, dtype=torch.float32)
        if self.inv_freq.dtype != torch.float32:
            inv_freq = self._compute_inv_freq(device=device)
        else:
            inv_freq = self.inv_freq
        freqs = torch.outer(t, inv_freq)
        self._cos_cached = torch.cos(freqs).to(dtype)
        self._sin_cached = torch.sin(freqs).to(dtype)

    def forward(self, qkv: torch.Tensor, kv: Optional[torch.Tensor] = None,
                seqlen_offset: int = 0, **kwargs) -> Tuple[torch.Tensor, torch.Tensor]:
        if (
            self._seq_len_cached < qkv.shape[1] + seqlen_offset
            or self._cos_cached.device != qkv.device
            or self._cos_cached.dtype != qkv.dtype
            or (self.training and self._cos_cached.is_inference())
        ):
            self._update_cos_sin_cache(qkv.shape[1] + seqlen_offset, device=qkv.device, dtype=qkv.dtype)
        q = _apply_rotary_emb(qkv, self._cos_cached[seqlen_offset:], self._sin_cached[seqlen_offset:])
        kv = _apply_rotary_emb_kv(kv, self._cos_cached[seqlen_offset:], self._sin_cached[seqlen_offset:])
        return q, kv


class MLP(nn.Module):
    def __init__(self, config: PretrainedConfig, n_inner: Optional[int] = None,
                 act_fn: Optional[str] = None) -> None:
        super().__init__()
        act_fn = config.activation_function if act_fn is None else act_fn
        n_inner = getattr(config, "n_inner", None) if n_inner is None else n_inner
        n_inner = n_inner if n_inner is not None else 4 * config.n_embd
        self.fc1 = nn.Linear(config.n_embd, n_inner)
        self.fc2 = nn.Linear(n_inner, config.n_embd)
        self.act = ACT2FN[act_fn]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(hidden_states)))


class SelfAttention(nn.Module):
    """Self-attention layer (the prompt, no cache)."""

    def __init__(self, causal: bool = True, softmax_scale: Optional[float] = None,
                 attention_dropout: float = 0.0) -> None:
        super().__init__()
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.drop = nn.Dropout(attention_dropout)

    def forward(self, qkv, causal=None, key_padding_mask=None, **kwargs):
        batch_size, seqlen = qkv.shape[0], qkv.shape[1]
        q, k, v = qkv.unbind(dim=2)
        q, k = q.to(torch.float32), k.to(torch.float32)
        causal = self.causal if causal is None else causal
        softmax_scale = self.softmax_scale or 1.0 / math.sqrt(q.shape[-1])
        scores = torch.einsum("bthd,bshd->bhts", q, k * softmax_scale)
        if key_padding_mask is not None:
            padding_mask = torch.full((batch_size, seqlen), -10000.0, dtype=scores.dtype, device=scores.device)
            padding_mask.masked_fill_(key_padding_mask, 0.0)
            scores = scores + padding_mask[:, None, None, :]
        if causal:
            causal_mask = torch.triu(torch.full((seqlen, seqlen), -10000.0, device=scores.device), 1)
            scores = scores + causal_mask.to(dtype=scores.dtype)
        attention = torch.softmax(scores, dim=-1).to(v.dtype)
        attention = self.drop(attention)
        return torch.einsum("bhts,bshd->bthd", attention, v)


class CrossAttention(nn.Module):
    """Attention of new queries to the cached keys and values."""

    def __init__(self, causal: bool = True, softmax_scale: Optional[float] = None,
                 attention_dropout: float = 0.0) -> None:
        super().__init__()
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.drop = nn.Dropout(attention_dropout)

    def forward(self, q, kv, causal=None, key_padding_mask=None, **kwargs):
        batch_size, seqlen_q = q.shape[0], q.shape[1]
        seqlen_k = kv.shape[1]
        if kv.shape[3] != q.shape[2]:
            kv = kv.repeat_interleave(q.shape[2] // kv.shape[3], dim=3)
        k, v = kv.unbind(dim=2)
        q, k = q.to(torch.float32), k.to(torch.float32)
        causal = self.causal if causal is None else causal
        softmax_scale = self.softmax_scale or 1.0 / math.sqrt(q.shape[-1])
        scores = torch.einsum("bthd,bshd->bhts", q, k * softmax_scale)
        if key_padding_mask is not None:
            padding_mask = torch.full((batch_size, seqlen_k), -10000.0, dtype=scores.dtype, device=scores.device)
            padding_mask.masked_fill_(key_padding_mask, 0.0)
            scores = scores + padding_mask[:, None, None, :]
        if causal:
            rows = torch.arange(seqlen_q, device=q.device, dtype=torch.long)[:, None]
            cols = torch.arange(seqlen_k, device=k.device, dtype=torch.long)
            causal_mask = cols > rows + seqlen_k - seqlen_q
            scores = scores.masked_fill(causal_mask, -10000.0)
        attention = torch.softmax(scores, dim=-1).to(v.dtype)
        attention = self.drop(attention)
        return torch.einsum("bhts,bshd->bthd", attention, v)


def _find_mha_dims(config: PretrainedConfig, n_head: Optional[int] = None,
                   n_head_kv: Optional[int] = None, head_dim: Optional[int] = None) -> Tuple[int, int]:
    if n_head is None and head_dim is None:
        head_dim = config.n_embd // config.n_head
        n_head = config.n_head
    elif n_head is None or head_dim is None:
        raise ValueError("`n_head` and `head_dim` must be both specified or `None`.")
    if n_head_kv is None:
        n_head_kv = getattr(config, "n_head_kv", None) or n_head
    return n_head, n_head_kv, head_dim


def _update_kv_cache(kv: torch.FloatTensor, inference_params: InferenceParams, layer_idx: int) -> torch.FloatTensor:
    num_heads, head_dim = kv.shape[-2:]
    if layer_idx not in inference_params.key_value_memory_dict:
        inference_params.key_value_memory_dict[layer_idx] = torch.empty(
            inference_params.max_batch_size, inference_params.max_seqlen, 2, num_heads, head_dim,
            dtype=kv.dtype, device=kv.device,
        )
    batch_start = inference_params.batch_size_offset
    batch_end = batch_start + kv.shape[0]
    sequence_start = inference_params.seqlen_offset
    sequence_end = sequence_start + kv.shape[1]
    # the cache outgrows max_seqlen: concatenate instead
    if sequence_end >= inference_params.max_seqlen:
        inference_params.key_value_memory_dict[layer_idx] = torch.concatenate(
            (inference_params.key_value_memory_dict[layer_idx], kv), dim=1)
    inference_params.key_value_memory_dict[layer_idx][batch_start:batch_end, sequence_start:sequence_end, ...] = kv
    kv = inference_params.key_value_memory_dict[layer_idx][batch_start:batch_end, :sequence_end, ...]
    return kv


class MHA(nn.Module):
    """Multi-head attention layer."""

    def __init__(self, config: PretrainedConfig, layer_idx: Optional[int] = None, **kwargs) -> None:
        super().__init__()
        self.rotary_dim = getattr(config, "rotary_dim", 0)
        if self.rotary_dim > 0:
            self.rotary_emb = RotaryEmbedding(self.rotary_dim, max_position_embeddings=config.n_positions)
        self.n_head, self.n_head_kv, self.head_dim = _find_mha_dims(config)
        op_size = self.head_dim * (self.n_head + 2 * self.n_head_kv)
        hidden_size = config.n_embd
        self.Wqkv = nn.Linear(hidden_size, op_size)
        self.out_proj = nn.Linear(hidden_size, hidden_size)
        self.inner_attn = SelfAttention(causal=True, attention_dropout=config.attn_pdrop)
        self.inner_cross_attn = CrossAttention(causal=True, attention_dropout=config.attn_pdrop)
        self.layer_idx = layer_idx

    def _forward_self_attn(self, x: torch.FloatTensor, key_padding_mask: Optional[torch.BoolTensor]) -> torch.FloatTensor:
        qkv = self.Wqkv(x)
        qkv = qkv.view(*qkv.shape[:-1], 3, self.n_head, self.head_dim)
        if self.rotary_dim > 0:
            q, kv = self.rotary_emb(qkv[:, :, 0], kv=qkv[:, :, 1:])
            qkv = torch.cat([q.unsqueeze(2), kv], dim=2)
        return self.inner_attn(qkv, key_padding_mask=key_padding_mask)

    def _forward_cross_attn(self, x: torch.FloatTensor, past_key_values: Optional[InferenceParams],
                            key_padding_mask: Optional[torch.BoolTensor]) -> torch.FloatTensor:
        qkv = self.Wqkv(x)
        q = qkv[..., : self.n_head * self.head_dim]
        q = q.view(*q.shape[:-1], self.n_head, self.head_dim)
        kv = qkv[..., self.n_head * self.head_dim :]
        kv = kv.view(*kv.shape[:-1], 2, self.n_head_kv, self.head_dim)
        seqlen_offset = past_key_values.seqlen_offset if past_key_values is not None else 0
        causal = None if seqlen_offset == 0 else False
        if self.rotary_dim > 0:
            q, kv = self.rotary_emb(q, kv=kv, seqlen_offset=seqlen_offset)
        if past_key_values is not None:
            kv = _update_kv_cache(kv, past_key_values, self.layer_idx)
        return self.inner_cross_attn(q, kv, key_padding_mask=key_padding_mask, causal=causal)

    def forward(self, x: torch.FloatTensor, past_key_values: Optional[InferenceParams] = None,
                attention_mask: Optional[Union[torch.LongTensor, torch.BoolTensor]] = None,
                **kwargs) -> Tuple[torch.FloatTensor, torch.FloatTensor]:
        if attention_mask is not None:
            attention_mask = attention_mask.bool()
        else:
            attention_mask = None
        if self.n_head == self.n_head_kv:
            if past_key_values is None:
                attn_output = self._forward_self_attn(x, attention_mask)
            else:
                attn_output = self._forward_cross_attn(x, past_key_values, attention_mask)
        else:
            attn_output = self._forward_cross_attn(x, past_key_values, attention_mask)
        output = attn_output.reshape(*attn_output.shape[:2], -1)
        return self.out_proj(output)


class ParallelBlock(nn.Module):
    """Attention and feed-forward side by side on the same normed input."""

    def __init__(self, config: PretrainedConfig, block_idx: Optional[int] = None) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.resid_dropout = nn.Dropout(config.resid_pdrop)
        self.block_idx = block_idx
        self.mixer = MHA(config, layer_idx=block_idx)
        self.mlp = MLP(config)

    def forward(self, hidden_states: torch.FloatTensor,
                past_key_values: Optional[Union[torch.FloatTensor, InferenceParams]] = None,
                attention_mask: Optional[torch.BoolTensor] = None, **kwargs) -> torch.FloatTensor:
        residual = hidden_states
        hidden_states = self.ln(hidden_states)
        attn_outputs = self.mixer(hidden_states, past_key_values=past_key_values, attention_mask=attention_mask)
        if isinstance(attn_outputs, tuple):
            attn_outputs = attn_outputs[0]
        attn_outputs = self.resid_dropout(attn_outputs)
        feed_forward_hidden_states = self.resid_dropout(self.mlp(hidden_states))
        return attn_outputs + feed_forward_hidden_states + residual


class CausalLMHead(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.linear = nn.Linear(config.n_embd, config.vocab_size)

    def forward(self, hidden_states: torch.FloatTensor) -> torch.FloatTensor:
        hidden_states = self.ln(hidden_states)
        return self.linear(hidden_states).to(torch.float32)


class CausalLMLoss(nn.Module):
    def __init__(self, shift_labels: bool = True) -> None:
        super().__init__()
        self.shift_labels = shift_labels
        self.loss_fct = nn.CrossEntropyLoss()

    def forward(self, logits: torch.FloatTensor, labels: torch.LongTensor) -> torch.FloatTensor:
        if self.shift_labels:
            logits = logits[..., :-1, :].contiguous()
            labels = labels[..., 1:].contiguous()
        return self.loss_fct(logits.view(-1, logits.size(-1)), labels.view(-1))


class PhiPreTrainedModel(PreTrainedModel):
    """Handles weight initialization and generation's inputs."""

    config_class = PhiConfig
    base_model_prefix = "transformer"
    supports_gradient_checkpointing = False
    _no_split_modules = ["ParallelBlock"]

    def __init__(self, *inputs, **kwargs) -> None:
        super().__init__(*inputs, **kwargs)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear,)):
            module.weight.data.normal_(mean=0.0, std=self.config.initializer_range)
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.data.normal_(mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, nn.LayerNorm):
            if module.bias is not None:
                module.bias.data.zero_()
            module.weight.data.fill_(1.0)

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor,
                                      past_key_values: Optional[Union[torch.FloatTensor, InferenceParams]] = None,
                                      attention_mask: Optional[Union[torch.LongTensor, torch.BoolTensor]] = None,
                                      **kwargs) -> Dict[str, Any]:
        if past_key_values is None or not (isinstance(past_key_values, InferenceParams)):
            past_key_values = InferenceParams(
                max_seqlen=self.config.n_positions,
                max_batch_size=input_ids.shape[0],
                seqlen_offset=0,
                batch_size_offset=0,
                key_value_memory_dict={},
                lengths_per_sample=None,
            )
        else:
            # the cache holds every token but the last of input_ids
            past_key_values.seqlen_offset = input_ids.shape[1] - 1
            input_ids = input_ids[:, -1].unsqueeze(-1)
        return {
            "input_ids": input_ids,
            "past_key_values": past_key_values,
            "attention_mask": attention_mask,
        }


class PhiModel(PhiPreTrainedModel):
    _keys_to_ignore_on_load_missing = [""]
    _keys_to_ignore_on_load_unexpected = [r"h\.\d+\.mlp.(fc_in|fc_out)\.(weight|bias)"]

    def __init__(self, config: PhiConfig) -> None:
        super().__init__(config)
        self.embd = Embedding(config)
        self.h = nn.ModuleList([ParallelBlock(config, block_idx=i) for i in range(config.n_layer)])
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embd.wte

    def set_input_embeddings(self, new_embeddings: nn.Embedding) -> None:
        self.embd.wte = new_embeddings

    def forward(self, input_ids: torch.LongTensor,
                past_key_values: Optional[Union[torch.FloatTensor, InferenceParams]] = None,
                attention_mask: Optional[torch.BoolTensor] = None) -> torch.FloatTensor:
        hidden_states = self.embd(input_ids)
        for layer in self.h:
            hidden_states = layer(hidden_states, past_key_values=past_key_values, attention_mask=attention_mask)
        return hidden_states


class PhiForCausalLM(PhiPreTrainedModel):
    """Phi for causal language modeling."""

    _keys_to_ignore_on_load_missing = [""]
    _keys_to_ignore_on_load_unexpected = [r"transformer\.h\.\d+\.mlp.(fc_in|fc_out)\.(weight|bias)"]

    def __init__(self, config: PhiConfig) -> None:
        super().__init__(config)
        self.transformer = PhiModel(config)
        self.lm_head = CausalLMHead(config)
        self.loss = CausalLMLoss()
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head.linear

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        self.lm_head.linear = new_embeddings

    def forward(self, input_ids: torch.LongTensor,
                past_key_values: Optional[Union[torch.FloatTensor, InferenceParams]] = None,
                attention_mask: Optional[torch.BoolTensor] = None,
                labels: Optional[torch.LongTensor] = None, **kwargs) -> CausalLMOutputWithPast:
        hidden_states = self.transformer(input_ids, past_key_values=past_key_values, attention_mask=attention_mask)
        lm_logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = self.loss(lm_logits, labels)
        return CausalLMOutputWithPast(loss=loss, logits=lm_logits, past_key_values=past_key_values)
