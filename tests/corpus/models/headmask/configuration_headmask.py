# ruff: noqa
"""Configuration of the ``headmask`` corpus model: the pattern of ChatGLM2/3, MPT and Falcon RW
(a reproduction, see ../README.md)."""

from transformers import PretrainedConfig


class HeadMaskConfig(PretrainedConfig):
    model_type = "headmask"

    def __init__(self, vocab_size=100, hidden_size=32, num_layers=2, num_attention_heads=4,
                 layer_norm_epsilon=1e-5, use_cache=True, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.num_attention_heads = num_attention_heads
        self.layer_norm_epsilon = layer_norm_epsilon
        self.use_cache = use_cache
        super().__init__(**kwargs)
