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

sys.path.insert(0, os.path.dirname(__file__))
import _workers  # noqa: E402
import test_travel as travel  # noqa: E402


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    os.environ["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__), *sys.path])
    ray.init(
        num_cpus=1, _node_ip_address="127.0.0.1", include_dashboard=False,
        log_to_driver=False, configure_logging=False,
    )
    yield ray
    ray.shutdown()


def test_ray_task_receives_instances_and_classes(ray_cluster: Any, tmp_path: Path) -> None:
    objs = travel.load_objects(travel.fresh_model(tmp_path))
    expected = _workers.describe_all(objs)
    task = ray_cluster.remote(_workers.ray_describe)
    assert ray_cluster.get(task.remote(objs), timeout=300) == expected
    # classes alone, through the object store (ray.put), dereferenced by the task
    ref = ray_cluster.put(objs[3:])
    assert ray_cluster.get(task.remote(ref), timeout=300) == expected[3:]
