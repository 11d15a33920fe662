"""``codeferry run`` records what produced an output, and resumes only the same producer.

The record (``<output>.codeferry.json``) names the model, its code digest, the task and the
options that shape the lines; a resume by another one is refused with
``ResumeMismatchError`` naming each difference, unless ``--force-resume``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

# Workers forked from this process start in about a second when torch and transformers are
# already imported here.
import torch  # noqa: F401
import transformers.modeling_utils  # noqa: F401
from _helpers import read_jsonl, write_jsonl

import codeferry
from codeferry import cli
from codeferry._commands.run import record_path, run
from codeferry._trust import options as _options
from codeferry.errors import CodeChangedError, ResumeMismatchError
from codeferry.testing import ModelSpec, write_model

pytestmark = pytest.mark.usefixtures("no_progress_bars")

ROWS = [{"id": f"r{i}", "prompt": f"prompt number {i}"} for i in range(8)]
FAST: dict[str, Any] = {"workers": 1, "start_method": "fork", "trust_remote_code": True}


def ids(path: Path) -> list[Any]:
    return [row["id"] for row in read_jsonl(path)]


def record(output: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(record_path(output).read_text(encoding="utf-8"))
    return data


def test_a_resume_by_another_producer_is_refused_unless_forced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = write_model(tmp_path / "rec", ModelSpec(name="rec", tokenizer=True))
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    first = codeferry.resolve(model).digest
    write_jsonl(source, ROWS[:2])
    run(model, source, output, max_new_tokens=3, **FAST)
    producer = {"model": str(model.resolve()), "digest": first, "task": "generate",
                "options": {"dtype": None, "max_new_tokens": 3}}
    assert record(output) == {"format": "codeferry-run/1", **producer, "earlier": []}
    assert all(set(json.loads(line)) == {"id", "output"}
               for line in output.read_text(encoding="utf-8").splitlines())  # lines unchanged

    # the same producer resumes exactly as before
    write_jsonl(source, ROWS[:4])
    assert run(model, source, output, max_new_tokens=3, **FAST).written == 2
    assert ids(output) == ["r0", "r1", "r2", "r3"]

    # another option, another task's option default, another code digest: refused
    write_jsonl(source, ROWS[:6])
    kept = output.read_bytes()
    with pytest.raises(ResumeMismatchError) as info:
        run(model, source, output, max_new_tokens=5, **FAST)
    assert info.value.differences == {"max_new_tokens": (3, 5)}
    with pytest.raises(ResumeMismatchError) as info:
        run(model, source, output, **FAST)  # the default is 16 tokens
    assert info.value.differences == {"max_new_tokens": (3, 16)}
    modeling = model / "modeling_rec.py"
    modeling.write_text(modeling.read_text() + "\n# a new version of the code\n")
    second = codeferry.resolve(model).digest
    with pytest.raises(ResumeMismatchError) as info:
        run(model, source, output, max_new_tokens=3, **FAST)
    assert info.value.differences == {"digest": (first, second)}
    assert first in str(info.value) and second in str(info.value)
    assert info.value.path == str(output) and "--force-resume" in str(info.value)
    argv = ["run", str(model), "--input", str(source), "-o", str(output), "--trust-remote-code",
            "--max-new-tokens", "3", "--workers", "1", "--start-method", "fork"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "digest" in err and "--force-resume" in err
    assert output.read_bytes() == kept  # nothing was written by the refused runs

    # --force-resume appends, and the record keeps what produced the earlier lines
    assert cli.main([*argv, "--force-resume"]) == 0
    assert ids(output) == [f"r{i}" for i in range(6)]
    assert record(output) == {"format": "codeferry-run/1", **producer, "digest": second,
                              "earlier": [producer]}
    capsys.readouterr()


def test_an_output_without_a_record_resumes_and_gets_one(tmp_path: Path) -> None:
    model = write_model(tmp_path / "old", ModelSpec(name="old", tokenizer=True))
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(source, ROWS[:2])
    run(model, source, output, task="embed", **FAST)
    record_path(output).unlink()  # as written before records existed
    write_jsonl(source, ROWS[:3])
    assert run(model, source, output, task="embed", **FAST).written == 1
    assert ids(output) == ["r0", "r1", "r2"]
    assert record(output)["options"] == {"dtype": None, "pooling": "mean"}
    with pytest.raises(ResumeMismatchError) as info:
        write_jsonl(source, ROWS[:4])
        run(model, source, output, task="embed", pooling="cls", **FAST)
    assert info.value.differences == {"pooling": ("mean", "cls")}


def test_a_run_whose_model_changes_after_the_check_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = write_model(tmp_path / "moving", ModelSpec(name="moving", tokenizer=True))
    source, output = write_jsonl(tmp_path / "in.jsonl", ROWS[:2]), tmp_path / "out.jsonl"
    real_resolve = _options.resolve  # run (then its Executor) resolves through ModelOptions
    checked: list[str] = []

    def resolve_then_change(*args: Any, **kwargs: Any) -> codeferry.Bundle:
        bundle = real_resolve(*args, **kwargs)  # what the record and the workers pin...
        if not checked:
            modeling = model / "modeling_moving.py"  # ...and the folder changes right after
            modeling.write_text(modeling.read_text() + "\n# changed during the run\n")
        checked.append(bundle.digest)
        return bundle

    monkeypatch.setattr(_options, "resolve", resolve_then_change)
    with pytest.raises(CodeChangedError) as info:
        run(model, source, output, **FAST)
    assert info.value.expected == checked[0] != info.value.actual
    assert not output.exists() and not record_path(output).exists()


def test_help_documents_force_resume(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    assert "--force-resume" in capsys.readouterr().out
