"""How a model's ``forward`` takes what the decode loop passes (``decode.py``), found by
what the model does, not by the names of its parameters.

Why: transformers renames them. 5.25's forwards take the cache as ``cache`` (and still
``past_key_values``, deprecated, with a warning); 4.53 to 5.24 as ``past_key_values``;
remote code written for 4.45 to 4.49 cuts its logits with ``num_logits_to_keep``, later
code with ``logits_to_keep``. Reading the signature for one spelling turned the loop down
on every model of a release that renamed it (a 69M Llama on 5.25: 99 tokens/s batched
against 212 in the loop). So ``calling`` runs a two-token forward per known spelling (the
spellings the signature lists first, so one forward usually suffices) and takes the first
under which the model writes into the cache it was given; a keep keyword counts only where
the logits come back one position long. ``input_ids``, ``attention_mask`` and
``position_ids`` keep their names on every release; whether a model honours them (left
padding, rows joining) is the worker's probe's to say (``stream.probe``). Before any
forward, ``supports`` says whether the loop's cache fits the model's layers at all.
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CACHE_WORDS", "KEEP_WORDS", "Calling", "calling", "supports"]

#: The keywords transformers' forwards have taken the cache in, newest first, and those
#: that cut the logits to the last positions.
CACHE_WORDS, KEEP_WORDS = ("cache", "past_key_values"), ("logits_to_keep", "num_logits_to_keep")


@dataclass(frozen=True)
class Calling:
    """How ``forward`` takes what the loop passes besides ids, mask and positions."""

    #: The keyword the cache goes in.
    cache: str
    #: ``use_cache=True``, where the forward takes it.
    options: dict[str, Any] = field(default_factory=dict)
    #: The keyword that cuts a prefill's logits to the last position, if one does.
    keep: str | None = None
    #: Whether ``forward`` passes keywords on (to attention, where ``attention.CACHE`` is read).
    passes: bool = False


_FOUND: weakref.WeakKeyDictionary[Any, Calling] = weakref.WeakKeyDictionary()


def _order(words: tuple[str, ...], listed: Any) -> list[str]:
    """``words``, those the signature lists first (it only orders the trials)."""
    return sorted(words, key=lambda word: word not in listed)


def calling(model: Any) -> Calling | str:
    """How ``model``'s forward takes the loop's cache and options, or why none worked (a
    failure is not remembered: the worker may switch attention and ask again)."""
    import torch

    if model in _FOUND:
        return _FOUND[model]
    try:
        parameters: Any = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        parameters = {}
    passes = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    device, failure = model.device, "no spelling wrote into the cache given"
    ids = torch.tensor([[1, 2]], device=device)
    for word in _order(CACHE_WORDS, parameters):
        for keep in [*_order(KEEP_WORDS, parameters), None]:
            tried = _try(model, ids, word, keep)
            if isinstance(tried, str):
                failure = tried
            elif tried is None:  # the forward ignored this cache keyword: the next one
                break
            elif tried[1]:  # the cache written, and the logits as long as asked
                _FOUND[model] = Calling(word, tried[0], keep, passes)
                return _FOUND[model]
    return f"its forward took the cache as none of {', '.join(CACHE_WORDS)} ({failure})"


def _try(model: Any, ids: Any, word: str,
         keep: str | None) -> tuple[dict[str, Any], bool] | str | None:
    """One spelling tried: the options it took and whether ``keep`` (if any) cut the logits
    to one position, ``None`` where the cache stayed empty, or the error it raised."""
    import torch
    from transformers.cache_utils import DynamicCache

    failure = ""
    for options in ({"use_cache": True}, {}):
        cache = DynamicCache(config=model.config)
        extra = {**options, word: cache, **({keep: 1} if keep else {})}
        try:
            with torch.inference_mode():
                out = model(input_ids=ids, attention_mask=torch.ones_like(ids),
                            position_ids=torch.arange(2, device=ids.device)[None], **extra)
        except Exception as exc:  # noqa: BLE001 - not this spelling; the next
            failure = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            continue
        if cache.get_seq_length() != 2:
            return None
        return options, keep is None or out.logits.shape[1] == 1
    return failure


def supports(model: Any) -> str | None:
    """``None`` when the loop's cache fits ``model`` (plain full-attention layers); otherwise
    why not. Whether the loop then drives it is ``calling``'s and the probe's to say."""
    try:
        from transformers.cache_utils import DynamicCache, DynamicLayer
    except ImportError:
        return "this transformers has no layered cache (cache_utils.DynamicLayer)"
    try:
        cache = DynamicCache(config=model.config)
    except Exception as exc:  # noqa: BLE001 - a config transformers cannot build a cache for
        return f"no cache for its config: {type(exc).__name__}: {exc}"
    if any(type(layer) is not DynamicLayer for layer in cache.layers):
        return "its cache is not plain full attention (sliding windows or states)"
    return None
