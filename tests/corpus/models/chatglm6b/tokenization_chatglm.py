# ruff: noqa
"""The ``chatglm6b`` corpus model's tokenizer: the bundled demo's characters, and what
ChatGLM-6B's own tokenizer does that its model code relies on: every prompt ends in
``[gMASK]`` and ``<sop>`` (the model finds the context's end and the mask's position by them;
a prompt without them fails in ``seq.index``). Its 4-D boolean attention mask is not
reproduced: given a tokenizer's usual 0/1 mask, the model's code drops it with a warning."""

from .tokenization_charlm import CharlmTokenizer

MASK, GMASK, SOP, EOP = "[MASK]", "[gMASK]", "<sop>", "<eop>"
SPECIAL = {MASK: 100, GMASK: 101, SOP: 102, EOP: 103}


class ChatGLMTokenizer(CharlmTokenizer):
    def _convert_token_to_id(self, token):
        return SPECIAL[token] if token in SPECIAL else super()._convert_token_to_id(token)

    def _convert_id_to_token(self, index):
        names = {v: k for k, v in SPECIAL.items()}
        return names[index] if index in names else super()._convert_id_to_token(index)

    def build_inputs_with_special_tokens(self, token_ids_0, token_ids_1=None):
        ids = list(token_ids_0) + list(token_ids_1 or [])
        return ids + [SPECIAL[GMASK], SPECIAL[SOP]]
