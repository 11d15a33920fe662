"""The decode loop's attention on CPU: float32 for half-precision models, whole buffers.

Why float32: PyTorch's CPU kernel for ``scaled_dot_product_attention`` in bfloat16 is slow
on a decode step (one query a row): on a 71M Llama, 16 rows, one thread, it took 58% of
each step, 1.6 ms a layer, against 0.4-0.9 ms in float32 over the same keys and values
(``docs/executor.md``). Converting the keys and values at every step costs most of that
back, so the decode loop stores them in float32 (``decode._Layer``: its cache is twice the
bytes of a bfloat16 one, and ``decode.rows_for`` counts them so) and attention runs on them
in float32, the query cast up and the output cast back to the model's dtype. Keys and values
are exactly what the model computed (bfloat16 values are exact in float32); only the
attention's own sums are more precise than in bfloat16.

Why whole buffers (``CACHE``, any dtype): the loop's cache is a buffer per layer that its
keys and values fill column by column. A batched product over a slice of a buffer (the
columns written so far) takes PyTorch's per-matrix path on CPU, over a whole contiguous
buffer its batched one: one thread, 16 rows x 8 heads x 90 of 180 columns, the scores took
0.38 ms as a slice and 0.17 whole (a 2-core AMD EPYC, Zen 4). So the loop keeps each buffer
only a little longer than its columns (``decode._Layer``: it grows by a quarter, at least
``SLACK`` columns, zeroed), and a decode step attends over the whole buffer, the columns not
written yet masked. One thread's decode of 32 prompts, 128 new tokens each: 14% less time
(outputs ending at spread lengths: 10%; tokens unchanged). The buffer is taken only where
the key the model hands over is the one its cache layer returned (``_whole``); any other
step attends as transformers' SDPA would.

Which kernel and layout, timed (``decode_way``): ``_step``, two products, over keys as they
come (``last``) or stored columns innermost (``innermost``, ``empty_keys``), or torch's SDPA
over keys as they come (``sdpa``). Which is fastest depends on the CPU (on the Zen 4, 32 rows
x 128 columns: ``last``; on AVX2, strided, SDPA beat ``innermost``), so each process times the
three once for its model's shapes and keeps the fastest; ``CODEFERRY_CPU_DECODE_KEYS`` fixes
it. A step with anything beyond plain attention (``_NOT_PLAIN``) goes to SDPA whole.

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

__all__ = ["CACHE", "NAME", "SLACK", "cache_dtype", "decode_way", "disable", "empty_keys", "enable",
           "kv_shape", "layout_note"]

#: The attention implementation's name in transformers' registries.
NAME = "codeferry_sdpa"
#: The keyword the decode loop passes its cache in, through the model's ``**kwargs``: a
#: decode step reads each layer's whole buffers (``_whole``).
CACHE = "codeferry_cache"
#: The fewest columns a buffer holds beyond those written (``decode._Layer``).
SLACK = 16
#: The decode step's ways (``decode_way``): ``_step`` over keys stored columns innermost,
#: ``_step`` over keys as they come, torch's SDPA over keys as they come.
WAYS = ("innermost", "last", "sdpa")


def _attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
               **kwargs: Any) -> tuple[Any, Any]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layer = _whole(kwargs.pop(CACHE, None), module, query, key, attention_mask)
    dtype = query.dtype
    if key.dtype != dtype:
        query = query.to(key.dtype)
        if attention_mask is not None and attention_mask.is_floating_point():
            attention_mask = attention_mask.to(key.dtype)
    # whole buffers are for a decode step of the loop's own rows; anything else attends as one
    if (layer is None or any(v is not None and v is not False for v in map(kwargs.get, _NOT_PLAIN))
            or kwargs.get("dropout")):
        out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        return out.to(dtype), weights
    import torch

    keys, values = layer.kbuf, layer.vbuf
    more = keys.shape[-2] - key.shape[-2]  # columns not written yet: masked out
    if attention_mask is None:
        mask = (torch.arange(keys.shape[-2]) < key.shape[-2]).view(1, 1, 1, -1)
    else:
        fill = False if attention_mask.dtype == torch.bool else float("-inf")
        mask = torch.nn.functional.pad(attention_mask, (0, more), value=fill)
    if keys.stride(-2) != 1 and decode_way(keys.shape[1], keys.shape[-1]) == "sdpa":
        out = sdpa_attention_forward(module, query, keys, values, mask, **kwargs)[0]
    else:
        out = _step(query, keys, values, mask, kwargs.get("scaling"))
    return out.to(dtype), None


def _whole(cache: Any, module: Any, query: Any, key: Any, mask: Any) -> Any:
    """The cache layer whose whole buffers a decode step may attend over: where ``key`` is
    the very slice that layer returned, its columns from the buffers' first, every row, one
    query a row; else ``None``."""
    index = getattr(module, "layer_idx", None)
    if cache is None or not isinstance(index, int) or query.shape[2] != 1:
        return None
    layers = getattr(cache, "layers", ())
    layer: Any = layers[index] if 0 <= index < len(layers) else None
    if (layer is None or id(getattr(layer, "keys", None)) != id(key) or getattr(layer, "at", None) != (0, 0)
            or layer.kbuf.shape[0] != key.shape[0]
            or (mask is not None and mask.shape[-1] != key.shape[-2])):
        return None
    return layer


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
    """A key buffer of ``shape``, ``[rows, heads, columns, dim]``: where the model runs
    ``NAME`` (``ours``), zeroed (a step reads the columns not written yet, masked: 0 times
    leftover memory that happens to be NaN is NaN), and its columns innermost in memory
    where ``decode_way`` says so; else uninitialised."""
    import torch

    if not ours:
        return torch.empty(shape, dtype=dtype, device=device)
    if decode_way(shape[1], shape[3]) != "innermost":
        return torch.zeros(shape, dtype=dtype, device=device)
    return _innermost(shape, dtype, device).zero_()


def decode_way(heads: int, dim: int) -> str:
    """How the decode loop's steps attend over keys of ``heads`` heads of ``dim`` (``WAYS``):
    as ``CODEFERRY_CPU_DECODE_KEYS`` says, else the way that timed fastest."""
    fixed = _settings.cpu_decode_keys()
    if fixed is not None:
        return fixed
    times = timed_ways(heads, dim)
    return min(times, key=times.__getitem__)


@functools.cache
def timed_ways(heads: int, dim: int, rows: int = 32, columns: int = 128) -> dict[str, float]:
    """Milliseconds a layer of a decode step's key write and attention (``WAYS``), float32,
    in this process's threads, over whole buffers of ``rows`` (fewer for big heads) x
    ``columns``, their last 16 masked as not written yet. Layers are cycled (64 MiB, more
    than a CPU's last-level cache holds), as a step reads them from memory; the ways
    alternate for five rounds after a warm-up, medians. Once a process for each shape:
    0.2-0.5 s."""
    import torch

    rows = max(1, min(rows, (32 << 20) // (2 * 4 * heads * columns * dim)))  # a big model's
    shape = (rows, heads, columns, dim)  # layers hold 32 MiB at most: 128 MiB for the ways
    layers = max(2, -(-(64 << 20) // (2 * 4 * rows * heads * columns * dim)))
    values = [torch.full(shape, 0.01) for _ in range(layers)]
    keys = {way: [_innermost(shape).fill_(0.01) if way == "innermost" else torch.full(shape, 0.01)
                  for _ in values] for way in ("innermost", "last")}
    query, new = torch.full((rows, heads, 1, dim), 0.01), torch.full((rows, heads, 1, dim), 0.02)
    mask = (torch.arange(columns) < columns - SLACK).view(1, 1, 1, -1)

    def sweep(way: str) -> float:
        started = time.perf_counter()
        for key, value in zip(keys["innermost" if way == "innermost" else "last"], values,
                              strict=True):
            key[:, :, -SLACK - 1:-SLACK] = new  # a step's write
            if way == "sdpa":
                torch.nn.functional.scaled_dot_product_attention(query, key, value, mask)
            else:
                _step(query, key, value, mask, None)
        return (time.perf_counter() - started) * 1000 / layers

    times: dict[str, list[float]] = {way: [] for way in WAYS}
    with torch.inference_mode():
        for _ in range(6):
            for way in WAYS:
                times[way].append(sweep(way))
    return {way: statistics.median(spent[1:]) for way, spent in times.items()}


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
    """How the decode loop's steps attend over ``model``'s keys in this process, and why
    (for ``doctor``)."""
    heads, dim = kv_shape(model)
    way = decode_way(heads, dim)
    what = {"innermost": "codeferry's step over keys stored columns innermost",
            "last": "codeferry's step over keys as they come",
            "sdpa": "torch's SDPA over keys as they come"}[way]
    if _settings.cpu_decode_keys() is not None:
        return f"a step attends by {what}: CODEFERRY_CPU_DECODE_KEYS"
    times = timed_ways(heads, dim)
    return (f"a step attends by {what}, whole buffers: ms a layer timed "
            + ", ".join(f"{name} {times[name]:.2f}" for name in WAYS))


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
