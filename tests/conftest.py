"""Shared session fixtures: tiny remote-code models from ``codeferry.testing``, written once.

``factory_models`` maps a variant name to its folder. Local variants are keyed by a plain name
(``"default"``, ``"helper_star"``, ``"largest"``...); hub variants by their repo id
(``"acme/tiny"``), mapped to their snapshot folder inside ``factory_hub_cache``.
``factory_specs`` gives the ``ModelSpec`` of every key. Treat both as read-only: copy a model
(``shutil.copytree``) before changing it.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

# The session's environment: offline, and every cache in a fresh temporary folder. Set
# before anything imports transformers (it reads HF_MODULES_CACHE once, at import);
# child processes inherit it.
_ROOT = tempfile.mkdtemp(prefix="codeferry-tests-")
# ...but the release environments the set-up made (`codeferry release`, the README's test
# command): made with the network, as a user's first run makes them, then used offline.
from codeferry._settings import releases_home  # noqa: E402 - reads nothing at import

os.environ["CODEFERRY_RELEASES"] = str(releases_home())
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HOME"] = os.path.join(_ROOT, "hf")
os.environ["HF_MODULES_CACHE"] = os.path.join(_ROOT, "hf", "modules")
os.environ["CODEFERRY_HOME"] = os.path.join(_ROOT, "codeferry")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

from codeferry.testing import (  # noqa: E402 - after the environment above
    HELPER_KINDS,
    LARGEST_SPEC,
    ModelSpec,
    write_hub_model,
    write_model,
)

#: Folder of the ``default`` variant: dots, a hyphen and a space, which loaders must cope with.
ODD_FOLDER = "my.model-v1 copy"

_LOCAL: dict[str, ModelSpec] = {
    "default": ModelSpec(),
    **{f"helper_{kind}": ModelSpec(name=f"h_{kind}", helpers=(kind,)) for kind in HELPER_KINDS},
    "all_helpers": ModelSpec(name="allh", helpers=HELPER_KINDS),
    "model_keys_first": ModelSpec(name="mkf", model_keys_first=True, config_helper=True),
    "config_helper": ModelSpec(name="cfgh", config_helper=True),
    "tokenizer": ModelSpec(name="tok", tokenizer=True),
    "processor": ModelSpec(name="proc", processor=True),
    "nested_subconfig": ModelSpec(name="nest", nested_subconfig=True),
    "asset": ModelSpec(name="asset", asset=True),
    "generic_a": ModelSpec(name="alpha", generic_names=True),
    "generic_b": ModelSpec(name="beta", generic_names=True, helpers=("flat", "subpackage")),
    # The other repo's code lives only in the hub cache (written with "acme/crossy").
    "cross_repo": ModelSpec(name="crossy", cross_repo="org/shared-heads"),
    "largest": LARGEST_SPEC,
}

_HUB: dict[str, ModelSpec] = {
    "acme/tiny": ModelSpec(),
    "acme/crossy": ModelSpec(name="crossy", cross_repo="org/shared-heads", model_keys_first=True),
    "acme/largest": _LOCAL["largest"],
}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--alone", action="store_true", default=False,
                     help="run only the tests marked alone (CI runs them in a stage of their own)")
    parser.addoption("--slow", action="store_true", default=False,
                     help="also run the long forms of the stress tests (marked slow)")


#: Under pytest-xdist (``-n 3`` in pyproject's addopts) a file's tests run on one worker, so
#: module fixtures are made once; these files share a worker too (one Ray instance, one vLLM
#: engine at a time on the machine). The longest files start first, so that the workers
#: finish together.
_SHARED_SCOPE = {"exec/test_ray_cluster.py": "ray", "exec/test_ray.py": "ray",
                 "contexts/test_ray_contexts.py": "ray",  # one 2-node cluster at a time
                 # one vLLM engine at a time: two on a small machine starve each other
                 "vllm/test_vllm.py": "vllm", "vllm/test_vllm_run_batch.py": "vllm",
                 "vllm/test_vllm_engine.py": "vllm", "vllm/test_structured_vllm.py": "vllm"}
_LONGEST_FIRST = ("exec/test_ray_cluster.py", "exec/test_ray.py", "vllm/test_vllm.py",
                  "vllm/test_vllm_run_batch.py", "vllm/test_vllm_engine.py",
                  "vllm/test_structured_vllm.py",
                  "contexts/test_pools.py",
                  "contexts/test_datasets.py", "install/test_exec.py", "contexts/test_dask.py",
                  "contexts/test_dataloader.py", "contexts/test_torchrun.py",
                  "commands/test_doctor.py", "install/test_doors.py", "exec/workers/test_worker_stdout.py",
                  "contexts/test_accelerate.py",
                  "runtime/test_travel.py", "code/test_hub_cache.py", "exec/test_executor.py")


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0].removeprefix("tests/")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return _SHARED_SCOPE.get(_file_of(nodeid), _file_of(nodeid))

    # xdist's loadscope queues scopes by their NUMBER of tests unless told otherwise: the
    # one-test contexts files (minutes each) went last and ran behind everything else; the
    # queue follows the collection's order instead (``_LONGEST_FIRST``)
    config.option.loadscopereorder = False
    return ByFile(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files first (stable otherwise). Tests marked ``slow`` (the long form of a
    stress test whose short form always runs) are skipped unless ``--slow`` is given."""
    def rank(item: pytest.Item) -> int:
        name = _file_of(item.nodeid)
        return _LONGEST_FIRST.index(name) if name in _LONGEST_FIRST else len(_LONGEST_FIRST)

    items.sort(key=rank)
    # tests marked ``alone`` share a machine badly with the rest (the 2-node Ray cluster's
    # actors went unscheduled in the full suite, and pass alone): CI runs them in a stage of
    # their own (`pytest --alone`); the default run leaves them out, --alone runs only them
    alone = config.getoption("--alone")
    kept = [item for item in items if ("alone" in item.keywords) == alone]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="long form: pytest --slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def factory_specs() -> dict[str, ModelSpec]:
    """The ``ModelSpec`` of every key of ``factory_models``."""
    return {**_LOCAL, **_HUB}


@pytest.fixture(scope="session")
def factory_hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face hub cache (``HF_HUB_CACHE``) holding the hub variants and cross repos."""
    cache = tmp_path_factory.mktemp("factory_hub")
    for repo_id, spec in _HUB.items():
        write_hub_model(cache, repo_id, spec)
    return cache


@pytest.fixture(scope="session")
def factory_models(
    tmp_path_factory: pytest.TempPathFactory, factory_hub_cache: Path
) -> dict[str, Path]:
    """Variant name (or hub repo id) -> model folder (or snapshot folder), written once."""
    root = tmp_path_factory.mktemp("factory_models")
    out: dict[str, Path] = {}
    for name, spec in _LOCAL.items():
        out[name] = write_model(root / (ODD_FOLDER if name == "default" else name), spec)
    for repo_id in _HUB:
        repo_dir = factory_hub_cache / ("models--" + repo_id.replace("/", "--"))
        commit = (repo_dir / "refs" / "main").read_text(encoding="utf-8").strip()
        out[repo_id] = repo_dir / "snapshots" / commit
    return out


@pytest.fixture()
def offline_hub(monkeypatch: pytest.MonkeyPatch, factory_hub_cache: Path) -> None:
    """Offline, with the factory hub cache as the default cache (cross-repo code lives there).

    A module takes it for every test with ``pytestmark = pytest.mark.usefixtures("offline_hub")``.
    """
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(factory_hub_cache))


@pytest.fixture()
def no_progress_bars(monkeypatch: pytest.MonkeyPatch) -> None:
    """huggingface_hub's progress bars off (they would land in the captured stderr)."""
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real 2-node Ray cluster (``_raycluster``: network namespaces, node 2 blind to the
    test's files), started by the first test of a module that asks for it; needs root (the
    tests that use it skip with the reason elsewhere). One module per run uses it (the
    contexts' one runs in CI's stage of its own), and it stops with that module: an idle
    cluster costs about 5% of a core, for the rest of the suite if it were the session's."""
    import _raycluster

    cluster = _raycluster.Cluster(tmp_path_factory.mktemp("raycluster"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def spawned_child() -> Iterator[cf.ProcessPoolExecutor]:
    """One spawned process per test module (started at its first task), for code that must
    run in a fresh interpreter."""
    with cf.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        yield pool


@pytest.fixture(scope="session")
def forkers() -> Iterator[Callable[[str], Any]]:
    """``forkers(method)``: the session's ``_forker.Forker`` of that start method (started at
    its first use), which runs each case in a new process forked from it."""
    from _forker import Forker

    made: dict[str, Forker] = {}

    def forker(method: str) -> Forker:
        if method not in made:
            made[method] = Forker(method)
        return made[method]

    try:
        yield forker
    finally:
        for one in made.values():
            one.close()


@pytest.fixture(scope="module")
def two_revisions(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(hub cache, first snapshot, second snapshot): ``acme/versy`` at two commits. The first's
    configuration module imports no helper, the second's does (``DEFAULTS``), so their code
    digests differ, and the second has other weights; main is the second."""
    cache = tmp_path_factory.mktemp("versy_hub")
    spec = ModelSpec(name="versy", tokenizer=True)
    first = write_hub_model(cache, "acme/versy", spec, commit="a" * 40)
    second = write_hub_model(cache, "acme/versy", replace(spec, config_helper=True, seed=1),
                             commit="b" * 40)
    return cache, first, second


@pytest.fixture(autouse=True)
def _unlocked_process() -> Iterator[None]:
    """Each test starts in a process no lock binds (a lock binds the process for good)."""
    from codeferry._trust import policy as _policy

    yield
    with _policy._lock:
        _policy._allowed.clear()
        _policy._files.clear()
        _policy._locked = False
