"""Objects of loaded classes cross real process boundaries with their classes intact.

Each receiver checks ``type(obj)`` is the class its own process resolves by name, that
``isinstance`` holds, and that state and outputs equal the sender's.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import multiprocessing as mp
import os
import pickle
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
import torch.multiprocessing as tmp
from transformers import AutoConfig, AutoModelForCausalLM

import codeferry
from codeferry.testing import ModelSpec, write_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the helper modules
import _workers
from _helpers import TESTS, load_objects, travel_model, unique_name

METHODS = ["spawn", "forkserver", "fork"]
WORKERS = TESTS / "_workers.py"


@pytest.fixture(scope="session")
def pools() -> Iterator[dict[str, tuple[cf.ProcessPoolExecutor, Any]]]:
    """One executor and one Pool per start method, started before any model is loaded."""
    made: dict[str, tuple[cf.ProcessPoolExecutor, Any]] = {}
    for method in METHODS:
        ctx = mp.get_context(method)
        executor = cf.ProcessPoolExecutor(1, mp_context=ctx)
        pool = ctx.Pool(1)
        made[method] = (executor, pool)
    for executor, pool in made.values():  # really started: workers exist and are warm
        executor.submit(_workers.describe, 1).result(180)
        pool.apply_async(_workers.describe, (1,)).get(180)
    yield made
    for executor, pool in made.values():
        executor.shutdown(cancel_futures=True)
        pool.terminate()


@pytest.mark.parametrize("method", METHODS)
def test_pools_started_before_load_receive_everything(
    method: str, pools: dict[str, Any], tmp_path: Path
) -> None:
    executor, pool = pools[method]  # started before this model is loaded
    objs = load_objects(travel_model(tmp_path))
    expected = _workers.describe_all(objs)
    assert all(d["canonical"] for d in expected)
    assert executor.submit(_workers.describe_all, objs).result(180) == expected
    assert pool.apply_async(_workers.describe_all, (objs,)).get(180) == expected


@pytest.mark.parametrize("method", METHODS)
def test_process_arguments_and_a_grandchild(method: str, tmp_path: Path) -> None:
    objs = load_objects(travel_model(tmp_path))
    expected = _workers.describe_all(objs)
    ctx = tmp.get_context(method)  # torch.multiprocessing: its pickler, its reducers
    queue = ctx.Queue()
    proc = ctx.Process(target=_workers.child_main, args=(objs, queue, "spawn"))
    proc.start()
    result = queue.get(timeout=300)
    proc.join(60)
    assert "error" not in result, result.get("tb")
    assert result["child"] == expected
    assert result["grandchild"] == expected


def as_json(value: Any) -> Any:
    """What a receiver's JSON report of ``value`` reads as."""
    return json.loads(json.dumps(value))


def run_receiver(data: bytes, env: dict[str, str] | None = None, cwd: str | None = None) -> Any:
    done = subprocess.run(
        [sys.executable, str(WORKERS)], input=data, capture_output=True, env=env, cwd=cwd,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return json.loads(done.stdout)


def test_fresh_interpreter_that_only_unpickles(tmp_path: Path) -> None:
    objs = load_objects(travel_model(tmp_path))
    assert run_receiver(pickle.dumps(objs)) == as_json(_workers.describe_all(objs))


def other_machine_env(root: Path) -> dict[str, str]:
    """A process standing for another machine: every cache and home is new and empty."""
    env = dict(os.environ)
    for var in ("HOME", "XDG_CACHE_HOME", "HF_HOME", "HF_MODULES_CACHE", "CODEFERRY_HOME"):
        env[var] = str(root / var.lower())
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


def test_another_machine_with_empty_caches_and_no_model_folder(tmp_path: Path) -> None:
    model_root = tmp_path / "gone"
    objs = load_objects(travel_model(model_root))
    expected = as_json(_workers.describe_all(objs))
    instances = pickle.dumps(objs[:3])
    instances_cp = cloudpickle.dumps(objs[:3])
    classes_cp = cloudpickle.dumps(objs[3:])
    shutil.rmtree(model_root)
    assert run_receiver(instances, other_machine_env(tmp_path / "m1"), cwd=str(tmp_path)) == expected[:3]
    assert run_receiver(instances_cp, other_machine_env(tmp_path / "m3"), cwd=str(tmp_path)) == expected[:3]
    # a class sent alone, by cloudpickle, carries its code too
    assert run_receiver(classes_cp, other_machine_env(tmp_path / "m2"), cwd=str(tmp_path)) == expected[3:]


def test_class_alone_through_rays_cloudpickle_to_another_machine(tmp_path: Path) -> None:
    ray_cloudpickle = pytest.importorskip("ray.cloudpickle")
    model_root = tmp_path / "gone"
    objs = load_objects(travel_model(model_root))
    data = ray_cloudpickle.dumps(objs[3:])
    shutil.rmtree(model_root)
    got = run_receiver(data, other_machine_env(tmp_path / "m"), cwd=str(tmp_path))
    assert got == as_json(_workers.describe_all(objs[3:]))


def test_multiprocessing_messages_stay_small(tmp_path: Path) -> None:
    from multiprocessing.reduction import ForkingPickler

    config = load_objects(travel_model(tmp_path))[0]
    first = bytes(ForkingPickler.dumps(config))
    later = bytes(ForkingPickler.dumps(config))
    assert len(later) <= 2 * len(config.to_json_string())
    assert len(first) == len(later)
    assert len(pickle.dumps(config)) > 2000  # plain pickle carries the code (another machine)


@pytest.mark.parametrize("method", METHODS)
def test_install_makes_plain_transformers_objects_travel(
    method: str, pools: dict[str, Any], tmp_path: Path
) -> None:
    executor, _ = pools[method]
    name = unique_name("t")
    path = write_model(tmp_path / name, ModelSpec(name=name, helpers=("flat", "star")))
    # Loaded by plain transformers before install(): adopted, so it travels too.
    early = AutoConfig.from_pretrained(path, trust_remote_code=True)
    assert type(early).__module__.startswith("transformers_modules.")
    codeferry.install()
    try:
        other = write_model(tmp_path / f"{name}b", ModelSpec(name=f"{name}b", helpers=("flat", "star")))
        config = AutoConfig.from_pretrained(other, trust_remote_code=True)
        model = AutoModelForCausalLM.from_pretrained(other, trust_remote_code=True).eval()
        assert type(config).__module__.startswith("codeferry._dyn.u")  # loaded by codeferry
        objs = [config, model, type(config), early]
        expected = _workers.describe_all(objs)
        assert executor.submit(_workers.describe_all, objs).result(180) == expected
        shipped = [config, model, early]
        assert run_receiver(pickle.dumps(shipped), other_machine_env(tmp_path / "m")) == as_json(
            _workers.describe_all(shipped))
    finally:
        codeferry.uninstall()


def test_install_adopts_model_modules_only(tmp_path: Path) -> None:
    """transformers' own holder packages (``transformers_modules.<model>``) are not units."""
    from codeferry._runtime import loader as _loader

    name = unique_name("t")
    path = write_model(tmp_path / name, ModelSpec(name=name))
    AutoConfig.from_pretrained(path, trust_remote_code=True)  # plain transformers
    codeferry.install()
    try:
        assert _loader.registered("transformers_modules") is None
        assert _loader.registered(f"transformers_modules.{name}") is None
        adopted = [p for p in list(_loader._registrations) if p.startswith(f"transformers_modules.{name}.")]
        assert len(adopted) == 1
    finally:
        codeferry.uninstall()
