"""Character-level slow tokenizer of the ``charlm`` test model, written by ``codeferry.testing``."""

import json
import os

from transformers import PreTrainedTokenizer

VOCAB_FILES_NAMES = {"vocab_file": "vocab.json"}


class CharlmTokenizer(PreTrainedTokenizer):
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
            handle.write("\n")
        return (path,)
