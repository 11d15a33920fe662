"""A real local Ray cluster (started by the test, bound to 127.0.0.1) receives objects
and classes of loaded models through Ray's own cloudpickle."""

from __future__ import annotations

import os
import queue
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
ray = pytest.importorskip("ray")

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the helper modules
sys.path.insert(0, TESTS)
import _workers  # noqa: E402
from _helpers import checksum, load_objects, refusing_model, travel_model  # noqa: E402

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


def test_an_actor_that_failed_to_start_is_killed_before_its_failed_and_frees_its_cpu(
    ray_cluster: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that cannot start sends ``failed``; its channel ends the actor, as a local
    worker exits: otherwise the actor kept its CPU for as long as anything held the channel,
    and on this one-CPU cluster the next try could not be placed.

    The kill comes before the post: the post can end the executor, whose close shuts down a
    Ray it started, and Ray exits the whole process, with no exception, when a thread is
    inside a call as it shuts down (under CI's load a driver died so: exit 1, "The core
    worker has already been shutdown", its error unprinted). Ray's ``kill`` is wrapped to see
    the order: a Ray call after the post, in any order of threads, is the bug."""
    model, flag = refusing_model(tmp_path)
    with codeferry.Executor(model, workers=1, backend="ray", trust_remote_code=True) as ex:
        transport, spec = ex._scheduler.transport, ex._scheduler.specs[0]
    flag.touch()
    order: list[str] = []
    kill = ray_cluster.kill
    monkeypatch.setattr(ray_cluster, "kill", lambda *a, **k: (order.append("kill"), kill(*a, **k)))
    events: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def post(event: Any) -> None:
        order.append(event.kind)
        events.put(event)

    channel = transport.start(0, spec, post)
    try:
        first = events.get(timeout=300)
        assert first.kind == "failed", first
        assert "no memory for the weights" in str(first.body.__cause__ or first.body)
        deadline = time.monotonic() + 60
        while ray_cluster.available_resources().get("CPU", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ray_cluster.available_resources().get("CPU", 0) == 1, "the actor kept its CPU"
        with pytest.raises(ray_cluster.exceptions.RayActorError):
            ray_cluster.get(channel.actor.handle.remote(b""), timeout=60)
        with pytest.raises(queue.Empty):  # nothing after failed: the kill is no second failure
            extra = events.get(timeout=1)
            pytest.fail(f"an event after failed: {extra.kind} {extra.body}")
        assert order == ["kill", "failed"]  # and no Ray call after the post
    finally:
        channel.stop(5.0)


def test_code_that_needs_a_release_runs_on_it_in_ray_actors(ray_cluster: Any, tmp_path: Path) -> None:
    """The corpus's ``hybridcache`` (code importing a name transformers 5 removed): each actor
    puts its node's release first on its path before it imports transformers, and generates
    the golden tokens; the driver's process stays on the installed transformers."""
    from codeferry import Request, SamplingParams
    from codeferry._code.removed import installed
    from codeferry._code.resolve import resolve
    from codeferry._exec.plan import release_line

    sys.path.insert(0, os.path.join(TESTS, "corpus"))
    try:
        from _corpus import NEW_TOKENS, PROMPTS, build, golden

        folder = build("hybridcache", tmp_path)
    finally:
        sys.path.remove(os.path.join(TESTS, "corpus"))
    line = release_line(resolve(folder))
    with codeferry.Executor(folder, workers=1, backend="ray", trust_remote_code=True,
                            ray_resources={"num_cpus": 1}) as ex:
        results = ex.complete([Request(p) for p in PROMPTS],
                              SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))
        ran_on = ex.worker_info[0]["transformers"]
    assert [list(r.completions[0].token_ids) for r in results] == golden()["hybridcache"]
    assert ran_on == installed() if line is None else ran_on.startswith(f"{line}."), ran_on
