"""Files the code reads are the checked bytes, and big assets are not source files.

Each tamper here happens after ``load`` checked the code and before the code (or
transformers, or ``inspect``, or ``torch.jit``) reads the file again: the store copy and
the model folder are rewritten. The tamper must have no effect.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import linecache
import multiprocessing as mp
import os
import pickle
import shutil
import stat
import subprocess
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import codeferry
from codeferry import errors
from codeferry._code.digest import unit_digest
from codeferry._code.lockfile import Lock
from codeferry._code.source import MAX_ASSET_BYTES
from codeferry._runtime import pickling as _pickling
from codeferry._runtime import private as _private
from codeferry._runtime.store import Unit
from codeferry.testing import ModelSpec, write_hub_model, write_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the helper modules
import _asset_workers
from _helpers import TESTS

ASSET_WORKERS = TESTS / "_asset_workers.py"

CONFIG_JSON = {
    "model_type": "tamperlm",
    "auto_map": {"AutoConfig": "configuration_tamperlm.TamperConfig"},
}

CONFIGURATION = '''from transformers import PretrainedConfig

from .ops import boom, read_table, scale  # noqa: F401


class TamperConfig(PretrainedConfig):
    model_type = "tamperlm"
'''

OPS = '''import json
from pathlib import Path

import torch

TABLE = "table.json"


def read_table():
    return json.loads((Path(__file__).parent / TABLE).read_text(encoding="utf-8"))


def scale(x: torch.Tensor) -> torch.Tensor:
    return x * 2  # CHECKED


def boom():
    raise ValueError("from the model")  # CHECKED
'''

TABLE = {"scale": [1.0, 0.5]}


def _writable(path: Path) -> None:
    """Make a store or private-copy file writable again (other layers may lock it down)."""
    os.chmod(path.parent, 0o700)
    if path.exists():
        os.chmod(path, 0o600)


def _tamper(path: Path) -> None:
    _writable(path)
    if path.suffix == ".json":
        path.write_text(json.dumps({"scale": [666.0]}), encoding="utf-8")
    else:
        text = path.read_text(encoding="utf-8")
        path.write_text(text.replace("x * 2", "x * 3").replace("CHECKED", "TAMPERED"),
                        encoding="utf-8")


@pytest.fixture(scope="module")
def tampered(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A model loaded, then its store copy and its folder rewritten behind its back."""
    root = tmp_path_factory.mktemp("tamper") / "model"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(CONFIG_JSON), encoding="utf-8")
    (root / "configuration_tamperlm.py").write_text(CONFIGURATION, encoding="utf-8")
    (root / "ops.py").write_text(OPS + f"# {os.getpid()}\n", encoding="utf-8")
    (root / "table.json").write_text(json.dumps(TABLE), encoding="utf-8")
    classes = codeferry.load(root, trust_remote_code=True)
    config_cls = classes["AutoConfig"]
    registration = _pickling.registration_of(config_cls)
    assert "table.json" in registration.unit.files  # an asset of the unit, hashed with the code
    ops = sys.modules[registration.module_name("ops")]
    for folder in (registration.files_dir, root):
        for name in ("ops.py", "table.json"):
            _tamper(folder / name)
    assert "TAMPERED" in (registration.files_dir / "ops.py").read_text(encoding="utf-8")
    yield {"root": root, "registration": registration, "ops": ops}


def test_asset_read_through_file_after_load_is_the_checked_bytes(tampered: dict[str, Any]) -> None:
    ops, registration = tampered["ops"], tampered["registration"]
    assert ops.read_table() == TABLE
    here = Path(ops.__file__).parent
    assert here == registration.verified_dir() != registration.files_dir
    # the private copy: read-only, in a folder of this process that only its user can enter
    assert stat.S_IMODE(here.stat().st_mode) == 0o500
    assert stat.S_IMODE((here / "table.json").stat().st_mode) == 0o400
    assert stat.S_IMODE(here.parent.stat().st_mode) == 0o700
    assert here.parent.stat().st_uid == os.getuid()
    assert (here / "table.json").read_bytes() == registration.unit.files["table.json"]


def test_getsource_linecache_and_tracebacks_show_the_checked_bytes(tampered: dict[str, Any]) -> None:
    ops, registration = tampered["ops"], tampered["registration"]
    # the strongest tamper a process's own user can do: its private copy too
    _tamper(Path(ops.__file__))
    assert "x * 2" in inspect.getsource(ops.scale)
    linecache.checkcache()  # what a long-running process does now and then
    line = inspect.getsourcelines(ops.scale)[1] + 1
    assert linecache.getline(ops.__file__, line).strip() == "return x * 2  # CHECKED"
    try:
        ops.boom()
    except ValueError:
        text = traceback.format_exc()
    assert 'raise ValueError("from the model")  # CHECKED' in text and "TAMPERED" not in text
    assert ops.__loader__.get_source(ops.__name__) == registration.unit.files["ops.py"].decode()


def test_torch_jit_script_compiles_the_checked_bytes(tampered: dict[str, Any]) -> None:
    import torch

    scripted = torch.jit.script(tampered["ops"].scale)
    assert scripted(torch.tensor([1.0, 2.0])).tolist() == [2.0, 4.0]
    assert "TAMPERED" not in scripted.code and "3" not in scripted.code


def test_autotokenizer_after_load_with_lock_reads_the_checked_vocab(
    factory_models: dict[str, Path], tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    root = shutil.copytree(factory_models["tokenizer"], tmp_path / "tok")
    lock = Lock.from_bundle(codeferry.resolve(root))
    assert any(f.path == "vocab.json" for f in lock.files)  # the vocabulary is locked
    checked = json.loads((root / "vocab.json").read_text(encoding="utf-8"))
    classes = codeferry.load(root, lock=lock)
    swapped = {token: len(checked) - 1 - index for token, index in checked.items()}
    (root / "vocab.json").write_text(json.dumps(swapped), encoding="utf-8")
    tok = AutoTokenizer.from_pretrained(root)
    assert type(tok) in classes["AutoTokenizer"]
    assert tok.get_vocab() == checked
    assert tok.name_or_path == str(root)  # what the caller named, not the private copy
    # a folder codeferry did not load is read as transformers always did
    other = shutil.copytree(root, tmp_path / "other")
    assert AutoTokenizer.from_pretrained(other).get_vocab() == swapped


def test_autotokenizer_of_a_hub_repo_id_reads_the_checked_vocab(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoTokenizer

    cache = tmp_path / "hub"
    snapshot = write_hub_model(cache, "acme/hubtok", ModelSpec(name="hubtok", tokenizer=True))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    checked = json.loads((snapshot / "vocab.json").read_text(encoding="utf-8"))
    codeferry.load("acme/hubtok", trust_remote_code=True)
    swapped = {token: len(checked) - 1 - index for token, index in checked.items()}
    (snapshot / "vocab.json").write_text(json.dumps(swapped), encoding="utf-8")
    tok = AutoTokenizer.from_pretrained("acme/hubtok", cache_dir=str(cache))
    assert tok.get_vocab() == checked


def test_private_copies_of_killed_processes_are_swept(tmp_path: Path) -> None:
    ours = _private._private_root()
    script = (
        "import os, signal, sys\n"
        "from codeferry._runtime import private as _private\n"
        "from codeferry._code.digest import unit_digest\n"
        "from codeferry._runtime.store import Unit\n"
        "files = {'m.py': b'X = 1\\n'}\n"
        "unit = Unit(unit_digest(files), files, ('m',), frozenset(), 'swept')\n"
        "print(_private.verified_dir(unit), flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == -9, done.stderr
    left = Path(done.stdout.strip()).parent
    assert left.is_dir()  # a killed process cannot clean up
    _private._sweep_private()
    assert not left.exists()
    assert ours.is_dir() and ours == _private._private_root()  # a live process's copy stays


def test_a_forked_child_never_removes_its_parents_copy_and_the_parent_does() -> None:
    script = (
        "import os, sys\n"
        "from codeferry._runtime import private as _private\n"
        "from codeferry._code.digest import unit_digest\n"
        "from codeferry._runtime.store import Unit\n"
        "files = {'m.py': b'X = 2\\n'}\n"
        "unit = Unit(unit_digest(files), files, ('m',), frozenset(), 'forked')\n"
        "folder = _private.verified_dir(unit)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    sys.exit(0)  # runs atexit, as a child that returns normally does\n"
        "os.waitpid(pid, 0)\n"
        "print(folder, (folder / 'm.py').read_bytes() == files['m.py'], flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    folder, intact = done.stdout.split()
    assert intact == "True"  # the child's exit left the parent's copy alone
    assert not Path(folder).parent.exists()  # and the parent's exit removed it


def test_private_copy_of_a_unit_deeper_than_the_recursion_limit() -> None:
    rel = "/".join(["d"] * (sys.getrecursionlimit() + 100)) + "/m.py"
    files = {rel: b"X = 1\n"}
    unit = Unit(unit_digest(files), files, (), frozenset(), "deep")
    folder = _private.verified_dir(unit)
    assert (folder / rel).read_bytes() == files[rel]
    assert stat.S_IMODE((folder / rel).parent.stat().st_mode) == 0o500
    del _private._private[unit.token]
    _private._remove_tree(folder)
    assert not folder.exists()


# -- big assets -------------------------------------------------------------------------------

BIG = 9_000_000  # Llama-3's tokenizer.json is about 9 MB


@pytest.fixture(scope="module")
def big_model(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = write_model(tmp_path_factory.mktemp("big") / "model",
                       ModelSpec(name="bigtok", big_asset=BIG, seed=os.getpid() % 1000))
    codeferry.load(root, trust_remote_code=True)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(root)
    data = (root / "tokenizer.json").read_bytes()
    return {"root": root, "config": config, "sha256": hashlib.sha256(data).hexdigest()}


def test_big_asset_loads_and_its_messages_stay_small(big_model: dict[str, Any]) -> None:
    from multiprocessing.reduction import ForkingPickler

    config = big_model["config"]
    assert _asset_workers.asset_report(config)["size"] == BIG  # loads: no SourceTooLargeError
    as_json = len(config.to_json_string())
    assert len(bytes(ForkingPickler.dumps(config))) <= 2 * as_json
    one = len(pickle.dumps(config))
    three = len(pickle.dumps([config, config, config]))
    assert one < BIG / 2  # compressed, once
    assert three < one + 3 * as_json  # the asset travels once per stream, not per config


def test_big_asset_reaches_fresh_processes_verified(
    big_model: dict[str, Any], tmp_path: Path
) -> None:
    config, expected = big_model["config"], big_model["sha256"]
    # a spawned process on this machine: the digest travels, the bytes come from the store
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_asset_workers.child_main, args=(config, queue))
    proc.start()
    got = queue.get(timeout=240)
    proc.join(60)
    assert got.get("sha256") == expected, got
    assert got["file"] != _asset_workers.asset_report(config)["file"]  # its own private copy
    # a fresh interpreter with an empty store (another machine): the bytes travel embedded
    env = dict(os.environ, CODEFERRY_HOME=str(tmp_path / "empty"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    done = subprocess.run([sys.executable, str(ASSET_WORKERS)], input=pickle.dumps([config] * 3),
                          capture_output=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    reports = json.loads(done.stdout)
    assert [r["sha256"] for r in reports] == [expected] * 3


def test_asset_above_the_asset_limit_is_a_typed_error(tmp_path: Path) -> None:
    root = tmp_path / "model"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(CONFIG_JSON), encoding="utf-8")
    (root / "configuration_tamperlm.py").write_text(CONFIGURATION, encoding="utf-8")
    (root / "ops.py").write_text(OPS, encoding="utf-8")
    with open(root / "table.json", "wb") as handle:
        handle.truncate(MAX_ASSET_BYTES + 1)  # sparse: checked by size, never read
    with pytest.raises(errors.AssetTooLargeError) as info:
        codeferry.resolve(root)
    err = info.value
    assert err.size == MAX_ASSET_BYTES + 1 and err.limit == MAX_ASSET_BYTES
    assert err.path is not None and err.path.endswith("table.json")
    assert "1024 MiB" in str(err) and err.fix
    again = pickle.loads(pickle.dumps(err))
    assert (again.size, again.limit, str(again)) == (err.size, err.limit, str(err))


@pytest.mark.parametrize("children", [150, pytest.param(3000, marks=pytest.mark.slow)],
                         ids=["short", "long"])
def test_private_copies_of_processes_starting_together_are_never_swept(children: int) -> None:
    """Every new private folder sweeps the others: one being created right then (its
    ``.alive`` not yet locked) must not look abandoned. Two sweepers in a tight loop
    while two processes fork ``children`` children each that make their folder and check it."""
    window = 60 * children // 150  # seconds the sweepers sweep (they stop when the makers end)
    sweeper = (
        "import time\n"
        "from codeferry._runtime import private as _private\n"
        f"end = time.monotonic() + {window}\n"
        "while time.monotonic() < end:\n"
        "    _private._sweep_private()\n"
    )
    maker = (
        "import os\n"
        "from codeferry._runtime import private as _private\n"
        "lost = 0\n"
        f"for _ in range({children}):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        root = _private._private_root()\n"
        "        os._exit(0 if (root / '.alive').is_file() else 1)\n"
        "    lost += os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0\n"
        "print(lost)\n"
    )
    sweepers = [subprocess.Popen([sys.executable, "-c", sweeper]) for _ in range(2)]
    try:
        makers = [subprocess.Popen([sys.executable, "-c", maker], stdout=subprocess.PIPE,
                                   text=True) for _ in range(2)]
        lost = [int(p.communicate(timeout=2 * window)[0]) for p in makers]
    finally:
        for p in sweepers:
            p.kill()
            p.wait()
    assert all(p.returncode == 0 for p in makers)
    assert lost == [0, 0]
