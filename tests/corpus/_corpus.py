"""The corpus's models, built alike on every transformers release, and their reference tokens.

Each folder of ``models/`` is one family's code (see its README); ``build`` copies it with a
tokenizer (the demo model's), makes random weights for its shrunk config, each tensor seeded by
its name (so the floors and the newest release build the same weights), and saves them as
safetensors. ``reference`` runs plain transformers, no codeferry, in a fresh interpreter:
this Python, with the release a family's code needs first on its path (``RELEASES``).
``GOLDEN`` holds those tokens, written on the floors (``python floors_reference.py --write``)
and checked there by CI's floors stage.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import codeferry
from codeferry._code.resolve import resolve
from codeferry._exec.plan import release_line
from codeferry._exec.workers import release

HERE = Path(__file__).resolve().parent
MODELS = HERE / "models"
FAMILIES = sorted(p.name for p in MODELS.iterdir() if (p / "config.json").is_file())
PROMPTS = ["hello", "the cat", "abc abc", "remote code", "zz", "a longer prompt here", "42", "q"]
NEW_TOKENS = 12
GOLDEN = HERE / "golden.json"
#: Families whose code needs an older release than the floors: their reference runs with that
#: transformers first on the path, installed beside the floors' environment
#: (``pip install --no-deps --target <env>/transformers-X transformers==X``; CI's set-up does).
RELEASES = {"chatglm": "4.48.3", "chatglm6b": "4.41.2"}


def build(family: str, root: Path) -> Path:
    """The family's files, the demo model's tokenizer, and seeded weights, in ``root``."""
    import transformers
    from _weights import head, save_seeded

    folder = root / family
    shutil.copytree(MODELS / family, folder,
                    ignore=shutil.ignore_patterns("README.md", "__pycache__"))
    demo = Path(codeferry.__file__).parent / "demo"
    for name in ("tokenization_charlm.py", "tokenizer_config.json", "vocab.json"):
        if not (folder / name).exists():  # a family may bring its own tokenizer on top
            shutil.copy(demo / name, folder / name)
    line = release_line(resolve(folder))  # as the executor decides it
    if line is not None:  # the running transformers cannot import this code: its release can
        assert release.made(line), f"make the release first: codeferry release {line}"
        done = subprocess.run([sys.executable, str(HERE / "_weights.py"), str(folder),
                               str(release.folder(line))], capture_output=True, text=True,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        return folder
    codeferry.load(folder, trust_remote_code=True)
    config = transformers.AutoConfig.from_pretrained(folder)
    save_seeded(getattr(transformers, head(folder)).from_config(config), str(folder))
    return folder


def reference(folder: Path, python: str = sys.executable) -> list[list[int]]:
    """The tokens plain transformers gives (``python``'s, or the family's own release)."""
    path = ""
    if folder.name in RELEASES:
        target = Path(python).parents[1] / f"transformers-{RELEASES[folder.name]}"
        assert (target / "transformers").is_dir(), f"install transformers into {target}"
        path = str(target)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}
    done = subprocess.run([python, str(HERE / "_reference.py"), str(folder), str(NEW_TOKENS),
                           *PROMPTS], capture_output=True, text=True, env=env, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    tokens: list[list[int]] = json.loads(done.stdout.strip().splitlines()[-1])
    return tokens


def golden() -> dict[str, list[list[int]]]:
    """Each family's reference tokens, as written on its own release."""
    tokens: dict[str, list[list[int]]] = json.loads(GOLDEN.read_text())
    return tokens
