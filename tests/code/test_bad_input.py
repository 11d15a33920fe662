"""Bad input to ``inspect``: a typed error naming file and line, one CLI line, nothing written."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest

from codeferry import errors
from codeferry._code.resolve import resolve
from codeferry.cli import main

CONFIG = '{"model_type": "x", "auto_map": {"AutoConfig": "configuration_x.XConfig"}}'
GOOD = "from transformers import PretrainedConfig\nclass XConfig(PretrainedConfig):\n    pass\n"


def make(root: Path, files: dict[str, str | bytes]) -> Path:
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    return root


def auto_map(value: object) -> str:
    return json.dumps({"model_type": "x", "auto_map": value}, indent=2)


CASES: dict[str, tuple[dict[str, str | bytes], type[errors.CodeferryError], str, int | None]] = {
    # name: (files, error type, file the error names, line)
    "no config.json": ({"configuration_x.py": GOOD}, errors.ConfigNotFoundError, "config.json", None),
    "invalid JSON": ({"config.json": '{\n  "auto_map": {,\n}'}, errors.InvalidConfigError,
                     "config.json", 2),
    "auto_map a list": ({"config.json": auto_map(["configuration_x.XConfig"])},
                        errors.InvalidAutoMapError, "config.json", 3),
    "entry without a dot": ({"config.json": auto_map({"AutoConfig": "configuration_x"})},
                            errors.InvalidAutoMapError, "config.json", 4),
    "entry escaping with ..": ({"config.json": auto_map({"AutoConfig": "../x.XConfig"})},
                               errors.UnsafePathError, "config.json", 4),
    "absolute entry": ({"config.json": auto_map({"AutoConfig": "/tmp/x.XConfig"})},
                       errors.UnsafePathError, "config.json", 4),
    "shadows stdlib": ({"config.json": auto_map({"AutoConfig": "json.XConfig"}), "json.py": GOOD},
                       errors.ShadowingModuleError, "config.json", 4),
    "shadows transformers": ({"config.json": auto_map({"AutoConfig": "transformers.XConfig"})},
                             errors.ShadowingModuleError, "config.json", 4),
    "non-UTF-8 source": ({"config.json": CONFIG,
                          "configuration_x.py": b"# ok\nx = '\xff\xfe'\nclass XConfig: pass\n"},
                         errors.SourceDecodeError, "configuration_x.py", 2),
    "bad tokenizer_config": ({"config.json": CONFIG, "configuration_x.py": GOOD,
                              "tokenizer_config.json": '{"auto_map": {"AutoTokenizer": 5}}'},
                             errors.InvalidAutoMapError, "tokenizer_config.json", 1),
    "relative import climbing out": ({"config.json": CONFIG,
                                      "configuration_x.py": "from ..outside import X\n" + GOOD},
                                     errors.UnsafePathError, "configuration_x.py", 1),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_raises_a_typed_error_naming_file_and_line(tmp_path: Path, case: str) -> None:
    files, kind, filename, line = CASES[case]
    root = make(tmp_path / "model", files)
    with pytest.raises(kind) as info:
        resolve(root)
    err = info.value
    assert err.path is not None and err.path.endswith(filename)
    assert err.line == line
    assert err.fix, "every error says how to fix it"
    assert filename in str(err)
    # errors survive pickling with their data (they cross process boundaries)
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is kind and again.path == err.path and again.line == err.line
    assert str(again) == str(err)


@pytest.mark.parametrize("case", sorted(CASES))
def test_cli_prints_one_line_and_writes_nothing(
    tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    files, _kind, filename, _ = CASES[case]
    root = make(tmp_path / "model", files)
    graph = tmp_path / "out" / "graph.dot"
    before = sorted(p for p in tmp_path.rglob("*"))
    assert main(["inspect", str(root), "--graph", str(graph)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("codeferry: error: ") and filename in err
    assert "Traceback" not in err
    assert sorted(p for p in tmp_path.rglob("*")) == before


def test_debug_shows_the_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = make(tmp_path / "model", CASES["invalid JSON"][0])
    assert main(["inspect", str(root), "--debug"]) == 1
    assert "Traceback" in capsys.readouterr().err


def test_missing_path_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(errors.ModelNotFoundError) as info:
        resolve(tmp_path / "nope")
    assert isinstance(info.value, FileNotFoundError)
    assert main(["inspect", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_unknown_repo_id_names_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(errors.ModelNotFoundError) as info:
        resolve("org/absent")
    assert str(tmp_path / "hub") in str(info.value) and "hf download org/absent" in str(info.value)


def test_symlink_pointing_outside(tmp_path: Path) -> None:
    outside = make(tmp_path / "elsewhere", {"configuration_x.py": GOOD})
    root = make(tmp_path / "model", {"config.json": CONFIG})
    os.symlink(outside / "configuration_x.py", root / "configuration_x.py")
    with pytest.raises(errors.UnsafePathError) as info:
        resolve(root)
    assert info.value.path is not None and info.value.path.endswith("configuration_x.py")


def test_fifty_megabyte_source_is_refused_without_reading_it(tmp_path: Path) -> None:
    root = make(tmp_path / "model", {"config.json": CONFIG})
    with open(root / "configuration_x.py", "wb") as handle:
        handle.write(GOOD.encode())
        handle.truncate(50 * 1024 * 1024)
    with pytest.raises(errors.SourceTooLargeError) as info:
        resolve(root)
    assert "50.0 MiB" in str(info.value)


def test_import_cycle_is_a_blocking_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = make(tmp_path / "model", {
        "config.json": CONFIG,
        "configuration_x.py": "from .a import A\n" + GOOD,
        "a.py": "from .b import B\nA = 1\n",
        "b.py": "from .a import A\nB = 2\n",
    })
    bundle = resolve(root)
    cycles = [p for p in bundle.problems if isinstance(p, errors.ImportCycleError)]
    assert len(cycles) == 1
    assert cycles[0].cycle == ("a", "b", "a")
    assert "a.py -> b.py -> a.py" in str(cycles[0])
    with pytest.raises(errors.ImportCycleError):
        bundle.check()
    assert main(["inspect", str(root)]) == 1
    assert "a.py -> b.py -> a.py" in capsys.readouterr().out


def test_cycle_through_a_function_level_import_is_fine(tmp_path: Path) -> None:
    root = make(tmp_path / "model", {
        "config.json": CONFIG,
        "configuration_x.py": "from .a import A\n" + GOOD,
        "a.py": "A = 1\ndef f():\n    from .configuration_x import XConfig\n    return XConfig\n",
    })
    bundle = resolve(root)
    assert bundle.problems == ()
    assert bundle.load_order == ("a", "configuration_x")
