"""The ``vllm.general_plugins`` entry point, without vLLM: what it does in one process.

vLLM calls ``codeferry._install.vllm:register`` in each of its processes; each case here is a
fresh spawned process that does the same, then calls transformers the way vLLM does
(``AutoConfig.from_pretrained``, ``get_class_from_dynamic_module``). The run inside real
vLLM is ``tests/test_vllm.py``.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import multiprocessing as mp
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
from _helpers import ROOT

from codeferry.testing import ModelSpec, write_model


class _Records:
    """Log records of one logger, as (level name, message)."""

    def __init__(self, name: str) -> None:
        import logging

        self.records: list[tuple[str, str]] = []
        handler = logging.Handler()
        handler.emit = lambda r: self.records.append((r.levelname, r.getMessage()))  # type: ignore[method-assign]
        logging.getLogger(name).addHandler(handler)


def _is_hooked() -> bool:
    import transformers.dynamic_module_utils as dmu

    return bool(getattr(dmu.get_class_from_dynamic_module, "__codeferry__", False))


def plugin_child(remote: str, broken: str, plain: str) -> dict[str, Any]:
    """Switch, trust, no remote code, codeferry's classes, a class that cannot load."""
    import os

    import transformers.dynamic_module_utils as dmu
    from transformers import AutoConfig

    from codeferry._install import vllm as _vllm

    out: dict[str, Any] = {}
    log = _Records("vllm.codeferry")
    os.environ["CODEFERRY_VLLM_PLUGIN"] = "0"
    _vllm.register()
    out["off_hooked"] = _is_hooked()
    del os.environ["CODEFERRY_VLLM_PLUGIN"]
    _vllm.register()
    _vllm.register()  # vLLM may call it more than once in a process
    out["on_hooked"] = _is_hooked()
    try:
        AutoConfig.from_pretrained(remote, trust_remote_code=False)
        out["untrusted"] = "loaded"
    except ValueError as exc:
        out["untrusted"] = type(exc).__name__
    out["untrusted_ran"] = [m for m in sys.modules if m.startswith("codeferry._dyn.u")]
    out["plain_config"] = type(AutoConfig.from_pretrained(plain, trust_remote_code=True)).__module__
    out["remote_config"] = type(AutoConfig.from_pretrained(remote, trust_remote_code=True)).__module__
    ref = json.loads((Path(broken) / "config.json").read_text())["auto_map"]["AutoModel"]
    errors = []
    for _ in range(2):  # vLLM asks again after a failure: said once
        try:
            dmu.get_class_from_dynamic_module(ref, broken)
        except Exception as exc:
            errors.append(type(exc).__name__)
    out["broken_errors"] = errors
    out["log"] = log.records
    return out


def locked_child(lock: str, other: str, locked_model: str) -> dict[str, Any]:
    """CODEFERRY_LOCK: a missing file, another model's code, then the locked model."""
    import os

    from transformers import AutoConfig

    from codeferry._install import vllm as _vllm
    from codeferry._trust import policy as _policy
    from codeferry.errors import LockFormatError, LockMismatchError

    out: dict[str, Any] = {}
    log = _Records("vllm.codeferry")
    os.environ["CODEFERRY_LOCK"] = lock + ".missing"
    try:
        _vllm.register()
        out["missing"] = "registered"
    except LockFormatError as exc:
        out["missing"] = f"LockFormatError {exc.path}"
    os.environ["CODEFERRY_LOCK"] = lock
    _vllm.register()
    try:
        AutoConfig.from_pretrained(other, trust_remote_code=True)
        out["other"] = "loaded"
    except LockMismatchError as exc:
        out["other"] = f"LockMismatchError {exc.path}"
    import transformers.dynamic_module_utils as dmu

    try:  # not code codeferry can check: refused, not handed to transformers
        dmu.get_class_from_dynamic_module("modeling_x.XModel", other + ".absent")
        out["unchecked"] = "loaded"
    except LockMismatchError as exc:
        out["unchecked"] = f"LockMismatchError {exc.path}"
    config = AutoConfig.from_pretrained(locked_model, trust_remote_code=True)
    out["locked_config"] = type(config).__module__
    out["locked"] = _policy._locked
    out["log"] = log.records
    return out


def fail_closed_child(lock: str, folder: str) -> dict[str, Any]:
    """CODEFERRY_LOCK with the plugin switched off, then naming a folder, then a missing file."""
    import os

    from codeferry._install import vllm as _vllm

    out: dict[str, Any] = {}
    log = _Records("vllm.codeferry")
    os.environ.update(CODEFERRY_LOCK=lock, CODEFERRY_VLLM_PLUGIN="0")
    for case, value in (("disabled", lock), ("folder", folder), ("missing", lock + ".missing")):
        os.environ["CODEFERRY_LOCK"] = value
        try:
            _vllm.register()
            out[case] = "registered"
        except Exception as exc:
            out[case] = f"{type(exc).__name__} {getattr(exc, 'path', None)}"
        out[case + "_hooked"] = _is_hooked()
        os.environ.pop("CODEFERRY_VLLM_PLUGIN", None)
    out["log"] = log.records
    return out


@pytest.fixture(scope="module")
def fresh_process() -> Any:
    """One spawned process per case: a plugin and a lock bind a process for good."""
    with cf.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"),
                                max_tasks_per_child=1) as pool:
        yield pool


def _models(tmp_path: Path) -> dict[str, Path]:
    remote = write_model(tmp_path / "remote", ModelSpec(name="vplug", helpers=("subpackage",)))
    broken = Path(shutil.copytree(remote, tmp_path / "broken"))
    helper = next(p for p in broken.rglob("*.py")
                  if p.parent != broken and p.name != "__init__.py")
    helper.write_text("import codeferry_missing_package_x\n" + helper.read_text())
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    return {"remote": remote, "broken": broken, "plain": plain, "helper": helper}


def test_the_plugin_routes_remote_code_and_says_why_a_class_cannot_load(
    tmp_path: Path, fresh_process: cf.ProcessPoolExecutor
) -> None:
    m = _models(tmp_path)
    out = fresh_process.submit(plugin_child, str(m["remote"]), str(m["broken"]),
                               str(m["plain"])).result(timeout=300)
    assert out["off_hooked"] is False and out["on_hooked"] is True
    # transformers' trust decision stands, and refused code never ran
    assert out["untrusted"] == "ValueError" and out["untrusted_ran"] == []
    assert out["plain_config"] == "transformers.models.llama.configuration_llama"
    assert out["remote_config"].startswith("codeferry._dyn.u")
    assert out["broken_errors"] == ["MissingPackageError"] * 2
    errors = [msg for level, msg in out["log"] if level == "ERROR"]
    assert len(errors) == 1, out["log"]  # once, though asked twice
    rel = m["helper"].relative_to(m["broken"]).as_posix()
    assert f"{rel}:1" in errors[0] and "pip install codeferry-missing-package-x" in errors[0]


def test_a_lock_in_the_environment_binds_the_process(
    tmp_path: Path, fresh_process: cf.ProcessPoolExecutor
) -> None:
    from codeferry import Lock, resolve

    locked = write_model(tmp_path / "locked", ModelSpec(name="vlock", helpers=("from_dot",)))
    other = write_model(tmp_path / "other", ModelSpec(name="vother"))
    lock = tmp_path / "locked.lock"
    lock.write_text(Lock.from_bundle(resolve(locked)).dumps())
    out = fresh_process.submit(locked_child, str(lock), str(other),
                               str(locked)).result(timeout=300)
    assert out["missing"] == f"LockFormatError {lock}.missing"
    assert out["other"] == f"LockMismatchError {lock}"
    assert out["unchecked"] == f"LockMismatchError {lock}"
    assert out["locked_config"].startswith("codeferry._dyn.u") and out["locked"] is True
    assert any(level == "ERROR" and str(lock) in msg for level, msg in out["log"])


def test_a_lock_that_binds_nothing_fails_closed(
    tmp_path: Path, fresh_process: cf.ProcessPoolExecutor
) -> None:
    """Switched off, or a lock that cannot be read: register() logs and raises, never
    returns as if the process were bound."""
    from codeferry import Lock, resolve

    model = write_model(tmp_path / "m", ModelSpec(name="vclosed"))
    lock = tmp_path / "m.lock"
    lock.write_text(Lock.from_bundle(resolve(model)).dumps())
    out = fresh_process.submit(fail_closed_child, str(lock), str(tmp_path)).result(timeout=300)
    assert out["disabled"] == f"PluginDisabledUnderLockError {lock}"
    assert out["folder"] == f"LockFormatError {tmp_path}"
    assert out["missing"] == f"LockFormatError {lock}.missing"
    assert not any(out[f"{case}_hooked"] for case in ("disabled", "folder", "missing"))
    errors = [msg for level, msg in out["log"] if level == "ERROR"]
    assert len(errors) == 3, out["log"]
    assert "CODEFERRY_VLLM_PLUGIN=0" in errors[0] and "cannot be read" in errors[1]


def test_the_entry_point_is_declared_for_vllm() -> None:
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in Python 3.11+")
    data = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    target = data["project"]["entry-points"]["vllm.general_plugins"]["codeferry"]
    module, _, name = target.partition(":")
    import importlib

    assert callable(getattr(importlib.import_module(module), name))
