"""A real local Ray cluster (started by the test, bound to 127.0.0.1) receives objects
and classes of loaded models through Ray's own cloudpickle."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
ray = pytest.importorskip("ray")

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the helper modules
sys.path.insert(0, TESTS)
import _workers  # noqa: E402
from _helpers import checksum, load_objects, travel_model  # noqa: E402

import codeferry  # noqa: E402


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    # Ray's workers get the helper modules through PYTHONPATH; given back after, or every
    # later test of this worker (and its children) would inherit this process's sys.path
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([TESTS, *sys.path])
    try:
        ray.init(
            num_cpus=1, _node_ip_address="127.0.0.1", include_dashboard=False,
            log_to_driver=False, configure_logging=False,
        )
        yield ray
        ray.shutdown()
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before


def test_ray_task_receives_instances_and_classes(ray_cluster: Any, tmp_path: Path) -> None:
    objs = load_objects(travel_model(tmp_path))
    expected = _workers.describe_all(objs)
    task = ray_cluster.remote(_workers.ray_describe)
    assert ray_cluster.get(task.remote(objs), timeout=300) == expected
    # classes alone, through the object store (ray.put), dereferenced by the task
    ref = ray_cluster.put(objs[3:])
    assert ray_cluster.get(task.remote(ref), timeout=300) == expected[3:]


def test_ray_actors_run_the_code_of_code_revision_with_the_weights_of_revision(
    ray_cluster: Any, two_revisions: tuple[Path, Path, Path],
) -> None:
    """The actor's folder holds the revision's files and, inside it, the code revision's."""
    cache, first, second = two_revisions
    with codeferry.Executor("acme/versy", revision=second.name, code_revision=first.name,
                            cache_dir=cache, trust_remote_code=True, backend="ray",
                            workers=1, ray_resources={"num_cpus": 1}) as ex:
        [seen] = ex.collective_rpc(_workers.code_and_weights)
        assert ex.generate(["hello"], max_new_tokens=2)
    assert not seen["config_has_defaults"]  # the first commit's code...
    assert seen["checksum"] == pytest.approx(checksum(second))  # ...the second's weights
