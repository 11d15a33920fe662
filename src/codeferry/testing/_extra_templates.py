"""Source text of the optional extras of a factory model: tokenizer, processors, shared head.

The classes a :class:`~codeferry.testing.ModelSpec` adds besides the model itself
(``tokenizer``, ``processor``, ``cross_repo``), kept apart from ``_templates`` (the
configuration, modeling and helper modules every model ships) so each file stays short.
The conventions are ``_templates``': literal file text with ``$placeholders`` for
:class:`string.Template`, and only public transformers names.
"""

from __future__ import annotations

# --------------------------------------------------------------------------------------------
# Tokenizer and processors
# --------------------------------------------------------------------------------------------

TOKENIZATION = '''"""Character-level slow tokenizer of the ``$name`` test model, written by ``codeferry.testing``."""

import json
import os

from transformers import PreTrainedTokenizer

VOCAB_FILES_NAMES = {"vocab_file": "$vocab_file"}


class ${Name}Tokenizer(PreTrainedTokenizer):
    """One token per character; unknown characters map to ``<unk>``."""

    vocab_files_names = VOCAB_FILES_NAMES
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>", **kwargs):
        with open(vocab_file, encoding="utf-8") as handle:
            self.vocab = json.load(handle)
        self.ids_to_tokens = {index: token for token, index in self.vocab.items()}
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        super().__init__(unk_token=unk_token, bos_token=bos_token, eos_token=eos_token, pad_token=pad_token, **kwargs)

    @property
    def vocab_size(self):
        return len(self.vocab)

    def get_vocab(self):
        vocab = dict(self.vocab)
        vocab.update(self.added_tokens_encoder)
        return vocab

    def _tokenize(self, text, **kwargs):
        return list(text)

    def _convert_token_to_id(self, token):
        return self.vocab.get(token, self.vocab["<unk>"])

    def _convert_id_to_token(self, index):
        return self.ids_to_tokens.get(index, "<unk>")

    def convert_tokens_to_string(self, tokens):
        return "".join(tokens)

    def build_inputs_with_special_tokens(self, token_ids_0, token_ids_1=None):
        return list(token_ids_0) + list(token_ids_1 or [])

    def save_vocabulary(self, save_directory, filename_prefix=None):
        name = (filename_prefix + "-" if filename_prefix else "") + VOCAB_FILES_NAMES["vocab_file"]
        path = os.path.join(save_directory, name)
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(self.vocab, handle, ensure_ascii=False, indent=2)
            handle.write("\\n")
        return (path,)
'''

IMAGE_PROCESSING = '''"""Image processor of the ``$name`` test model: numbers in, a float tensor out."""

import numpy as np
import torch
from transformers import BatchFeature
from transformers.image_processing_utils import BaseImageProcessor


class ${Name}ImageProcessor(BaseImageProcessor):
    """Turns a list of numbers (or a small array) into ``pixel_values`` of shape (batch, n)."""

    model_input_names = ["pixel_values"]

    def __init__(self, scale=0.5, **kwargs):
        super().__init__(**kwargs)
        self.scale = scale

    def preprocess(self, images, **kwargs):
        array = np.asarray(images, dtype=np.float32) * self.scale
        if array.ndim == 1:
            array = array[None, :]
        return BatchFeature(data={"pixel_values": torch.from_numpy(array)})

    def __call__(self, images, **kwargs):
        return self.preprocess(images, **kwargs)
'''

PROCESSING = '''"""Processor of the ``$name`` test model: combines its image processor and tokenizer."""

from transformers import BatchFeature
from transformers.processing_utils import ProcessorMixin


class ${Name}Processor(ProcessorMixin):
    attributes = ["image_processor", "tokenizer"]
    image_processor_class = "AutoImageProcessor"
    tokenizer_class = "AutoTokenizer"

    def __init__(self, image_processor=None, tokenizer=None, **kwargs):
        super().__init__(image_processor, tokenizer, **kwargs)

    def __call__(self, text=None, images=None, **kwargs):
        data = {}
        if text is not None:
            data.update(self.tokenizer(text, return_tensors="pt", padding=True))
        if images is not None:
            data.update(self.image_processor(images))
        return BatchFeature(data=data)
'''

# --------------------------------------------------------------------------------------------
# The cross-repository head
# --------------------------------------------------------------------------------------------

SHARED_HEADS = '''"""A classification head shared by several repos (referenced as ``repo--modeling_heads.Class``).

Self-contained: it imports only torch and transformers, and works with any config that has
``hidden_size`` and ``vocab_size``.
"""

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import SequenceClassifierOutput


class ${Name}Config(PretrainedConfig):
    """Stand-in named like the config of the models that share this head.

    When an Auto class registers a remote model class, transformers (5.x) checks that
    ``config_class.__name__`` equals the name of the loaded config class; nothing else of it is used.
    """


class SharedHeadForSequenceClassification(PreTrainedModel):
    config_class = ${Name}Config
    base_model_prefix = "shared_head"

    def __init__(self, config):
        super().__init__(config)
        self.num_labels = config.num_labels or 2
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        hidden = self.embed(input_ids)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        weights = attention_mask.to(hidden.dtype)[..., None]
        pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1.0)
        logits = self.score(pooled)
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)
'''
