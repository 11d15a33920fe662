"""Models in a real Hugging Face cache: snapshot files are symlinks into ``../../blobs``.

Every entry point takes a repo id, the snapshot folder (what ``snapshot_download()``
returns, and what a parent hands its workers) and a plain local folder, fenced right in
every process: the snapshot's fence is its ``models--org--name`` folder, so its blob links
read, and a link anywhere else is still refused.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

# Workers forked from this process start in about a second when torch and transformers are
# already imported here.
import torch  # noqa: F401
import transformers.modeling_utils  # noqa: F401

import codeferry
from codeferry import cli
from codeferry._commands.run import record_path
from codeferry.errors import UnsafePathError
from codeferry.testing import ModelSpec, write_hub_model

REPO = "acme/linked"
FORMS = ("repo", "snapshot", "local")
PROMPTS = ["abc", "hello there", "zz"]


@pytest.fixture(scope="module")
def forms(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The same model as a repo id, as its snapshot folder, and copied into a plain folder."""
    root = tmp_path_factory.mktemp("hub_cache")
    cache = root / "hub"
    # helpers in a sub-package: their links are one folder deeper (../../../blobs)
    snapshot = write_hub_model(cache, REPO, ModelSpec(name="linked", tokenizer=True,
                                                      helpers=("subpackage",)))
    local = root / "local copy"
    shutil.copytree(snapshot, local)  # follows the links: plain files
    was = os.environ.get("HF_HUB_CACHE")
    os.environ["HF_HUB_CACHE"] = str(cache)  # workers inherit it
    yield {"repo": REPO, "snapshot": str(snapshot), "local": str(local)}
    if was is None:
        os.environ.pop("HF_HUB_CACHE", None)
    else:
        os.environ["HF_HUB_CACHE"] = was


@pytest.fixture(scope="module")
def expected(forms: dict[str, str]) -> list[str]:
    """What the model generates, from the plain folder (which always worked)."""
    with codeferry.Executor(forms["local"], workers=1, start_method="fork",
                            trust_remote_code=True) as ex:
        return ex.generate(PROMPTS, max_new_tokens=3)


def test_the_snapshot_really_is_blob_symlinks(forms: dict[str, str]) -> None:
    snapshot = Path(forms["snapshot"])
    assert os.readlink(snapshot / "config.json").startswith("../../blobs/")
    assert os.readlink(snapshot / "utils" / "rope.py").startswith("../../../blobs/")
    assert not (Path(forms["local"]) / "config.json").is_symlink()


@pytest.mark.parametrize("form", FORMS)
def test_resolve_load_inspect_lock_and_verify(form: str, forms: dict[str, str], tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    model = forms[form]
    snapshot = Path(forms["snapshot"])
    bundle = codeferry.resolve(model)
    bundle.check()
    if form == "local":
        assert bundle.origin.fence == Path(model).resolve() and bundle.origin.repo_id is None
    else:
        assert bundle.origin.fence == snapshot.parents[1].resolve()
        assert (bundle.origin.repo_id, bundle.origin.commit) == (REPO, snapshot.name)
        assert bundle.origin.name == f"{REPO}@{snapshot.name}"
    assert bundle.digest == codeferry.resolve(forms["local"]).digest  # the same code
    classes = codeferry.load(model, trust_remote_code=True)
    assert {"AutoConfig", "AutoModelForCausalLM"} <= set(classes)
    assert cli.main(["inspect", model]) == 0
    lock = tmp_path / "m.lock"
    assert cli.main(["lock", model, "-o", str(lock)]) == 0
    assert cli.main(["verify", model, "--lock", str(lock)]) == 0
    if form == "snapshot":  # a lock of the snapshot is the lock of the repo
        assert cli.main(["verify", REPO, "--lock", str(lock)]) == 0
    out, err = capsys.readouterr()
    assert f"digest   {bundle.digest}" in out and "error" not in err


# The local folder's executor is ``expected``'s.
@pytest.mark.parametrize("form, method", [("repo", "spawn"), ("snapshot", "spawn"),
                                          ("repo", "fork"), ("snapshot", "forkserver")])
def test_executor_every_form_and_start_method(form: str, method: str, forms: dict[str, str],
                                              expected: list[str]) -> None:
    with codeferry.Executor(forms[form], workers=1, start_method=method,
                            trust_remote_code=True) as ex:
        assert ex.generate(PROMPTS, max_new_tokens=3) == expected
        if method == "spawn" and form == "repo":
            # a replacement worker gets the same snapshot, fenced the same way
            pid = ex.pids[0]
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            assert ex.generate(PROMPTS, max_new_tokens=3) == expected
            assert ex.pids[0] != pid


@pytest.mark.parametrize("form, method", [("repo", "spawn"), ("snapshot", "spawn"),
                                          ("local", "fork"), ("repo", "forkserver")])
def test_codeferry_run_every_form(form: str, method: str, forms: dict[str, str],
                                  expected: list[str], tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "in.txt"
    source.write_text("".join(p + "\n" for p in PROMPTS), encoding="utf-8")
    output = tmp_path / "out.jsonl"
    argv = ["run", forms[form], "--input", str(source), "-o", str(output),
            "--trust-remote-code", "--workers", "1", "--start-method", method,
            "--max-new-tokens", "3"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in output.read_text(encoding="utf-8").splitlines()]
    assert [{"id": r["id"], "output": r["output"]} for r in rows] == [
        {"id": i, "output": text} for i, text in enumerate(expected, 1)]
    assert all(r["finish_reason"] in ("stop", "length") and r["completion_tokens"] >= 1 for r in rows)
    record = json.loads(record_path(output).read_text(encoding="utf-8"))
    snapshot = Path(forms["snapshot"])
    assert record["model"] == (forms["local"] if form == "local" else f"{REPO}@{snapshot.name}")
    assert record["digest"] == codeferry.resolve(forms[form]).digest
    capsys.readouterr()


@pytest.mark.parametrize("form, method", [
    ("repo", "spawn"), ("snapshot", "spawn"), ("local", "fork"), ("repo", "fork"),
    ("snapshot", "forkserver"),
])
def test_codeferry_doctor_every_form(form: str, method: str, forms: dict[str, str],
                                     capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["doctor", forms[form], "--trust-remote-code", "--workers", "1",
                     "--start-method", method, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0, out
    assert out["ok"] is True and "AutoModelForCausalLM" in out["workers"][0]["checks"]["models_built"]


def test_a_symlink_out_of_the_repo_folder_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    snapshot = write_hub_model(cache, "acme/escape", ModelSpec(name="escape"))
    other = write_hub_model(cache, "acme/neighbour", ModelSpec(name="escape"))
    modeling = snapshot / "modeling_escape.py"
    outside = tmp_path / "elsewhere.py"
    outside.write_bytes(modeling.read_bytes())
    neighbour_blob = os.readlink(other / "modeling_escape.py").rsplit("/", 1)[1]
    targets = [
        str(outside),  # anywhere on the disk
        f"../../../models--acme--neighbour/blobs/{neighbour_blob}",  # another repo's blob
    ]
    for target in targets:
        modeling.unlink()
        modeling.symlink_to(target)
        assert modeling.read_bytes() == outside.read_bytes()  # the same bytes, elsewhere
        for model in ("acme/escape", str(snapshot)):
            with pytest.raises(UnsafePathError) as info:
                codeferry.load(model, trust_remote_code=True)
            assert "modeling_escape.py" in str(info.value)
            with pytest.raises(UnsafePathError):
                codeferry.Executor(model, workers=1, trust_remote_code=True)


def test_a_model_in_a_sub_folder_of_a_snapshot_reads_its_blobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    outer = write_hub_model(cache, "acme/outer", ModelSpec(name="outer"))
    inner = outer / "inner"
    inner.mkdir()
    for link in outer.iterdir():  # the same files, one folder deeper, as a download has them
        if link.is_symlink():
            (inner / link.name).symlink_to("../" + os.readlink(link))
    bundle = codeferry.resolve(inner)
    bundle.check()
    assert bundle.origin.root == inner.resolve() and bundle.origin.fence == outer.parents[1].resolve()
    assert bundle.digest == codeferry.resolve(outer).digest
