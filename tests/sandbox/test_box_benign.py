"""A benign model gives the same outputs in the box as out of it: the box takes nothing
a model needs (its files, the environment's, torch's kernel facts, a scratch folder),
through the executor (spawn and warm workers) and through ``codeferry run --sandbox``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import codeferry
from codeferry.testing import demo_model_path

PROMPTS = ["hello", "the cat sat", "a longer prompt of several words", "x"]


@pytest.mark.parametrize("how", [{"start_method": "spawn"}, {"warm": True}])
def test_the_same_outputs_in_and_out_of_the_box(how: dict[str, object]) -> None:
    """Greedy outputs, token for token, and embeddings to the bit."""
    found = []
    for sandbox in (False, True):
        with codeferry.Executor(demo_model_path(), workers=1, sandbox=sandbox, trust_remote_code=True,
                                **how) as ex:  # type: ignore[arg-type]
            found.append((ex.generate(PROMPTS, max_new_tokens=6), ex.embed(PROMPTS)))
    assert found[0] == found[1]
    assert len(found[0][0]) == len(PROMPTS)


def _run(tmp_path: Path, *flags: str) -> str:
    done = subprocess.run([sys.executable, "-m", "codeferry", "run", "--workers", "1",
                           "--max-new-tokens", "4", *flags], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env={**os.environ})
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_run_sandbox_writes_what_run_writes(tmp_path: Path) -> None:
    """``codeferry run --sandbox`` on the bundled demo: the same JSONL lines as unboxed."""
    plain = _run(tmp_path)
    assert len(plain.splitlines()) == 8
    assert _run(tmp_path, "--sandbox") == plain
