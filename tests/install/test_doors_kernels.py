"""Hub kernels (the ``kernels`` package): a model whose config names a kernel repo as its
attention makes transformers fetch and import that repo's code with no ``trust_remote_code``
(CVE-2026-4372's pattern). codeferry refuses it before anything is fetched or imported:
under a lock always (no lock lists a kernel), without one unless the caller trusts the model
or named the kernel itself; in this process and in spawned workers that install codeferry.

A kernel repo is written into the offline hub cache (``kernels--org--name``, a universal
build) whose code writes a MARK file when imported, and every refusal asserts the MARK absent.
This environment has no ``kernels`` release that transformers 5.23 accepts (it wants
>= 0.18.2), so plain transformers stops at that check: the plain case proves that it goes for
the config's kernel without any trust, not that the kernel's code runs.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import os
from pathlib import Path
from typing import Any

import pytest
from _doors import write_native_model

import codeferry
from codeferry._code.doors import kernel_repos
from codeferry._code.lockfile import Lock
from codeferry._install.adopt import install_for_engine
from codeferry.errors import HubKernelRefusedError

KERNEL = "kernels-community/flash-evil"


def write_kernel_repo(cache: Path, repo: str, mark: Path) -> Path:
    """A kernel repo in the hub cache layout, universal build variant, code writes ``mark``."""
    folder = cache / ("kernels--" + repo.replace("/", "--"))
    commit = "c" * 40
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / "main").write_text(commit, encoding="utf-8")
    package = folder / "snapshots" / commit / "build" / "torch-universal" / repo.split("/")[1].replace("-", "_")
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(
        f"open({str(mark)!r}, 'a').write('imported\\n')\n"
        "def flash_attn_varlen_func(*a, **k):\n    raise RuntimeError('evil')\n",
        encoding="utf-8")
    return folder


def load_native(folder: str, mark: str, how: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``AutoModelForCausalLM.from_pretrained`` after ``how``: plain transformers,
    ``install()``, or ``install_for_engine`` with the lock ``kwargs.pop('lock')``."""
    lock = kwargs.pop("lock", None)
    if how == "install":
        codeferry.install()
    elif how == "engine":
        install_for_engine(codeferry.read_lock(lock))
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
        out: dict[str, Any] = {"loaded": True, "kernelized": bool(getattr(model, "use_kernels", False))}
    except Exception as exc:
        out = {"error": type(exc).__name__, "message": str(exc),
               "path": getattr(exc, "path", None), "line": getattr(exc, "line", None)}
    finally:
        if how != "plain":
            codeferry.uninstall()
    out["mark"] = os.path.exists(mark)
    return out


@pytest.fixture(scope="module")
def kernel_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("kernel_model")
    mark = root / "MARK"
    write_kernel_repo(Path(os.environ["HF_HOME"]) / "hub", KERNEL, mark)
    return write_native_model(root / "m", attn_implementation=KERNEL), mark


@pytest.fixture(scope="module")
def any_lock(factory_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    lock = tmp_path_factory.mktemp("lock") / "any.lock"
    lock.write_text(Lock.from_bundle(codeferry.resolve(factory_models["default"])).dumps(),
                    encoding="utf-8")
    return lock


@pytest.fixture(scope="module")
def spawned() -> Any:
    with cf.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        yield pool


def _line(path: Path, needle: str) -> int:
    return next(n for n, t in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
                if needle in t)


def test_the_door_plain_transformers_reaches_for_the_config_kernel(kernel_model: tuple[Path, Path]) -> None:
    """No trust_remote_code anywhere, no auto_map: plain transformers still goes for the
    kernel the config names (here it stops at the kernels package, which this environment
    does not have in the version transformers wants; with it, it would fetch the repo)."""
    folder, mark = kernel_model
    got = load_native(str(folder), str(mark), "plain", {})
    assert got.get("error") != "HubKernelRefusedError", got
    # with a kernels release it accepts, the kernel's code ran (MARK); without, it says so
    assert got["mark"] or ("kernel" in got["message"].lower()
                           and "trust_remote_code" not in got["message"]), got
    assert kernel_repos(folder) == {KERNEL: kernel_repos(folder)[KERNEL]}


@pytest.mark.parametrize("where", ["parent", "spawned"])
def test_install_refuses_a_kernel_only_the_config_names(
        kernel_model: tuple[Path, Path], spawned: Any, where: str) -> None:
    folder, mark = kernel_model
    args = (str(folder), str(mark), "install", {})
    got = load_native(*args) if where == "parent" else spawned.submit(load_native, *args).result(240)
    assert got["error"] == "HubKernelRefusedError", got
    assert got["path"] == str(folder / "config.json")
    assert got["line"] == _line(folder / "config.json", '"attn_implementation"')
    assert KERNEL in got["message"] and not got["mark"]


def test_the_callers_trust_or_own_kernel_passes_the_gate(kernel_model: tuple[Path, Path]) -> None:
    """Without a lock the caller decides: trust_remote_code=True, or naming the kernel itself,
    goes on to transformers (which stops at the kernels package here, as plain)."""
    folder, mark = kernel_model
    for kwargs in ({"trust_remote_code": True}, {"attn_implementation": KERNEL}):
        got = load_native(str(folder), str(mark), "install", dict(kwargs))
        assert got.get("error") != "HubKernelRefusedError", (kwargs, got)


@pytest.mark.parametrize("where", ["parent", "spawned"])
def test_under_a_lock_no_kernel_runs_even_the_callers(
        kernel_model: tuple[Path, Path], any_lock: Path, spawned: Any, where: str) -> None:
    folder, mark = kernel_model
    for kwargs in ({"trust_remote_code": True}, {"attn_implementation": KERNEL}):
        args = (str(folder), str(mark), "engine", {**kwargs, "lock": str(any_lock)})
        got = load_native(*args) if where == "parent" else spawned.submit(
            load_native, *args).result(240)
        assert got["error"] == "HubKernelRefusedError", (kwargs, got)
        assert "a lock binds this process" in got["message"] and not got["mark"]


@pytest.mark.parametrize("where", ["parent", "spawned"])
def test_under_a_lock_the_default_kernelization_is_left_out_and_an_asked_one_refused(
        tmp_path: Path, any_lock: Path, spawned: Any, where: str) -> None:
    """transformers 5.25+ kernelizes every model that ``from_pretrained`` loads (``kernels``
    is its dependency, ``USE_HUB_KERNELS`` defaults on), and our gate used to refuse that as
    if the caller had asked: every locked load failed (``codeferry run`` in CI's [ray] extra).
    Under a lock it is now left out (the model keeps its own layers: not kernelized), while
    ``use_kernels=True`` is still refused. Before 5.25 nothing kernelizes by default, and
    without a ``kernels`` release transformers accepts, ``use_kernels=True`` stops at
    transformers' own check; CI's newest-transformers stage runs this with both."""
    from transformers.utils import is_kernels_available

    folder, mark = write_native_model(tmp_path / "m"), tmp_path / "MARK"
    run = (lambda *a: load_native(*a)) if where == "parent" else (
        lambda *a: spawned.submit(load_native, *a).result(240))
    got = run(str(folder), str(mark), "engine", {"lock": str(any_lock)})
    assert got.get("loaded") and got["kernelized"] is False, got
    asked = run(str(folder), str(mark), "engine", {"lock": str(any_lock), "use_kernels": True})
    assert not asked.get("loaded"), asked
    if is_kernels_available():
        assert asked["error"] == "HubKernelRefusedError", asked
        assert "a lock binds this process" in asked["message"], asked
    else:
        assert "kernels" in asked["message"].lower(), asked


#: A native model's load, in a process started by ``codeferry exec``: its outcome as JSON.
_NATIVE_LOAD = """
import json, os, sys
from transformers import AutoModelForCausalLM
try:
    AutoModelForCausalLM.from_pretrained(sys.argv[1])
    out = {"loaded": True}
except Exception as exc:
    out = {"error": type(exc).__name__, "message": str(exc), "line": getattr(exc, "line", None)}
out["mark"] = os.path.exists(sys.argv[2])
print(json.dumps(out))
"""


@pytest.mark.parametrize("form", ["folder", "hub"])
@pytest.mark.parametrize("flags", [["--trust-remote-code"], ["--lock"]], ids=["trusted", "locked"])
def test_under_codeferry_exec_a_native_models_config_kernel_is_refused(
        kernel_model: tuple[Path, Path], any_lock: Path, flags: list[str], form: str) -> None:
    """``codeferry exec`` routes each process from the import of transformers' dynamic module
    utilities, and put the kernel gates in at the first remote class: a native model (no
    ``auto_map``) asks for none, so its config's kernel went to transformers ungated, under a
    lock too. Each module the gates patch now gets them as it executes. ``hub``: the same
    model by repo id, in huggingface_hub's cache layout (snapshot files are symlinks into
    ``blobs/``), where the refusal still names the snapshot's config line."""
    import json
    import subprocess
    import sys

    from codeferry.testing._factory import _write_hub_repo

    folder, mark = kernel_model
    model, config = str(folder), folder / "config.json"
    if form == "hub":
        files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
        snapshot = _write_hub_repo(Path(os.environ["HF_HOME"]) / "hub", "acme/native-kernel",
                                   files, None)
        model, config = "acme/native-kernel", snapshot / "config.json"
        assert config.is_symlink()
    if flags == ["--lock"]:
        flags = ["--lock", str(any_lock)]
    proc = subprocess.run([sys.executable, "-m", "codeferry", "exec", *flags, "--",
                           sys.executable, "-c", _NATIVE_LOAD, model, str(mark)],
                          capture_output=True, text=True, timeout=240, check=False,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got.get("error") == "HubKernelRefusedError", got
    why = "a lock binds this process" if "--lock" in flags else "the model's own files name it"
    assert why in got["message"] and KERNEL in got["message"], got
    assert got["line"] == _line(config, '"attn_implementation"')
    assert not got["mark"]


def test_without_a_lock_transformers_kernelizes_as_it_would_alone(tmp_path: Path) -> None:
    """Without a lock, ``install()`` leaves transformers' default kernelization alone: the
    model is kernelized exactly when plain transformers kernelizes it (5.25+ with ``kernels``)."""
    folder, mark = write_native_model(tmp_path / "m"), tmp_path / "MARK"
    plain = load_native(str(folder), str(mark), "plain", {})
    installed = load_native(str(folder), str(mark), "install", {})
    assert plain.get("loaded") and installed.get("loaded"), (plain, installed)
    assert installed["kernelized"] == plain["kernelized"], (plain, installed)


def test_a_direct_kernel_request_under_a_lock_is_refused(tmp_path: Path,
                                                         factory_models: dict[str, Path]) -> None:
    """transformers' own ``get_kernel``/``load_and_register_attn_kernel``, called with no
    model load around them, are gated too."""
    from transformers.integrations import hub_kernels

    lock = Lock.from_bundle(codeferry.resolve(factory_models["default"]))
    install_for_engine(lock)
    try:
        for call in (lambda: hub_kernels.get_kernel(KERNEL),
                     lambda: hub_kernels.load_and_register_attn_kernel(KERNEL)):
            with pytest.raises(HubKernelRefusedError) as info:
                call()
            assert info.value.repo == KERNEL
    finally:
        codeferry.uninstall()
    assert hub_kernels.get_kernel.__module__ == "transformers.integrations.hub_kernels"


def test_a_kernel_transformers_maps_by_name_is_refused_under_a_lock_and_left_alone_without(
        any_lock: Path) -> None:
    """``lazy_load_kernel("finegrained-fp8")``: transformers maps a name to a repo of its own
    choosing (fp8, MoE and fp4 layers ask for it; a model's ``quantization_config`` picks the
    layer, never the repo). It fetches through the gated ``get_kernel``: under a lock refused,
    nothing fetched and nothing cached in transformers' mapping; without a lock it is
    transformers' own decision and reaches the ``kernels`` package (offline here: its own
    error). Without ``kernels`` (the dev environment) transformers goes to no Hub at all and
    answers ``None``; CI's newest stage has ``kernels`` and checks the gate."""
    from transformers.integrations import hub_kernels
    from transformers.utils import is_kernels_available

    name, mapping = "finegrained-fp8", {}
    install_for_engine(codeferry.read_lock(any_lock))
    try:
        if is_kernels_available():
            with pytest.raises(HubKernelRefusedError, match="a lock binds this process") as info:
                hub_kernels.lazy_load_kernel(name, mapping)
            assert info.value.repo == "kernels-community/finegrained-fp8"
            assert mapping == {}  # refused before transformers recorded anything
        else:
            assert hub_kernels.lazy_load_kernel(name, mapping) is None
    finally:
        codeferry.uninstall()
    codeferry.install()
    try:
        if is_kernels_available():
            with pytest.raises(Exception) as passed:  # the kernels package's own error
                hub_kernels.lazy_load_kernel(name, {})
            assert not isinstance(passed.value, HubKernelRefusedError), passed.value
            assert "offline" in str(passed.value), passed.value
        else:
            assert hub_kernels.lazy_load_kernel(name, {}) is None
    finally:
        codeferry.uninstall()


def _kernelize(model: Any, config: Any) -> Any:
    """transformers' ``kernelize`` with ``config``: its argument from 5.25, the model's
    ``kernel_config`` before (what the function reads when it has no such argument)."""
    import inspect

    from transformers.integrations import hub_kernels

    if "kernel_config" in inspect.signature(hub_kernels.kernelize).parameters:
        return hub_kernels.kernelize(model, kernel_config=config)
    model.kernel_config = config
    return hub_kernels.kernelize(model)


def test_under_a_lock_a_kernelization_that_maps_no_kernel_passes(
        tmp_path: Path, any_lock: Path) -> None:
    """``reset_kernels()`` (transformers 5.25) kernelizes with an empty mapping that inherits
    none: it puts the torch layers back and fetches nothing, so a lock lets it through; a
    mapping that names a kernel, or none given (the global mapping), is still refused. Where
    ``kernels`` is missing transformers itself stops the call that passes (CI's newest stage
    has it, and runs ``reset_kernels()``)."""
    from transformers import AutoModelForCausalLM, KernelConfig
    from transformers.utils import is_kernels_available

    model = AutoModelForCausalLM.from_pretrained(write_native_model(tmp_path / "m"))
    empty = KernelConfig(kernel_mapping={}, inherit_mapping=False)
    install_for_engine(codeferry.read_lock(any_lock))
    try:
        for refused in (None, KernelConfig(kernel_mapping={}),
                        KernelConfig(kernel_mapping={"RMSNorm": "kernels-community/evil"})):
            with pytest.raises(HubKernelRefusedError, match="a lock binds this process"):
                _kernelize(model, refused)
        if is_kernels_available():
            _kernelize(model, empty)
            assert not hasattr(model, "reset_kernels") or model.reset_kernels() is True
            assert model.use_kernels is False
        else:
            with pytest.raises(ImportError, match="kernels"):
                _kernelize(model, empty)
    finally:
        codeferry.uninstall()


def after_load(folder: str, mark: str, other: str, lock: str | None) -> dict[str, Any]:
    """``codeferry.load`` of another model (with ``lock``, or trusted), then plain transformers."""
    codeferry.load(other, lock=lock, trust_remote_code=lock is None)
    return load_native(folder, mark, "plain", {})


def test_a_plain_load_does_not_gate_but_a_locked_one_does(
        kernel_model: tuple[Path, Path], factory_models: dict[str, Path], tmp_path: Path) -> None:
    """``load()`` answers only for its own models: the process stays transformers' own, until
    a lock binds it (then no Hub kernel runs in it)."""
    folder, mark = kernel_model
    other = factory_models["default"]
    lock = tmp_path / "other.lock"
    lock.write_text(Lock.from_bundle(codeferry.resolve(other)).dumps(), encoding="utf-8")
    for used, refused in ((None, False), (str(lock), True)):
        with cf.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
            got = pool.submit(after_load, str(folder), str(mark), str(other), used).result(240)
        assert (got.get("error") == "HubKernelRefusedError") is refused, (used, got)
        assert not got["mark"]
