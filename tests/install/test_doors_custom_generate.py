"""``generate(custom_generate="org/repo")`` of a repo no lock lists, in a process that
``codeferry.load(model, lock=...)`` binds: transformers fetches the repo's
``custom_generate/generate.py`` and executes it with the ``get_class_in_module`` that
``transformers.generation.utils`` bound by name at its import (``load()`` itself imports it),
so the gate must stand there too, not only in ``dynamic_module_utils``.

The repo lives on a local Hub (``_hub_server.FakeHub``), not in the cache, so codeferry cannot
locate it and transformers downloads it itself. Each case is a fresh interpreter (a lock
binds a process for good; ``HF_ENDPOINT`` is read when huggingface_hub is imported); the
repo's code appends to a MARK file when it runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from _doors import write_native_model
from _hub_server import FakeHub, Repo, add_commit

from codeferry import Lock, resolve
from codeferry.testing import ModelSpec, write_model

REPO = "acme/cgen"

GENERATE = """import os


def generate(model, **kwargs):
    with open(os.environ["CGEN_MARK"], "a") as out:
        out.write("ran\\n")
    return "cgen ran"
"""

#: ``load(A, lock=...)`` (or trusted, without a lock), a native model, then its
#: ``generate(custom_generate=REPO, trust_remote_code=True)``: the outcome as JSON.
_CHILD = """
import json, os, sys
import codeferry
from codeferry import errors
model, native, lock, repo = sys.argv[1:5]
if lock:
    codeferry.load(model, lock=lock)
else:
    codeferry.load(model, trust_remote_code=True)
from transformers import AutoModelForCausalLM
lm = AutoModelForCausalLM.from_pretrained(native)
try:
    out = {"value": lm.generate(custom_generate=repo, trust_remote_code=True)}
except Exception as exc:
    out = {"error": type(exc).__name__, "typed": isinstance(exc, errors.CodeferryError),
           "message": str(exc), "path": getattr(exc, "path", None),
           "door": getattr(exc, "door", None)}
out["mark"] = os.path.exists(os.environ["CGEN_MARK"])
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    root = tmp_path_factory.mktemp("cgen")
    model = write_model(root / "a", ModelSpec(name="cgenlocked"))
    lock = root / "a.lock"
    lock.write_text(Lock.from_bundle(resolve(model)).dumps(), encoding="utf-8")
    repos: dict[str, Repo] = {}
    add_commit(repos, REPO, {"custom_generate/generate.py": GENERATE.encode(),
                             "README.md": b"a custom generate recipe\n"}, "main")
    hub = FakeHub(repos)
    try:
        yield {"root": str(root), "model": str(model), "lock": str(lock), "url": hub.url,
               "native": str(write_native_model(root / "native"))}
    finally:
        hub.stop()


def _run(setup: dict[str, str], case: str, lock: str) -> dict[str, object]:
    folder = Path(setup["root"]) / case
    folder.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(HF_ENDPOINT=setup["url"], HF_HUB_CACHE=str(folder / "hub"),
               HF_MODULES_CACHE=str(folder / "modules"), CGEN_MARK=str(folder / "MARK"),
               HF_HUB_DISABLE_PROGRESS_BARS="1")
    proc = subprocess.run([sys.executable, "-c", _CHILD, setup["model"], setup["native"], lock,
                           REPO], capture_output=True, text=True, timeout=300, check=False,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return got


def test_without_a_lock_the_trusted_custom_generate_of_another_repo_runs(
        setup: dict[str, str]) -> None:
    """The repro bites: trusted, no lock, the repo's code is fetched and runs."""
    got = _run(setup, "trusted", "")
    assert got.get("value") == "cgen ran" and got["mark"], got


def test_under_load_lock_another_repos_custom_generate_is_refused(
        setup: dict[str, str]) -> None:
    """``load(A, lock=...)``: ``generate(custom_generate="org/repo", trust_remote_code=True)``
    of a repo the lock does not list raises ``UnlockedCodeError`` naming its file, and none
    of it runs."""
    got = _run(setup, "locked", setup["lock"])
    assert got.get("error") == "UnlockedCodeError" and got["typed"], got
    assert got["door"] == "custom_generate", got
    assert str(got["path"]).endswith("custom_generate/generate.py"), got
    assert "is not a file the lock lists" in str(got["message"]), got
    assert not got["mark"], got
