# ruff: noqa
"""Configuration of the ``hybridcache`` corpus model: the pattern of remote code built on
Gemma 2 (a reproduction, see ../README.md)."""

from transformers.configuration_utils import PretrainedConfig


class HybridCacheConfig(PretrainedConfig):
    model_type = "hybridcache"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(self, vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=256, rms_norm_eps=1e-6,
                 rope_theta=10000.0, sliding_window=4, final_logit_softcapping=30.0,
                 use_cache=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                 tie_word_embeddings=False, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.sliding_window = sliding_window
        self.final_logit_softcapping = final_logit_softcapping
        self.use_cache = use_cache
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id,
                         eos_token_id=eos_token_id, tie_word_embeddings=tie_word_embeddings,
                         **kwargs)
