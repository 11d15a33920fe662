# ruff: noqa
"""Configuration of the ``stablelm`` corpus model: the pattern of StableLM-3B-4E1T and
StableLM-Zephyr's ``stablelm_epoch`` code (a reproduction, see ../README.md)."""

from transformers import PretrainedConfig
from transformers.utils import logging

logger = logging.get_logger(__name__)


class StableLMEpochConfig(PretrainedConfig):
    model_type = "stablelm_epoch"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(self, vocab_size=50_304, intermediate_size=6912, hidden_size=2560, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, hidden_act="silu", rope_pct=0.25,
                 rope_theta=10_000, max_position_embeddings=4096, initializer_range=0.02, norm_eps=1.0e-5,
                 use_cache=True, use_qkv_bias=False, bos_token_id=0, eos_token_id=2,
                 tie_word_embeddings=False, **kwargs):
        self.vocab_size = vocab_size
        self.max_position_embeddings = max_position_embeddings
        self.intermediate_size = intermediate_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.hidden_act = hidden_act
        self.rope_pct = rope_pct
        self.rope_theta = rope_theta
        self.initializer_range = initializer_range
        self.norm_eps = norm_eps
        self.use_cache = use_cache
        self.use_qkv_bias = use_qkv_bias
        self.tie_word_embeddings = tie_word_embeddings
        super().__init__(bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)
