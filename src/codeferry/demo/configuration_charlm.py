"""Configuration of the ``charlm`` test model, written by ``codeferry.testing``."""

from transformers import PretrainedConfig


class CharlmConfig(PretrainedConfig):
    """Hyper-parameters of the tiny ``charlm`` causal LM."""

    model_type = "charlm"
    # transformers' generation utilities (the KV cache) look for the standard name.
    attribute_map = {"num_hidden_layers": "num_layers"}

    def __init__(
        self,
        vocab_size=100,
        hidden_size=48,
        num_layers=2,
        max_position_embeddings=256,
        initializer_range=0.02,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)
