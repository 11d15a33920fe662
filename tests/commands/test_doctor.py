"""``codeferry doctor``: real workers of each start method, and their real errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from _helpers import unique_model

from codeferry._commands.doctor import doctor, render_doctor
from codeferry._exec.layout import layout
from codeferry.cli import main
from codeferry.errors import (
    CodeUnavailableError,
    DoctorCheckError,
    RemoteCodeExecutionError,
    RemoteTraceback,
)


def model(root: Path, **kw: object) -> Path:
    return unique_model(root, "d", helpers=("subpackage",), **kw)


@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
def test_every_worker_loads_and_builds(method: str, tmp_path: Path) -> None:
    report = doctor(str(model(tmp_path)), trust_remote_code=True, workers=2, start_method=method)
    assert report.ok, [w.to_json() for w in report.workers]
    assert len({w.pid for w in report.workers}) == 2
    for w in report.workers:
        assert w.checks["config_class_is_loaded_class"] is True
        assert "AutoModelForCausalLM" in w.checks["models_built"]
    # what `codeferry run` starts on this machine when not told, and why (_exec.layout)
    shape = report.to_json()["layout"]
    assert (shape["workers"], shape["threads"]) == layout("cpu", "local", None, None,
                                                          cpus=shape["cpus"])
    assert f"layout   codeferry run here: {shape['workers']} worker" in render_doctor(report)
    assert shape["reason"] in render_doctor(report)
    usable = sorted(os.sched_getaffinity(0))
    if shape["workers"] * shape["threads"] <= len(usable):  # each on cores of its own
        assert sorted(c for cores in shape["cores"] for c in cores) == usable[
            :shape["workers"] * shape["threads"]] and "binds each" in shape["reason"]


def test_a_worker_error_arrives_typed_with_the_workers_traceback(tmp_path: Path) -> None:
    path = model(tmp_path)
    modeling = next(path.glob("modeling_*.py"))
    modeling.write_text(
        modeling.read_text()
        + "\nimport multiprocessing\nif multiprocessing.parent_process() is not None:\n"
        "    raise RuntimeError('only in workers')\n"
    )
    report = doctor(str(path), trust_remote_code=True, workers=1)
    assert not report.ok
    err = report.workers[0].error
    assert isinstance(err, RemoteCodeExecutionError) and err.digest
    assert isinstance(err.__cause__, RemoteTraceback)
    assert "only in workers" in err.__cause__.tb


def test_a_worker_without_the_code_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = model(tmp_path)
    report = doctor(str(path), trust_remote_code=True, workers=1)  # loaded here, store filled
    assert report.ok
    # Workers now get another, empty store: the digest alone cannot be materialized.
    monkeypatch.setenv("CODEFERRY_HOME", str(tmp_path / "empty-store"))
    report = doctor(str(path), trust_remote_code=True, workers=1)
    err = report.workers[0].error
    assert isinstance(err, CodeUnavailableError)
    assert "CODEFERRY_HOME" in str(err) and isinstance(err.__cause__, RemoteTraceback)


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = model(tmp_path)
    assert main(["doctor", str(path)]) == 1  # no trust decision: refused, nothing runs
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--trust-remote-code" in err
    assert main(["doctor", str(path), "--trust-remote-code", "--workers", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is True and out["workers"][0]["ok"] is True


WHY = "past_key_values of another release"


def cannot_generate(root: Path) -> Path:
    """A model that loads, builds and runs forward, but whose ``prepare_inputs_for_generation``
    raises, as code written against another release's generate does."""
    path = unique_model(root, "nh", tokenizer=True)
    modeling = next(path.glob("modeling_*.py"))
    text = modeling.read_text()
    line = "    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):\n"
    assert line in text
    modeling.write_text(text.replace(line, line + f"        raise KeyError({WHY!r})\n"))
    return path


def test_a_model_that_cannot_generate_fails_the_doctor_as_run_fails(tmp_path: Path) -> None:
    """``run``'s generate path fails on every input; the doctor, generating one token the same
    way in each worker, says so instead of ``ok``."""
    import codeferry

    path = cannot_generate(tmp_path)
    with codeferry.Executor(path, workers=1, start_method="fork", trust_remote_code=True) as ex:
        with pytest.raises(Exception, match=WHY):
            ex.generate(["abc"], max_new_tokens=2)
    for method in ("spawn", "fork"):
        report = doctor(str(path), trust_remote_code=True, workers=2, start_method=method)
        assert not report.ok
        for worker in report.workers:
            err = worker.error
            assert isinstance(err, DoctorCheckError) and err.check == "generate"
            assert WHY in str(err) and isinstance(err.__cause__, RemoteTraceback)
        text = render_doctor(report)
        assert text.endswith("FAILED\n") and "worker 1  FAILED DoctorCheckError" in text
        assert WHY in text


def test_the_doctor_generates_a_token_in_each_worker_as_run_does(tmp_path: Path) -> None:
    path = unique_model(tmp_path, "gt", tokenizer=True)
    report = doctor(str(path), trust_remote_code=True, workers=2, start_method="fork")
    assert report.ok, [w.to_json() for w in report.workers]
    for worker in report.workers:
        generated = worker.checks["generate"]
        assert generated["path"] == "batched" and generated["reason"].startswith(
            "the decode loop does not work for this model: ")
        assert isinstance(generated["text"], str)
    assert "generated 1 token (batched" in render_doctor(report)
    # which engine the default gives, read without starting vLLM (none in this environment)
    assert report.workers[0].checks["engine"] == {"auto": "transformers",
                                                  "reason": "vLLM is not installed here"}
    assert "engine: transformers (--engine auto, the default: vLLM is not installed here)" \
        in render_doctor(report)
    # Without a tokenizer there is nothing to generate from: said, and not a failure here.
    bare = doctor(str(model(tmp_path)), trust_remote_code=True, workers=1, start_method="fork")
    assert bare.ok and "skipped" in bare.workers[0].checks["generate"]
