"""``datasets.Dataset.map(fn, num_proc=2)`` with the remote tokenizers in ``fn``, under fork,
spawn and forkserver (datasets' pool is ``multiprocess``: its start method is set with
``multiprocess.set_start_method``). One ``map`` per start method tokenizes with every
layout's tokenizer (a pool per call costs seconds under spawn). The dataset is read from
disk, so ``map`` caches its result under its fingerprint; ``argv[3] == "again"`` maps once
more (fork), in a new process, and reports the fingerprint and whether ``fn`` ran again."""

import _ctx

_ctx.codeferry_if_asked()

import os  # noqa: E402
import sys  # noqa: E402

import multiprocess  # noqa: E402
from datasets import Dataset, load_from_disk  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

TEXTS = ["hello world", "remote code", "in every process", "on every node"] * 2


def calls_in(path):
    if not os.path.exists(path):
        return 0
    with open(path) as handle:
        return len(handle.read().split())


def mapped(tokenizers, method):
    """``map`` over the dataset saved for ``method``, with every tokenizer in ``fn``."""
    folder = os.path.join(_ctx.out_dir(), f"ds-{method}")
    calls = os.path.join(_ctx.out_dir(), f"calls-{method}.txt")
    if not os.path.exists(folder):
        Dataset.from_dict({"text": TEXTS}).save_to_disk(folder)

    def fn(batch):
        with open(calls, "a") as handle:  # one line per batch that really ran
            handle.write(f"{os.getpid()}\n")
        out = {}
        for layout, tok in tokenizers.items():
            out[f"ids_{layout}"] = [tok(text)["input_ids"] for text in batch["text"]]
            out[f"class_{layout}"] = [type(tok).__module__.split(".")[0]] * len(batch["text"])
        return out

    multiprocess.set_start_method(method, force=True)
    before = calls_in(calls)
    ds = load_from_disk(folder).map(fn, batched=True, batch_size=2, num_proc=2)
    result = {"fingerprint": ds._fingerprint, "ran": calls_in(calls) - before}
    for layout, tok in tokenizers.items():
        result[layout] = {"right": ds[f"ids_{layout}"][0] == tok(TEXTS[0])["input_ids"],
                          "worker_tokenizer": sorted(set(ds[f"class_{layout}"]))}
    return result


if __name__ == "__main__":
    methods = ("fork",) if sys.argv[3] == "again" else ("fork", "spawn", "forkserver")
    report, tokenizers = {}, {}
    for layout, model in _ctx.layouts():
        try:
            tokenizers[layout] = AutoTokenizer.from_pretrained(model, trust_remote_code=True)
            report[layout] = {"tokenizer": _ctx.module_of(tokenizers[layout])}
        except Exception as exc:
            report[layout] = _ctx.error(exc)
    for method in methods:
        report[method] = _ctx.attempt(lambda: mapped(tokenizers, method))
    _ctx.report(report)
