"""The vLLM files' shared models: written once per session (``test_vllm.py`` and
``test_vllm_run_batch.py`` share a worker: ``_SHARED_SCOPE`` in ``tests/conftest.py``)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

CHILD = Path(__file__).resolve().parents[1] / "_vllm_child.py"


@pytest.fixture(scope="session")
def vllm_built(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, dict[str, str]], Path]:
    """``vllm_built(python, env)``: the folder of ``_vllm_child.py build``'s models (the plain
    reference and the remote-code layouts, written by vLLM's own transformers), built by
    ``python`` at the first call and shared after it. Read-only: copy a model to change it."""
    built: dict[str, Path] = {}

    def build(python: str, env: dict[str, str]) -> Path:
        if python not in built:
            root = tmp_path_factory.mktemp("vllm_models") / "models"
            done = subprocess.run([python, str(CHILD), "build", str(root)], capture_output=True,
                                  text=True, timeout=600, env=env)
            assert done.returncode == 0, done.stderr[-3000:]
            built[python] = root
        return built[python]

    return build


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """``CODEFERRY_VLLM_PYTHON``: the python of the vLLM environment; without it the test
    skips, except under CI (``CI`` set), where the vLLM tests must run and it fails."""
    python = os.environ.get("CODEFERRY_VLLM_PYTHON", "").strip()
    if not python:
        reason = "no vLLM environment: set CODEFERRY_VLLM_PYTHON (README 'Inside vLLM')"
        if os.environ.get("CI"):
            pytest.fail(f"under CI the vLLM tests must run: {reason}")
        pytest.skip(reason)
    return python
