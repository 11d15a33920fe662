"""Two models, one ``model_type``, different code: each gets its own classes, never the other's.

transformers' registry holds one config class per ``model_type`` and prefers it over remote
code; fine-tunes share ``model_type``. After ``codeferry.load(A)``, ``from_pretrained(B)``
must build B's classes (when B's code is trusted) or refuse, typed, never answer with A's.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

import codeferry
from codeferry import errors
from codeferry.testing import ModelSpec, write_model


def twins(root: Path, name: str) -> tuple[Path, Path]:
    """Two folders with one model_type and different code (a constant tells them apart)."""
    out = []
    for flavor in ("a", "b"):
        path = write_model(root / flavor, ModelSpec(name=name))
        for module in (f"configuration_{name}.py", f"modeling_{name}.py"):
            with open(path / module, "a", encoding="utf-8") as handle:
                handle.write(f"\nFLAVOR = {flavor!r}\n")
        out.append(path)
    return out[0], out[1]


def flavor(obj: Any) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return sys.modules[cls.__module__].FLAVOR  # type: ignore[no-any-return]


def check_twins(a: str, b: str) -> dict[str, Any]:
    """Runs here and in a spawned worker: load A, then ask transformers for both."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import codeferry
    from codeferry import errors

    out: dict[str, Any] = {}
    classes = codeferry.load(a, trust_remote_code=True)
    out["a_config"] = flavor(AutoConfig.from_pretrained(a))
    try:
        AutoConfig.from_pretrained(b)
        out["b_untrusted"] = "answered"
    except errors.ModelTypeConflictError as exc:
        out["b_untrusted"] = type(exc).__name__
    config_b = AutoConfig.from_pretrained(b, trust_remote_code=True)
    model_b = AutoModelForCausalLM.from_pretrained(b, trust_remote_code=True)
    out["b_config"] = flavor(config_b)
    out["b_model"] = flavor(model_b)
    out["b_config_class_is_type_config"] = model_b.config_class is type(config_b)
    out["b_is_not_a"] = type(config_b) is not classes["AutoConfig"]
    # A is still A, after B took the model_type
    config_a = AutoConfig.from_pretrained(a)
    model_a = AutoModelForCausalLM.from_pretrained(a)
    out["a_again"] = flavor(config_a)
    out["a_model"] = flavor(model_a)
    out["a_is_loaded_class"] = type(config_a) is classes["AutoConfig"]
    return out


EXPECTED = {"a_config": "a", "b_untrusted": "ModelTypeConflictError", "b_config": "b",
            "b_model": "b", "b_config_class_is_type_config": True, "b_is_not_a": True,
            "a_again": "a", "a_model": "a", "a_is_loaded_class": True}


def test_two_models_sharing_a_model_type_in_one_process(tmp_path: Path) -> None:
    a, b = twins(tmp_path, "twina")
    assert check_twins(str(a), str(b)) == EXPECTED


def test_two_models_sharing_a_model_type_in_a_spawned_worker(tmp_path: Path) -> None:
    a, b = twins(tmp_path, "twinb")
    with cf.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        assert pool.submit(check_twins, str(a), str(b)).result(timeout=300) == EXPECTED


def test_the_conflict_error_names_both_models(tmp_path: Path) -> None:
    from transformers import AutoConfig

    a, b = twins(tmp_path, "twinc")
    codeferry.load(a, trust_remote_code=True)
    with pytest.raises(errors.ModelTypeConflictError) as info:
        AutoConfig.from_pretrained(b)
    message = str(info.value)
    assert str(a) in message and str(b) in message and "twinc" in message
    assert info.value.model_type == "twinc" and "trust_remote_code=True" in (info.value.fix or "")


def test_a_copy_with_the_same_code_shares_the_class(tmp_path: Path) -> None:
    from transformers import AutoConfig

    a, _ = twins(tmp_path, "twind")
    copy = Path(shutil.copytree(a, tmp_path / "copy"))
    classes = codeferry.load(a, trust_remote_code=True)
    assert type(AutoConfig.from_pretrained(copy)) is classes["AutoConfig"]
