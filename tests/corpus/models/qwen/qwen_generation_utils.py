# ruff: noqa
"""Generation helpers of the ``qwen`` corpus model, as Qwen (v1)'s ``qwen_generation_utils.py``:
a logits processor that keeps stop-word sequences from being completed."""

from typing import Iterable, List

import torch
from transformers import LogitsProcessor


class StopWordsLogitsProcessor(LogitsProcessor):
    def __init__(self, stop_words_ids: Iterable[Iterable[int]], eos_token_id: int):
        self.stop_words_ids = list(filter(lambda bad: bad != [eos_token_id], stop_words_ids))
        self.eos_token_id = eos_token_id

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        stopped = self._calc_stopped_samples(input_ids)
        for i, should_stop in enumerate(stopped):
            if should_stop:
                scores[i, self.eos_token_id] = float(2**15)
        return scores

    def _calc_stopped_samples(self, prev_input_ids: Iterable[int]) -> Iterable[int]:
        stopped_samples = []
        for prev_input_ids_slice in prev_input_ids:
            match = False
            for stop_token_seq in self.stop_words_ids:
                if prev_input_ids_slice[-len(stop_token_seq):].tolist() == stop_token_seq:
                    match = True
                    break
            stopped_samples.append(match)
        return stopped_samples


def get_stop_words_ids(chat_format: str, tokenizer) -> List[List[int]]:
    return [[tokenizer.im_end_id], [tokenizer.im_start_id]] if chat_format == "chatml" else []
