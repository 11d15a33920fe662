"""``torch.utils.data.DataLoader(num_workers=2)`` under spawn and forkserver; the dataset
holds the remote tokenizers, and travels to each worker by pickle. One loader per start
method serves every layout (item ``i`` is text ``i`` through each layout's tokenizer)."""

import _ctx

_ctx.codeferry_if_asked()

import multiprocessing as mp  # noqa: E402

from torch.utils.data import DataLoader, Dataset  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

TEXTS = ["hello world", "remote code", "in every process", "on every node"]


class Texts(Dataset):
    def __init__(self, tokenizers):
        self.tokenizers = tokenizers

    def __len__(self):
        return len(TEXTS)

    def __getitem__(self, index):
        return {layout: {"ids": tok(TEXTS[index])["input_ids"],
                         "class": type(tok).__module__.split(".")[0]}
                for layout, tok in self.tokenizers.items()}


def loaded(tokenizers, method):
    loader = DataLoader(Texts(tokenizers), batch_size=None, num_workers=2,
                        multiprocessing_context=mp.get_context(method), timeout=120)
    items = list(loader)
    return {layout: {"right": [item[layout]["ids"] for item in items]
                     == [tok(text)["input_ids"] for text in TEXTS],
                     "worker_tokenizer": sorted({item[layout]["class"] for item in items})}
            for layout, tok in tokenizers.items()}


if __name__ == "__main__":
    report, tokenizers = {}, {}
    for layout, model in _ctx.layouts():
        try:
            tokenizers[layout] = AutoTokenizer.from_pretrained(model, trust_remote_code=True)
            report[layout] = {"tokenizer": _ctx.module_of(tokenizers[layout])}
        except Exception as exc:
            report[layout] = _ctx.error(exc)
    for method in ("spawn", "forkserver"):
        report[method] = _ctx.attempt(lambda: loaded(tokenizers, method))
    _ctx.report(report)
