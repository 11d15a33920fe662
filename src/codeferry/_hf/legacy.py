"""transformers 4's objects that transformers 5 removed, written as transformers 4.53 has them.

Why: ``_hf.compat`` serves these to the remote modules that import or call them; they live
apart so that what they compute (a mask, a head mask, a legacy cache) reads as the release it
copies, beside nothing else.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["legacy_dynamic_cache", "OBJECTS", "METHODS"]


def _torch() -> Any:
    import torch

    return torch


# -- the removed objects, written as transformers 4.53 has them -------------------------------

def _make_causal_mask(input_ids_shape: Any, dtype: Any, device: Any,
                      past_key_values_length: int = 0, sliding_window: int | None = None) -> Any:
    """transformers 4's ``_make_causal_mask``: a ``(bsz, 1, tgt, tgt + past)`` additive mask."""
    torch = _torch()
    bsz, tgt_len = input_ids_shape
    mask = torch.full((tgt_len, tgt_len), torch.finfo(dtype).min, device=device)
    mask_cond = torch.arange(mask.size(-1), device=device)
    mask.masked_fill_(mask_cond < (mask_cond + 1).view(mask.size(-1), 1), 0)
    mask = mask.to(dtype)
    if past_key_values_length > 0:
        mask = torch.cat([torch.zeros(tgt_len, past_key_values_length, dtype=dtype,
                                      device=device), mask], dim=-1)
    if sliding_window is not None:
        diagonal = past_key_values_length - sliding_window - 1
        context_mask = torch.tril(torch.ones_like(mask, dtype=torch.bool), diagonal=diagonal)
        mask.masked_fill_(context_mask, torch.finfo(dtype).min)
    return mask[None, None, :, :].expand(bsz, 1, tgt_len, tgt_len + past_key_values_length)


def _expand_mask(mask: Any, dtype: Any, tgt_len: int | None = None) -> Any:
    """transformers 4's ``_expand_mask``: ``(bsz, src)`` to an additive ``(bsz, 1, tgt, src)``."""
    torch = _torch()
    bsz, src_len = mask.size()
    tgt_len = tgt_len if tgt_len is not None else src_len
    expanded = mask[:, None, None, :].expand(bsz, 1, tgt_len, src_len).to(dtype)
    inverted = 1.0 - expanded
    return inverted.masked_fill(inverted.to(torch.bool), torch.finfo(dtype).min)


def _true() -> bool:
    return True


def _find_pruneable_heads_and_indices(heads: Any, n_heads: int, head_size: int,
                                      already_pruned_heads: Any) -> tuple[set[int], Any]:
    torch = _torch()
    mask = torch.ones(n_heads, head_size)
    heads = set(heads) - already_pruned_heads
    for head in heads:
        head = head - sum(1 if h < head else 0 for h in already_pruned_heads)
        mask[head] = 0
    mask = mask.view(-1).contiguous().eq(1)
    index = torch.arange(len(mask))[mask].long()
    return heads, index


def _conv1d() -> Any:
    from transformers.pytorch_utils import Conv1D

    return Conv1D


def _generate_output() -> Any:
    from transformers.generation.utils import (
        GenerateDecoderOnlyOutput,
        GenerateEncoderDecoderOutput,
    )

    return GenerateEncoderDecoderOutput | GenerateDecoderOnlyOutput


def _deepspeed_zero3() -> Any:
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    return is_deepspeed_zero3_enabled


@functools.cache
def legacy_dynamic_cache() -> type:
    """``DynamicCache`` with the legacy-format methods of transformers 4, and nothing else."""
    from transformers.cache_utils import DynamicCache

    class DynamicCache4(DynamicCache):
        """A ``DynamicCache`` that also reads and writes transformers 4's tuples of tensors."""

        @classmethod
        def from_legacy_cache(cls, past_key_values: Any = None) -> Any:
            cache = cls()
            for layer_idx, (key, value) in enumerate(past_key_values or ()):
                cache.update(key, value, layer_idx)
            return cache

        def to_legacy_cache(self) -> tuple[tuple[Any, Any], ...]:
            return tuple((getattr(layer, "keys"), getattr(layer, "values"))  # noqa: B009
                         for layer in self.layers if getattr(layer, "keys", None) is not None)

        def get_usable_length(self, new_seq_length: int, layer_idx: int | None = 0) -> int:
            return int(self.get_seq_length(layer_idx or 0))

        @property
        def seen_tokens(self) -> int:
            return int(self.get_seq_length())

        def get_max_cache_shape(self) -> None:
            return None

    DynamicCache4.__name__ = DynamicCache4.__qualname__ = "DynamicCache"
    return DynamicCache4


def _dynamic_cache() -> Any:
    return legacy_dynamic_cache()


#: (module, name) -> the object a remote module gets where the installed module lacks it.
def _get_head_mask(self: Any, head_mask: Any, num_hidden_layers: int,
                   is_attention_chunked: bool = False) -> Any:
    if head_mask is None:
        return [None] * num_hidden_layers
    head_mask = _convert_head_mask_to_5d(self, head_mask, num_hidden_layers)
    if is_attention_chunked:
        head_mask = head_mask.unsqueeze(-1)
    return head_mask


def _convert_head_mask_to_5d(self: Any, head_mask: Any, num_hidden_layers: int) -> Any:
    if head_mask.dim() == 1:
        head_mask = head_mask.unsqueeze(0).unsqueeze(0).unsqueeze(-1).unsqueeze(-1)
        head_mask = head_mask.expand(num_hidden_layers, -1, -1, -1, -1)
    elif head_mask.dim() == 2:
        head_mask = head_mask.unsqueeze(1).unsqueeze(-1).unsqueeze(-1)
    return head_mask.to(dtype=self.dtype)


def _invert_attention_mask(self: Any, encoder_attention_mask: Any) -> Any:
    torch = _torch()
    if encoder_attention_mask.dim() == 3:
        extended = encoder_attention_mask[:, None, :, :]
    else:
        extended = encoder_attention_mask[:, None, None, :]
    extended = extended.to(dtype=self.dtype)
    return (1.0 - extended) * torch.finfo(self.dtype).min


def _get_extended_attention_mask(self: Any, attention_mask: Any, input_shape: Any,
                                 device: Any = None, dtype: Any = None) -> Any:
    torch = _torch()
    dtype = dtype if dtype is not None else self.dtype
    if attention_mask.dim() == 3:
        extended = attention_mask[:, None, :, :]
    elif attention_mask.dim() == 2:
        if getattr(self.config, "is_decoder", False):
            batch_size, seq_length = input_shape
            seq_ids = torch.arange(seq_length, device=attention_mask.device)
            causal = seq_ids[None, None, :].repeat(batch_size, seq_length, 1) <= seq_ids[None, :, None]
            causal = causal.to(attention_mask.dtype)
            if causal.shape[1] < attention_mask.shape[1]:
                prefix = attention_mask.shape[1] - causal.shape[1]
                causal = torch.cat([torch.ones((batch_size, seq_length, prefix),
                                               device=attention_mask.device,
                                               dtype=causal.dtype), causal], dim=-1)
            extended = causal[:, None, :, :] * attention_mask[:, None, None, :]
        else:
            extended = attention_mask[:, None, None, :]
    else:
        raise ValueError(f"Wrong shape for input_ids (shape {input_shape}) or attention_mask "
                         f"(shape {attention_mask.shape})")
    extended = extended.to(dtype=dtype)
    return (1.0 - extended) * torch.finfo(dtype).min


OBJECTS: dict[tuple[str, str], Callable[[], Any]] = {
    ("transformers.modeling_attn_mask_utils", "_expand_mask"): lambda: _expand_mask,
    ("transformers.modeling_attn_mask_utils", "_make_causal_mask"): lambda: _make_causal_mask,
    ("transformers.models.llama.modeling_llama", "_expand_mask"): lambda: _expand_mask,
    ("transformers.models.llama.modeling_llama", "_make_causal_mask"): lambda: _make_causal_mask,
    ("transformers.utils", "is_torch_fx_available"): lambda: _true,
    ("transformers.utils.import_utils", "is_torch_fx_available"): lambda: _true,
    ("transformers.utils", "is_torch_sdpa_available"): lambda: _true,
    ("transformers.utils.import_utils", "is_torch_sdpa_available"): lambda: _true,
    ("transformers.pytorch_utils", "find_pruneable_heads_and_indices"):
        lambda: _find_pruneable_heads_and_indices,
    ("transformers.modeling_utils", "Conv1D"): _conv1d,
    ("transformers.generation.utils", "SampleOutput"): _generate_output,
    ("transformers.generation.utils", "GreedySearchOutput"): _generate_output,
    ("transformers.generation.utils", "BeamSearchOutput"): _generate_output,
    ("transformers.deepspeed", "is_deepspeed_zero3_enabled"): _deepspeed_zero3,
    ("transformers.cache_utils", "DynamicCache"): _dynamic_cache,
}


METHODS: dict[str, Any] = {
    "get_head_mask": _get_head_mask,
    "_convert_head_mask_to_5d": _convert_head_mask_to_5d,
    "invert_attention_mask": _invert_attention_mask,
    "get_extended_attention_mask": _get_extended_attention_mask,
}
