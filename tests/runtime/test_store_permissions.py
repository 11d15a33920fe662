"""The store belongs to its user: created private, and refused when another user owns or
can write the home, a folder above it, or an entry.

The attacker is a real second user (created once for this module when the tests run as
root) whose writes run in a subprocess under its own uid; the victim is this process.
"""

from __future__ import annotations

import os
import pickle
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from _helpers import SRC

from codeferry._code.digest import unit_digest
from codeferry._runtime.store import Unit, read_unit, write_unit
from codeferry.errors import StorePermissionError, StoreUnavailableError

ATTACKER = "cfstoreattacker"

FILES = {
    "__init__.py": b"",
    "modeling_x.py": b"from .helpers.maths import double\nX = double(21)\n",
    "helpers/__init__.py": b"",
    "helpers/maths.py": b"def double(x):\n    return 2 * x\n",
}


def make_unit() -> Unit:
    return Unit(unit_digest(FILES), FILES, ("helpers", "helpers.maths", "modeling_x", ""),
                    frozenset({"", "helpers"}), "unit-perm")


@dataclass(frozen=True)
class Attacker:
    uid: int
    gid: int

    def run(self, script: str) -> None:
        """Run ``script`` with /bin/sh as the attacker (no root, no supplementary groups)."""

        def drop() -> None:
            os.setgroups([])
            os.setgid(self.gid)
            os.setuid(self.uid)

        done = subprocess.run(["/bin/sh", "-ec", script], preexec_fn=drop, cwd="/",
                              capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, f"the attacker's script failed: {done.stderr}"


@pytest.fixture(scope="module")
def attacker() -> Iterator[Attacker]:
    if os.geteuid() != 0:
        pytest.skip("needs root, to create a second user and act as it")
    if shutil.which("useradd") is None:
        pytest.skip("needs useradd, to create a second user")
    created = subprocess.run(["id", "-u", ATTACKER], capture_output=True).returncode != 0
    if created:
        subprocess.run(["useradd", "--no-create-home", "--user-group", "--shell", "/bin/sh",
                        ATTACKER], check=True, capture_output=True)
    import pwd

    entry = pwd.getpwnam(ATTACKER)
    yield Attacker(entry.pw_uid, entry.pw_gid)
    if created:
        subprocess.run(["userdel", ATTACKER], capture_output=True)


@pytest.fixture
def shared() -> Iterator[Path]:
    """A folder every user can write, like /tmp (sticky bit); reachable by the attacker."""
    folder = Path(tempfile.mkdtemp(prefix="codeferry-shared-", dir="/tmp"))
    folder.chmod(0o1777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _assert_refused(err: StorePermissionError, path: Path) -> None:
    assert isinstance(err, PermissionError)
    assert err.path == str(path)
    assert str(path) in str(err)
    assert err.fix is not None and "CODEFERRY_HOME=/tmp" not in err.fix
    again = pickle.loads(pickle.dumps(err))
    assert (type(again), again.path, again.owner, again.mode, again.fix) == (
        type(err), err.path, err.owner, err.mode, err.fix)


# -- a fresh store is private ----------------------------------------------------------------


def test_fresh_store_has_private_folders_and_files(tmp_path: Path) -> None:
    """Even under umask 0, every folder (missing parents of the home included) is 0700 and
    no file is writable by group or others."""
    home = tmp_path / "a" / "b" / "home"
    old = os.umask(0)
    try:
        write_unit(make_unit(), home / "v1")
    finally:
        os.umask(old)
    seen = [tmp_path / "a", tmp_path / "a" / "b", home]
    for folder, dirs, files in os.walk(home):
        seen += [Path(folder) / d for d in dirs]
        for name in files:
            mode = stat.S_IMODE(os.lstat(Path(folder) / name).st_mode)
            assert mode & 0o022 == 0, f"{folder}/{name} is {oct(mode)}"
            assert mode & 0o077 == 0, f"{folder}/{name} is {oct(mode)}"
    assert len(seen) > 6
    for folder in seen:
        assert stat.S_IMODE(os.lstat(folder).st_mode) == 0o700, folder
    assert read_unit(make_unit().digest, home / "v1") == make_unit()


# -- the home ----------------------------------------------------------------------------------


def test_home_owned_by_another_user_is_refused(
    attacker: Attacker, shared: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The attacker made the folder first (it knew the victim's CODEFERRY_HOME)."""
    home = shared / "codeferry"
    attacker.run(f"mkdir -m 755 {home}")
    monkeypatch.setenv("CODEFERRY_HOME", str(home))
    unit = make_unit()
    with pytest.raises(StorePermissionError) as info:
        write_unit(unit)
    _assert_refused(info.value, home)
    assert info.value.owner == attacker.uid
    assert ATTACKER in str(info.value) and "CODEFERRY_HOME" in (info.value.fix or "")
    assert os.listdir(home) == []  # nothing was written into it
    with pytest.raises(StorePermissionError):
        read_unit(unit.digest)


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o733])
def test_world_writable_home_is_refused(tmp_path: Path, mode: int) -> None:
    home = tmp_path / "home"
    home.mkdir()
    home.chmod(mode)
    with pytest.raises(StorePermissionError) as info:
        write_unit(make_unit(), home / "v1")
    _assert_refused(info.value, home)
    assert info.value.mode == mode and info.value.owner == os.geteuid()
    assert "chmod go-w" in (info.value.fix or "")
    home.chmod(0o755)  # the fix
    write_unit(make_unit(), home / "v1")


def test_group_writable_home_of_another_group_is_refused(
    attacker: Attacker, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    os.chown(home, -1, attacker.gid)
    home.chmod(0o770)
    with pytest.raises(StorePermissionError) as info:
        write_unit(make_unit(), home / "v1")
    _assert_refused(info.value, home)
    # Our own group, which nobody else is in, may write: only we are in it.
    os.chown(home, -1, os.getegid())
    write_unit(make_unit(), home / "v1")
    assert read_unit(make_unit().digest, home / "v1") == make_unit()


def test_symlinked_home_to_a_folder_of_another_user_is_refused(
    attacker: Attacker, shared: Path, tmp_path: Path
) -> None:
    target = shared / "theirs"
    attacker.run(f"mkdir -m 755 {target}")
    home = tmp_path / "home"
    home.symlink_to(target)
    with pytest.raises(StorePermissionError) as info:
        write_unit(make_unit(), home / "v1")
    assert info.value.owner == attacker.uid


# -- folders above the home --------------------------------------------------------------------


def test_home_in_a_shared_folder_without_sticky_bit_is_refused(tmp_path: Path) -> None:
    """Anyone can rename our home away there and put their own in its place."""
    parent = tmp_path / "shared"
    parent.mkdir()
    parent.chmod(0o777)
    home = parent / "home"
    home.mkdir(mode=0o700)
    with pytest.raises(StorePermissionError) as info:
        write_unit(make_unit(), home / "v1")
    _assert_refused(info.value, parent)
    assert "sticky" in str(info.value)
    parent.chmod(0o1777)  # like /tmp: nobody can move what is not theirs
    write_unit(make_unit(), home / "v1")


def test_store_subfolder_made_writable_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "home" / "v1"
    unit = make_unit()
    write_unit(unit, root)
    for sub in ("v1", "v1/units", "v1/locks", "v1/tmp"):
        folder = tmp_path / "home" / sub
        folder.chmod(0o777)
        with pytest.raises(StorePermissionError) as info:
            read_unit(unit.digest, root)
        _assert_refused(info.value, folder)
        with pytest.raises(StorePermissionError):
            write_unit(unit, root)
        folder.chmod(0o700)
    assert read_unit(unit.digest, root) == unit


# -- entries -----------------------------------------------------------------------------------


@pytest.fixture
def victim_store(attacker: Attacker, shared: Path) -> Iterator[tuple[Path, Unit, Path]]:
    """A private store in a shared folder, and a copy of its entry the attacker can read."""
    root = shared / "victim" / "v1"
    unit = make_unit()
    write_unit(unit, root)
    entry = root / "units" / unit.token
    copy = shared / "copy"
    shutil.copytree(entry, copy)
    for folder, _, files in os.walk(copy):
        os.chmod(folder, 0o755)
        for name in files:
            os.chmod(Path(folder) / name, 0o644)
    yield root, unit, copy


def _open_to_others(*folders: Path) -> None:
    """The victim left these open for a while (a careless chmod, an old release's 0777)."""
    for folder in folders:
        folder.chmod(0o777)


def _close(*folders: Path) -> None:
    for folder in folders:
        folder.chmod(0o700)


@pytest.mark.parametrize("what", ["unit", "manifest", "file"])
def test_entry_replaced_by_another_user_is_refused(
    attacker: Attacker, victim_store: tuple[Path, Unit, Path], what: str
) -> None:
    """Even with bytes that match the digest: the attacker can change them at any time."""
    root, unit, copy = victim_store
    entry = root / "units" / unit.token
    home = root.parent
    path = {"unit": entry, "manifest": entry / "manifest.json",
            "file": entry / "files" / "modeling_x.py"}[what]
    opened = [home, root, root / "units"] + {
        "unit": [], "manifest": [entry], "file": [entry, entry / "files"]}[what]
    if what == "unit":
        shutil.rmtree(entry)
    _open_to_others(*opened)
    source = copy / path.relative_to(entry) if what != "unit" else copy
    attacker.run(f"cp -r {source} {path}.new && mv -f {path}.new {path}" if what != "unit"
                 else f"cp -r {source} {path}")
    _close(*opened)
    assert os.lstat(path).st_uid == attacker.uid
    for attempt in (read_unit, write_unit):
        with pytest.raises(StorePermissionError) as info:
            attempt(unit.digest if attempt is read_unit else unit, root)  # type: ignore[operator]
        _assert_refused(info.value, path)
        assert info.value.owner == attacker.uid and info.value.digest is not None
        assert unit.token in (info.value.digest or "")
        assert f"rm -rf {path}" in (info.value.fix or "")
    shutil.rmtree(entry)  # the fix
    write_unit(unit, root)
    assert read_unit(unit.digest, root) == unit


def test_entry_file_made_writable_by_others_is_refused(
    attacker: Attacker, victim_store: tuple[Path, Unit, Path]
) -> None:
    root, unit, _ = victim_store
    entry = root / "units" / unit.token
    target = entry / "files" / "helpers" / "maths.py"
    target.chmod(0o666)
    for folder in (root.parent, root, root / "units", entry, entry / "files",
                   entry / "files" / "helpers"):
        folder.chmod(0o711)  # others may pass through, not list or write
    attacker.run(f"printf 'import os\\n' > {target}")
    with pytest.raises(StorePermissionError) as info:
        read_unit(unit.digest, root)
    _assert_refused(info.value, target)
    assert info.value.mode == 0o666


# -- messages ----------------------------------------------------------------------------------


def test_no_message_suggests_a_shared_store(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(StoreUnavailableError) as info:
        write_unit(make_unit(), blocker / "home" / "v1")
    assert "CODEFERRY_HOME=/tmp" not in (info.value.fix or "")
    for path in SRC.rglob("*.py"):
        text = path.read_text("utf-8")
        assert "CODEFERRY_HOME=/tmp" not in text, path
        assert "/tmp/codeferry" not in text, path
