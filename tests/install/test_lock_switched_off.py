"""A lock in the environment while a switch turns codeferry off: one rule, in every process
that would load remote code (``_settings.lock_switched_off``).

Under ``codeferry exec --lock`` a child that sets ``CODEFERRY_INSTALL=0`` but keeps
``CODEFERRY_LOCK`` loaded the model's code unlocked, silently, while the vLLM plugin refused
the same state (``CODEFERRY_VLLM_PLUGIN=0`` under a lock). Decided: a lock nothing enforces
binds nothing, so the state is refused, typed (``PluginDisabledUnderLockError``, ``switch``
naming the variable, ``path`` the lock): by the exec boot when the process imports
transformers' remote-code loader (a process that never imports it runs as before), and by the
vLLM plugin's ``register()``. ``CODEFERRY_INSTALL`` unset is not "off": it only asks for
nothing (outside vLLM a lock binds under the switch).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from _helpers import unique_model

import codeferry
from codeferry import _settings
from codeferry.errors import PluginDisabledUnderLockError

#: Run under ``codeferry exec --lock``: starts the child below with ``CHILD_ENV`` over its own
#: environment (``CODEFERRY_LOCK`` kept), and prints what the child printed and its exit code.
PARENT = textwrap.dedent("""
    import json, os, subprocess, sys
    child_env = {**os.environ, **json.loads(sys.argv[3])}
    done = subprocess.run([sys.executable, sys.argv[1], sys.argv[2]], env=child_env,
                          capture_output=True, text=True, timeout=300)
    print(json.dumps({"rc": done.returncode, "out": done.stdout.strip(), "err": done.stderr}))
""")

#: The child: plain transformers. Prints the codeferry error in the failure's chain (transformers'
#: lazy ``from transformers import AutoConfig`` wraps an import failure in its own
#: ``ModuleNotFoundError``; ours is its cause), or "loaded".
CHILD = textwrap.dedent("""
    import json, sys
    try:
        from transformers import AutoConfig
        AutoConfig.from_pretrained(sys.argv[1], trust_remote_code=True)
        print(json.dumps({"result": "loaded"}))
    except Exception as exc:
        while exc is not None and not type(exc).__module__.startswith("codeferry"):
            exc = exc.__cause__
        print(json.dumps({"result": type(exc).__name__, "switch": getattr(exc, "switch", None),
                          "path": getattr(exc, "path", None), "text": str(exc)}))
""")


def _env(tmp_path: Path) -> dict[str, str]:
    fresh = Path(tempfile.mkdtemp(prefix="caches", dir=tmp_path))
    env = {**os.environ, "HF_MODULES_CACHE": str(fresh / "modules"),
           "CODEFERRY_HOME": str(fresh / "codeferry"), "OMP_NUM_THREADS": "1"}
    for name in ("CODEFERRY_INSTALL", "CODEFERRY_LOCK", "CODEFERRY_VLLM_PLUGIN"):
        env.pop(name, None)
    return env


def _under_exec(tmp_path: Path, lock: Path, model: Path, child_env: dict[str, str],
                child: str = CHILD) -> dict[str, object]:
    parent, script = tmp_path / "parent.py", tmp_path / "child.py"
    parent.write_text(PARENT)
    script.write_text(child)
    proc = subprocess.run(
        [sys.executable, "-m", "codeferry", "exec", "--lock", str(lock), "--", sys.executable,
         str(parent), str(script), str(model), json.dumps(child_env)],
        env=_env(tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=600,
        check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return report


def _locked_model(tmp_path: Path) -> tuple[Path, Path, Path]:
    marker = tmp_path / "ran.txt"
    model = unique_model(tmp_path, "swoff", marker=str(marker))
    lock = tmp_path / "model.lock"
    lock.write_text(codeferry.Lock.from_bundle(codeferry.resolve(model)).dumps())
    return model, lock, marker


def test_a_child_switching_install_off_under_exec_lock_is_refused(tmp_path: Path) -> None:
    model, lock, marker = _locked_model(tmp_path)
    child = _under_exec(tmp_path, lock, model, {"CODEFERRY_INSTALL": "0"})
    assert child["rc"] == 0, child["err"]
    report = json.loads(str(child["out"]).splitlines()[-1])
    assert report["result"] == "PluginDisabledUnderLockError", report
    assert report["switch"] == "CODEFERRY_INSTALL" and report["path"] == str(lock)
    assert "CODEFERRY_INSTALL=0" in report["text"] and "Fix: unset CODEFERRY_INSTALL" in report["text"]
    assert not marker.exists()  # none of the model's code ran

    # a child that never imports transformers is not touched by the rule
    plain = _under_exec(tmp_path, lock, model, {"CODEFERRY_INSTALL": "0"},
                        child="import sys; print('fine', sys.argv[1] != '')\n")
    assert plain["rc"] == 0 and plain["out"] == "fine True", plain["err"]

    # the same child with the switch left on loads the locked code, checked
    kept = _under_exec(tmp_path, lock, model, {})
    assert json.loads(str(kept["out"]).splitlines()[-1]) == {"result": "loaded"}, kept["err"]
    assert marker.exists()


@pytest.mark.parametrize(
    ("env", "vllm", "expected"),
    [
        ({"CODEFERRY_INSTALL": "0"}, False, "CODEFERRY_INSTALL=0"),
        ({"CODEFERRY_INSTALL": "off"}, True, "CODEFERRY_INSTALL=off"),
        ({"CODEFERRY_VLLM_PLUGIN": "0"}, True, "CODEFERRY_VLLM_PLUGIN=0"),
        ({"CODEFERRY_VLLM_PLUGIN": "0"}, False, None),  # not vLLM's process: not its switch
        ({"CODEFERRY_INSTALL": "1"}, False, None),
        ({}, False, None),  # unset asks for nothing
        ({}, True, None),
    ],
)
def test_the_one_rule(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], vllm: bool,
                      expected: str | None) -> None:
    for name in ("CODEFERRY_INSTALL", "CODEFERRY_VLLM_PLUGIN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CODEFERRY_LOCK", "/some/model.lock")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert _settings.lock_switched_off(vllm=vllm) == expected
    monkeypatch.delenv("CODEFERRY_LOCK")
    assert _settings.lock_switched_off(vllm=vllm) is None  # no lock: nothing to refuse


def test_the_vllm_plugin_refuses_install_switched_off_under_a_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``register()`` in this process, as vLLM calls it, with ``CODEFERRY_INSTALL=0`` and a
    real lock: refused before anything is hooked (before, the plugin installed the lock and
    went on, while the exec boot ran the same state unlocked)."""
    import transformers.dynamic_module_utils as dmu

    from codeferry._install import adopt
    from codeferry._install.vllm import register

    _, lock, _ = _locked_model(tmp_path)
    monkeypatch.delenv("CODEFERRY_VLLM_PLUGIN", raising=False)
    monkeypatch.setenv("CODEFERRY_LOCK", str(lock))
    monkeypatch.setenv("CODEFERRY_INSTALL", "0")
    before = dmu.get_class_from_dynamic_module
    try:
        with caplog.at_level(logging.ERROR, logger="vllm.codeferry"), \
                pytest.raises(PluginDisabledUnderLockError) as info:
            register()
        assert dmu.get_class_from_dynamic_module is before  # nothing hooked
    finally:
        if dmu.get_class_from_dynamic_module is not before:
            adopt.uninstall()
    err = info.value
    assert err.switch == "CODEFERRY_INSTALL" and err.path == str(lock) and err.fix
    assert "CODEFERRY_INSTALL=0" in err.message
    assert any("CODEFERRY_INSTALL=0" in r.getMessage() for r in caplog.records)
