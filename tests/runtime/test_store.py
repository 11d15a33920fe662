"""The content-addressed store: digests, verification, idempotent and repairing writes,
errors that name the fix, and a short form of ``benchmarks/stress_store.py`` (real
processes at once, a SIGKILLed writer, torn entries)."""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import sys
import time
import types
from pathlib import Path

import pytest
from _helpers import ROOT

from codeferry._code.digest import token_of, unit_digest
from codeferry._runtime import loader as _loader
from codeferry._runtime.store import Unit, read_unit, unit_path, write_unit
from codeferry.errors import StoreCorruptError, StoreUnavailableError

STRESS_SCRIPT = ROOT / "benchmarks" / "stress_store.py"


def _load_stress() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("codeferry_stress_store", STRESS_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while executing it
    spec.loader.exec_module(module)
    return module


stress = _load_stress()


def make_unit(nonce: str = "t") -> Unit:
    files = stress.unit_sources(nonce)
    return Unit(unit_digest(files), files, stress.ORDER, stress.PACKAGES, f"unit-{nonce}")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "store" / "v1"


# -- digests -----------------------------------------------------------------------------------


def test_digest_is_stable_and_independent_of_order() -> None:
    files = {"b.py": b"B = 2\n", "a.py": b"A = 1\n", "pkg/__init__.py": b""}
    # A fixed value: the digest names code across machines and releases.
    expected = "sha256:6cdb23e3634590ec6b442549e4e55b6c1d590b90eca9fd20c4b96538e280c2b8"
    assert unit_digest(files) == unit_digest(dict(reversed(list(files.items()))))
    assert unit_digest(files) == expected
    assert token_of(expected) == expected[7:39]


def test_digest_covers_paths_and_bytes() -> None:
    base = {"a.py": b"A = 1\n"}
    assert unit_digest(base) != unit_digest({"a.py": b"A = 2\n"})
    assert unit_digest(base) != unit_digest({"b.py": b"A = 1\n"})
    assert unit_digest(base) != unit_digest({**base, "c.json": b"{}"})


def test_verify_detects_corruption() -> None:
    unit = make_unit()
    unit.verify()
    files = dict(unit.files)
    files["helpers/maths.py"] = files["helpers/maths.py"].replace(b"2 * x", b"3 * x")
    bad = Unit(unit.digest, files, unit.order, unit.packages, unit.label)
    with pytest.raises(StoreCorruptError) as info:
        bad.verify()
    assert info.value.digest == unit.digest
    assert unit.digest in str(info.value)
    with pytest.raises(StoreCorruptError):
        write_unit(bad, Path("/nonexistent-never-touched"))


# -- writes and reads ------------------------------------------------------------------------


def test_write_then_read_roundtrip(root: Path) -> None:
    unit = make_unit()
    files_dir = write_unit(unit, root)
    assert files_dir == unit_path(unit, root) == root / "units" / unit.token / "files"
    got = read_unit(unit.digest, root)
    assert got == unit
    assert read_unit(unit.token, root) == unit  # by token as well as by digest
    assert stress.read_tree(files_dir) == dict(unit.files)
    assert stress.check_store(root, unit) == []
    assert list((root / "tmp").iterdir()) == []


def test_write_is_idempotent(root: Path) -> None:
    unit = make_unit()
    first = write_unit(unit, root)
    manifest = root / "units" / unit.token / "manifest.json"
    before = (manifest.stat().st_ino, manifest.stat().st_mtime_ns)
    time.sleep(0.01)
    assert write_unit(unit, root) == first
    assert (manifest.stat().st_ino, manifest.stat().st_mtime_ns) == before  # not rewritten
    assert sorted(p.name for p in (root / "units").iterdir()) == [unit.token]
    assert list((root / "tmp").iterdir()) == []


def test_read_of_absent_unit_is_none(root: Path) -> None:
    assert read_unit(make_unit().digest, root) is None


@pytest.mark.parametrize("variant", stress.TORN_VARIANTS)
def test_read_of_torn_entry_is_none(root: Path, variant: str) -> None:
    unit = make_unit()
    stress.write_torn(root, unit, variant)
    assert read_unit(unit.digest, root) is None
    assert stress.check_store(root, unit) != []  # the stress script's check sees it too


@pytest.mark.parametrize("variant", stress.TORN_VARIANTS)
def test_write_repairs_torn_entry(root: Path, variant: str) -> None:
    unit = make_unit()
    stress.write_torn(root, unit, variant)
    write_unit(unit, root)
    assert read_unit(unit.digest, root) == unit
    assert stress.check_store(root, unit) == []
    assert list((root / "tmp").iterdir()) == []  # the broken entry is gone, not parked


def test_write_repairs_entry_corrupted_later(root: Path) -> None:
    unit = make_unit()
    write_unit(unit, root)
    target = root / "units" / unit.token / "files" / "modeling_stress.py"
    target.write_bytes(target.read_bytes()[:100])
    assert read_unit(unit.digest, root) is None
    write_unit(unit, root)
    assert stress.check_store(root, unit) == []


def test_manifest_that_lies_about_a_file_is_broken(root: Path) -> None:
    """Bytes right, manifest hash wrong: not a valid entry (it is rewritten)."""
    unit = make_unit()
    write_unit(unit, root)
    path = root / "units" / unit.token / "manifest.json"
    manifest = json.loads(path.read_text("utf-8"))
    manifest["files"]["table.json"] = "0" * 64
    path.write_text(json.dumps(manifest), "utf-8")
    assert read_unit(unit.digest, root) is None
    write_unit(unit, root)
    assert json.loads(path.read_text("utf-8"))["files"]["table.json"] != "0" * 64
    assert stress.check_store(root, unit) == []


def test_garbage_of_killed_writers_is_cleaned(root: Path) -> None:
    """A killed writer leaves a staging folder (or worse) in tmp/; the next writer drops it."""
    unit, other = make_unit(), make_unit("other")
    (root / "tmp").mkdir(parents=True)
    half = root / "tmp" / f"{unit.token}.4242.deadbeef"
    (half / "files").mkdir(parents=True)
    (half / "files" / "modeling_stress.py").write_bytes(unit.files["modeling_stress.py"][:50])
    (root / "tmp" / f"{unit.token}.broken.cafe").write_bytes(b"a file where a folder was")
    foreign = root / "tmp" / f"{other.token}.1.x"  # another unit's writer: not ours to touch
    foreign.mkdir()
    write_unit(unit, root)
    assert sorted(p.name for p in (root / "tmp").iterdir()) == [foreign.name]
    assert stress.check_store(root, unit) == []


# -- an unwritable store -----------------------------------------------------------------------


def _assert_names_digest_and_fix(err: StoreUnavailableError, unit: Unit) -> None:
    assert isinstance(err, OSError)
    assert err.digest == unit.digest
    assert unit.digest in str(err)
    assert err.fix is not None and "CODEFERRY_HOME" in err.fix
    assert "CODEFERRY_HOME" in str(err)


def test_store_below_a_file_raises_with_digest_and_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Tests run as root, where chmod stops nothing: a path below a regular file cannot be
    # created by anyone.
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("CODEFERRY_HOME", str(blocker / "codeferry"))
    unit = make_unit()
    with pytest.raises(StoreUnavailableError) as info:
        write_unit(unit)  # the store from the environment
    _assert_names_digest_and_fix(info.value, unit)
    assert str(blocker) in str(info.value)
    assert read_unit(unit.digest) is None
    # The loader surfaces the same error, and registers nothing.
    with pytest.raises(StoreUnavailableError):
        _loader.register(unit)
    assert _loader.registered(_loader.default_package(unit)) is None


@pytest.mark.parametrize("failing", ["fsync", "replace"])
def test_failure_mid_write_leaves_no_partial_entry(
    root: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    """Disk full while writing a file, or a read-only remount before the rename."""
    unit = make_unit()
    real_fsync, calls = os.fsync, [0]

    def fsync(fd: int) -> None:
        calls[0] += 1
        if calls[0] == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    def replace(src: object, dst: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    if failing == "fsync":
        monkeypatch.setattr(os, "fsync", fsync)
    else:
        monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(StoreUnavailableError) as info:
        write_unit(unit, root)
    monkeypatch.undo()
    _assert_names_digest_and_fix(info.value, unit)
    assert not os.path.lexists(root / "units" / unit.token)
    assert list((root / "tmp").iterdir()) == []  # the staging folder is gone too
    write_unit(unit, root)  # and the store works once the disk does
    assert stress.check_store(root, unit) == []


# -- the loader executes the verified bytes, never the files ------------------------------------


def test_loader_executes_verified_bytes_not_the_store_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CODEFERRY_HOME", str(tmp_path / "home"))
    nonce = f"loader-{os.getpid()}-{time.time_ns()}"
    unit = make_unit(nonce)
    registration = _loader.register(unit)
    on_disk = registration.files_dir / "helpers" / "maths.py"
    on_disk.write_bytes(b"raise RuntimeError('the store copy was executed')\n")
    for name in unit.order:
        _loader.import_module(registration, name)
    modeling = sys.modules[registration.module_name("modeling_stress")]
    config = modeling.StressConfig(width=stress.WIDTH)
    assert modeling.StressModel(config).forward(stress.INPUTS) == stress.expected_output()
    expected = {path: stress.sha(data) for path, data in unit.files.items()}
    assert stress._check_modules(registration, expected, nonce) == len(unit.order)


# -- the stress run, short -----------------------------------------------------------------------


STRESS_FORMS = [
    # 2 rounds x 8 processes at once on empty stores: one with a writer SIGKILLed mid-write
    # (plus 2 more killed at random), one with a torn entry; no codeferry.load round.
    pytest.param(["--rounds", "2", "--procs", "8", "--kinds", "killed,torn", "--load-every", "0",
                  "--seed", "1", "--timeout", "60"], {"killed", "torn"}, id="short"),
    # The benchmark's own defaults: 20 rounds x 16 processes through every fault kind (clean,
    # slow, killed, torn), every 5th round a real codeferry.load (torch and transformers).
    pytest.param(["--seed", "1"], {"clean", "slow", "killed", "torn", "clean+load",
                                   "slow+load", "killed+load", "torn+load"},
                 id="long", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("argv", "kinds"), STRESS_FORMS)
def test_stress(capsys: pytest.CaptureFixture[str], argv: list[str], kinds: set[str]) -> None:
    """Processes at once on empty stores, with writers SIGKILLed mid-write and torn entries;
    after each round in-place corruption repaired by a wave, and a digest-only reader. The
    long form is ``benchmarks/stress_store.py`` as it runs by default."""
    code = stress.main(argv)
    out = capsys.readouterr().out
    assert code == 0, out
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.split() and line.split()[0] in kinds}
    assert set(rows) == kinds, out
    for kind, cols in rows.items():
        assert cols[4] == "0", f"{kind}: failures\n{out}"
        repaired, torn = cols[5].split("/")
        assert int(repaired) >= int(torn) >= int(cols[1]), out  # a corruption per round, at least
    killed = [cols for kind, cols in rows.items() if kind.startswith("killed")]
    assert all(int(cols[6]) >= 1 for cols in killed), out  # the lock holder died mid-write
    torn_rounds = sum(int(cols[1]) for kind, cols in rows.items() if kind.startswith("torn"))
    torn_entries = sum(int(cols[5].split("/")[1]) for kind, cols in rows.items()
                       if kind.startswith("torn"))
    assert torn_entries == 2 * torn_rounds, out  # a torn entry and a corruption per round
