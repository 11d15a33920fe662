"""An input the model raises on gets the error alone: its batch is split until it is alone.

A model that raised on one input of a batch used to fail the whole batch: every batch-mate
got the poison's error (a ``codeferry run`` wrote an error line for each, blaming innocent
inputs). The scheduler now splits a batch whose worker replied with an error in halves,
each retried as a batch of its own, so only the poisoned input gets ``BatchFailedError``
(naming it alone), and at a cost of about one failed batch per halving.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest

import codeferry
from codeferry.errors import BatchFailedError
from codeferry.testing import ModelSpec, write_model

# Raises whenever any row of the forward's input holds the token that the file ``marked``
# holds (no file: never); each raise appends a line to its ".count" file, so the test can
# tell how many batches held the poison. The path is written into the code, not passed in
# the environment: a forkserver started earlier by another test would not see a variable.
POISONED_FORWARD = '''

import os as _os

_original_forward = {cls}.forward


def _forward(self, input_ids=None, **kwargs):
    marked = {marked!r}
    if input_ids is not None and _os.path.exists(marked):
        if int(open(marked).read()) in input_ids.flatten().tolist():
            with open(marked + ".count", "a") as count:
                count.write("raised\\n")
            raise RuntimeError("the model raised on the poisoned input")
    return _original_forward(self, input_ids=input_ids, **kwargs)


{cls}.forward = _forward
'''

INNOCENT = ["abc", "hello", "tiny model", "one more", "last", "a cat", "the dog",
            "blue sky", "red sun", "green", "white"]
POISON = 7  # of 12: the second batch of 6
MAX_RETRIES = 1


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_model(tmp_path_factory.mktemp("models") / "poisoned",
                       ModelSpec(name="poisoned", tokenizer=True))
    modeling = path / "modeling_poisoned.py"
    modeling.write_text(modeling.read_text() + POISONED_FORWARD.format(
        cls="PoisonedForCausalLM", marked=str(_marker(path))))
    return path


def _marker(model: Path) -> Path:
    return model.parent / "poison"


@pytest.fixture
def marked(model: Path) -> Iterator[Path]:
    """The file that names the poisoned token (absent: nothing raises)."""
    path = _marker(model)
    for stale in (path, Path(f"{path}.count")):
        stale.unlink(missing_ok=True)
    yield path
    for done in (path, Path(f"{path}.count")):
        done.unlink(missing_ok=True)


@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
def test_only_the_input_that_raises_gets_the_error(model: Path, marked: Path,
                                                   method: str) -> None:
    """12 inputs in batches of 6, one of them poisoned: before, its 5 batch-mates got its
    error too; now it alone does, each other input its own result."""
    with codeferry.Executor(model, workers=1, start_method=method, trust_remote_code=True,
                            batch_size=6, max_retries=MAX_RETRIES) as ex:
        clean = ex.generate(INNOCENT, max_new_tokens=3)
        # a character in no innocent prompt and in none of their outputs: the marker
        used = "".join(INNOCENT + clean)
        mark = next(c for c in "zqxjkvwy" if c not in used)
        prompts = [*INNOCENT[:POISON], mark * 3, *INNOCENT[POISON:]]
        vocab = json.loads((model / "vocab.json").read_text())
        marked.write_text(str(vocab[mark]))
        outcomes = list(ex.generate_iter(prompts, max_new_tokens=3))
        # every input exactly one outcome; the poison's error is its own alone
        assert sorted(o.index for o in outcomes) == list(range(len(prompts)))
        expected = [*clean[:POISON], None, *clean[POISON:]]
        for o in outcomes:
            if o.index == POISON:
                assert isinstance(o.error, BatchFailedError)
                assert o.error.indices == (POISON,) and o.error.inputs == (mark * 3,)
                assert "raised on the poisoned input" in str(o.error.__cause__)
            else:
                assert o.error is None and o.value == expected[o.index]
        # a batch of 6 halves down to the poison in at most ceil(log2(6)) failed batches,
        # then the poison alone is tried max_retries + 1 times, as a batch of one always was
        raised = len(Path(str(marked) + ".count").read_text().splitlines())
        assert MAX_RETRIES + 1 < raised <= math.ceil(math.log2(6)) + MAX_RETRIES + 1
        # the blocking call raises the poison's error, naming it alone
        with pytest.raises(BatchFailedError) as info:
            ex.generate(prompts, max_new_tokens=3)
        assert info.value.indices == (POISON,)
