"""The executor on a real 2-node Ray cluster whose second node cannot see our files.

The cluster (``_raycluster``) lives in network namespaces this test creates; node2 has
its own tmpfs over the test's folders, ``~/.cache`` and ``/dev/shm`` and a scrubbed
environment, so whatever runs there came through Ray. Drivers run in the head's
namespace (``_ray_driver``). Needs root: skipped with that reason elsewhere.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from codeferry.testing import ModelSpec, write_hub_model, write_model

import _raycluster  # noqa: E402 - tests/ is on sys.path (rootdir conftest)

pytestmark = pytest.mark.skipif(_raycluster.missing() is not None,
                                reason=str(_raycluster.missing()))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_raycluster.Cluster]:
    root = tmp_path_factory.mktemp("raycluster")
    (root / "scratch").mkdir()
    os.environ["CF_SCRATCH"] = str(root / "scratch")
    cluster = _raycluster.Cluster(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        os.environ.pop("CF_SCRATCH", None)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("raymodels")
    return {
        "plain": write_model(root / "plain", ModelSpec(name="rayplain", tokenizer=True)),
        "subpackage": write_model(root / "sub", ModelSpec(name="raysub", tokenizer=True,
                                                          helpers=("subpackage",))),
        "other": write_model(root / "other", ModelSpec(name="rayother", tokenizer=True)),
    }


@pytest.mark.parametrize("kind", ["plain", "subpackage"])
def test_generate_embed_score_across_both_nodes_from_a_deleted_folder(
    cluster: _raycluster.Cluster, models: dict[str, Path], kind: str
) -> None:
    out = cluster.driver("across", str(models[kind]))
    assert out["same"] == {"generate": True, "embed": True, "score": True}
    assert out["nodes"] == [_raycluster.HEAD_IP, _raycluster.NODE2_IP]
    assert all(f["written"] or f["fetched_bytes"] == 0 for f in out["ferry"])
    for where in out["rpc"]:  # neither node ran it from the driver's folder
        assert str(models[kind]) not in where["model"] and "/ferry/" in where["model"]
    node2 = [w for w in out["rpc"] if w["hf"] == []]
    assert node2, "node2's environment is scrubbed: no HF_* variables"
