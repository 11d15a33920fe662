"""Remote code written for transformers 4 generates through codeferry on the installed
transformers, token for token as that code does on the release it was written for.

codeferry's side is the ``Executor`` with a real worker, on this process's transformers (the
newest, the dev pin, and the floors in CI). The other side is ``golden.json``: plain
transformers' tokens on the family's own release, which CI's floors stage computes again
(``floors_reference.py``), so the file cannot drift from what that code does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _corpus import FAMILIES, NEW_TOKENS, PROMPTS, build, golden

import codeferry
from codeferry import Request, SamplingParams


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    return request.param, build(request.param, tmp_path_factory.mktemp("corpus"))


def test_every_family_has_its_reference() -> None:
    tokens = golden()
    assert sorted(tokens) == FAMILIES
    assert all(len(rows) == len(PROMPTS) and all(rows) for rows in tokens.values())


def test_generates_as_on_its_own_release(family: tuple[str, Path]) -> None:
    name, folder = family
    expected = golden()[name]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    with codeferry.Executor(folder, workers=1, trust_remote_code=True) as ex:
        results = ex.complete([Request(p) for p in PROMPTS], params)
    got = [list(r.completions[0].token_ids) for r in results]
    assert got == expected, name  # an end-of-sequence token ends both, and is in both
