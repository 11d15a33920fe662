"""``codeferry run`` records what produced an output, and resumes only the same producer.

The record (``<output>.codeferry.json``) names the model, its code digest, the task and the
options that shape the lines, and a digest of each input's request; a resume by another
producer is refused with ``ResumeMismatchError`` naming each difference, one whose input
changed under ids already answered with ``InputChangedError``, one that cannot be checked
(no record beside the output) with ``ResumeUncheckedError``, unless ``--force-resume``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

# Workers forked from this process start in about a second when torch and transformers are
# already imported here.
import torch  # noqa: F401
import transformers.modeling_utils  # noqa: F401
from _helpers import GENERATED, read_jsonl, write_jsonl

import codeferry
from codeferry import cli, errors
from codeferry._commands.inputs import read_inputs
from codeferry._commands.record import check_record, producer, write_record
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


def digests(rows: list[dict[str, Any]]) -> dict[str, str]:
    """The record's ``inputs``: each id (as JSON) -> the start of its prompt's sha256."""
    return {json.dumps(row["id"]): hashlib.sha256(row["prompt"].encode()).hexdigest()[:16]
            for row in rows}


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
    summary = record(output).pop("summary")
    assert summary["written"] == 2 and summary["completion_tokens"] == 6
    assert {k: v for k, v in record(output).items() if k != "summary"} == {
        "format": "codeferry-run/2", **producer, "earlier": [], "inputs": digests(ROWS[:2])}
    assert all(set(json.loads(line)) == GENERATED
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
    capsys.readouterr()  # the earlier runs' summaries
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "digest" in err and "--force-resume" in err
    assert output.read_bytes() == kept  # nothing was written by the refused runs

    # --force-resume appends, and the record keeps what produced the earlier lines
    assert cli.main([*argv, "--force-resume"]) == 0
    assert ids(output) == [f"r{i}" for i in range(6)]
    assert {k: v for k, v in record(output).items() if k != "summary"} == {
        "format": "codeferry-run/2", **producer, "digest": second,
                              "earlier": [producer], "inputs": digests(ROWS[:6])}
    capsys.readouterr()


def test_the_engine_is_recorded_and_a_resume_by_another_engine_is_refused(
    tmp_path: Path,
) -> None:
    """An output a vLLM engine wrote names it in its record; transformers (every record
    before engines) names none. Under ``auto`` the engine is known only once the workers
    start (``pending``): until then the recorded one stands, then it is checked."""
    model = write_model(tmp_path / "eng", ModelSpec(name="eng", tokenizer=True))
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(source, ROWS[:4])
    run(model, source, output, max_new_tokens=3, **FAST)  # no vLLM here: transformers
    assert "engine" not in record(output)["options"]
    items = read_inputs(source, "generate")
    written = {row["id"] for row in read_jsonl(output)}
    bundle = codeferry.resolve(model)

    def made(engine: str | None) -> dict[str, Any]:
        return producer(bundle, str(model.resolve()), "generate", 3, None, None, engine=engine)

    assert "engine" not in made("transformers")["options"]
    assert check_record(output, made("transformers"), items, written, False) is None
    with pytest.raises(ResumeMismatchError) as info:
        check_record(output, made("vllm"), items, written, False)
    assert info.value.differences == {"engine": ("transformers", "vllm")}
    # auto before its workers start: nothing to refuse yet, nothing rewritten
    assert check_record(output, made(None), items, written, False, pending=("engine",)) is None

    # lines a vLLM engine wrote: resumed by vLLM, refused to transformers, the other way too
    write_record(output, {**record(output), **made("vllm")})
    assert check_record(output, made("vllm"), items, written, False) is None
    assert check_record(output, made(None), items, written, False, pending=("engine",)) is None
    with pytest.raises(ResumeMismatchError) as info:
        check_record(output, made("transformers"), items, written, False)
    assert info.value.differences == {"engine": ("vllm", "transformers")}
    # a real run, whose engine is known before it starts (no vLLM: transformers): refused,
    # the output untouched
    kept = output.read_bytes()
    write_jsonl(source, ROWS[:6])
    with pytest.raises(ResumeMismatchError) as info:
        run(model, source, output, max_new_tokens=3, **FAST)
    assert info.value.differences == {"engine": ("vllm", "transformers")}
    assert output.read_bytes() == kept
    # forced: appended, and the record keeps the engine of the earlier lines
    assert run(model, source, output, max_new_tokens=3, force_resume=True, **FAST).written == 2
    assert [e["options"].get("engine") for e in record(output)["earlier"]] == ["vllm"]
    assert "engine" not in record(output)["options"]


def test_an_output_without_its_record_is_resumed_only_when_forced(tmp_path: Path) -> None:
    """Moved away from its record, an output cannot be checked: a resume with other options
    used to be accepted, and mixed them into one output."""
    model = write_model(tmp_path / "old", ModelSpec(name="old", tokenizer=True))
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(source, ROWS[:2])
    run(model, source, output, task="embed", **FAST)
    moved = tmp_path / "moved.jsonl"
    output.rename(moved)  # the record stays behind
    kept = moved.read_bytes()
    write_jsonl(source, ROWS[:3])
    with pytest.raises(ResumeMismatchError) as info:
        run(model, source, moved, task="embed", pooling="cls", **FAST)
    assert isinstance(info.value, errors.ResumeUncheckedError)
    assert info.value.path == str(moved) and "--force-resume" in str(info.value)
    assert "holds 2 lines but no record" in info.value.message
    assert moved.read_bytes() == kept and not record_path(moved).exists()
    # forced, it resumes and gets a record from then on
    assert run(model, source, moved, task="embed", force_resume=True, **FAST).written == 1
    assert ids(moved) == ["r0", "r1", "r2"]
    assert record(moved)["options"] == {"dtype": None, "pooling": "mean"}
    assert record(moved)["inputs"] == digests(ROWS[:3])
    with pytest.raises(ResumeMismatchError) as info:
        write_jsonl(source, ROWS[:4])
        run(model, source, moved, task="embed", pooling="cls", **FAST)
    assert info.value.differences == {"pooling": ("mean", "cls")}


def test_an_input_edited_under_answered_ids_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Same ids, another prompt: the old lines would be stale answers, resumed silently."""
    model = write_model(tmp_path / "edit", ModelSpec(name="edit", tokenizer=True))
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(source, ROWS[:3])
    run(model, source, output, max_new_tokens=2, **FAST)
    kept = output.read_bytes()
    edited = [*ROWS[:1], {"id": "r1", "prompt": "another prompt"}, *ROWS[2:5]]
    write_jsonl(source, edited)
    argv = ["run", str(model), "--input", str(source), "-o", str(output), "--trust-remote-code",
            "--max-new-tokens", "2", "--workers", "1", "--start-method", "fork"]
    capsys.readouterr()  # the earlier run's summary
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and 'line 2 (id "r1")' in err and "--force-resume" in err
    assert output.read_bytes() == kept
    with pytest.raises(errors.InputChangedError) as info:
        run(model, source, output, max_new_tokens=2, **FAST)
    assert (info.value.ids, info.value.lines) == (("r1",), (2,))
    assert isinstance(info.value, ResumeMismatchError) and info.value.path == str(output)
    # an input that only grew resumes as before; forced, an edited one keeps the old lines
    write_jsonl(source, [*ROWS[:3], *ROWS[3:5]])
    assert run(model, source, output, max_new_tokens=2, **FAST).written == 2
    write_jsonl(source, [*edited, ROWS[5]])
    assert run(model, source, output, max_new_tokens=2, force_resume=True, **FAST).written == 1
    assert ids(output) == [f"r{i}" for i in range(6)]
    assert record(output)["inputs"] == digests([*edited, ROWS[5]])
    # a copy with its record beside it is checked like the original
    copy = tmp_path / "copy.jsonl"
    shutil.copy(output, copy)
    shutil.copy(record_path(output), record_path(copy))
    write_jsonl(source, ROWS[:7])
    with pytest.raises(errors.InputChangedError):
        run(model, source, copy, max_new_tokens=2, **FAST)


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
