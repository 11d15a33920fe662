"""Lock files, verify, load(lock=...), and verified execution across processes."""

from __future__ import annotations

import multiprocessing as mp
import shutil
from pathlib import Path
from typing import Any

import pytest
from _helpers import TESTS, unique_model

import codeferry
import codeferry._trust.options as _options
from codeferry._code.lockfile import Lock, read_lock
from codeferry.cli import main
from codeferry.errors import LockFormatError, LockMismatchError, TrustRequiredError
from codeferry.testing import ModelSpec, write_model

GOLDEN = TESTS / "golden" / "lock_v1.txt"


def golden_model(root: Path) -> Path:
    return write_model(root / "golden-model", ModelSpec(
        name="gold", helpers=("flat", "subpackage", "try_except"), tokenizer=True, asset=True))


def fresh(root: Path) -> Path:
    return unique_model(root, "k", helpers=("flat",))


def test_lock_format_is_pinned_by_a_golden_file(tmp_path: Path) -> None:
    text = Lock.from_bundle(codeferry.resolve(golden_model(tmp_path))).dumps()
    assert text == GOLDEN.read_text(), "the lock format changed: bump FORMAT_VERSION and the docs"
    assert Lock.loads(text) == Lock.loads(GOLDEN.read_text())


def test_cli_lock_then_verify(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = fresh(tmp_path)
    lockfile = tmp_path / "model.lock"
    assert main(["lock", str(path), "-o", str(lockfile)]) == 0
    assert main(["verify", str(path), "--lock", str(lockfile)]) == 0
    capsys.readouterr()
    layers = path / "layers.py"
    before = read_lock(lockfile)
    layers.write_text(layers.read_text() + "\n# tampered\n")
    (path / "extra.py").write_text("X = 1\n")
    modeling = next(path.glob("modeling_*.py"))
    modeling.write_text("from .extra import X\n" + modeling.read_text())
    assert main(["verify", str(path), "--lock", str(lockfile)]) == 1
    out = capsys.readouterr().out
    old_sha = next(f.sha256 for f in before.files if f.path == "layers.py")
    assert f"changed  layers.py  expected sha256:{old_sha}" in out
    assert "added    extra.py" in out
    assert f"codeferry lock {path} -o {lockfile}" in out


def test_a_lock_is_trust_for_exactly_the_locked_code(tmp_path: Path) -> None:
    path = fresh(tmp_path)
    lockfile = tmp_path / "model.lock"
    lockfile.write_text(Lock.from_bundle(codeferry.resolve(path)).dumps())
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    classes = codeferry.load(copy, lock=lockfile)  # no trust_remote_code: the lock is the trust
    assert "AutoConfig" in classes
    layers = copy / "layers.py"
    layers.write_text(layers.read_text() + "\nX = 1\n")
    with pytest.raises(LockMismatchError) as info:
        codeferry.load(copy, lock=lockfile)
    assert "changed  layers.py" in str(info.value) and "codeferry lock" in str(info.value)
    with pytest.raises(TrustRequiredError):
        codeferry.load(copy)


def test_a_file_swapped_after_the_check_never_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = fresh(tmp_path)
    marker = tmp_path / "swapped-code-ran"
    real_resolve = _options.resolve  # load resolves through its ModelOptions

    def resolve_then_swap(*args: Any, **kwargs: Any) -> Any:
        bundle = real_resolve(*args, **kwargs)  # the bytes are read and hashed here
        layers = path / "layers.py"
        layers.write_text(f"open({str(marker)!r}, 'w').close()\n" + layers.read_text())
        return bundle

    monkeypatch.setattr(_options, "resolve", resolve_then_swap)
    classes = codeferry.load(path, trust_remote_code=True)
    assert not marker.exists()
    import sys

    layers_module = sys.modules[classes["AutoConfig"].__module__.rsplit(".", 1)[0] + ".layers"]
    assert "swapped" not in (layers_module.__loader__.get_source(layers_module.__name__) or "")


def _load_in_worker(path: str, lockfile: str, payload: bytes | None, queue: Any) -> None:
    import pickle

    try:
        codeferry.load(path, lock=lockfile)
        if payload is not None:
            pickle.loads(payload)
        queue.put("ok")
    except Exception as exc:
        queue.put(exc)


def run_worker(*args: Any) -> Any:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_load_in_worker, args=(*args, queue))
    proc.start()
    result = queue.get(timeout=180)
    proc.join(30)
    return result


def test_workers_refuse_tampered_code_and_code_their_lock_does_not_list(tmp_path: Path) -> None:
    from multiprocessing.reduction import ForkingPickler

    from transformers import AutoConfig

    locked, other = fresh(tmp_path), fresh(tmp_path)
    lockfile = tmp_path / "locked.lock"
    lockfile.write_text(Lock.from_bundle(codeferry.resolve(locked)).dumps())
    codeferry.load(other, trust_remote_code=True)  # the parent trusts another model
    payload = bytes(ForkingPickler.dumps(AutoConfig.from_pretrained(other)))
    err = run_worker(str(locked), str(lockfile), payload)
    assert isinstance(err, LockMismatchError) and "none of its locks" in str(err)
    assert run_worker(str(locked), str(lockfile), None) == "ok"
    layers = locked / "layers.py"
    layers.write_text(layers.read_text() + "\n# tampered\n")
    err = run_worker(str(locked), str(lockfile), None)
    assert isinstance(err, LockMismatchError) and "layers.py" in str(err)


GOOD_LOCK = """codeferry-lock 1
model org/name
revision -
digest {digest}
file - {sha} 3 a.py
end
"""


def lock_text(**kw: str) -> str:
    from codeferry._code.digest import bundle_digest
    from codeferry._code.lockfile import LockedFile

    sha = "ab" * 32
    digest = kw.pop("digest", bundle_digest([LockedFile(None, "a.py", sha, 3)]))
    return GOOD_LOCK.format(digest=digest, sha=sha)


@pytest.mark.parametrize("case, text, line", [
    ("truncated", lock_text()[:-5], 5),
    ("unknown version", lock_text().replace("codeferry-lock 1", "codeferry-lock 7"), 1),
    ("digest not of its file list", lock_text(digest="sha256:" + "0" * 64), 4),
    ("malformed line", lock_text().replace("file - ", "file -"), 5),
    ("empty", "", 1),
])
def test_bad_lock_files(tmp_path: Path, case: str, text: str, line: int,
                        capsys: pytest.CaptureFixture[str]) -> None:
    lockfile = tmp_path / "bad.lock"
    lockfile.write_text(text)
    with pytest.raises(LockFormatError) as info:
        read_lock(lockfile)
    assert info.value.path == str(lockfile) and info.value.line == line and info.value.fix
    path = fresh(tmp_path)
    assert main(["verify", str(path), "--lock", str(lockfile)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(lockfile) in err


def test_a_lock_of_another_model(tmp_path: Path, factory_hub_cache: Path) -> None:
    tiny = codeferry.resolve("acme/tiny", cache_dir=factory_hub_cache)
    lock = Lock.from_bundle(tiny)
    other = Lock(lock.model.replace("tiny", "other"), lock.revision, lock.digest, lock.files)
    with pytest.raises(LockMismatchError) as info:
        other.check(tiny)
    assert "acme/other" in str(info.value)
    with pytest.raises(LockMismatchError):
        lock.check(codeferry.resolve(fresh(tmp_path)))


def test_static_commands_never_write_into_the_model_folder(tmp_path: Path) -> None:
    path = fresh(tmp_path)
    before = {p: p.stat().st_mtime_ns for p in path.rglob("*")}
    path.chmod(0o555)
    try:
        assert main(["lock", str(path), "-o", str(tmp_path / "x.lock")]) == 0
        assert main(["verify", str(path), "--lock", str(tmp_path / "x.lock")]) == 0
        codeferry.load(path, trust_remote_code=True)
    finally:
        path.chmod(0o755)
    assert {p: p.stat().st_mtime_ns for p in path.rglob("*")} == before


def test_lock_and_verify_execute_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "executed"
    path = write_model(tmp_path / "marked", ModelSpec(name="marked", helpers=("flat",),
                                                      marker=str(marker)))
    lockfile = tmp_path / "marked.lock"
    assert main(["lock", str(path), "-o", str(lockfile)]) == 0
    assert main(["verify", str(path), "--lock", str(lockfile)]) == 0
    assert not marker.exists()
