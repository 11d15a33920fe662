"""Per-class loading on folders with the faults real remote-code models have.

One missing package, one helper written for another transformers, one deferred helper that
cannot import: each takes down only the classes whose module-level imports reach it, as
plain transformers (class by class) would, and codeferry says why with file:line and the fix.
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib.util
import logging
import os
import pickle
import sys
from pathlib import Path

import pytest
import torch

import codeferry
from codeferry import errors
from codeferry.cli import main
from codeferry.testing import MISSING_PACKAGES, REAL_WORLD_KINDS, write_real_world_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the helper modules
import _perclass_child

MODELS = ("AutoModel", "AutoModelForCausalLM")
ALL = {"AutoConfig", *MODELS, "AutoTokenizer"}

#: kind -> (keys that load, {key: error type that keeps it out})
EXPECTED: dict[str, tuple[set[str], dict[str, type[errors.CodeferryError]]]] = {
    "tokenizer_missing_package": ({"AutoConfig", *MODELS},
                                  {"AutoTokenizer": errors.MissingPackageError}),
    "vision_missing_package": (ALL, {"AutoModelForVision2Seq": errors.MissingPackageError}),
    "deferred_helpers": (ALL, {}),
    "transformers_name_missing": (
        ALL, {"AutoModelForSequenceClassification": errors.MissingTransformersNameError}),
    "config_missing_package": ({"AutoTokenizer"}, {
        "AutoConfig": errors.MissingPackageError,
        "AutoModel": errors.ConfigUnavailableError,
        "AutoModelForCausalLM": errors.ConfigUnavailableError,
    }),
}


def test_the_missing_packages_are_really_missing() -> None:
    present = [name for name in MISSING_PACKAGES if importlib.util.find_spec(name) is not None]
    assert not present, f"the variants need these packages absent: {present}"


@pytest.fixture(scope="module")
def variants(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("real_world")
    return {kind: write_real_world_model(root / kind, kind, name=f"rw{i}")
            for i, kind in enumerate(REAL_WORLD_KINDS)}


@pytest.fixture(scope="module")
def child(spawned_child: cf.ProcessPoolExecutor) -> cf.ProcessPoolExecutor:
    """The spawned process, started before anything was loaded here."""
    spawned_child.submit(os.getpid).result(timeout=120)
    return spawned_child


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_inspect_reports_each_class(kind: str, variants: dict[str, Path]) -> None:
    bundle = codeferry.resolve(variants[kind])
    ok, bad = EXPECTED[kind]
    for ref in bundle.classes:
        problems = bundle.problems_for(ref)
        if ref.key in ok:
            assert problems == (), (ref.key, problems)
        elif ref.key in bad and bad[ref.key] is not errors.ConfigUnavailableError:
            assert problems and isinstance(problems[0], bad[ref.key]), (ref.key, problems)
            assert problems[0].path and problems[0].line and problems[0].fix
    if kind.endswith("missing_package"):
        problem = next(p for p in bundle.blocking if isinstance(p, errors.MissingPackageError))
        assert f"pip install {problem.distribution}" in (problem.fix or "")
        source = Path(problem.path or "").read_text(encoding="utf-8").splitlines()
        assert f"import {problem.package}" in source[(problem.line or 0) - 1]


def test_inspect_human_output_shows_per_class_status(
    variants: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(variants["vision_missing_package"])]) == 1
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("    Auto")}
    assert lines["AutoModelForCausalLM"].endswith("  ok")
    assert "blocked: MissingPackageError at " in lines["AutoModelForVision2Seq"]
    assert "vision_tower.py:3" in lines["AutoModelForVision2Seq"]
    assert "`pip install timm`" in out


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_load_returns_every_class_that_can_load(
    kind: str, variants: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    ok, bad = EXPECTED[kind]
    with caplog.at_level(logging.WARNING, logger="codeferry"):
        result = codeferry.load(variants[kind], trust_remote_code=True)
        assert set(result) == ok
        assert {k: type(e) for k, e in result.failed.items()} == bad
        for error in result.failed.values():
            assert error.path and error.fix
        warned = [r for r in caplog.records if "cannot load" in r.getMessage()]
        assert len(warned) == len(bad)
        codeferry.load(variants[kind], trust_remote_code=True)  # again: no second warning
        assert len([r for r in caplog.records if "cannot load" in r.getMessage()]) == len(bad)
    if "AutoConfig" in bad:
        error = result.failed["AutoModel"]
        assert "needs the model's config class" in str(error)
        assert error.config_error is result.failed["AutoConfig"]


@pytest.mark.parametrize("kind", sorted(k for k, (_, bad) in EXPECTED.items() if bad))
def test_asking_for_a_class_that_cannot_load_raises_its_error(
    kind: str, variants: dict[str, Path]
) -> None:
    ok, bad = EXPECTED[kind]
    key, kind_of_error = next(iter(bad.items()))
    with pytest.raises(kind_of_error) as info:
        codeferry.load(variants[kind], trust_remote_code=True, classes=[key])
    assert info.value.fix
    with pytest.raises(errors.CodeferryError):
        codeferry.load(variants[kind], trust_remote_code=True, strict=True)
    good = sorted(ok)[0]
    assert set(codeferry.load(variants[kind], trust_remote_code=True, classes=[good])) == {good}
    with pytest.raises(errors.MissingClassError):
        codeferry.load(variants[kind], trust_remote_code=True, classes=["AutoNope"])


def test_a_git_lfs_pointer_config_says_git_lfs_pull(
    variants: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    path = variants["lfs_config"]
    for call in (codeferry.resolve, lambda p: codeferry.load(p, trust_remote_code=True)):
        with pytest.raises(errors.LFSPointerError) as info:
            call(path)
        assert "git lfs pull" in (info.value.fix or "") and info.value.line == 1
        assert "not valid JSON" not in str(info.value)
    assert main(["inspect", str(path)]) == 1
    err = capsys.readouterr().err
    assert "Git LFS pointer" in err and "git lfs pull" in err and "Traceback" not in err


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_per_class_loading_in_a_spawned_process(
    kind: str, variants: dict[str, Path], child: cf.ProcessPoolExecutor, tmp_path: Path
) -> None:
    marker = tmp_path / "executed.log"
    report = child.submit(_perclass_child.load_and_report, str(variants[kind]),
                          str(marker)).result(timeout=300)
    ok, bad = EXPECTED[kind]
    assert set(report["loaded"]) == ok
    assert {k: v[0] for k, v in report["failed"].items()} == {k: t.__name__ for k, t in bad.items()}


def test_deferred_helpers_execute_on_first_import_from_verified_bytes(
    child: cf.ProcessPoolExecutor, tmp_path: Path
) -> None:
    # A model of its own: the child has not executed any of it yet.
    path = write_real_world_model(tmp_path / "d", "deferred_helpers", name="lazy")
    bundle = codeferry.resolve(path)
    listed = {f.path for f in bundle.files}
    assert {"lazy_ops.py", "cpp_kernels.py"} <= listed  # in the digest and in a lock
    lock = codeferry.Lock.from_bundle(bundle).dumps()
    assert " lazy_ops.py" in lock and " cpp_kernels.py" in lock
    closure = next(c for r, c in bundle.closures.items() if r.key == "AutoModel")
    assert "lazy_ops" not in closure and "cpp_kernels" not in closure
    # bitsandbytes is missing, but only inside a function: a note, not a problem
    assert bundle.blocking == ()
    marker = tmp_path / "executed.log"
    report = child.submit(_perclass_child.load_and_report, str(path),
                          str(marker)).result(timeout=300)
    assert report["marker_after_load"] is False  # not executed at load
    assert report["lazy_double"] == 42
    (executed,) = report["marker_lines"]  # executed once, on first use, inside codeferry
    assert executed.startswith("codeferry._dyn.u") and executed.endswith(".lazy_ops")
    assert report["quantize_error"] == ["ModuleNotFoundError", "bitsandbytes"]


def test_a_deferred_helper_runs_the_checked_bytes_even_if_the_folder_changes(
    variants: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    path = Path(shutil.copytree(variants["deferred_helpers"], tmp_path / "m"))
    classes = codeferry.load(path, trust_remote_code=True)
    (path / "lazy_ops.py").write_text("def double(x):\n    return 'tampered'\n")
    module = sys.modules[classes["AutoModel"].__module__]
    assert module.lazy_double(2) == 4
    assert sys.modules[module.__name__.rsplit(".", 1)[0] + ".lazy_ops"].__spec__ is not None


@pytest.mark.parametrize("kind", ["tokenizer_missing_package", "vision_missing_package",
                                  "transformers_name_missing"])
def test_what_loaded_travels_to_a_spawned_process(
    kind: str, variants: dict[str, Path], child: cf.ProcessPoolExecutor
) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    path = variants[kind]
    codeferry.load(path, trust_remote_code=True)
    config = AutoConfig.from_pretrained(path)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        expected = model(torch.tensor([[1, 2, 3]])).logits.flatten()[:8].tolist()
    report = child.submit(_perclass_child.receive, pickle.dumps([config, model])).result(timeout=300)
    assert report["config_module"].startswith("codeferry._dyn.u")
    assert report["config_class_is_type_config"] and report["same_config_class"]
    assert report["logits"] == pytest.approx(expected, abs=1e-6)


def test_a_cross_repo_class_whose_repo_is_absent_fails_alone(
    factory_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    result = codeferry.load(factory_models["cross_repo"], trust_remote_code=True)
    assert {"AutoConfig", "AutoModelForCausalLM"} <= set(result)
    error = result.failed["AutoModelForSequenceClassification"]
    assert isinstance(error, errors.MissingModuleError) and "org/shared-heads" in str(error)
