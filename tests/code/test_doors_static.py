"""The doors beside ``auto_map``, statically: ``custom_pipelines`` code enters the bundle
(digest, ``inspect``, ``lock``, ``audit``), and ``inspect``/``audit`` list every Hub kernel
and ``trust_remote_code`` key of a model's JSON files with file and line. Nothing runs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _doors import add_pipeline, edit_json

from codeferry import resolve
from codeferry._code.audit.report import audit
from codeferry._code.doors import find_doors, kernel_repos
from codeferry._code.lockfile import Lock
from codeferry.errors import InvalidAutoMapError, UnsafePathError


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "codeferry", *args], capture_output=True,
                          text=True, timeout=120)


@pytest.fixture(scope="module")
def piped(factory_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("piped")
    return add_pipeline(Path(shutil.copytree(factory_models["tokenizer"], root / "m")))


def test_custom_pipeline_code_is_in_the_bundle_and_the_lock(piped: Path) -> None:
    bundle = resolve(piped)
    refs = [c for c in bundle.classes if c.declared_in == "config.json:custom_pipelines"]
    assert [(r.key, r.module, r.name) for r in refs] == [("tok-task", "pipe_tok", "TokPipeline")]
    paths = {f.path for f in bundle.files}
    assert {"pipe_tok.py", "pipe_helper.py"} <= paths
    assert bundle.closures[refs[0]] == ("pipe_helper", "pipe_tok")
    lock = Lock.from_bundle(bundle).dumps()
    assert " pipe_tok.py\n" in lock and " pipe_helper.py\n" in lock


def test_a_changed_pipeline_helper_changes_the_digest(piped: Path, tmp_path: Path) -> None:
    other = Path(shutil.copytree(piped, tmp_path / "m"))
    (other / "pipe_helper.py").write_text("WHO = 'changed'\n", encoding="utf-8")
    before, after = resolve(piped), resolve(other)
    assert before.digest != after.digest
    diff = Lock.from_bundle(before).diff(after)
    assert [e.path for e, _ in diff.changed] == ["pipe_helper.py"]


def test_inspect_and_verify_cover_the_pipeline(piped: Path, tmp_path: Path) -> None:
    shown = cli("inspect", str(piped))
    assert shown.returncode == 0, shown.stderr
    assert "config.json:custom_pipelines" in shown.stdout and "pipe_helper.py" in shown.stdout
    assert f"config.json:{_line(piped / 'config.json', 'tok-task')}: custom-pipeline" in shown.stdout
    lock = tmp_path / "m.lock"
    assert cli("lock", str(piped), "-o", str(lock)).returncode == 0
    other = Path(shutil.copytree(piped, tmp_path / "m"))
    (other / "pipe_helper.py").write_text("WHO = 'changed'\n", encoding="utf-8")
    verified = cli("verify", str(other), "--lock", str(lock))
    assert verified.returncode == 1 and "changed  pipe_helper.py" in verified.stdout


@pytest.mark.parametrize("impl", [None, 3, "no_dot", "../up.Class"])
def test_a_custom_pipeline_without_a_usable_impl_names_its_line(
        factory_models: dict[str, Path], tmp_path: Path, impl: object) -> None:
    folder = add_pipeline(Path(shutil.copytree(factory_models["default"], tmp_path / "m")),
                          impl=impl)
    with pytest.raises((InvalidAutoMapError, UnsafePathError)) as info:
        resolve(folder)
    assert info.value.path == str(folder / "config.json")
    assert info.value.line is not None and info.value.line >= _line(folder / "config.json", "tok-task")


def _line(path: Path, needle: str) -> int:
    return next(n for n, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
                if needle in text)


@pytest.fixture(scope="module")
def doored(factory_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The processor variant, with every kind of door in its JSON files."""
    folder = Path(shutil.copytree(factory_models["processor"],
                                  tmp_path_factory.mktemp("doored") / "m"))
    edit_json(folder / "config.json", attn_implementation="kernels-community/flash-evil",
              _attn_implementation_internal="evil/kern:attn", trust_remote_code=True,
              text_config={"experts_implementation": "evil/moe@v1", "model_type": "x"})
    edit_json(folder / "tokenizer_config.json", trust_remote_code=True)
    edit_json(folder / "processor_config.json",
              tokenizer={"trust_remote_code": True, "tokenizer_class": "X"})
    edit_json(folder / "generation_config.json", use_kernels=True)
    return folder


def test_find_doors_lists_each_with_file_and_line(doored: Path) -> None:
    found = {(d.file, d.key, d.kind): d.line for d in find_doors(doored)}
    config = doored / "config.json"
    assert found == {
        ("config.json", "attn_implementation", "hub-kernel"): _line(config, '"attn_implementation"'),
        ("config.json", "_attn_implementation_internal", "hub-kernel"):
            _line(config, "_attn_implementation_internal"),
        ("config.json", "trust_remote_code", "trust-in-file"): _line(config, "trust_remote_code"),
        ("config.json", "text_config.experts_implementation", "hub-kernel"):
            _line(config, "experts_implementation"),
        ("tokenizer_config.json", "trust_remote_code", "trust-in-file"):
            _line(doored / "tokenizer_config.json", "trust_remote_code"),
        ("processor_config.json", "tokenizer.trust_remote_code", "trust-in-file"):
            _line(doored / "processor_config.json", "trust_remote_code"),
        ("generation_config.json", "use_kernels", "hub-kernel"):
            _line(doored / "generation_config.json", "use_kernels"),
    }
    assert sorted(kernel_repos(doored)) == ["evil/kern", "evil/moe", "kernels-community/flash-evil"]


def test_plain_attention_names_are_no_door(factory_models: dict[str, Path], tmp_path: Path) -> None:
    folder = Path(shutil.copytree(factory_models["default"], tmp_path / "m"))
    edit_json(folder / "config.json", attn_implementation="sdpa",
              _attn_implementation_internal="flash_attention_2", use_kernels=False)
    assert find_doors(folder) == ()


def test_audit_and_inspect_list_the_doors(doored: Path) -> None:
    report = audit(doored)
    doors = {(f.path, f.line) for f in report.findings if f.category == "dynamic-code"
             and f.reason.startswith(("hub-kernel", "trust-in-file"))}
    assert {(d.file, d.line) for d in find_doors(doored)} == doors
    shown = cli("audit", str(doored), "--fail-on", "dynamic-code")
    assert shown.returncode == 1
    assert f"config.json:{_line(doored / 'config.json', 'trust_remote_code')}:1: trust_remote_code" in shown.stdout
    data = json.loads(cli("inspect", str(doored), "--json").stdout)
    assert {(d["path"], d["door"]) for d in data["doors"]} == {
        (d.file, d.kind) for d in find_doors(doored)}


def test_processor_auto_maps_per_backend_enter_the_bundle(
        factory_models: dict[str, Path], tmp_path: Path) -> None:
    """transformers 5 reads an image or video processor's ``auto_map`` entry as a mapping
    per backend (``{"pil": ..., "torchvision": ...}``): each module is the model's code."""
    folder = Path(shutil.copytree(factory_models["processor"], tmp_path / "m"))
    (folder / "image_processing_fast_proc.py").write_text(
        "from .image_processing_proc import ProcImageProcessor\n\n\n"
        "class ProcImageProcessorFast(ProcImageProcessor):\n    pass\n", encoding="utf-8")
    (folder / "video_processing_proc.py").write_text(
        "from .image_processing_proc import ProcImageProcessor\n\n\n"
        "class ProcVideoProcessor(ProcImageProcessor):\n    pass\n", encoding="utf-8")
    edit_json(folder / "preprocessor_config.json", auto_map={
        "AutoImageProcessor": {"pil": "image_processing_proc.ProcImageProcessor",
                               "torchvision": "image_processing_fast_proc.ProcImageProcessorFast"},
        "AutoProcessor": "processing_proc.ProcProcessor"})
    edit_json(folder / "video_preprocessor_config.json", auto_map={
        "AutoVideoProcessor": {"torchvision": "video_processing_proc.ProcVideoProcessor"}})
    bundle = resolve(folder)
    refs = {(c.declared_in, c.key, c.slot, c.module) for c in bundle.classes}
    assert {("preprocessor_config.json", "AutoImageProcessor", 0, "image_processing_proc"),
            ("preprocessor_config.json", "AutoImageProcessor", 1, "image_processing_fast_proc"),
            ("video_preprocessor_config.json", "AutoVideoProcessor", 0,
             "video_processing_proc")} <= refs
    assert {"image_processing_fast_proc.py", "video_processing_proc.py"} <= {
        f.path for f in bundle.files}
    assert not bundle.blocking


@pytest.mark.parametrize("filename", ["audio_tokenizer_config.json", "processor_config.json"])
def test_an_audio_tokenizer_path_is_a_nested_load(
        factory_models: dict[str, Path], tmp_path: Path, filename: str) -> None:
    """A processor loads another model from the path its audio tokenizer entry names."""
    folder = Path(shutil.copytree(factory_models["processor"], tmp_path / "m"))
    entry = {"audio_tokenizer_class": "XAudio", "audio_tokenizer_name_or_path": "org/codec"}
    if filename == "processor_config.json":
        edit_json(folder / filename, audio_tokenizer=entry)
        key = "audio_tokenizer.audio_tokenizer_name_or_path"
    else:
        edit_json(folder / filename, **entry)
        key = "audio_tokenizer_name_or_path"
    found = [d for d in find_doors(folder) if d.kind == "nested-load"]
    assert [(d.file, d.key, d.value) for d in found] == [(filename, key, '"org/codec"')]
    assert found[0].line == _line(folder / filename, "audio_tokenizer_name_or_path")
