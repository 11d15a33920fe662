"""The store belongs to its user: created private, and refused when another user owns or
can write the home, a folder above it, or an entry.

The attacker is a real second user (created once for this module when the tests run as
root) whose writes run in a subprocess under its own uid; the victim is this process.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import stat
import subprocess
import sys
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

    def run(self, script: str, *, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run ``script`` with /bin/sh as the attacker (no root, no supplementary groups)."""

        def drop() -> None:
            os.setgroups([])
            os.setgid(self.gid)
            os.setuid(self.uid)

        done = subprocess.run(["/bin/sh", "-ec", script], preexec_fn=drop, cwd="/",
                              capture_output=True, text=True, timeout=30)
        assert done.returncode == 0 or not check, f"the attacker's script failed: {done.stderr}"
        return done


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


# -- private copies ----------------------------------------------------------------------------

#: A process that loads a tokenizer model with TMPDIR in the shared folder, says where its
#: private copy is, waits, then reads the vocabulary through transformers as any caller does.
VICTIM = r"""
import glob, json, os, sys
from pathlib import Path
import codeferry
from codeferry.errors import StorePermissionError
model = sys.argv[1]
try:
    codeferry.load(model, trust_remote_code=True)
except StorePermissionError as exc:
    print("REFUSED", json.dumps({"path": exc.path, "text": str(exc)}), flush=True)
    sys.exit(0)
(folder,) = glob.glob(os.path.join(os.environ["TMPDIR"], f"codeferry-private-{os.getpid()}-*"))
units = [p.name for p in Path(folder).iterdir() if (p / "vocab.json").is_file()]
print("READY", json.dumps({"folder": folder, "units": units}), flush=True)
sys.stdin.readline()
from transformers import AutoTokenizer
print("VOCAB", json.dumps(AutoTokenizer.from_pretrained(model).get_vocab()), flush=True)
"""


def _readable(folder: Path) -> None:
    for where, _, files in os.walk(folder):
        os.chmod(where, 0o755)
        for name in files:
            os.chmod(Path(where) / name, 0o644)


def _child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


@pytest.mark.parametrize("mode", [0o777, 0o1777], ids=["not-sticky", "sticky"])
def test_private_copy_only_where_no_other_user_can_swap_it(
    attacker: Attacker, shared: Path, tmp_path: Path, mode: int
) -> None:
    """TMPDIR in a folder every user can write: without the sticky bit another user can
    rename a root process's private copy away and put a copy of theirs under its name, whose
    vocab.json the tokenizer would read, and whose files the clean-up at exit would delete.
    Such a folder is refused before anything is written; with the sticky bit (/tmp) it is
    fine, and the rename fails."""
    from codeferry.testing import ModelSpec, write_model

    shared.chmod(mode)
    model = write_model(shared / "model", ModelSpec(name=f"swap{mode:o}", tokenizer=True))
    _readable(model)
    checked = json.loads((model / "vocab.json").read_text(encoding="utf-8"))
    swapped = {token: len(checked) - 1 - index for token, index in checked.items()}
    planted = shared / "planted.json"
    planted.write_text(json.dumps(swapped), encoding="utf-8")
    planted.chmod(0o644)
    with open(tmp_path / "victim.err", "w") as err:
        victim = subprocess.Popen([sys.executable, "-c", VICTIM, str(model)], text=True,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                  env=_child_env(TMPDIR=str(shared)))
    try:
        assert victim.stdout is not None and victim.stdin is not None
        kind, _, data = victim.stdout.readline().partition(" ")
        assert kind in ("READY", "REFUSED"), (tmp_path / "victim.err").read_text()[-3000:]
        if mode == 0o1777 or kind == "READY":
            info = json.loads(data)
            folder = Path(info["folder"])
            assert info["units"], "the private copy holds no vocab.json"
            swap = attacker.run(
                f"mv {folder} {folder}.gone && mkdir {folder}" + "".join(
                    f" && mkdir {folder}/{u} && cp -r {model}/. {folder}/{u}/"
                    f" && cp {planted} {folder}/{u}/vocab.json" for u in info["units"]),
                check=False)
            planted_files = len(list(folder.rglob("*"))) if swap.returncode == 0 else 0
            victim.stdin.write("go\n")
            victim.stdin.flush()
            read = json.loads(victim.stdout.readline().partition(" ")[2])
            assert victim.wait(120) == 0
            theirs = sorted(p.name for p in folder.rglob("*")) if swap.returncode == 0 else []
            assert read == checked and mode == 0o1777, (
                f"the victim read the {'planted' if read == swapped else 'checked'} "
                f"vocab.json; its clean-up at exit left {len(theirs)} of the {planted_files} "
                "files the attacker put in the folder it put in its place")
            assert swap.returncode != 0  # sticky: nobody moves what is not theirs
            assert not folder.exists()  # and the victim removed its own copy at exit
            return
        refused = json.loads(data)
        assert refused["path"] == str(shared)
        assert "TMPDIR" in refused["text"] and "sticky" in refused["text"]
        assert victim.wait(120) == 0
        assert list(shared.glob("codeferry-private-*")) == []  # nothing written there
    finally:
        victim.kill()
        victim.wait()


#: Makes its private copy in TMPDIR, prints the copy's folder, exits when told.
MAKER = r"""
import sys
from codeferry._code.digest import unit_digest
from codeferry._runtime import loader
from codeferry._runtime.store import Unit
files = {"m.py": b"X = 1\n", "sub/t.json": b"{}"}
unit = Unit(unit_digest(files), files, ("m",), frozenset(), "cleaned")
print(loader.verified_dir(unit).parent, flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize("swap", ["link", "their-folder"])
def test_clean_up_at_exit_never_follows_what_was_put_in_place_of_the_copy(
    attacker: Attacker, tmp_path: Path, swap: str
) -> None:
    """The process's folder renamed away and, under its name, a link to a folder of files
    or a folder of another user's: the clean-up at exit removes neither those files nor
    theirs (it opens its folder without following a link, and checks it is the one it made)."""
    temp = tmp_path / "temp"
    temp.mkdir(mode=0o700)
    precious = tmp_path / "precious"
    (precious / "inner").mkdir(parents=True)
    (precious / "keep.txt").write_text("keep")
    (precious / "inner" / "keep.txt").write_text("keep")
    precious.chmod(0o755)
    maker = subprocess.Popen([sys.executable, "-c", MAKER], text=True, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, env=_child_env(TMPDIR=str(temp)))
    try:
        assert maker.stdout is not None and maker.stdin is not None
        folder = Path(maker.stdout.readline().strip())
        assert folder.parent == temp, folder
        folder.rename(folder.parent / "moved-away")
        if swap == "link":
            folder.symlink_to(precious)
            kept = precious
        else:
            shutil.copytree(precious, folder)
            for where, _, files in os.walk(folder):
                os.chown(where, attacker.uid, attacker.gid)
                for name in files:
                    os.chown(Path(where) / name, attacker.uid, attacker.gid)
            kept = folder
        modes = {p: stat.S_IMODE(os.lstat(p).st_mode) for p in [kept, *kept.rglob("*")]}
        maker.stdin.write("exit\n")
        maker.stdin.flush()
        assert maker.wait(120) == 0
        after = {p: stat.S_IMODE(os.lstat(p).st_mode) for p in [kept, *kept.rglob("*")]
                 if os.path.lexists(p)}
        assert after == modes, "the clean-up removed or changed files that were not its own"
    finally:
        maker.kill()
        maker.wait()


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
