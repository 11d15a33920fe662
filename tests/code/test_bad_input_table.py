"""The bad-input table of the trust issue: every row a typed error, a one-line CLI failure,
and nothing half-written (no output file, no store entry for the refused code)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from _helpers import unique_model

import codeferry
from codeferry import errors
from codeferry._code.lockfile import Lock
from codeferry._runtime.store import read_unit, store_root
from codeferry.cli import main

LFS = b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"0" * 64 + b"\nsize 1234\n"


def model(root: Path) -> Path:
    return unique_model(root, "b", helpers=("flat",))


def locked(root: Path) -> tuple[Path, Path]:
    path = model(root)
    lockfile = root / "model.lock"
    lockfile.write_text(Lock.from_bundle(codeferry.resolve(path)).dumps())
    return path, lockfile


def truncated_lock(root: Path) -> tuple[Path, list[str]]:
    path, lockfile = locked(root)
    lockfile.write_text(lockfile.read_text()[:-20])
    return path, ["verify", str(path), "--lock", str(lockfile)]


def unknown_version(root: Path) -> tuple[Path, list[str]]:
    path, lockfile = locked(root)
    lockfile.write_text(lockfile.read_text().replace("codeferry-lock 1", "codeferry-lock 9"))
    return path, ["doctor", str(path), "--lock", str(lockfile)]


def digest_not_of_its_files(root: Path) -> tuple[Path, list[str]]:
    path, lockfile = locked(root)
    text = lockfile.read_text()
    lockfile.write_text(text.replace(" layers.py", " layers2.py"))
    return path, ["doctor", str(path), "--lock", str(lockfile)]


def lock_of_another_model(root: Path) -> tuple[Path, list[str]]:
    _, lockfile = locked(root / "one")
    other = model(root / "two")
    return other, ["doctor", str(other), "--lock", str(lockfile)]


def changed_between_lock_and_load(root: Path) -> tuple[Path, list[str]]:
    path, lockfile = locked(root)
    (path / "layers.py").write_text((path / "layers.py").read_text() + "\n# changed\n")
    return path, ["doctor", str(path), "--lock", str(lockfile)]


def lfs_pointer(root: Path) -> tuple[Path, list[str]]:
    path = model(root)
    (path / "layers.py").write_bytes(LFS)
    return path, ["doctor", str(path), "--trust-remote-code"]


def not_python(root: Path) -> tuple[Path, list[str]]:
    path = model(root)
    (path / "layers.py").write_text("def broken(:\n")
    return path, ["doctor", str(path), "--trust-remote-code"]


def read_only_store(root: Path) -> tuple[Path, list[str]]:
    path = model(root)
    blocker = root / "not-a-folder"
    blocker.write_text("a file where the store's parent folder should be")
    os.environ["CODEFERRY_HOME"] = str(blocker / "store")  # restored by the test
    return path, ["doctor", str(path), "--trust-remote-code"]


ROWS: dict[str, tuple[Callable[[Path], tuple[Path, list[str]]], type[errors.CodeferryError]]] = {
    "truncated lock file": (truncated_lock, errors.LockFormatError),
    "lock of an unknown format version": (unknown_version, errors.LockFormatError),
    "lock whose digest does not match its file list": (digest_not_of_its_files, errors.LockFormatError),
    "lock of another model": (lock_of_another_model, errors.LockMismatchError),
    "files changed between lock and load": (changed_between_lock_and_load, errors.LockMismatchError),
    "Git LFS pointer where code should be": (lfs_pointer, errors.LFSPointerError),
    "file that is not valid Python": (not_python, errors.SourceSyntaxError),
    "read-only store": (read_only_store, errors.StoreUnavailableError),
}


@pytest.mark.parametrize("row", sorted(ROWS))
def test_bad_input_row(row: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    setup, kind = ROWS[row]
    saved = os.environ["CODEFERRY_HOME"]
    try:
        path, argv = setup(tmp_path)
        digest = codeferry.resolve(path).digest
        units_before = set((store_root() / "units").glob("*")) if (store_root() / "units").exists() else set()
        before = sorted(p for p in tmp_path.rglob("*"))
        code = main(argv)
        err = capsys.readouterr().err
        assert code == 1
        assert err.count("\n") == 1 and err.startswith("codeferry: error: ") and "Traceback" not in err
        # the same input through the API: the typed error, with its location and a fix
        with pytest.raises(kind) as info:
            if argv[0] == "verify":
                codeferry.read_lock(argv[-1])
            else:
                lock = argv[argv.index("--lock") + 1] if "--lock" in argv else None
                codeferry.load(path, trust_remote_code=lock is None, lock=lock, strict=True)
        assert info.value.fix
        assert sorted(p for p in tmp_path.rglob("*")) == before  # nothing written
        units_after = set((store_root() / "units").glob("*")) if (store_root() / "units").exists() else set()
        assert units_after == units_before  # no store entry for refused code
        assert read_unit(digest) is None or row == "read-only store"
    finally:
        os.environ["CODEFERRY_HOME"] = saved


def test_corrupted_store_entry_is_rebuilt_when_the_bytes_are_at_hand_else_refused(
    tmp_path: Path,
) -> None:
    from codeferry._runtime import loader as _loader
    from codeferry._runtime import pickling as _pickling

    path = model(tmp_path)
    classes = codeferry.load(path, trust_remote_code=True)
    package = classes["AutoConfig"].__module__.rsplit(".", 1)[0]
    token = package.rsplit(".u", 1)[1]
    entry = store_root() / "units" / token
    victim = next(p for p in (entry / "files").rglob("*.py"))
    victim.write_text("# corrupted on disk\n")
    assert read_unit(token) is None  # detected
    # refused where only the digest is at hand (a process that reads the store)
    with pytest.raises(errors.CodeUnavailableError):
        _pickling._arrive_ref("transformers_modules.corrupted.entry", token)
    # rebuilt by a process that has the verified bytes
    from codeferry._runtime.store import write_unit

    write_unit(_loader.registered(package).unit)  # type: ignore[union-attr]
    assert read_unit(token) is not None
    shutil.rmtree(tmp_path / path.name)
