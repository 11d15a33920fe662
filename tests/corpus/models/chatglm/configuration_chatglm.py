# ruff: noqa
"""Configuration of the ``chatglm`` corpus model: the pattern of ChatGLM2/3 and CodeGeeX2
(a reproduction, see ../README.md)."""

from transformers import PretrainedConfig


class ChatGLMConfig(PretrainedConfig):
    model_type = "chatglm"

    def __init__(self, num_layers=2, padded_vocab_size=100, hidden_size=32, ffn_hidden_size=64,
                 kv_channels=8, num_attention_heads=4, seq_length=256, layernorm_epsilon=1e-5,
                 multi_query_group_num=2, **kwargs):
        self.num_layers = num_layers
        self.vocab_size = padded_vocab_size
        self.padded_vocab_size = padded_vocab_size
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.kv_channels = kv_channels
        self.num_attention_heads = num_attention_heads
        self.seq_length = seq_length
        self.layernorm_epsilon = layernorm_epsilon
        self.multi_query_group_num = multi_query_group_num
        super().__init__(**kwargs)
