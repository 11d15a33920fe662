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

Why a decode step of its own (``_step``, any dtype), and why timed: with one query a row,
torch's SDPA kernel on CPU computes each score as a dot product of ``dim`` floats (a
horizontal sum per column); with the keys stored columns innermost (``empty_keys``) the
scores are one query row times a matrix read along its rows, and the output one more
product. Which is faster depends on the CPU. One thread, 8 heads of 64, ms a layer, SDPA
over keys as they come -> ``_step`` (``benchmarks/bench_cpu_step.py --part kernels``): on
an AVX-512 Zen 5, 16 rows x 60 columns 0.43 -> 0.35, 24 x 150 1.25 -> 0.86, 64 x 100 2.70 ->
1.62, 32 x 400 3.58 -> 2.54; on an AVX2 machine, 0.78 -> 1.10, 2.53 -> 2.96, 4.85 -> 5.81,
9.01 -> 8.44. So each process times both once for its model's shapes (``keys_innermost``,
the key's write included: it is strided in that layout) and stores its keys in the faster
layout; ``CODEFERRY_CPU_DECODE_KEYS`` fixes it. A decode step attends with ``_step`` where
its keys are stored columns innermost, with SDPA where not, and with SDPA whole where it has
anything beyond plain attention (``_NOT_PLAIN``).

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

import functools
import statistics
import time
from typing import Any

from ... import _settings

__all__ = ["NAME", "SPANS", "cache_dtype", "disable", "empty_keys", "enable", "keys_innermost",
           "kv_shape", "layout_note"]

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

    parts = []
    for a, b, c in runs:
        q, k, v = query[a:b], key[a:b, :, c:], value[a:b, :, c:]
        mask = None if attention_mask is None else attention_mask[a:b, ..., c:]
        parts.append(_step(q, k, v, mask, kwargs.get("scaling")) if k.stride(-2) == 1
                     else sdpa_attention_forward(module, q, k, v, mask, **kwargs)[0])
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
    model runs ``NAME`` (``ours``) and ``keys_innermost`` says so, its columns innermost in
    memory, for ``_step``."""
    import torch

    if not ours or not keys_innermost(shape[1], shape[3]):
        return torch.empty(shape, dtype=dtype, device=device)
    return _innermost(shape, dtype, device)


def keys_innermost(heads: int, dim: int) -> bool:
    """Whether the decode loop stores keys of ``heads`` heads of ``dim`` columns innermost:
    as ``CODEFERRY_CPU_DECODE_KEYS`` says, else where ``_step`` timed faster than SDPA."""
    fixed = _settings.cpu_decode_keys()
    if fixed is not None:
        return fixed == "innermost"
    ours, sdpa = timed_layouts(heads, dim)
    return ours < sdpa


@functools.cache
def timed_layouts(heads: int, dim: int, rows: int = 32, columns: int = 128) -> tuple[float, float]:
    """Milliseconds a layer of a decode step's key write and attention, float32, in this
    process's threads: ``_step`` over keys stored columns innermost, then torch's SDPA over
    keys as they come. Layers of ``rows`` (fewer for big heads) x ``columns`` are cycled
    (64 MiB, more than a CPU's last-level cache holds), as a step reads them from memory; the two ways alternate
    for five rounds after a warm-up, medians. Once a process for each shape: 0.1-0.3 s."""
    import torch

    rows = max(1, min(rows, (32 << 20) // (2 * 4 * heads * columns * dim)))  # a big model's
    shape = (rows, heads, columns, dim)  # layers hold 32 MiB at most: 96 MiB for the two ways
    layers = max(2, -(-(64 << 20) // (2 * 4 * rows * heads * columns * dim)))
    values = [torch.full(shape, 0.01) for _ in range(layers)]
    keys = {way: [_innermost(shape) if way else torch.empty(shape) for _ in values]
            for way in (False, True)}
    query, new = torch.full((rows, heads, 1, dim), 0.01), torch.full((rows, heads, 1, dim), 0.02)
    for way in keys.values():
        for one in way:
            one.fill_(0.01)

    def sweep(innermost: bool) -> float:
        started = time.perf_counter()
        for key, value in zip(keys[innermost], values, strict=True):
            key[:, :, -1:] = new  # a step's write
            if innermost:
                _step(query, key, value, None, None)
            else:
                torch.nn.functional.scaled_dot_product_attention(query, key, value)
        return (time.perf_counter() - started) * 1000 / layers

    times: dict[bool, list[float]] = {True: [], False: []}
    with torch.inference_mode():
        for _ in range(6):
            for innermost in (True, False):
                times[innermost].append(sweep(innermost))
    return statistics.median(times[True][1:]), statistics.median(times[False][1:])


def _innermost(shape: tuple[int, ...], dtype: Any = None, device: Any = None) -> Any:
    """``torch.empty(shape)``, ``[rows, heads, columns, dim]``, its columns innermost."""
    import torch

    rows, heads, columns, dim = shape
    return torch.empty((rows, heads, dim, columns), dtype=dtype, device=device).transpose(2, 3)


def kv_shape(model: Any) -> tuple[int, int]:
    """``model``'s key heads and their size (from its text config)."""
    config = model.config.get_text_config()
    heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    return heads, dim


def layout_note(model: Any) -> str:
    """How the decode loop stores ``model``'s keys in this process, and why (for ``doctor``)."""
    heads, dim = kv_shape(model)
    where = "columns innermost (codeferry's step)" if keys_innermost(heads, dim) else (
        "as they come (torch's SDPA)")
    if _settings.cpu_decode_keys() is not None:
        return f"keys stored {where}: CODEFERRY_CPU_DECODE_KEYS"
    ours, sdpa = timed_layouts(heads, dim)
    return (f"keys stored {where}: a step's attention timed {ours:.2f} ms a layer with "
            f"codeferry's step, {sdpa:.2f} with SDPA")


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
