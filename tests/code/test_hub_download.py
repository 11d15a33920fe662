"""Repo ids the cache lacks are downloaded with huggingface_hub's real client, from a real server.

The server (``_hub_server.FakeHub``) answers on 127.0.0.1 as huggingface.co does;
``HF_ENDPOINT`` points at it. The session is offline (conftest sets ``HF_HUB_OFFLINE=1``,
which huggingface_hub read at import): each test here unsets it, and codeferry must read
the environment as it is at call time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from _helpers import ROOT
from _hub_server import FakeHub, Repo, add_commit

import codeferry
from codeferry import cli
from codeferry.errors import (
    GatedRepoError,
    HubDownloadError,
    HubRepoNotFoundError,
    HubRevisionNotFoundError,
    ModelNotCachedError,
    ModelNotFoundError,
)
from codeferry.testing import ModelSpec, write_model

REPO, GATED, TOKEN = "acme/remote", "acme/gated", "hf_open_sesame"
WEIGHTS = "model.safetensors"
SPECS = {  # each commit has its own code, so that a digest tells which one was fetched
    "main": ModelSpec(name="hubby", tokenizer=True),
    "v1": ModelSpec(name="oldie"),  # a tag
    "dev": ModelSpec(name="devvy"),  # a branch
    "pinned": ModelSpec(name="pinny"),  # a commit no ref points to
    "gated": ModelSpec(name="gatey", tokenizer=True),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each spec as a plain local folder: what the Hub serves, and what a digest should be."""
    root = tmp_path_factory.mktemp("served")
    return {key: write_model(root / key, spec) for key, spec in SPECS.items()}


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def served(folders: dict[str, Path]) -> dict[str, Repo]:
    """What the Hub holds: REPO's main, tag v1, branch dev and an unnamed commit; GATED."""
    repos: dict[str, Repo] = {}
    for key in ("main", "v1", "dev"):
        add_commit(repos, REPO, _files(folders[key]), key)
    add_commit(repos, REPO, _files(folders["pinned"]))
    add_commit(repos, GATED, _files(folders["gated"]), "main")
    repos[GATED].token = TOKEN
    return repos


@pytest.fixture
def hub(served: dict[str, Repo], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    """A running Hub serving the repos, and this process online with an empty cache."""
    server = FakeHub(served)
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    yield server
    server.stop()


def _sha(served: dict[str, Repo], ref: str) -> str:
    return served[REPO].refs[ref]


def _snapshot(tmp_path: Path, repo: str, sha: str) -> Path:
    return tmp_path / "hub" / ("models--" + repo.replace("/", "--")) / "snapshots" / sha


def test_inspect_fetches_the_code_and_configs_but_no_weights(
    hub: FakeHub, folders: dict[str, Path], served: dict[str, Repo], tmp_path: Path
) -> None:
    bundle = codeferry.resolve(REPO)
    assert bundle.origin.commit == _sha(served, "main")
    assert bundle.digest == codeferry.resolve(folders["main"]).digest
    snapshot = _snapshot(tmp_path, REPO, _sha(served, "main"))
    assert {"config.json", "modeling_hubby.py", "tokenizer_config.json", "vocab.json"} <= {
        p.name for p in snapshot.iterdir()}
    assert not (snapshot / WEIGHTS).exists()
    assert hub.seen(suffix=WEIGHTS) == []  # not even a HEAD
    before = len(hub.requests)
    assert codeferry.resolve(REPO).digest == bundle.digest  # cached now: no request at all
    assert len(hub.requests) == before


def test_load_downloads_the_whole_model_and_its_classes_load(
    hub: FakeHub, folders: dict[str, Path], served: dict[str, Repo], tmp_path: Path
) -> None:
    codeferry.resolve(REPO)  # the code only, as inspect leaves it: load completes it
    classes = codeferry.load(REPO, trust_remote_code=True)
    snapshot = _snapshot(tmp_path, REPO, _sha(served, "main"))
    assert (snapshot / WEIGHTS).read_bytes() == (folders["main"] / WEIGHTS).read_bytes()
    assert hub.seen("GET", WEIGHTS)
    model = classes["AutoModelForCausalLM"].from_pretrained(str(snapshot))
    assert type(model).__name__ == "HubbyForCausalLM"


@pytest.mark.parametrize("revision", ["dev", "v1", "pinned"], ids=["branch", "tag", "commit"])
def test_a_revision_is_fetched_at_the_commit_it_names(
    revision: str, hub: FakeHub, folders: dict[str, Path], served: dict[str, Repo],
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    repo = served[REPO]
    sha = repo.refs.get(revision) or next(
        s for s in repo.commits if s not in repo.refs.values())
    asked = sha if revision == "pinned" else revision
    bundle = codeferry.resolve(REPO, revision=asked)
    assert bundle.origin.commit == sha
    assert bundle.digest == codeferry.resolve(folders[revision]).digest
    refs = tmp_path / "hub" / "models--acme--remote" / "refs"
    named = sorted(p.name for p in refs.iterdir()) if refs.is_dir() else []
    assert named == ([] if revision == "pinned" else [revision])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # cached now: found offline, without a request
    before = len(hub.requests)
    assert codeferry.resolve(REPO, revision=asked).digest == bundle.digest
    assert len(hub.requests) == before


def test_a_gated_repo_needs_a_token(
    hub: FakeHub, folders: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(GatedRepoError) as info:
        codeferry.resolve(GATED)
    assert isinstance(info.value, PermissionError) and info.value.repo_id == GATED
    assert "HF_TOKEN" in str(info.value) and "--token" in str(info.value)
    with pytest.raises(GatedRepoError):
        codeferry.resolve(GATED, token="hf_wrong")  # 403: a token without access
    expected = codeferry.resolve(folders["gated"]).digest
    assert codeferry.resolve(GATED, token=TOKEN).digest == expected
    sent = {auth for _, path, auth in hub.requests if "/resolve/" in path}
    assert sent == {None, "Bearer hf_wrong", f"Bearer {TOKEN}"}
    monkeypatch.setenv("HF_TOKEN", TOKEN)  # the environment's token, read at call time
    assert codeferry.resolve(GATED, cache_dir=tmp_path / "other").digest == expected


def test_a_repo_or_revision_the_hub_lacks_is_typed(hub: FakeHub) -> None:
    with pytest.raises(HubRepoNotFoundError) as info:
        codeferry.resolve("acme/nothing")
    assert isinstance(info.value, ModelNotFoundError) and info.value.fix
    with pytest.raises(HubRevisionNotFoundError) as revision:
        codeferry.resolve(REPO, revision="no-such-branch")
    assert revision.value.revision == "no-such-branch"


def test_a_download_cut_short_leaves_nothing_half_written(
    hub: FakeHub, served: dict[str, Repo], folders: dict[str, Path], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hub.die_during(WEIGHTS)
    with pytest.raises(HubDownloadError) as info:
        codeferry.load(REPO, trust_remote_code=True)
    assert isinstance(info.value, ConnectionError) and not hub.alive
    cache = tmp_path / "hub"
    assert not (_snapshot(tmp_path, REPO, _sha(served, "main")) / WEIGHTS).exists()
    assert [p for p in cache.rglob("*") if ".incomplete" in p.name] == []
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # what is cached is not taken for the model
    with pytest.raises(ModelNotCachedError) as offline:
        codeferry.load(REPO, trust_remote_code=True)
    assert offline.value.missing == (WEIGHTS,)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    again = FakeHub(served)  # the Hub is back, on another port
    try:
        monkeypatch.setenv("HF_ENDPOINT", again.url)
        codeferry.load(REPO, trust_remote_code=True)
        weights = _snapshot(tmp_path, REPO, _sha(served, "main")) / WEIGHTS
        assert weights.read_bytes() == (folders["main"] / WEIGHTS).read_bytes()
        assert again.seen("GET", WEIGHTS) and not again.seen("GET", "config.json")  # the rest kept
    finally:
        again.stop()


def test_offline_no_request_reaches_the_hub(hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ModelNotCachedError) as info:
        codeferry.resolve(REPO, local_files_only=True)
    assert "local_files_only" in str(info.value)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for call in (lambda: codeferry.resolve(REPO), lambda: codeferry.load(REPO)):
        with pytest.raises(ModelNotCachedError) as info:
            call()
        assert "HF_HUB_OFFLINE" in str(info.value) and info.value.missing == ()
    assert cli.main(["inspect", REPO]) == 2
    assert hub.requests == []


def test_codeferry_run_downloads_the_model_for_its_workers(
    hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\nworld\n", encoding="utf-8")
    out = tmp_path / "out.jsonl"
    assert cli.main(["run", REPO, "--input", str(prompts), "-o", str(out), "--trust-remote-code",
                     "--workers", "1", "--start-method", "fork", "--max-new-tokens", "2"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["id"] for row in rows] == [1, 2] and all("output" in row for row in rows)
    assert hub.seen("GET", WEIGHTS)
    capsys.readouterr()


def test_the_executor_downloads_the_whole_model_with_its_token(hub: FakeHub) -> None:
    with pytest.raises(ModelNotCachedError):
        codeferry.Executor(GATED, token=TOKEN, local_files_only=True, trust_remote_code=True)
    assert hub.requests == []  # refused before any request, and before any worker
    with codeferry.Executor(GATED, workers=1, start_method="fork", trust_remote_code=True,
                            token=TOKEN) as executor:
        assert (Path(executor.model) / WEIGHTS).is_file()  # what the worker loaded
        assert len(executor.generate(["hi"], max_new_tokens=2)) == 1
    assert hub.seen("GET", WEIGHTS)


def test_the_command_line_passes_the_token_in_a_fresh_process(hub: FakeHub, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "HF_HUB_CACHE", "HF_TOKEN")}
    env.update(PYTHONPATH=str(ROOT / "src"), HF_ENDPOINT=hub.url)
    base = [sys.executable, "-m", "codeferry", "inspect", GATED, "--json",
            "--cache-dir", str(tmp_path / "fresh")]

    def cli_run(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*base, *extra], env=env, capture_output=True, text=True,
                              timeout=300)

    refused = cli_run()
    assert refused.returncode == 1 and "gated" in refused.stderr, refused.stderr
    local = cli_run("--local-files-only")
    assert local.returncode == 2 and "local_files_only" in local.stderr, local.stderr
    done = cli_run("--token", TOKEN)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["classes"]


# -- a snapshot only partly there --------------------------------------------------------------

PARTED = "acme/parted"


@pytest.fixture
def parted(hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """A sub-package model on the Hub, cached as plain transformers leaves it when it fails on
    it: config.json and the two modules the auto_map names, fetched file by file (no file
    list), without the helpers (layers.py, utils/). Returns (the snapshot, the model's folder)."""
    from huggingface_hub import constants, hf_hub_download

    folder = write_model(tmp_path / "served-parted",
                         ModelSpec(name="parted", helpers=("flat", "subpackage")))
    sha = add_commit(hub.repos, PARTED, _files(folder), "main")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # read at import: offline
    for name in ("config.json", "configuration_parted.py", "modeling_parted.py"):
        hf_hub_download(PARTED, name, cache_dir=tmp_path / "hub", endpoint=hub.url)
    snapshot = _snapshot(tmp_path, PARTED, sha)
    assert not (snapshot / "layers.py").exists() and not (snapshot / "utils").exists()
    assert not (snapshot.parents[1] / "trees").exists()  # nothing says what the repo holds
    hub.requests.clear()
    return snapshot, folder


def test_a_snapshot_that_lacks_files_its_code_imports_is_completed_online(
    hub: FakeHub, parted: tuple[Path, Path]
) -> None:
    snapshot, folder = parted
    bundle = codeferry.resolve(PARTED)
    assert [type(p).__name__ for p in bundle.problems if p.blocking] == []
    assert bundle.digest == codeferry.resolve(folder).digest
    assert (snapshot / "layers.py").is_file() and (snapshot / "utils" / "rope.py").is_file()
    assert hub.seen("GET", "/layers.py") and hub.seen("GET", "/utils/rope.py")
    assert hub.seen(suffix=WEIGHTS) == []  # the code's files only, as for any inspect
    before = len(hub.requests)
    assert codeferry.resolve(PARTED).digest == bundle.digest  # complete now: no request
    assert len(hub.requests) == before
    classes = codeferry.load(PARTED, trust_remote_code=True)  # the weights too, and it runs
    model = classes["AutoModelForCausalLM"].from_pretrained(str(snapshot))
    assert type(model).__name__ == "PartedForCausalLM"


def test_offline_a_partial_snapshot_names_each_missing_file_and_the_command(
    hub: FakeHub, parted: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    snapshot, _ = parted
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotCachedError) as info:
        codeferry.resolve(PARTED)
    err = info.value
    assert err.missing == ("layers.py", "utils/rope.py") and err.repo_id == PARTED
    command = f"hf download {PARTED} layers.py utils/rope.py --revision {snapshot.name}"
    assert command in str(err) and "HF_HUB_OFFLINE" in str(err)
    assert "to the model folder" not in str(err)
    assert cli.main(["inspect", PARTED]) == 2
    assert command in capsys.readouterr().err
    assert hub.requests == []


def test_a_repo_id_is_found_in_a_cache_named_only_by_huggingface_hub_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """HUGGINGFACE_HUB_CACHE, the older name huggingface_hub still honours, and nothing else."""
    from codeferry.testing import write_hub_model

    cache = tmp_path / "old-name"
    snapshot = write_hub_model(cache, "acme/oldname", ModelSpec(name="oldname"))
    for name in ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the default cache is empty
    monkeypatch.setenv("HUGGINGFACE_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    bundle = codeferry.resolve("acme/oldname")
    assert bundle.origin.root == snapshot and bundle.origin.repo_id == "acme/oldname"
    assert cli.main(["inspect", "acme/oldname", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["classes"]
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "new-name"))  # the newer name wins
    with pytest.raises(ModelNotCachedError):
        codeferry.resolve("acme/oldname")
