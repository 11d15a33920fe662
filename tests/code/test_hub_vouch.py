"""A lock the Hub vouches for: ``--verify-hub`` against a real server, through the real client.

The server (``_hub_server.FakeHub``) answers on 127.0.0.1 as huggingface.co does, its
``model_info(files_metadata=True)`` included: a git blob sha1 per file, and the sha256 of an
LFS file. Each test gets a fresh server (some move a branch) and an empty cache, downloads the
model with codeferry (huggingface_hub's own client), then tampers with the cache or a mirror
the way an attacker or a bad disk would. The session is offline (conftest): each test here
unsets ``HF_HUB_OFFLINE``, and the offline tests set it again.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from _helpers import ROOT
from _hub_server import FakeHub, Repo, add_commit, git_blob_sha

import codeferry
from codeferry import cli
from codeferry.errors import (
    HubMismatchError,
    HubUncheckedError,
    LockFormatError,
    LockMismatchError,
    ModelNotFoundError,
)
from codeferry.testing import ModelSpec, write_hub_model, write_model
from codeferry.testing._contents import cross_repo_files, model_files
from codeferry.testing._spec import ASSET_FILE

REPO, HEADS = "acme/vouchy", "acme/vouch-heads"
SPEC = ModelSpec(name="vouchy", asset=True, cross_repo=HEADS)
MOVED = ModelSpec(name="vouchy", asset=True, cross_repo=HEADS, helpers=("flat",))
MODELING = "modeling_vouchy.py"


def _serve(files: dict[str, bytes] | None = None) -> dict[str, Repo]:
    """REPO (its asset stored through LFS, as a large data file on the Hub) and HEADS."""
    repos: dict[str, Repo] = {}
    add_commit(repos, REPO, files if files is not None else model_files(SPEC), "main")
    add_commit(repos, HEADS, cross_repo_files(SPEC), "main")
    repos[REPO].lfs.add(ASSET_FILE)
    return repos


def _online(monkeypatch: pytest.MonkeyPatch, server: FakeHub, cache: Path) -> None:
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    """A running Hub serving REPO and HEADS, and this process online with an empty cache."""
    server = FakeHub(_serve())
    _online(monkeypatch, server, tmp_path / "hub")
    yield server
    server.stop()


def _commit(server: FakeHub, repo: str, ref: str = "main") -> str:
    return server.repos[repo].refs[ref]


def _cached(tmp_path: Path, repo: str, path: str, commit: str) -> Path:
    """The snapshot link of ``path`` in the cache the ``hub`` fixture set."""
    return tmp_path / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots" / commit / path


def _tamper(link: Path, data: bytes) -> None:
    """Rewrite the blob behind a snapshot link (as a bad disk, or someone with write access
    to the cache, would: every snapshot that shares the blob sees it)."""
    blob = link.resolve()
    blob.chmod(0o644)
    blob.write_bytes(data)


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _lock_lines(path: Path) -> dict[str, list[str]]:
    lines: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        kind, _, rest = line.partition(" ")
        lines.setdefault(kind, []).append(rest)
    return lines


def test_lock_pins_commits_and_the_hub_vouches_for_every_file(
    hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lock = tmp_path / "m.lock"
    code, _, err = _cli(capsys, "lock", REPO, "--verify-hub", "-o", str(lock))
    assert code == 0, err
    lines = _lock_lines(lock)
    # the branch was resolved: the model and the cross-repo reference each at a commit
    assert lines["revision"] == [_commit(hub, REPO)]
    assert lines["pin"] == [f"{HEADS} {_commit(hub, HEADS)}"]
    files = len(lines["file"])
    assert f"vouches for all {files} locked file(s)" in err
    assert f"{REPO}@{_commit(hub, REPO)}" in err and f"{HEADS}@{_commit(hub, HEADS)}" in err
    assert ASSET_FILE in {line.rsplit(" ", 1)[1] for line in lines["file"]}  # the LFS file too
    # the Hub was asked for its hashes at the commits, not at the branch
    assert f"/api/models/{REPO}/revision/{_commit(hub, REPO)}" in hub.seen("GET")
    assert f"/api/models/{HEADS}/revision/{_commit(hub, HEADS)}" in hub.seen("GET")

    code, out, err = _cli(capsys, "verify", REPO, "--lock", str(lock), "--verify-hub")
    assert code == 0, err
    assert f"vouches for all {files} locked file(s)" in out

    # a plain lock, and a lock named by the branch, pin the same commit
    code, out, _ = _cli(capsys, "lock", REPO, "--revision", "main")
    assert code == 0 and f"revision {_commit(hub, REPO)}\n" in out

    # the Python API: the same check, its result a value
    check = codeferry.read_lock(lock).check_hub(codeferry.resolve(REPO))
    assert check.files == files
    assert {(repo, commit) for repo, commit, _ in check.units} == {
        (REPO, _commit(hub, REPO)), (HEADS, _commit(hub, HEADS))}
    assert check.endpoint == hub.url


def test_a_tampered_blob_in_the_cache_is_caught_before_anything_runs(
    hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _cli(capsys, "lock", REPO, "-o", str(tmp_path / "first.lock"))[0] == 0  # downloads
    link = _cached(tmp_path, REPO, MODELING, _commit(hub, REPO))
    original = link.read_bytes()
    evil = b"import os\nos.system('echo pwned')\n" + original
    _tamper(link, evil)

    # a plain lock locks the tampering: the lock alone cannot know
    tampered = tmp_path / "tampered.lock"
    assert _cli(capsys, "lock", REPO, "-o", str(tampered))[0] == 0
    assert _cli(capsys, "verify", REPO, "--lock", str(tampered))[0] == 0

    # the Hub's hash tells
    code, out, err = _cli(capsys, "verify", REPO, "--lock", str(tampered), "--verify-hub")
    assert code == 1
    assert "vouches" not in out
    assert (f"{MODELING}: expected git-sha1:{git_blob_sha(original)}, actual "
            f"git-sha1:{git_blob_sha(evil)}") in err
    assert "Fix: delete the cached repo" in err and "--verify-hub -o FILE" in err
    assert "Traceback" not in err

    refused = tmp_path / "refused.lock"
    code, out, err = _cli(capsys, "lock", REPO, "--verify-hub", "-o", str(refused))
    assert code == 1 and MODELING in err
    assert not refused.exists() and not out  # nothing written, on disk or stdout

    with pytest.raises(HubMismatchError) as caught:
        codeferry.read_lock(tampered).check_hub(codeferry.resolve(REPO))
    assert caught.value.mismatches == (
        (MODELING, f"git-sha1:{git_blob_sha(original)}", f"git-sha1:{git_blob_sha(evil)}"),)
    assert caught.value.path == MODELING
    # a lock of other code is refused before the Hub is asked
    with pytest.raises(LockMismatchError):
        codeferry.read_lock(tmp_path / "first.lock").check_hub(codeferry.resolve(REPO))


def test_a_tampered_lfs_file_and_cross_repo_file_are_caught(
    hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _cli(capsys, "lock", REPO, "-o", str(tmp_path / "first.lock"))[0] == 0
    asset = _cached(tmp_path, REPO, ASSET_FILE, _commit(hub, REPO))
    original = asset.read_bytes()
    assert asset.resolve().name == hashlib.sha256(original).hexdigest()  # stored as LFS
    _tamper(asset, original.replace(b"0", b"1", 1))
    heads = _cached(tmp_path, HEADS, "modeling_heads.py", _commit(hub, HEADS))
    _tamper(heads, heads.read_bytes() + b"\nEVIL = True\n")

    code, _, err = _cli(capsys, "lock", REPO, "--verify-hub", "-o", str(tmp_path / "x.lock"))
    assert code == 1
    changed = original.replace(b"0", b"1", 1)
    assert (f"{ASSET_FILE}: expected sha256:{hashlib.sha256(original).hexdigest()}, actual "
            f"sha256:{hashlib.sha256(changed).hexdigest()}") in err
    assert f"{HEADS}--modeling_heads.py: expected git-sha1:" in err
    assert "2 file(s) are not what" in err
    assert not (tmp_path / "x.lock").exists()


def test_a_mirror_that_serves_a_tampered_lfs_file_is_caught_against_the_hub(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str]
) -> None:
    """A mirror whose LFS pointer (the sha256 it lists) matches its own tampered bytes: the
    download is consistent with the mirror, and only the Hub's hash catches it."""
    files = model_files(SPEC)
    files[ASSET_FILE] = files[ASSET_FILE].replace(b"0", b"2", 1)
    mirror = FakeHub(_serve(files))
    mirror.repos[REPO].refs["main"] = _commit(hub, REPO)  # it claims the Hub's commit
    mirror.repos[REPO].commits[_commit(hub, REPO)] = files
    try:
        monkeypatch.setenv("HF_ENDPOINT", mirror.url)
        lock = tmp_path / "mirror.lock"
        code, _, err = _cli(capsys, "lock", REPO, "--verify-hub", "-o", str(lock))
        assert code == 0, err  # the mirror vouches for itself: asking it proves nothing
        code, out, err = _cli(capsys, "verify", REPO, "--lock", str(lock), "--verify-hub",
                              "--hub-endpoint", hub.url)
        assert code == 1, out
        expected = hashlib.sha256(model_files(SPEC)[ASSET_FILE]).hexdigest()
        assert f"{ASSET_FILE}: expected sha256:{expected}, actual sha256:" in err
        assert f"not what {hub.url} holds" in err
    finally:
        mirror.stop()


def test_a_file_the_hubs_commit_lacks_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The cache holds the Hub's commit, plus a file the Hub's commit never had."""
    served = model_files(SPEC)
    del served[ASSET_FILE]
    server = FakeHub(_serve(served))
    try:
        _online(monkeypatch, server, tmp_path / "hub")
        write_hub_model(tmp_path / "hub", REPO, SPEC, commit=_commit(server, REPO))
        code, _, err = _cli(capsys, "lock", REPO, "--verify-hub", "-o", str(tmp_path / "x.lock"))
        assert code == 1
        assert f"{ASSET_FILE}: not in the Hub's commit" in err
        assert not (tmp_path / "x.lock").exists()
        assert not server.seen("GET", ASSET_FILE)  # nothing downloaded: the cache was current
    finally:
        server.stop()


def test_a_commit_the_hub_never_had_is_caught(
    hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    forged = "f" * 40
    write_hub_model(tmp_path / "hub", REPO, SPEC, commit=forged)
    lock = tmp_path / "forged.lock"
    assert _cli(capsys, "lock", REPO, "-o", str(lock))[0] == 0
    assert f"revision {forged}\n" in lock.read_text()
    code, _, err = _cli(capsys, "verify", REPO, "--lock", str(lock), "--verify-hub")
    assert code == 1
    assert f"has no commit {forged} of {REPO}" in err
    with pytest.raises(HubMismatchError) as caught:
        codeferry.read_lock(lock).check_hub(codeferry.resolve(REPO))
    assert caught.value.mismatches == ((REPO, "absent", forged),)


def test_a_moved_branch(hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Locked at A; the Hub's main moves to B: the lock of A still verifies (the Hub is asked
    about A, not about main), and locking again pins B."""
    old = tmp_path / "a.lock"
    assert _cli(capsys, "lock", REPO, "--verify-hub", "-o", str(old))[0] == 0
    a = _commit(hub, REPO)
    b = add_commit(hub.repos, REPO, model_files(MOVED), "main")
    assert a != b

    code, _, err = _cli(capsys, "verify", REPO, "--lock", str(old), "--verify-hub")
    assert code == 0, err
    new = tmp_path / "b.lock"
    code, _, err = _cli(capsys, "lock", REPO, "--verify-hub", "-o", str(new))
    assert code == 0, err
    assert _lock_lines(new)["revision"] == [b]
    assert _lock_lines(new)["digest"] != _lock_lines(old)["digest"]  # B's code, downloaded
    assert _cli(capsys, "verify", REPO, "--lock", str(new), "--verify-hub")[0] == 0
    # the cache's main is B now: A's lock no longer matches main, but still matches A
    assert _cli(capsys, "verify", REPO, "--lock", str(old), "--verify-hub")[0] == 1
    code, _, err = _cli(capsys, "verify", REPO, "--revision", a, "--lock", str(old),
                        "--verify-hub")
    assert code == 0, err


def test_offline_or_unreachable_it_says_it_could_not_check(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str]
) -> None:
    lock = tmp_path / "m.lock"
    assert _cli(capsys, "lock", REPO, "-o", str(lock))[0] == 0
    asked = len(hub.requests)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, out, err = _cli(capsys, "verify", REPO, "--lock", str(lock), "--verify-hub")
    assert code == 3
    assert "could not check" in err and "HF_HUB_OFFLINE=1" in err and "Traceback" not in err
    assert "vouches" not in out
    code, out, err = _cli(capsys, "lock", REPO, "--verify-hub", "-o", str(tmp_path / "x.lock"))
    assert code == 3 and "could not check" in err
    assert not (tmp_path / "x.lock").exists()
    assert len(hub.requests) == asked  # offline: not one request
    with pytest.raises(HubUncheckedError) as caught:
        codeferry.read_lock(lock).check_hub(codeferry.resolve(REPO))
    assert caught.value.reason == "HF_HUB_OFFLINE=1"

    # online, but nothing answers: the same, from a fresh process (its exit code, no traceback)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    hub.stop()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, "-m", "codeferry", "verify", REPO, "--lock",
                           str(lock), "--verify-hub"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 3, done.stderr
    assert "could not check" in done.stderr and "Traceback" not in done.stderr
    assert done.stderr.count("\n") <= 2, done.stderr


def test_a_lock_of_a_local_folder_cannot_be_vouched_for(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE")
    folder = write_model(tmp_path / "local", ModelSpec(name="localy"))
    lock = tmp_path / "local.lock"
    assert _cli(capsys, "lock", str(folder), "-o", str(lock))[0] == 0
    code, _, err = _cli(capsys, "verify", str(folder), "--lock", str(lock), "--verify-hub")
    assert code == 3
    assert "local folder" in err and "no Hub holds its files" in err


def test_a_lock_pins_commits_only(tmp_path: Path) -> None:
    """A revision or pin that is a branch name (a lock written by hand, or by a tool that
    did not resolve it) is refused: it would float."""
    folder = write_model(tmp_path / "m", ModelSpec(name="pinny"))
    text = codeferry.Lock.from_bundle(codeferry.resolve(folder)).dumps()
    assert "\nrevision -\n" in text
    codeferry.Lock.loads(text.replace("revision -", "revision " + "a" * 40))
    with pytest.raises(LockFormatError, match="a revision or pin is a commit") as caught:
        codeferry.Lock.loads(text.replace("revision -", "revision main"))
    assert caught.value.line == 4
    pinned = text.replace("\nfile ", f"\npin org/other {'b' * 40}\nfile ", 1)
    codeferry.Lock.loads(pinned)
    with pytest.raises(LockFormatError, match="a revision or pin is a commit"):
        codeferry.Lock.loads(pinned.replace("b" * 40, "main"))


def test_a_cached_ref_that_is_not_a_commit_is_refused(tmp_path: Path) -> None:
    write_hub_model(tmp_path, REPO, SPEC)
    ref = tmp_path / f"models--{REPO.replace('/', '--')}" / "refs" / "main"
    ref.write_text("main")
    with pytest.raises(ModelNotFoundError, match="not a commit") as caught:
        codeferry.resolve(REPO, cache_dir=tmp_path)
    assert caught.value.path == str(ref)
