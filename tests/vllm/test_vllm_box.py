"""vLLM in the box: a hostile remote-code model run by vLLM (its Transformers backend builds
the model's own class, whose code tries each attempt at import, in ``__init__`` and in
``forward``) is refused every attempt, each reaching the caller as a ``SandboxRefusedError``
naming what was tried; without the box the same model does all of it (so the test bites);
benign outputs are the same in and out of the box. Both ways vLLM runs: as the executor's
engine in a boxed worker (``tests/_vllm_box_child.py``), and vLLM's own ``LLM`` in a script
under ``codeferry exec --sandbox`` (``tests/_vllm_exec_child.py``, the plugin loading the
model's code).

vLLM runs in its own environment (``CODEFERRY_VLLM_PYTHON``); real vLLM, the real kernel.
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
from _hostile import ATTEMPTS, REFUSED, listener, make_hostile, names, plant_home  # noqa: E402

CHILD = TESTS / "_vllm_box_child.py"
SCRIPT = TESTS / "_vllm_exec_child.py"


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
    env.update(HOME=str(home), HF_TOKEN="hf_parent_secret")
    with listener() as port, log.open("wb") as sink:
        _vllm_child.run_in_group([vllm_python, str(CHILD), str(model), str(port), str(out)],
                                 env=env, stdout=sink, timeout=900)
        assert out.exists(), log.read_text(errors="replace")[-6000:]
        result: dict[str, Any] = json.loads(out.read_text())
        # vLLM's own LLM in a script under `codeferry exec --sandbox`: the script's folder is
        # the current one; the model's folder is read, its control file written, as allowed
        run = work / "run"
        run.mkdir()
        shutil.copy(SCRIPT, run / SCRIPT.name)
        (model / "control").write_text("")
        with (work / "exec.log").open("wb") as sink:
            _vllm_child.run_in_group(
                [vllm_python, "-m", "codeferry", "exec", "--trust-remote-code", "--sandbox",
                 "--", vllm_python, SCRIPT.name, str(model), str(port)],
                env={**env, "CODEFERRY_SANDBOX_READ": str(model),
                     "CODEFERRY_SANDBOX_WRITE": str(model / "control")},
                stdout=sink, timeout=900, cwd=run)
    lines = (work / "exec.log").read_text(errors="replace").splitlines()
    printed = [line for line in lines if line.startswith('{"text"')]
    assert printed, "\n".join(lines[-60:])
    result["exec"] = json.loads(printed[-1])
    return result


def test_every_attempt_in_vllms_forward_is_refused_and_named(report: dict[str, Any]) -> None:
    ours, lscpu = report["cores"]
    assert [list(c) for c in ours] == lscpu  # the cores the box reads in /sys, as lscpu says
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


def test_every_attempt_in_vllms_own_processes_under_exec_is_refused_and_named(
        report: dict[str, Any]) -> None:
    """vLLM's ``LLM`` under ``codeferry exec --sandbox``: each attempt fails its request, and
    the boot tells it as ``SandboxRefusedError`` naming the operation and target."""
    found = report["exec"]
    for attempt in ATTEMPTS:
        told = found[attempt]
        assert "codeferry.errors.SandboxRefusedError: " in told, (attempt, told)
        assert names(told, attempt), (attempt, told)
    assert found["text"].split() == report["box"]["outputs"][0].split()
