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


def test_without_cloudpickle_the_ray_backend_names_the_extra_before_starting_ray(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An install of ray alone (the `ray` extra once lacked cloudpickle): said at once, not
    when the first request is pickled."""
    pytest.importorskip("ray")
    path = write_model(tmp_path / "m", ModelSpec(name="nocp", tokenizer=True))
    monkeypatch.setitem(sys.modules, "cloudpickle", None)  # `import cloudpickle` raises
    with pytest.raises(ExtraMissingError) as info:
        codeferry.Executor(path, backend="ray", trust_remote_code=True)
    assert info.value.extra == "ray" and "cloudpickle" in str(info.value)
    import ray

    assert not ray.is_initialized()


def test_the_ray_extra_lists_every_package_the_backend_imports() -> None:
    """What `pip install codeferry[ray]` brings: ray, and cloudpickle for the requests."""
    import tomllib
    from _helpers import ROOT

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert {r.split(">")[0].split("=")[0] for r in extras["ray"]} >= {"ray", "cloudpickle"}


def test_the_local_executor_never_imports_ray() -> None:
    code = ("import sys, codeferry, codeferry._exec.executor, codeferry._exec.scheduler, "
            "codeferry._exec.transport; assert 'ray' not in sys.modules, 'ray imported'")
    subprocess.run([sys.executable, "-c", code], check=True)

