"""Under a lock, a module of transformers' module cache runs from the bytes the gate checked,
never from a ``.pyc`` someone planted beside it.

transformers executes a module of its cache (``get_class_in_module``) with a
``SourceFileLoader``, which runs ``__pycache__/<module>.*.pyc`` instead of the source without
comparing the two when the pyc is unchecked-hash (and a timestamp pyc only by the source's
mtime and size). Whoever can write a shared module cache could run code under any lock. Each
case plants such a pyc beside the locked module and its relative import, in a process of its
own (a lock binds a process for good), forked from one started with spawn, forkserver or fork
(``_forker``), and under ``codeferry exec --lock``; plain transformers runs the pyc.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import _bytecode_child as child
import pytest
from _forker import Forker
from _helpers import SRC

import codeferry

METHODS = ["spawn", "forkserver", "fork"]
MODES = ["unchecked-hash", "timestamp"]


def _model(tmp_path: Path) -> tuple[Path, Path]:
    """A model (its folder's name unique: transformers' cache is per name) and its lock."""
    model = child.write(tmp_path / f"pyc_{uuid.uuid4().hex[:12]}")
    lock = tmp_path / "model.lock"
    lock.write_text(codeferry.Lock.from_bundle(codeferry.resolve(model)).dumps())
    return model, lock


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("method", METHODS)
def test_under_load_with_a_lock_the_locked_source_runs_never_a_planted_pyc(
    tmp_path: Path, forkers: Callable[[str], Forker], method: str, mode: str
) -> None:
    model, lock = _model(tmp_path)
    marker = tmp_path / "marker.txt"
    out = forkers(method).run(child.run, str(model), str(marker), mode, "load", str(lock))
    assert out == {"got": "source source", "ran": []}


@pytest.mark.parametrize("mode", MODES)
def test_a_forced_reload_under_a_lock_runs_the_checked_bytes_too(
    tmp_path: Path, forkers: Callable[[str], Forker], mode: str
) -> None:
    """``force_download=True`` makes transformers drop the module and execute its file again
    after the gate; under a lock the class comes from the module the gate ran instead."""
    model, lock = _model(tmp_path)
    marker = tmp_path / "marker.txt"
    out = forkers("spawn").run(child.run, str(model), str(marker), mode, "load", str(lock),
                               True)
    assert out == {"got": "source source", "ran": []}


@pytest.mark.parametrize("mode", MODES)
def test_plain_transformers_runs_the_planted_pyc(
    tmp_path: Path, forkers: Callable[[str], Forker], mode: str
) -> None:
    """What the cases above guard against: without codeferry, the pyc is what runs."""
    model, _ = _model(tmp_path)
    marker = tmp_path / "marker.txt"
    out = forkers("spawn").run(child.run, str(model), str(marker), mode)
    assert out == {"got": "pyc pyc", "ran": [f"{child.MODULE} pyc ran"]}


@pytest.mark.parametrize("mode", MODES)
def test_under_codeferry_exec_with_a_lock_the_locked_source_runs(tmp_path: Path, mode: str) -> None:
    model, lock = _model(tmp_path)
    marker = tmp_path / "marker.txt"
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"),
           "CODEFERRY_HOME": str(tmp_path / "codeferry"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(child.__file__).parent), str(SRC.parent)])}
    script = [sys.executable, child.__file__, str(model), str(marker), mode]
    proc = subprocess.run([sys.executable, "-m", "codeferry", "exec", "--lock", str(lock), "--",
                           *script], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"got": "source source", "ran": []}
    plain = subprocess.run(script, env=env, cwd=tmp_path, capture_output=True, text=True,
                           timeout=600, check=False)
    assert json.loads(plain.stdout.strip().splitlines()[-1])["got"] == "pyc pyc", plain.stderr
