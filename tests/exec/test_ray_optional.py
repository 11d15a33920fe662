"""Ray stays optional: imported only by backend="ray", and missing, it is named."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import codeferry
from codeferry.errors import ExtraMissingError
from codeferry.testing import ModelSpec, write_model


def test_without_ray_the_ray_backend_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_model(tmp_path / "m", ModelSpec(name="noray", tokenizer=True))
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(ExtraMissingError) as info:
        codeferry.Executor(path, backend="ray", trust_remote_code=True)
    assert info.value.extra == "ray" and "codeferry[ray]" in str(info.value)


def test_the_local_executor_never_imports_ray() -> None:
    code = ("import sys, codeferry, codeferry._exec.executor, codeferry._exec.scheduler, "
            "codeferry._exec.transport; assert 'ray' not in sys.modules, 'ray imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
