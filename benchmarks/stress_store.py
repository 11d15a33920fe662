"""Stress the codeferry store: many processes at once, slow writers, killed writers, torn entries.

The requirement: P processes (default 16) that start at the same instant on an *empty*
store and all load the same model never fail, including while a writer is SIGKILLed in
the middle of writing; no half-written file is ever executed; an entry left broken (by a
killed writer, an old buggy writer, or corruption later) is detected and repaired.

Every round gets a NEW empty store (``CODEFERRY_HOME`` names a folder that does not exist
yet) and starts real processes (``subprocess.Popen`` of this script with ``--worker``).
Each one imports codeferry, writes ``ready/<name>``, then spins until the parent creates
the ``start`` file: they all go at once. Rounds cycle through four fault kinds:

``clean``   no fault, only contention: P loaders race to write the unit.
``slow``    a process holds the unit's lock (``filelock.FileLock(store/v1/locks/<token>
            .lock)``) for a while before the loaders go, and a real writer whose ``os.fsync``
            sleeps goes with them: loaders wait, then succeed.
``killed``  a real ``write_unit`` whose ``os.fsync`` sleeps takes the lock first and is
            SIGKILLed at a random moment while loaders wait for it; ``--kill-rate`` of P more
            such writers go with the loaders and are SIGKILLed at random times. A killed
            writer may leave garbage in ``tmp/``, never a broken ``units/<token>``.
``torn``    a broken ``units/<token>/`` written directly, as a killed or buggy old writer
            leaves it (truncated module, no manifest, empty manifest, manifest hashes that
            do not match, a missing file, an empty folder, a plain file, a dangling link,
            another unit's manifest): before the round on even torn rounds, during it
            (while a lock holder keeps the loaders waiting) on odd ones. Readers must
            detect and repair it.

After every round's loaders finish, the valid entry is corrupted in place and a wave of
min(4, P) more loaders starts at once: they must repair it too. Then a process that only
has the digest imports the unit by its content-named package (``codeferry._dyn.u<token>``)
from the store. Finally the parent checks the store itself: ``read_unit`` returns the unit,
the manifest's per-file hashes and every file on disk match the original bytes, and
``units/`` holds nothing else.

A loader builds the unit the way ``codeferry.load`` does after resolving (``Unit`` from
the files), calls ``codeferry._runtime.loader.register(unit)`` (which writes the store) and imports
its modules in order. The unit is pure Python: two modules, a sub-package, relative imports,
and an asset read through ``Path(__file__).parent`` at import (so the store copy is used).
Each module carries the round's nonce and records ``sha256`` of its own source as its loader
gives it; the loader process checks that every executed module came from codeferry's
loader, from exactly the bytes the parent wrote (hash per file, computed by the parent),
and that the classes compute the expected result. Every ``--load-every``-th round uses the
real ``codeferry.load(model, trust_remote_code=True)`` on a factory model instead (imports
torch and transformers, so ``--load-procs`` processes only), with the same faults and checks
(the classes are instantiated and the model runs forward).

Repairs are counted by the loaders themselves (their ``os.replace`` is traced: a move to
``tmp/<token>.broken.*`` is a repair). Any failure exits 1.

Run: ``HF_HUB_OFFLINE=1 python benchmarks/stress_store.py [--rounds 20] [--procs 16]
[--kill-rate 0.25] [--seed 0]``; CI runs a short form from ``tests/runtime/test_store.py``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

HERE = Path(__file__).resolve()
KINDS = ("clean", "slow", "killed", "torn")
TORN_VARIANTS = (
    "truncated",
    "no-manifest",
    "empty-manifest",
    "manifest-hashes",
    "altered-file",
    "missing-file",
    "empty-folder",
    "plain-file",
    "dangling-link",
    "other-digest",
)

# -- the pure-Python unit -------------------------------------------------------------------

ORDER = ("configuration_stress", "helpers.maths", "helpers", "modeling_stress")
PACKAGES = frozenset({"helpers"})
SCALE = 7
WIDTH = 3
INPUTS = [1, 2, 3, 5]

_SELF_HASH = (
    "import hashlib as _hashlib\n"
    "SOURCE_SHA = _hashlib.sha256(__loader__.get_source(__name__).encode('utf-8')).hexdigest()\n"
)


def unit_sources(nonce: str) -> dict[str, bytes]:
    """The unit's files; ``nonce`` makes every round's code (and digest) its own."""
    pad = "".join(f"# padding line {i:04d}: makes a torn copy likely to cut a statement\n"
                  for i in range(200))
    files = {
        "configuration_stress.py": (
            f'"""Stress configuration."""\nNONCE = {nonce!r}\n{_SELF_HASH}\n\n'
            "class StressConfig:\n"
            '    model_type = "stress"\n\n'
            "    def __init__(self, width: int = 1) -> None:\n"
            "        self.width = width\n"
        ),
        "helpers/__init__.py": (
            f"NONCE = {nonce!r}\n{_SELF_HASH}from .maths import double\n"
        ),
        "helpers/maths.py": (
            f"NONCE = {nonce!r}\n{_SELF_HASH}\n\ndef double(x: int) -> int:\n    return 2 * x\n"
        ),
        "modeling_stress.py": (
            f'"""Stress model."""\nimport json\nfrom pathlib import Path\n\n'
            "from . import helpers\n"
            "from .configuration_stress import StressConfig\n"
            "from .helpers import double\n\n"
            f"NONCE = {nonce!r}\n{_SELF_HASH}"
            'TABLE = json.loads((Path(__file__).parent / "table.json").read_text("utf-8"))\n'
            'if TABLE["nonce"] != NONCE or helpers.NONCE != NONCE:\n'
            '    raise RuntimeError("asset or helper from another unit")\n'
            f"{pad}\n\n"
            "class StressModel:\n"
            "    config_class = StressConfig\n\n"
            "    def __init__(self, config: StressConfig) -> None:\n"
            "        self.config = config\n\n"
            "    def forward(self, xs: list[int]) -> list[int]:\n"
            '        return [double(x) * TABLE["scale"] + self.config.width for x in xs]\n'
            f"{pad}"
        ),
        "table.json": json.dumps({"scale": SCALE, "nonce": nonce}),
    }
    return {path: text.encode("utf-8") for path, text in files.items()}


def expected_output() -> list[int]:
    return [2 * x * SCALE + WIDTH for x in INPUTS]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_tree(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*")) if p.is_file()
    }


def build_unit(source: Mapping[str, Any]) -> Any:
    """The round's ``Unit``, built in this process from the files (as a loader would)."""
    from codeferry._code.digest import unit_digest
    from codeferry._runtime.store import Unit

    if source["kind"] == "pure":
        files = read_tree(Path(source["path"]))
        return Unit(unit_digest(files), files, ORDER, PACKAGES, "stress-unit")
    from codeferry._code.resolve import resolve
    from codeferry._runtime.loader import units_of

    return units_of(resolve(source["path"]))[None]


# -- worker processes --------------------------------------------------------------------


def _trace_store(events: dict[str, int]) -> None:
    """Count what this process does to the store (repairs, writes, stale tmp cleaned)."""
    real_replace = os.replace
    real_rmtree = shutil.rmtree

    def replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        name = Path(dst).name
        if ".broken." in name:
            events["repaired"] += 1
        elif Path(dst).parent.name == "units":
            events["wrote"] += 1
        real_replace(src, dst, *args, **kwargs)

    def rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
        if Path(path).parent.name == "tmp" and ".broken." not in Path(path).name:
            events["stale_cleaned"] += 1
        real_rmtree(path, *args, **kwargs)

    os.replace = replace  # type: ignore[assignment]
    shutil.rmtree = rmtree  # type: ignore[assignment]


def _slow_fsync(marker: Path, delay: float, start: Path | None) -> None:
    """Make this process's ``os.fsync`` slow; ``marker`` holds how many calls started.

    With ``start``, the first call also waits for that file: the writer holds the lock in
    the middle of writing until the loaders go.
    """
    real_fsync = os.fsync
    calls = [0]

    def fsync(fd: int) -> None:
        calls[0] += 1
        tmp = marker.with_name(marker.name + ".tmp")
        tmp.write_text(str(calls[0]))
        os.rename(tmp, marker)
        if start is not None and calls[0] == 1:
            while not start.exists():
                time.sleep(0.002)
        time.sleep(delay)
        real_fsync(fd)

    os.fsync = fsync


def _barrier(spec: Mapping[str, Any]) -> None:
    round_dir = Path(spec["round_dir"])
    (round_dir / "ready" / spec["name"]).touch()
    start = round_dir / "start"
    while not start.exists():
        time.sleep(0.002)


def _check_modules(registration: Any, expected: Mapping[str, str], nonce: str | None) -> int:
    """Every executed module of ``registration``: codeferry's loader, exactly the expected bytes."""
    from codeferry._runtime import loader as _loader

    checked = 0
    for fullname, module in list(sys.modules.items()):
        if not fullname.startswith(registration.package + "."):
            continue
        loader = module.__spec__.loader
        if not isinstance(loader, _loader._Loader):
            raise TypeError(f"{fullname} was not executed by codeferry's loader: {loader!r}")
        if loader.rel is None:
            continue
        got = sha(loader.registration.unit.files[loader.rel])
        if got != expected.get(loader.rel):
            raise AssertionError(f"{fullname} executed bytes {got}, expected {expected.get(loader.rel)}")
        if module.__file__ != str(registration.verified_dir() / loader.rel):
            raise AssertionError(f"{fullname}.__file__ is {module.__file__}")
        if nonce is not None and (module.NONCE != nonce or module.SOURCE_SHA != got):
            raise AssertionError(f"{fullname} recorded {module.NONCE} {module.SOURCE_SHA}")
        checked += 1
    return checked


def _load_pure(spec: Mapping[str, Any]) -> dict[str, Any]:
    from codeferry._runtime import loader as _loader

    unit = build_unit(spec["source"])
    registration = _loader.register(unit)
    for name in unit.order:
        _loader.import_module(registration, name)
    modeling = sys.modules[registration.module_name("modeling_stress")]
    out = modeling.StressModel(modeling.StressConfig(width=WIDTH)).forward(INPUTS)
    if out != expected_output():
        raise AssertionError(f"forward gave {out}, expected {expected_output()}")
    checked = _check_modules(registration, spec["expected"]["files"], spec["nonce"])
    if checked != len(ORDER):
        raise AssertionError(f"checked {checked} modules, expected {len(ORDER)}")
    return {"digest": registration.unit.digest, "modules": checked}


def _load_real(spec: Mapping[str, Any]) -> dict[str, Any]:
    import codeferry
    from codeferry._runtime import loader as _loader

    classes = codeferry.load(spec["source"]["path"], trust_remote_code=True)
    config = classes["AutoConfig"]()
    model = classes["AutoModelForCausalLM"](config)
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]])).logits
    if tuple(logits.shape) != (1, 3, config.vocab_size):
        raise AssertionError(f"logits of shape {tuple(logits.shape)}")
    registration = _loader.registered(f"{_loader.PREFIX}.u{spec['expected']['digest'][7:39]}")
    if registration is None or registration.unit.digest != spec["expected"]["digest"]:
        raise AssertionError("the model's unit is not registered under its digest")
    checked = _check_modules(registration, spec["expected"]["files"], None)
    if checked < 2:
        raise AssertionError(f"only {checked} modules executed")
    return {"digest": registration.unit.digest, "modules": checked}


def _read_by_digest(spec: Mapping[str, Any]) -> dict[str, Any]:
    """A process that has only the digest: import the unit's modules from the store."""
    import importlib

    from codeferry._runtime import loader as _loader

    token = spec["expected"]["digest"][7:39]
    for name in spec["modules"]:
        importlib.import_module(f"{_loader.PREFIX}.u{token}.{name}")
    registration = _loader.registered(f"{_loader.PREFIX}.u{token}")
    assert registration is not None
    checked = _check_modules(registration, spec["expected"]["files"], spec.get("nonce"))
    return {"digest": registration.unit.digest, "modules": checked}


def worker_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text("utf-8"))
    result: dict[str, Any] = {"name": spec["name"], "role": spec["role"], "ok": False}
    events = {"repaired": 0, "wrote": 0, "stale_cleaned": 0}
    round_dir = Path(spec["round_dir"])
    try:
        import codeferry._runtime.loader  # noqa: F401  (the imports happen before the barrier)
        from codeferry._runtime.store import store_root, write_unit

        role = spec["role"]
        _trace_store(events)
        if role == "loader":
            _barrier(spec)
            pure = spec["source"]["kind"] == "pure"
            result.update(_load_pure(spec) if pure else _load_real(spec))
        elif role == "reader":
            _barrier(spec)
            result.update(_read_by_digest(spec))
        elif role == "lock-holder":  # takes the unit's lock, then holds it after the start
            from filelock import FileLock

            locks = store_root() / "locks"
            locks.mkdir(parents=True, exist_ok=True)
            token = spec["expected"]["digest"][7:39]
            with FileLock(str(locks / f"{token}.lock")):
                (round_dir / "holding" / spec["name"]).touch()
                _barrier(spec)
                time.sleep(spec["hold"])
        elif role == "slow-writer":  # a real write_unit, slowed down (killed or not)
            unit = build_unit(spec["source"])
            early = bool(spec.get("early"))
            _slow_fsync(round_dir / "writing" / spec["name"], spec["write_delay"],
                        round_dir / "start" if early else None)
            if not early:
                _barrier(spec)
            write_unit(unit)
        else:
            raise ValueError(f"unknown role {role}")
        result["ok"] = True
    except BaseException as exc:
        result["error"] = "".join(traceback.format_exception(exc))
    result["t_ready"] = time.time()
    result["events"] = events
    out = round_dir / "out" / f"{spec['name']}.json"
    out.write_text(json.dumps(result), "utf-8")
    return 0 if result["ok"] else 1


# -- torn entries -----------------------------------------------------------------------------


def write_torn(root: Path, unit: Any, variant: str) -> None:
    """A broken ``units/<token>`` written in place, as a killed or buggy writer leaves it."""
    from codeferry._runtime.store import _manifest

    final = root / "units" / unit.token
    final.parent.mkdir(parents=True, exist_ok=True)
    if variant == "plain-file":
        final.write_bytes(b"\0" * 100)
        return
    if variant == "dangling-link":
        final.symlink_to(final.parent / "gone")
        return
    final.mkdir()
    if variant == "empty-folder":
        return
    files = dict(unit.files)
    manifest = _manifest(unit)
    py = sorted(p for p in files if p.endswith(".py"))
    victim = max(py, key=lambda p: len(files[p]))
    if variant == "truncated":
        files[victim] = files[victim][: len(files[victim]) // 2]
    elif variant == "altered-file":
        files[victim] = files[victim].replace(b"2 * x", b"3 * x").replace(b"import", b"imp0rt", 1)
    elif variant == "missing-file":
        del files[victim]
    elif variant == "manifest-hashes":
        # The bytes are right but the manifest lies about them (a buggy writer).
        manifest["files"][victim] = sha(b"something else")  # type: ignore[index]
    elif variant == "other-digest":
        manifest["digest"] = "sha256:" + sha(b"another unit")
    for path, data in files.items():
        target = final / "files" / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    text = json.dumps(manifest, indent=1, sort_keys=True)
    if variant == "empty-manifest":
        text = ""
    elif variant == "truncated":
        text = text[: len(text) * 2 // 3]
    if variant != "no-manifest":
        (final / "manifest.json").write_text(text, "utf-8")


def corrupt_in_place(root: Path, unit: Any, rng: random.Random) -> str:
    """Break a valid entry after the fact (bit rot, a stray editor, a partial copy)."""
    final = root / "units" / unit.token
    choice = rng.choice(("truncate-module", "garble-manifest", "flip-byte"))
    if choice == "garble-manifest":
        (final / "manifest.json").write_text('{"digest": ', "utf-8")
        return choice
    py = sorted(p for p in unit.files if p.endswith(".py"))
    target = final / "files" / rng.choice(py)
    data = target.read_bytes()
    if choice == "truncate-module":
        target.write_bytes(data[: len(data) // 3])
    else:
        i = rng.randrange(len(data))
        target.write_bytes(data[:i] + bytes([data[i] ^ 0x20]) + data[i + 1:])
    return choice


def check_store(root: Path, unit: Any) -> list[str]:
    """The store after a round: the entry valid, the files on disk exactly the bytes."""
    from codeferry._runtime.store import read_unit

    problems = []
    got = read_unit(unit.digest, root)
    if got is None:
        problems.append("read_unit returned None after the round")
    elif dict(got.files) != dict(unit.files):
        problems.append("read_unit returned other bytes")
    final = root / "units" / unit.token
    try:
        manifest = json.loads((final / "manifest.json").read_text("utf-8"))
        if manifest["digest"] != unit.digest:
            problems.append("manifest digest differs")
        if manifest["files"] != {p: sha(b) for p, b in unit.files.items()}:
            problems.append("manifest file hashes differ from the bytes")
        if read_tree(final / "files") != dict(unit.files):
            problems.append("files on disk differ from the unit's bytes")
    except (OSError, ValueError, KeyError) as exc:
        problems.append(f"entry unreadable: {exc}")
    others = sorted(p.name for p in (root / "units").iterdir() if p.name != unit.token)
    if others:
        problems.append(f"units/ holds other entries: {others}")
    return problems


# -- rounds -----------------------------------------------------------------------------------


@dataclass
class Row:
    rounds: int = 0
    procs: int = 0
    faults: int = 0
    failures: int = 0
    repairs: int = 0
    torn: int = 0
    mid_write_kills: int = 0
    tmp_garbage: int = 0
    ready: list[float] = field(default_factory=list)


@dataclass
class Options:
    procs: int
    load_procs: int
    kill_rate: float
    write_delay: float
    hold: float
    timeout: float
    verbose: bool
    seed: int


class Round:
    def __init__(self, index: int, kind: str, occurrence: int, real: bool, work: Path,
                 source: dict[str, Any], unit: Any, nonce: str | None, opts: Options,
                 rng: random.Random) -> None:
        self.index, self.kind, self.real, self.opts, self.rng = index, kind, real, opts, rng
        self.occurrence = occurrence  # rounds of this kind before this one
        self.dir = work / f"round-{index:03d}"
        self.store = self.dir / "store"  # CODEFERRY_HOME; does not exist yet
        self.root = self.store / "v1"
        self.source, self.unit, self.nonce = source, unit, nonce
        self.expected = {"digest": unit.digest,
                         "files": {p: sha(b) for p, b in unit.files.items()}}
        self.procs: dict[str, tuple[subprocess.Popen[bytes], dict[str, Any]]] = {}
        self.failures: list[str] = []
        self.row_events = {"repaired": 0, "torn": 0, "mid_write_kills": 0}
        self.ready: list[float] = []
        for sub in ("ready", "holding", "writing", "out", "specs", "logs"):
            (self.dir / sub).mkdir(parents=True)
        self.env = dict(os.environ, CODEFERRY_HOME=str(self.store), HF_HUB_OFFLINE="1",
                        OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                        HF_MODULES_CACHE=str(self.dir / "hf-modules"))
        self.env.pop("PYTHONSTARTUP", None)
        self.start_time = 0.0

    def spawn(self, name: str, role: str, **extra: Any) -> subprocess.Popen[bytes]:
        spec = {"name": name, "role": role, "round_dir": str(self.dir), "source": self.source,
                "expected": self.expected, "nonce": self.nonce, **extra}
        path = self.dir / "specs" / f"{name}.json"
        path.write_text(json.dumps(spec), "utf-8")
        log = open(self.dir / "logs" / f"{name}.log", "wb")
        proc = subprocess.Popen([sys.executable, str(HERE), "--worker", str(path)],
                                env=self.env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.procs[name] = (proc, spec)
        return proc

    def wait_for(self, folder: str, names: Sequence[str]) -> None:
        deadline = time.time() + self.opts.timeout
        while not all((self.dir / folder / n).exists() for n in names):
            dead = [n for n in names if self.procs[n][0].poll() is not None
                    and not (self.dir / folder / n).exists()]
            if dead:
                raise RuntimeError(f"{dead} exited before reaching {folder}/")
            if time.time() > deadline:
                raise RuntimeError(f"timed out waiting for {folder}/ of {names}")
            time.sleep(0.005)

    def go(self) -> None:
        self.start_time = time.time()
        (self.dir / "start").touch()

    def reset_barrier(self) -> None:
        (self.dir / "start").unlink()
        for p in (self.dir / "ready").iterdir():
            p.unlink()

    def loaders(self, prefix: str, count: int, role: str = "loader", **extra: Any) -> list[str]:
        names = [f"{prefix}{i:02d}" for i in range(count)]
        for name in names:
            self.spawn(name, role, **extra)
        return names

    def finish(self, names: Sequence[str], must_succeed: bool = True) -> None:
        deadline = time.time() + self.opts.timeout
        for name in names:
            proc, spec = self.procs[name]
            try:
                rc = proc.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                rc = None
            if not must_succeed:
                continue
            out = self.dir / "out" / f"{name}.json"
            result = json.loads(out.read_text("utf-8")) if out.exists() else {}
            self.row_events["repaired"] += result.get("events", {}).get("repaired", 0)
            if rc != 0 or not result.get("ok"):
                log = (self.dir / "logs" / f"{name}.log").read_text("utf-8", "replace")
                why = result.get("error") or log or f"exit status {rc}"
                self.failures.append(f"{name} ({spec['role']}) failed: {why.strip()[-2000:]}")
                continue
            if spec["role"] == "loader":
                if result.get("digest") != self.unit.digest:
                    self.failures.append(f"{name} loaded digest {result.get('digest')}")
                self.ready.append(result["t_ready"] - self.start_time)

    def kill_at(self, schedule: Sequence[tuple[float, str]]) -> None:
        """SIGKILL each writer at its time (seconds after the start); count mid-write kills."""
        nfiles = len(self.unit.files)
        for at, name in sorted(schedule):
            time.sleep(max(0.0, self.start_time + at - time.time()))
            proc = self.procs[name][0]
            if proc.poll() is not None:
                continue  # it finished (found the unit valid, or wrote it) before its time
            marker = self.dir / "writing" / name
            calls = int(marker.read_text() or 0) if marker.exists() else 0
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            if 1 <= calls <= nfiles + 1:  # sleeping in the fsync of a file or the manifest
                self.row_events["mid_write_kills"] += 1

    def run(self) -> None:
        opts, rng = self.opts, self.rng
        n = opts.load_procs if self.real else opts.procs
        main_names: list[str] = []
        delay = opts.write_delay
        write_time = delay * (len(self.unit.files) + 1)
        if self.kind == "slow":
            hold = opts.hold * rng.uniform(0.5, 1.0)
            self.spawn("holder", "lock-holder", hold=hold)
            self.wait_for("holding", ["holder"])
            main_names = self.loaders("loader", n)
            self.spawn("slowwriter", "slow-writer", write_delay=delay)
            self.wait_for("ready", ["holder", *main_names, "slowwriter"])
            self.go()
            self.finish(["holder", "slowwriter"])
        elif self.kind == "killed":
            extra = max(0, round(opts.kill_rate * n))
            self.spawn("killed00", "slow-writer", early=True, write_delay=delay)
            self.wait_for("writing", ["killed00"])  # it holds the lock, in the middle of writing
            main_names = self.loaders("loader", n)
            killers = [f"killed{i:02d}" for i in range(1, extra + 1)]
            for name in killers:
                self.spawn(name, "slow-writer", write_delay=delay)
            self.wait_for("ready", [*main_names, *killers])
            self.go()
            schedule = [(rng.uniform(0.0, write_time * 0.8), "killed00")]
            schedule += [(rng.uniform(0.0, write_time * 3), k) for k in killers]
            self.kill_at(schedule)
            self.finish(["killed00", *killers], must_succeed=False)
        elif self.kind == "torn":
            variant = TORN_VARIANTS[(self.occurrence + opts.seed) % len(TORN_VARIANTS)]
            during = self.occurrence % 2 == 1
            if not during:
                write_torn(self.root, self.unit, variant)
                self.row_events["torn"] += 1
                main_names = self.loaders("loader", n)
                self.wait_for("ready", main_names)
                self.go()
            else:
                hold = max(0.2, opts.hold * 0.5)
                self.spawn("holder", "lock-holder", hold=hold)
                main_names = self.loaders("loader", n)
                self.wait_for("ready", ["holder", *main_names])
                self.go()
                self.wait_for("holding", ["holder"])
                time.sleep(hold * rng.uniform(0.2, 0.6))  # loaders are waiting for the lock
                write_torn(self.root, self.unit, variant)
                self.row_events["torn"] += 1
                self.finish(["holder"])
            if opts.verbose:
                print(f"  round {self.index}: torn entry {variant!r}, "
                      f"{'during' if during else 'before'} the round")
        else:
            main_names = self.loaders("loader", n)
            self.wait_for("ready", main_names)
            self.go()
        self.finish(main_names)
        self.failures += [f"after the loaders: {p}" for p in check_store(self.root, self.unit)]

        # Corrupt the valid entry in place; a wave of loaders starting at once repairs it.
        how = corrupt_in_place(self.root, self.unit, rng)
        self.row_events["torn"] += 1
        self.reset_barrier()
        wave = self.loaders("wave", min(4, n))
        self.wait_for("ready", wave)
        self.go()
        self.finish(wave)
        self.failures += [f"after the wave ({how}): {p}" for p in check_store(self.root, self.unit)]

        if not self.real:  # a process with only the digest reads the unit from the store
            self.reset_barrier()
            self.spawn("reader", "reader", modules=list(ORDER))
            self.wait_for("ready", ["reader"])
            self.go()
            self.finish(["reader"])
        self.tmp_garbage = len(list((self.root / "tmp").iterdir())) if (self.root / "tmp").exists() else 0
        self.loader_count = len(main_names) + len(wave) + (0 if self.real else 1)
        self.fault_count = sum(1 for _, spec in self.procs.values()
                               if spec["role"] in ("lock-holder", "slow-writer"))
        self.fault_count += self.row_events["torn"]

    def cleanup(self) -> None:
        for proc, _ in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _pure_source(work: Path, index: int, seed: int) -> tuple[dict[str, Any], str]:
    nonce = f"seed{seed}-round{index}-{os.urandom(4).hex()}"
    folder = work / f"round-{index:03d}-src"
    for path, data in unit_sources(nonce).items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_bytes(data)
    return {"kind": "pure", "path": str(folder)}, nonce


def _write_factory_model(work: Path) -> Path:
    """The real model, written by a child (the factory imports torch for the weights)."""
    dest = work / "model"
    code = ("import sys; from codeferry.testing import ModelSpec, write_model; "
            "write_model(sys.argv[1], ModelSpec(name='stress', asset=True))")
    subprocess.run([sys.executable, "-c", code, str(dest)], check=True)
    return dest


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--procs", type=int, default=16, help="loaders started at once per round")
    parser.add_argument("--kill-rate", type=float, default=0.25,
                        help="in killed rounds, this fraction of --procs more writers are "
                        "SIGKILLed at random times (besides the one killed holding the lock)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help=f"fault kinds the rounds cycle through (of {', '.join(KINDS)})")
    parser.add_argument("--load-every", type=int, default=5,
                        help="every Nth round uses the real codeferry.load (0: never)")
    parser.add_argument("--load-procs", type=int, default=4,
                        help="processes in the real codeferry.load rounds")
    parser.add_argument("--write-delay", type=float, default=0.05,
                        help="seconds each fsync of a slowed writer sleeps")
    parser.add_argument("--hold", type=float, default=1.0, help="seconds a slow lock holder holds")
    parser.add_argument("--timeout", type=float, default=180.0, help="per-phase timeout (s)")
    parser.add_argument("--workdir", help="keep the rounds here (default: a temp folder, removed)")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main(args.worker)

    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if not kinds or any(k not in KINDS for k in kinds):
        parser.error(f"--kinds takes a comma-separated subset of {KINDS}")
    rng = random.Random(args.seed)
    opts = Options(args.procs, args.load_procs, args.kill_rate, args.write_delay, args.hold,
                   args.timeout, args.verbose, args.seed)
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="codeferry-stress-"))
    work.mkdir(parents=True, exist_ok=True)
    rows: dict[str, Row] = {}
    failures: list[str] = []
    model: Path | None = None
    real_unit: Any = None
    seen: dict[str, int] = {}
    began = time.time()
    try:
        for index in range(args.rounds):
            kind = kinds[index % len(kinds)]
            occurrence = seen[kind] = seen.get(kind, -1) + 1
            real = args.load_every > 0 and index % args.load_every == args.load_every - 1
            if real:
                if model is None:
                    model = _write_factory_model(work)
                    real_unit = build_unit({"kind": "model", "path": str(model)})
                source: dict[str, Any] = {"kind": "model", "path": str(model)}
                unit, nonce = real_unit, None
            else:
                source, nonce = _pure_source(work, index, args.seed)
                unit = build_unit(source)
            rnd = Round(index, kind, occurrence, real, work, source, unit, nonce, opts, rng)
            t0 = time.time()
            try:
                rnd.run()
            except Exception as exc:
                rnd.failures.append(f"round aborted: {type(exc).__name__}: {exc}")
                rnd.loader_count = getattr(rnd, "loader_count", 0)
                rnd.fault_count = getattr(rnd, "fault_count", 0)
                rnd.tmp_garbage = 0
            finally:
                rnd.cleanup()
            row = rows.setdefault(kind + ("+load" if real else ""), Row())
            row.rounds += 1
            row.procs += rnd.loader_count
            row.faults += rnd.fault_count
            row.failures += len(rnd.failures)
            row.repairs += rnd.row_events["repaired"]
            row.torn += rnd.row_events["torn"]
            row.mid_write_kills += rnd.row_events["mid_write_kills"]
            row.tmp_garbage += rnd.tmp_garbage
            row.ready += rnd.ready
            failures += [f"round {index} ({kind}{'+load' if real else ''}): {f}" for f in rnd.failures]
            if args.verbose or rnd.failures:
                print(f"round {index:3d} {kind:7s}{' load' if real else '     '} "
                      f"{time.time() - t0:6.2f}s  failures={len(rnd.failures)} "
                      f"repairs={rnd.row_events['repaired']}/{rnd.row_events['torn']}",
                      flush=True)
            if rnd.row_events["repaired"] < rnd.row_events["torn"]:
                failures.append(f"round {index}: {rnd.row_events['torn']} torn entries, only "
                                f"{rnd.row_events['repaired']} repairs observed")
                row.failures += 1
    finally:
        if not args.workdir and not failures:
            shutil.rmtree(work, ignore_errors=True)

    header = (f"{'fault kind':12s} {'rounds':>6s} {'procs':>6s} {'faults':>6s} {'failures':>8s} "
              f"{'repairs':>9s} {'killed mid-write':>16s} {'tmp garbage':>11s} "
              f"{'median ready':>12s} {'max ready':>9s}")
    print(f"\ncodeferry store stress: {args.rounds} rounds, {args.procs} procs "
          f"({args.load_procs} in codeferry.load rounds), seed {args.seed}, "
          f"{time.time() - began:.1f}s")
    print(header)
    print("-" * len(header))
    order = [k + s for s in ("", "+load") for k in KINDS]
    for key in [k for k in order if k in rows]:
        row = rows[key]
        med = f"{statistics.median(row.ready):.3f}s" if row.ready else "-"
        top = f"{max(row.ready):.3f}s" if row.ready else "-"
        print(f"{key:12s} {row.rounds:6d} {row.procs:6d} {row.faults:6d} {row.failures:8d} "
              f"{f'{row.repairs}/{row.torn}':>9s} {row.mid_write_kills:16d} "
              f"{row.tmp_garbage:11d} {med:>12s} {top:>9s}")
    print("procs: loader processes (all must exit 0); faults: slow/killed writer processes and "
          "torn entries; repairs: observed/torn entries (in-place corruption after each round "
          "counts as one); ready: seconds from the common start to verified classes.")
    if failures:
        print(f"\n{len(failures)} FAILURES (work folder kept: {work}):")
        for f in failures:
            print(f"  {f}")
        return 1
    print("OK: no failures.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
