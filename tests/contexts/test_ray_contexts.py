"""Ray on the project's real 2-node cluster (``tests/_raycluster.py``; node 2 never saw the
model files): tasks and actors pinned to node 2 build the model from the driver's config and
classes, the RL pattern (a trainer's config, class and weights to an actor on node 2, logits
back) and ``ray.data`` ``map_batches`` with a callable class holding the remote tokenizer.

One driver run (``scripts/ray_cluster.py``) per mode, all layouts and Ray APIs inside it:
plain transformers; the script calling ``codeferry.install()``; and the plain script under
``codeferry exec`` with the workers switched on by the job's ``runtime_env``, whose
``env_vars`` are ``codeferry exec --print-env --json`` (docs/ray.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import _raycluster
import pytest
from _contexts import LAYOUTS, command, environment, last_json, script, show

pytestmark = pytest.mark.skipif(_raycluster.missing() is not None,
                                reason=str(_raycluster.missing()))


def runtime_env(env: dict[str, str]) -> dict[str, Any]:
    """The documented ``runtime_env``: ``env_vars`` from ``codeferry exec --print-env --json``."""
    printed = subprocess.run([sys.executable, "-m", "codeferry", "exec", "--trust-remote-code",
                              "--print-env", "--json"], env=env, capture_output=True, text=True,
                             check=True, timeout=60)
    return {"env_vars": json.loads(printed.stdout)}


def drive(cluster: _raycluster.Cluster, mode: str, layouts: Path, root: Path,
          hub_cache: Path) -> dict[str, Any]:
    """``scripts/ray_cluster.py`` in ``mode``, in the head's namespace; its report."""
    env = cluster.env(**environment(root, hub_cache, mode))
    if mode == "exec":
        # What `ray job submit --runtime-env-json` hands the driver (Ray merges it into the
        # job's runtime_env at ray.init): the script itself stays unchanged.
        renv = runtime_env(env)
        print(f"\nruntime_env = {json.dumps(renv, indent=2)}")
        env["RAY_JOB_CONFIG_JSON_ENV_VAR"] = json.dumps({"runtime_env": renv})
    out = tempfile.mkdtemp(prefix=f"ray-{mode}-", dir=root)
    argv = command(mode, [sys.executable, script("ray_cluster.py"), str(layouts), out])
    proc = subprocess.run(["ip", "netns", "exec", cluster.ns_a, *argv], env=env, cwd=root,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, f"{mode}: exit {proc.returncode}\n{proc.stderr[-6000:]}"
    return last_json(proc)


#: Plain transformers today: node 2 cannot unpickle the driver's ``transformers_modules``
#: config, model class or tokenizer (Ray's ``No module named 'transformers_modules'``), for a
#: task, the RL actor and ``ray.data``'s actor alike; the sub-package layout does not load in
#: the driver (transformers copies ``utils/rope.py`` as ``utils.rope.py``).
PLAIN_ERRORS = {"task": "RayTaskError(RaySystemError)", "rl": "ActorDiedError",
                "data": "ActorDiedError"}


def check_plain(report: dict[str, Any]) -> None:
    assert report["subpackage"]["error"] == "FileNotFoundError", report["subpackage"]
    assert "utils.rope.py" in report["subpackage"]["message"], report["subpackage"]
    for layout in ("flat", "hub"):
        got = report[layout]
        assert got["config"] == "transformers_modules", got
        for api, error in PLAIN_ERRORS.items():
            assert got[api]["error"] == error, (layout, api, got[api])
            assert got[api]["no_transformers_modules"] is True, (layout, api, got[api])


def check_codeferry(report: dict[str, Any], switch: str | None, door: str) -> None:
    """Every layout, every API on node 2, with the driver's classes; ``switch`` and ``door``:
    what node 2's workers see of the runtime_env (none without it: the config and classes
    travel with their code all the same)."""
    for layout in LAYOUTS:
        got = report[layout]
        assert got["config"] == "codeferry", (layout, got)
        assert got["task"] == {
            "node": _raycluster.NODE2_IP, "config": "codeferry", "model": "codeferry",
            "same_config_class": True, "hf_vars": [], "switch": switch, "door": door,
            "config_back_same_class": True, "model_class_back_is_driver_class": True,
            "config_class_back_is_driver_class": True}, (layout, got["task"])
        assert got["rl"] == {"node": _raycluster.NODE2_IP, "model": "codeferry",
                             "same_config_class": True, "logits_shape": [2, 4, 64],
                             "logits_equal_trainer": True}, (layout, got["rl"])
        assert got["data"] == {"rows": 4, "n_ids_match": True, "tokenizer": ["codeferry"],
                               "node": [_raycluster.NODE2_IP]}, (layout, got["data"])


@pytest.mark.alone
def test_ray_tasks_actors_data_and_the_rl_pattern_on_node2_in_every_mode(
    ray_cluster: _raycluster.Cluster, tmp_path: Path, context_layouts: Path,
    context_hub_cache: Path
) -> None:
    reports = {mode: drive(ray_cluster, mode, context_layouts, tmp_path, context_hub_cache)
               for mode in ("plain", "codeferry", "exec")}
    show("ray", reports)
    check_plain(reports["plain"])
    assert reports["plain"]["runtime_env_vars"] == reports["codeferry"]["runtime_env_vars"] == []
    check_codeferry(reports["codeferry"], None, "transformers")
    # codeferry exec on the driver, the runtime_env's variables in every worker of the job
    assert reports["exec"]["runtime_env_vars"] == ["CODEFERRY_INSTALL", "PYTHONPATH"]
    check_codeferry(reports["exec"], "1", "codeferry")
