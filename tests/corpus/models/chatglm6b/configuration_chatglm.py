# ruff: noqa
"""Configuration of the ``chatglm6b`` corpus model: the pattern of ChatGLM-6B (the first
ChatGLM; a reproduction, see ../README.md)."""

from transformers.configuration_utils import PretrainedConfig
from transformers.utils import logging

logger = logging.get_logger(__name__)


class ChatGLMConfig(PretrainedConfig):
    model_type = "chatglm"

    def __init__(self, vocab_size=130528, hidden_size=4096, num_layers=28, num_attention_heads=32,
                 layernorm_epsilon=1e-5, use_cache=False, bos_token_id=130004, eos_token_id=130005,
                 mask_token_id=130000, gmask_token_id=130001, pad_token_id=3, max_sequence_length=2048,
                 inner_hidden_size=16384, position_encoding_2d=True, quantization_bit=0,
                 pre_seq_len=None, prefix_projection=False, **kwargs):
        self.num_layers = num_layers
        self.vocab_size = vocab_size
        self.num_attention_heads = num_attention_heads
        self.hidden_size = hidden_size
        self.max_sequence_length = max_sequence_length
        self.layernorm_epsilon = layernorm_epsilon
        self.inner_hidden_size = inner_hidden_size
        self.use_cache = use_cache
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.mask_token_id = mask_token_id
        self.gmask_token_id = gmask_token_id
        self.position_encoding_2d = position_encoding_2d
        self.quantization_bit = quantization_bit
        self.pre_seq_len = pre_seq_len
        self.prefix_projection = prefix_projection
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id,
                         eos_token_id=eos_token_id, **kwargs)
