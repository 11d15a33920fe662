"""Remote code written for transformers 4 generates through codeferry on the installed
transformers, token for token as that code does on the release it was written for.

Each folder of ``models/`` is one family's code (see its README); the set-up copies it with a
tokenizer, makes seeded random weights for its shrunk config and saves them as safetensors.
The reference is plain transformers on the floors (4.53), or on the release a family's code
needs (``RELEASES``), run by the floors' Python in a subprocess (``CODEFERRY_FLOORS_PYTHON``,
default ``/work/floors/bin/python``); codeferry's side is the ``Executor`` with a real worker,
on this process's transformers.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import codeferry
from codeferry import Request, SamplingParams

HERE = Path(__file__).resolve().parent
MODELS = HERE / "models"
FAMILIES = sorted(p.name for p in MODELS.iterdir() if (p / "config.json").is_file())
PROMPTS = ["hello", "the cat", "abc abc", "remote code", "zz", "a longer prompt here", "42", "q"]
NEW_TOKENS = 12
FLOORS = os.environ.get("CODEFERRY_FLOORS_PYTHON", "/work/floors/bin/python")
#: Families whose code needs an older release than the floors: the reference runs the floors'
#: Python with that transformers first on its path (installed beside the floors' environment,
#: ``pip install --no-deps --target <env>/transformers-X transformers==X``; CI's set-up does).
RELEASES = {"chatglm": "4.48.3"}


def build(family: str, root: Path) -> Path:
    """The family's files, the demo model's tokenizer, and seeded weights, in ``root``."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = root / family
    shutil.copytree(MODELS / family, folder, ignore=shutil.ignore_patterns("README.md", "__pycache__"))
    demo = Path(codeferry.__file__).parent / "demo"
    for name in ("tokenization_charlm.py", "tokenizer_config.json", "vocab.json"):
        shutil.copy(demo / name, folder / name)
    codeferry.load(folder, trust_remote_code=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    generator = torch.Generator().manual_seed(1234)
    state = {}
    for name, tensor in model.state_dict().items():
        noise = torch.randn(tensor.shape, generator=generator) * 0.3
        state[name] = (noise + (1.0 if name.endswith("norm.weight") else 0.0)).contiguous()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    return request.param, build(request.param, tmp_path_factory.mktemp("corpus"))


def reference(folder: Path) -> list[list[int]]:
    """The tokens plain transformers gives on the floors (or the family's own release), in
    a fresh interpreter."""
    path = ""
    if folder.name in RELEASES:
        release = Path(FLOORS).parents[1] / f"transformers-{RELEASES[folder.name]}"
        assert (release / "transformers").is_dir(), f"install transformers into {release}"
        path = str(release)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}
    done = subprocess.run([FLOORS, str(HERE / "_reference.py"), str(folder), str(NEW_TOKENS),
                           *PROMPTS], capture_output=True, text=True, env=env, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_generates_as_on_its_own_release(family: tuple[str, Path]) -> None:
    name, folder = family
    expected = reference(folder)
    assert len(expected) == len(PROMPTS) and all(expected)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    with codeferry.Executor(folder, workers=1, trust_remote_code=True) as ex:
        results = ex.complete([Request(p) for p in PROMPTS], params)
    got = [list(r.completions[0].token_ids) for r in results]
    assert got == expected, name  # an end-of-sequence token ends both, and is in both
    assert sys.modules.get("transformers") is not None
