"""The decode loop's attention on CPU: float32 for half-precision models, rows in runs.

Why float32: PyTorch's CPU kernel for ``scaled_dot_product_attention`` in bfloat16 is slow
on a decode step (one query a row): on a 71M Llama, 16 rows, one thread, it took 58% of
each step, 1.6 ms a layer, against 0.4-0.9 ms in float32 over the same keys and values
(``docs/executor.md``). Converting the keys and values at every step costs most of that
back, so the decode loop stores them in float32 (``decode._Layer``: its cache is twice the
bytes of a bfloat16 one, and ``decode.rows_for`` counts them so) and attention runs on them
in float32, the query cast up and the output cast back to the model's dtype. Keys and values
are exactly what the model computed (bfloat16 values are exact in float32); only the
attention's own sums are more precise than in bfloat16.

Why runs (``SPANS``, any dtype): the loop's cache is a rectangle, every row left-padded to
the longest; the loop passes runs of rows (``cuts.spans``) and each run attends apart,
from the first column one of its rows needs, instead of every row reading every padding
column at every step and layer.

Why a decode step of its own (``_step``, any dtype): with one query a row, torch's SDPA
kernel on CPU computes each score as a dot product of ``dim`` floats (a horizontal sum per
column); with the keys stored columns innermost (``empty_keys``: the loop's cache holds them
so) the scores are one query row times a matrix read along its rows, and the output one
more product. One thread, AVX-512 (``benchmarks/bench_cpu_step.py --part kernels``, 8 heads
of 64): 16 rows x 60 columns 0.43 -> 0.35 ms a layer, 24 x 150 1.25 -> 0.86, 64 x 100 2.70
-> 1.62, 32 x 400 3.58 -> 2.54 (vLLM CPU's paged kernel: 0.21, 0.76, 1.47, 2.36); one
thread's decode of a 71M Llama (``--part loops``, 16, 32, 64 prompts x 128 tokens, medians
of 3 alternated rounds): 605 -> 664, 711 -> 800, 805 -> 877 tokens/s. Writing a step's key
is then a strided write, which costs less than the reads save. A step with anything beyond
plain attention (``_NOT_PLAIN``) goes to ``sdpa_attention_forward``.

How: transformers' public ``AttentionInterface`` (and ``AttentionMaskInterface``, for
the masks ``sdpa`` gets) takes one more implementation, ``NAME``; it runs transformers'
own ``sdpa_attention_forward``, after a cast when the keys are float32 and the query is
not (a decode step of the loop's rows: ``_step``, once per run). A model whose modeling
code calls attention through that interface (``_can_set_attn_implementation``) and runs
``sdpa`` is switched to it (``enable``); any other model is left as it is. Under
``generate`` and its ``DynamicCache`` the keys have the query's dtype and no runs are
passed, so nothing changes there. The worker switches a model
only to probe the decode loop on it (``stream.choose``), and switches it back when the probe
does not match.

What it relies on in transformers, each decided by what happens, not by version or name:
``AttentionInterface``, ``AttentionMaskInterface`` with ``sdpa_mask``,
``sdpa_attention_forward``, ``_can_set_attn_implementation`` and ``set_attn_implementation``
(5.x; 4.53 has no ``set_attn_implementation`` nor ``sdpa_mask``). ``enable`` answers True
only where the switch took (the config reads ``NAME`` afterwards), anything missing is
False, and the model keeps ``sdpa``; the probe then compares the tokens with ``generate``'s.
"""

from __future__ import annotations

from typing import Any

__all__ = ["NAME", "SPANS", "cache_dtype", "disable", "empty_keys", "enable"]

#: The attention implementation's name in transformers' registries.
NAME = "codeferry_sdpa"
#: The keyword the decode loop passes its runs of rows in, ``(first row, end row, first
#: column)`` each (``cuts.spans``), through the model's ``**kwargs``: each run attends
#: apart, from the first cache column one of its rows needs.
SPANS = "codeferry_spans"


def _attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
               **kwargs: Any) -> tuple[Any, Any]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    runs = kwargs.pop(SPANS, None)
    dtype = query.dtype
    if key.dtype != dtype:
        query = query.to(key.dtype)
        if attention_mask is not None and attention_mask.is_floating_point():
            attention_mask = attention_mask.to(key.dtype)
    # runs are for a decode step of the loop's own rows; anything else attends as one
    if (not runs or query.shape[2] != 1 or runs[-1][1] != query.shape[0]
            or any(v is not None and v is not False for v in map(kwargs.get, _NOT_PLAIN))
            or kwargs.get("dropout")):
        out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        return out.to(dtype), weights
    import torch

    parts = [_step(query[a:b], key[a:b, :, c:], value[a:b, :, c:],
                   None if attention_mask is None else attention_mask[a:b, ..., c:],
                   kwargs.get("scaling")) for a, b, c in runs]
    return (torch.cat(parts) if len(parts) > 1 else parts[0]).to(dtype), None


#: What ``sdpa_attention_forward`` does beyond plain attention: a step with any of them
#: goes to it.
_NOT_PLAIN = ("position_bias", "cache", "softcap", "s_aux", "sinks", "output_attentions")


def _step(query: Any, key: Any, value: Any, mask: Any, scaling: float | None) -> Any:
    """One new token a row: ``[rows, 1, heads, dim]``, as ``sdpa_attention_forward``
    returns it. Two products over the keys as ``empty_keys`` stores them."""
    import torch

    rows, heads, _, dim = query.shape
    kv, group = key.shape[1], heads // key.shape[1]  # a key head's group of query heads
    query = query.reshape(rows, kv, group, dim) * (dim ** -0.5 if scaling is None else scaling)
    scores = torch.matmul(query, key.transpose(-1, -2))  # [rows, kv heads, group, columns]
    if mask is not None:
        if mask.shape[1] != 1:
            mask = mask.reshape(rows, kv, group, mask.shape[-1])
        if mask.dtype == torch.bool:
            scores.masked_fill_(~mask, float("-inf"))
        else:
            scores.add_(mask)
    out = torch.matmul(scores.softmax(-1), value)
    return out.reshape(rows, heads, 1, dim).transpose(1, 2)


def empty_keys(shape: tuple[int, ...], dtype: Any, device: Any, ours: bool) -> Any:
    """An uninitialised key buffer of ``shape``, ``[rows, heads, columns, dim]``; where the
    model runs ``NAME`` (``ours``), its columns innermost in memory, for ``_step``."""
    import torch

    if not ours:
        return torch.empty(shape, dtype=dtype, device=device)
    rows, heads, columns, dim = shape
    return torch.empty((rows, heads, dim, columns), dtype=dtype, device=device).transpose(2, 3)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, _attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def enable(model: Any) -> bool:
    """Switch ``model`` (float32 or half precision, ``sdpa``, attention through
    transformers' interface) to ``NAME``; whether it was switched."""
    import torch

    config = getattr(model, "config", None)
    if (getattr(model, "dtype", None) not in (torch.float32, torch.bfloat16, torch.float16)
            or getattr(config, "_attn_implementation", None) != "sdpa"):
        return False
    try:
        if not model._can_set_attn_implementation():
            return False
        _register()
        model.set_attn_implementation(NAME)
    except Exception:  # noqa: BLE001 - a transformers without the interface: leave it be
        disable(model)
        return False
    if getattr(config, "_attn_implementation", None) != NAME:
        disable(model)
        return False
    return True


def disable(model: Any) -> None:
    """Back to ``sdpa`` where ``enable`` switched ``model``."""
    if getattr(getattr(model, "config", None), "_attn_implementation", None) == NAME:
        model.set_attn_implementation("sdpa")


def cache_dtype(model: Any) -> Any:
    """The dtype the decode loop stores keys and values in: float32 when ``model`` runs
    ``NAME``, else ``None`` (the model's own)."""
    import torch

    config = getattr(model, "config", None)
    return torch.float32 if getattr(config, "_attn_implementation", None) == NAME else None
