"""The paths the defaults rely on are taken on the running transformers, whatever its
forwards call their parameters (``_exec/generate/calling.py``).

CI runs this file on the dev pin and on the newest release (``.ci/run``'s "newest
transformers" stage): a release that renames what the decode loop passes (5.25: the cache
as ``cache``, not ``past_key_values``) fails here, with the probe's reason, instead of
quietly sending every CPU worker to batched ``generate``. Nothing is timed.
"""

from __future__ import annotations

from typing import Any

import pytest

from codeferry._exec.generate.calling import Calling, calling
from codeferry._exec.generate.decode import RowOptions, decode
from codeferry._exec.generate.stream import choose, probe


def tiny_llama() -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=32)).eval()


def _layered() -> bool:
    from transformers import cache_utils

    return hasattr(cache_utils, "DynamicLayer")


def test_auto_takes_the_decode_loop_on_a_llama() -> None:
    import transformers

    path, why = choose(tiny_llama(), "auto", "cpu", 0)
    if not _layered():  # a transformers whose cache has no layers: the loop says so
        assert (path, "layered cache" in why) == ("batched", True), why
        return
    assert path == "decode", f"transformers {transformers.__version__}: {why}"
    model = tiny_llama()
    assert probe(model, 0) is None, f"transformers {transformers.__version__}"


class _Renamed:
    """A forward over a Llama that takes the cache as ``word`` and the keep option as
    ``keep`` only, whatever the running transformers calls them; ``loose`` also takes (and
    drops) any other keyword, as forwards with ``**kwargs`` do."""

    def __init__(self, inner: Any, word: str, keep: str, loose: bool) -> None:
        self.inner, self.word, self.keep, self.loose = inner, word, keep, loose
        self.config, self.device = inner.config, inner.device
        self.generation_config = inner.generation_config
        found = calling(inner)
        assert isinstance(found, Calling), found
        self.found = found

    def parameters(self) -> Any:
        return self.inner.parameters()

    def __call__(self, **kwargs: Any) -> Any:
        return self.forward(**kwargs)

    def forward(self, input_ids: Any, attention_mask: Any = None, position_ids: Any = None,
                **kwargs: Any) -> Any:
        cache, keep = kwargs.pop(self.word, None), kwargs.pop(self.keep, 0)
        use = kwargs.pop("use_cache", None)
        if kwargs and not self.loose:
            raise TypeError(f"forward() got an unexpected keyword argument {next(iter(kwargs))!r}")
        passed = {self.found.cache: cache, "use_cache": use}
        if self.found.keep and keep:
            passed[self.found.keep] = keep
        return self.inner(input_ids=input_ids, attention_mask=attention_mask,
                          position_ids=position_ids, **passed)


@pytest.mark.skipif(not _layered(), reason="the decode loop needs a layered cache")
@pytest.mark.parametrize(("word", "keep", "loose"), [
    ("cache", "logits_to_keep", False), ("past_key_values", "logits_to_keep", True),
    ("past_key_values", "num_logits_to_keep", True), ("cache", "num_logits_to_keep", False)])
def test_the_loop_passes_what_the_forward_takes(word: str, keep: str, loose: bool) -> None:
    llama = tiny_llama()
    renamed = _Renamed(llama, word, keep, loose)
    found = calling(renamed)
    assert isinstance(found, Calling), found
    assert (found.cache, found.keep) == (word, keep)
    prompts = [[3, 9, 12, 5, 7], [4, 8], [11, 2, 6]]
    options = [RowOptions(n, (), n) for n in (6, 3, 5)]
    assert (decode(renamed, prompts, options, pad_token_id=0, max_rows=2)
            == decode(llama, prompts, options, pad_token_id=0, max_rows=2))


@pytest.mark.skipif(not _layered(), reason="the decode loop needs a layered cache")
def test_a_forward_that_drops_the_cache_is_turned_down() -> None:
    renamed = _Renamed(tiny_llama(), "kv", "logits_to_keep", True)
    found = calling(renamed)
    assert isinstance(found, str) and "cache, past_key_values" in found
