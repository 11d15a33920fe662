"""The corpus's reference, computed again: plain transformers (no codeferry) on the release
each family's code was written for gives the tokens of ``golden.json``.

Run by CI's floors stage with the floors' Python (``pytest tests/corpus/floors_reference.py``;
not collected by the suite: on transformers 5 this code does not run without codeferry, which
is what the corpus shows). ``python floors_reference.py --write`` writes ``golden.json``.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest
from _corpus import FAMILIES, GOLDEN, build, golden, reference


@pytest.mark.parametrize("name", FAMILIES)
def test_plain_transformers_on_its_release_gives_the_golden_tokens(
        name: str, tmp_path: Path) -> None:
    assert reference(build(name, tmp_path)) == golden()[name]


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    with tempfile.TemporaryDirectory() as root:
        found = {name: reference(build(name, Path(root))) for name in FAMILIES}
    GOLDEN.write_text("{\n" + ",\n".join(f" {json.dumps(name)}: {json.dumps(rows)}"
                                        for name, rows in found.items()) + "\n}\n")
