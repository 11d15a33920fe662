"""A Hub kernel named with a prefix before ``|`` in a native model's ``config.json``.

transformers 5 reads ``attn_implementation`` as a kernel when the whole value matches its
``is_kernel`` pattern (whose classes let ``|`` through), then fetches what follows the first
``|`` (``load_and_register_attn_kernel``), or the last (the MSA kernel's loader); 4.53 passes
the whole value's repo part to ``get_kernel``. So ``"|org/repo"`` and ``"x1|org/repo"`` are
kernels as much as ``"org/repo"``: ``inspect``/``audit`` list them and the runtime gate
refuses them like the plain spelling (``HubKernelRefusedError`` naming the config line),
before anything is fetched.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from _doors import write_native_model
from _helpers import run_cli

import codeferry
from codeferry._code.doors import find_doors, kernel_repos
from codeferry.errors import HubKernelRefusedError

KERNEL = "kernels-community/flash-evil"

#: Spellings of ``KERNEL`` transformers fetches: each reads as ``KERNEL`` at some release.
SPELLINGS = [KERNEL, f"|{KERNEL}", f"x1|{KERNEL}", f"Flash-2 |{KERNEL}", f"x|{KERNEL}@main",
             f"|{KERNEL}:flash_attn_varlen_func", f"paged|x|{KERNEL}", f"a|b|{KERNEL}"]


def _transformers_fetches(value: str, monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The repos the installed transformers' ``load_and_register_attn_kernel`` asks
    ``get_kernel`` for, given ``value`` (``get_kernel`` recorded and stopped)."""
    from transformers.integrations import hub_kernels

    asked: set[str] = set()

    def get_kernel(repo_id: str, *args: Any, **kwargs: Any) -> Any:
        asked.add(repo_id)
        raise LookupError("recorded")

    monkeypatch.setattr(hub_kernels, "get_kernel", get_kernel)
    monkeypatch.setattr(hub_kernels, "is_kernels_available", lambda: True)
    try:
        hub_kernels.load_and_register_attn_kernel(value)
    except (LookupError, ValueError):
        pass
    return asked


@pytest.mark.parametrize("value", SPELLINGS)
def test_the_static_side_reads_a_kernel_name_as_transformers_does(
        value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    fetched = _transformers_fetches(value, monkeypatch)
    doors = [d for d in find_doors(_model(value)) if d.kind == "hub-kernel"]
    assert fetched <= {r for d in doors for r in d.repos}, (value, fetched, doors)
    assert KERNEL in {r for d in doors for r in d.repos}, (value, doors)


_models: dict[str, Path] = {}


def _model(value: str) -> Path:
    if value not in _models:
        root = Path(os.environ["CODEFERRY_HOME"]).parent / "kernel-names"
        _models[value] = write_native_model(root / f"m{len(_models)}", attn_implementation=value)
    return _models[value]


@pytest.mark.parametrize("value", SPELLINGS)
def test_audit_fails_on_every_spelling(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _model(value)
    assert set(kernel_repos(folder)) >= {KERNEL}
    code, out, err = run_cli(capsys, "audit", "--json", "--fail-on", "dynamic-code", str(folder))
    assert code == 1, (value, out, err)
    assert KERNEL in out or json.dumps(value)[1:-1] in out, out


@pytest.mark.parametrize("value", SPELLINGS)
def test_from_pretrained_without_trust_is_refused_for_every_spelling(value: str) -> None:
    from transformers import AutoModelForCausalLM

    folder = _model(value)
    codeferry.install()
    try:
        with pytest.raises(HubKernelRefusedError) as info:
            AutoModelForCausalLM.from_pretrained(folder)
    finally:
        codeferry.uninstall()
    assert info.value.repo == KERNEL or KERNEL in info.value.message, info.value
    assert info.value.path == str(folder / "config.json")
    lines = (folder / "config.json").read_text(encoding="utf-8").splitlines()
    assert '"attn_implementation"' in lines[(info.value.line or 0) - 1]
