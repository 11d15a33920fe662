"""Custom pipelines (``custom_pipelines`` in config.json) under a lock: ``pipeline(task,
model=folder, trust_remote_code=True)`` runs exactly the locked bytes of the pipeline module
and its helpers, and a changed helper is refused before any of it executes. Each case runs in
a new process of its own (a lock binds a process for good), forked from a process started
with each start method, as an engine's workers are (``_forker``)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _doors import add_pipeline
from _forker import Forker

from codeferry import resolve
from codeferry._code.lockfile import Lock

MARK = "import os\nopen(os.environ['DOORS_MARK'], 'a').write(WHO + '\\n')\n"


def run_pipeline(folder: str, lock: str | None, mark: str) -> dict[str, Any]:
    """What an engine's process does: install (with the lock), then plain transformers."""
    import os

    os.environ["DOORS_MARK"] = mark
    from codeferry._code.lockfile import read_lock
    from codeferry._install.adopt import install_for_engine

    install_for_engine(read_lock(lock) if lock else None)
    from transformers import pipeline

    try:
        pipe = pipeline("tok-task", model=folder, trust_remote_code=True)
        return {"module": type(pipe).__module__, "out": pipe("hello")}
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)}


@pytest.fixture(scope="module")
def locked_pipeline(factory_models: dict[str, Path],
                    tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("pipes")
    folder = add_pipeline(Path(shutil.copytree(factory_models["tokenizer"], root / "m")))
    with (folder / "pipe_tok.py").open("a", encoding="utf-8") as f:
        f.write(MARK)
    lock = root / "m.lock"
    lock.write_text(Lock.from_bundle(resolve(folder)).dumps(), encoding="utf-8")
    return folder, lock




@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
def test_a_locked_pipeline_runs_the_locked_bytes(
        locked_pipeline: tuple[Path, Path], tmp_path: Path, method: str,
        forkers: Callable[[str], Forker]) -> None:
    folder, lock = locked_pipeline
    mark = tmp_path / "MARK"
    got = forkers(method).run(run_pipeline, str(folder), str(lock), str(mark))
    assert "error" not in got, got
    assert got["module"].startswith("codeferry._dyn.u") and got["out"] == {"who": "locked"}
    assert mark.read_text(encoding="utf-8") == "locked\n"  # executed once, from codeferry


@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
def test_a_changed_pipeline_helper_is_refused(
        locked_pipeline: tuple[Path, Path], tmp_path: Path, method: str,
        forkers: Callable[[str], Forker]) -> None:
    folder, lock = locked_pipeline
    changed = Path(shutil.copytree(folder, tmp_path / "m"))
    (changed / "pipe_helper.py").write_text("WHO = 'changed'\n", encoding="utf-8")
    mark = tmp_path / "MARK"
    got = forkers(method).run(run_pipeline, str(changed), str(lock), str(mark))
    assert got["error"] == "LockMismatchError", got
    assert "changed  pipe_helper.py" in got["message"]
    assert not mark.exists()  # nothing of the pipeline module ran


def test_without_a_lock_the_pipeline_comes_from_codeferry(
        locked_pipeline: tuple[Path, Path], tmp_path: Path,
        forkers: Callable[[str], Forker]) -> None:
    folder, _ = locked_pipeline
    mark = tmp_path / "MARK"
    got = forkers("spawn").run(run_pipeline, str(folder), None, str(mark))
    assert got["module"].startswith("codeferry._dyn.u") and got["out"] == {"who": "locked"}
