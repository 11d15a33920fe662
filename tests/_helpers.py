"""Helpers shared by test files in several folders: plain functions and paths.

Fixtures live in ``conftest.py``; functions that run in child processes in ``_workers.py``.
This module imports nothing of codeferry, torch or transformers at module level: a test file
pays for what it calls.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pytest

#: ``tests/``: the helper modules, ``golden/``.
TESTS = Path(__file__).resolve().parent
#: The repository root.
ROOT = TESTS.parent
#: The package's source folder.
SRC = ROOT / "src" / "codeferry"

_count = itertools.count()


#: The keys of a ``codeferry run`` generate line of a plain input.
GENERATED = {"id", "output", "finish_reason", "prompt_tokens", "completion_tokens"}
#: The closing line every ``codeferry run`` writes on stderr (a regular expression).
SUMMARY = r"{written} written, {failed} failed, in \d+:\d\d; [\d.]+ (tokens|inputs)/s\n"


def summary_only(err: str, written: int | str = r"\d+", failed: int | str = r"\d+") -> bool:
    """Whether ``err`` (a run's stderr) is its closing summary line and nothing else."""
    return re.fullmatch(SUMMARY.format(written=written, failed=failed), err) is not None


def unique_name(prefix: str) -> str:
    """A model name no other model of this session has: ``prefix`` and a number."""
    return f"{prefix}{next(_count)}"


def unique_model(root: Path, prefix: str, **spec: Any) -> Path:
    """A factory model with code of its own (a name, so a digest, no other test used), written
    to ``root/<name>``; ``spec`` is passed to ``ModelSpec``."""
    from codeferry.testing import ModelSpec, write_model

    name = unique_name(prefix)
    return write_model(root / name, ModelSpec(name=name, **spec))


def travel_model(root: Path, **spec: Any) -> Path:
    """A fresh model with every part that must travel: helpers of three kinds, an asset, a
    tokenizer."""
    return unique_model(root, "t", helpers=("subpackage", "from_dot", "flat"), asset=True,
                        tokenizer=True, **spec)


def load_objects(path: Path) -> list[Any]:
    """``load`` the model, then what transformers builds of it: config, model, tokenizer, and
    the config and model classes."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    import codeferry

    classes = codeferry.load(path, trust_remote_code=True)
    config = AutoConfig.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return [config, model, tokenizer, classes["AutoConfig"], classes["AutoModelForCausalLM"]]


def checksum(snapshot: Path) -> float:
    """What ``_workers.code_and_weights`` reports of the weights in ``snapshot``."""
    from safetensors.torch import load_file

    weights = load_file(str(snapshot / "model.safetensors"))
    return float(sum(t.double().sum() for t in weights.values()))


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``codeferry <argv>`` in this process: its exit code, stdout and stderr."""
    from codeferry.cli import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


#: Appended to a model's modeling file by ``refusing_model``.
_REFUSE = """

import os as _os

_init = RefuseForCausalLM.__init__


def _refuse(self, *args, **kwargs):
    flag = {flag!r}  # in the source: a warm zygote's children have its environment, not ours
    if _os.path.exists(flag):
        with open(flag + ".tries", "a") as handle:
            handle.write(f"{{_os.getpid()}}\\n")
        if _os.path.exists(flag + ".hold"):  # a thread that is no daemon: the exit waits on it
            import threading, time
            threading.Thread(target=time.sleep, args=(3600,), daemon=False).start()
        raise MemoryError("no memory for the weights (on purpose)")
    _init(self, *args, **kwargs)


RefuseForCausalLM.__init__ = _refuse
"""


def refusing_model(root: Path) -> tuple[Path, Path]:
    """A model under ``root`` whose every start fails once the flag file (the second path)
    exists, each try's pid appended to ``FLAG.tries``; ``FLAG.hold`` also leaves a thread
    that is no daemon behind. The flag's path is in the source, not the environment: a warm
    zygote's children have the zygote's environment, and a Ray actor the cluster's."""
    from codeferry.testing import ModelSpec, write_model

    model = write_model(root / "refuse", ModelSpec(name="refuse", tokenizer=True))
    modeling = model / "modeling_refuse.py"
    flag = root / "refuse.flag"
    modeling.write_text(modeling.read_text() + _REFUSE.format(flag=str(flag)))
    return model, flag
