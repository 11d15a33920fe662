"""Fine-tune -> save -> reload: ``save_pretrained`` of codeferry-loaded objects writes their code.

The saved folder holds every file of the code (helpers, sub-packages, assets) under its
original path, byte for byte, so ``codeferry inspect`` gives the same digest and a fresh
process loads it again: with codeferry always, with plain transformers where plain
transformers could load the original.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import codeferry
from codeferry.testing import HELPER_KINDS, ModelSpec, demo_model_path, write_model


def reload_in_child(folder: str, with_codeferry: bool) -> dict[str, Any]:
    """Runs in a fresh spawned process: load the saved folder, build the model, run it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if with_codeferry:
        import codeferry

        codeferry.load(folder, trust_remote_code=True)
    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]])).logits.flatten()[:8].tolist()
    return {"config_module": type(config).__module__,
            "config_class_is_type_config": model.config_class is type(config),
            "logits": logits}


def _save_all(path: Path, out: Path) -> list[float]:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    codeferry.load(path, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    model.save_pretrained(out)
    if (path / "tokenizer_config.json").exists():
        AutoTokenizer.from_pretrained(path).save_pretrained(out)
    AutoConfig.from_pretrained(path).save_pretrained(out / "config_only")
    with torch.no_grad():
        return model(torch.tensor([[1, 2, 3]])).logits.flatten()[:8].tolist()  # type: ignore[no-any-return]


def _code_files(bundle: codeferry.Bundle) -> dict[str, str]:
    return {f.path: f.sha256 for f in bundle.files if f.repo is None}


@pytest.mark.parametrize("which", ["all_helpers", "demo"])
def test_saved_folder_has_every_code_file_and_the_same_digest(
    which: str, tmp_path: Path, spawned_child: cf.ProcessPoolExecutor
) -> None:
    if which == "demo":
        path = demo_model_path()
    else:
        path = write_model(tmp_path / "m", ModelSpec(name="savedall", helpers=HELPER_KINDS,
                                                     tokenizer=True, asset=True))
    out = tmp_path / "saved"
    expected_logits = _save_all(path, out)
    original, saved = codeferry.resolve(path), codeferry.resolve(out)
    assert saved.digest == original.digest
    assert _code_files(saved) == _code_files(original)
    for rel in _code_files(original):
        assert (out / rel).read_bytes() == (path / rel).read_bytes(), rel
    config_only = codeferry.resolve(out / "config_only")
    assert {f.path for f in config_only.files} >= {
        f.path for f in original.files if f.path.startswith("configuration_")}
    auto_map = json.loads((out / "config.json").read_text())["auto_map"]
    assert auto_map == json.loads((Path(path) / "config.json").read_text())["auto_map"]
    report = spawned_child.submit(reload_in_child, str(out), True).result(timeout=300)
    assert report["config_module"].startswith("codeferry._dyn.u")
    assert report["config_class_is_type_config"]
    assert report["logits"] == pytest.approx(expected_logits, abs=1e-6)


def test_plain_transformers_reloads_a_saved_folder(
    tmp_path: Path, spawned_child: cf.ProcessPoolExecutor
) -> None:
    # a layout plain transformers can load: then it loads the saved copy too
    path = write_model(tmp_path / "m", ModelSpec(name="savedplain", helpers=("flat", "star"),
                                                 tokenizer=True))
    out = tmp_path / "saved"
    expected_logits = _save_all(path, out)
    report = spawned_child.submit(reload_in_child, str(out), False).result(timeout=300)
    assert report["config_module"].startswith("transformers_modules.")
    assert report["logits"] == pytest.approx(expected_logits, abs=1e-6)


def test_a_cross_repo_class_keeps_its_reference(
    factory_models: dict[str, Path], factory_hub_cache: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from transformers import AutoConfig

    monkeypatch.setenv("HF_HUB_CACHE", str(factory_hub_cache))  # where org/shared-heads is
    path = factory_models["cross_repo"]
    codeferry.load(path, trust_remote_code=True)
    AutoConfig.from_pretrained(path).save_pretrained(tmp_path / "out")
    auto_map = json.loads((tmp_path / "out" / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModelForSequenceClassification"].startswith("org/shared-heads--")
    assert not (tmp_path / "out" / "modeling_heads.py").exists()
    assert os.path.exists(tmp_path / "out" / "configuration_crossy.py")


def test_a_processor_saves_its_code_too(tmp_path: Path) -> None:
    from transformers import AutoProcessor

    path = write_model(tmp_path / "m", ModelSpec(name="savedproc", processor=True))
    codeferry.load(path, trust_remote_code=True)
    out = tmp_path / "saved"
    AutoProcessor.from_pretrained(path).save_pretrained(out)
    original = codeferry.resolve(path)
    for rel in _code_files(original):
        assert (out / rel).read_bytes() == (path / rel).read_bytes(), rel
    saved_maps = {}
    for name in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        if (out / name).exists():
            saved_maps.update(json.loads((out / name).read_text()).get("auto_map", {}))
    assert "AutoProcessor" in saved_maps
