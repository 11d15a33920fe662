"""vLLM's engine in the box: a hostile remote-code model run by vLLM (its Transformers
backend builds the model's own class, whose code tries each attempt at import, in
``__init__`` and in ``forward``) is refused every attempt, each reaching the caller as a
``SandboxRefusedError`` naming what was tried; without the box the same model does all of it
(so the test bites); benign outputs are the same in and out of the box.

vLLM runs in its own environment (``CODEFERRY_VLLM_PYTHON``): one child process
(``tests/_vllm_box_child.py``) starts the engines; real vLLM, the real kernel.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))
sys.path.insert(0, str(TESTS / "sandbox"))
import _vllm_child  # noqa: E402 - stdlib only at import
from _hostile import ATTEMPTS, REFUSED, listener, make_hostile, plant_home  # noqa: E402

CHILD = TESTS / "_vllm_box_child.py"


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory,
           vllm_built: Callable[[str, dict[str, str]], Path],
           vllm_python: str) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("vllm_box")
    env = _vllm_child.child_env(work, TESTS.parent / "src")
    model = work / "hostile"
    shutil.copytree(vllm_built(vllm_python, env) / "plain", model)
    home = plant_home(work / "home")
    make_hostile(model, "modeling_xllama.py", "XLlamaModel", home)
    out, log = work / "report.json", work / "child.log"
    with listener() as port, log.open("wb") as sink:
        _vllm_child.run_in_group([vllm_python, str(CHILD), str(model), str(port), str(out)],
                                 env={**env, "HOME": str(home), "HF_TOKEN": "hf_parent_secret"},
                                 stdout=sink, timeout=900)
    assert out.exists(), log.read_text(errors="replace")[-6000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def test_every_attempt_in_vllms_forward_is_refused_and_named(report: dict[str, Any]) -> None:
    box = report["box"]
    assert box["engine"] == ["vllm"]
    for attempt in ATTEMPTS:
        operation, target = REFUSED[attempt]
        told = box["forward"][attempt]
        assert told[:2] == ["refused", operation], (attempt, told)
        assert target in told[2], (attempt, told)
    assert not box["planted"] and box["bashrc"] == "# the user's\n"


def test_attempts_in_vllms_init_and_at_import_stop_the_engine_named(
        report: dict[str, Any]) -> None:
    assert report["box"]["init"][:2] == ["refused", "connect"], report["box"]["init"]
    assert "127.0.0.1" in report["box"]["init"][2]
    assert report["box"]["import"][:2] == ["refused", "open"], report["box"]["import"]
    assert ".ssh/id_rsa" in report["box"]["import"][2]


def test_without_the_box_vllm_lets_every_attempt_through_and_outputs_are_the_same(
        report: dict[str, Any]) -> None:
    box, open_ = report["box"], report["open"]
    assert open_["forward"] == {attempt: "ok" for attempt in ATTEMPTS}
    assert open_["planted"] and "echo owned" in open_["bashrc"]
    assert box["outputs"] == open_["outputs"] == box["after"] == open_["after"]
    assert all(len(text.split()) == 8 for text in box["outputs"]), box["outputs"]
