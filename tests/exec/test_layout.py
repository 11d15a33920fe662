"""How many workers an executor starts, threads each, and their cores (``_exec/layout.py``):
pure."""

from __future__ import annotations

from typing import Any

import pytest

from codeferry._exec.layout import RAY_WORKERS, bindings, cores, cpus, layout, reason


@pytest.mark.parametrize(("device", "cores", "want"), [
    ("cpu", 2, (2, 1)), ("cpu", 16, (2, 8)), ("cpu", 3, (2, 1)), ("cpu", 1, (1, 1)),
    ("mps", 8, (2, 4)),
])
def test_a_cpu_machine_gets_two_workers_sharing_its_cores(device: str, cores: int,
                                                         want: tuple[int, int]) -> None:
    assert layout(device, "local", None, None, cpus=cores) == want


def test_an_accelerator_gets_one_worker_per_visible_device() -> None:
    assert layout("cuda", "local", None, None, cpus=16, devices=4) == (4, 4)
    assert layout("cuda", "local", None, None, cpus=16, devices=0) == (1, 16)
    assert layout("cuda:1", "local", None, None, cpus=16, devices=4) == (1, 16)


def test_what_the_caller_gives_wins() -> None:
    assert layout("cpu", "local", 3, None, cpus=8) == (3, 2)
    assert layout("cpu", "local", 4, None, cpus=2) == (4, 1)  # at least one thread each
    assert layout("cpu", "local", 2, 5, cpus=2) == (2, 5)
    assert layout("cpu", "ray", None, None, cpus=2, ray_cpus=3) == (RAY_WORKERS, 3)
    assert layout("cpu", "ray", 5, 2, cpus=2) == (5, 2)


@pytest.mark.parametrize(("args", "says"), [
    (("cpu", "local", None, None), "2 cores shared by 2 workers, whichever engine"),
    (("cpu", "local", 3, None), "workers given"),
    (("cpu", "local", 3, 2), "workers and threads_per_worker given"),
    (("cpu", "ray", None, None), "Ray: two actors"),
    (("cuda", "local", None, None), "one worker per visible accelerator (4 here)"),
])
def test_the_reason_names_the_branch_the_layout_took(args: tuple[str, str, int | None,
                                                                int | None], says: str) -> None:
    assert reason(*args, cpus=2, devices=4).startswith(says)
    assert reason("cpu", "local", None, None, cpus=1) == "one core: one worker"


@pytest.mark.parametrize(("count", "threads", "usable", "want"), [
    (2, 1, [0, 1], [(0,), (1,)]),
    (2, 8, list(range(16)), [tuple(range(8)), tuple(range(8, 16))]),
    (2, 1, [5, 3, 9], [(3,), (5,)]),  # the cores this process may use, in order
    (3, 1, [0, 1], [(), (), ()]),  # more threads than cores: none bound
    (2, 2, [0, 1, 2], [(), ()]),
])
def test_each_worker_binds_to_a_run_of_cores_of_its_own(count: int, threads: int,
                                                         usable: list[int], want: Any) -> None:
    assert cores(count, threads, usable, bind=True) == want
    assert cores(count, threads, usable, bind=False) == [()] * count


def test_only_local_cpu_workers_bind_and_the_setting_turns_it_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    usable = sorted(os.sched_getaffinity(0))
    monkeypatch.delenv("CODEFERRY_CPU_BIND", raising=False)
    assert bindings("cpu", "local", 1, len(usable)) == [tuple(usable)]
    assert bindings("cpu", "ray", 1, 1) == [()]  # an actor's cores are its node's
    assert bindings("cuda:0", "local", 1, 1) == [()]
    monkeypatch.setenv("CODEFERRY_CPU_BIND", "0")
    assert bindings("cpu", "local", 1, 1) == [()]
    assert "binds" not in reason("cpu", "local", None, None, cpus=2, bound=False)
    assert "binds each to cores of its own" in reason("cpu", "local", None, None, cpus=2,
                                                       bound=True)


def test_a_worker_binds_to_its_cores_and_runs_unbound_where_the_os_refuses_them() -> None:
    """In a process of its own (a binding is for good): cores that do not exist (a cpuset
    changed after the parent looked) leave it on every core; its own core, on that one."""
    import json
    import os
    import subprocess
    import sys

    usable = sorted(os.sched_getaffinity(0))
    code = ("import json, os\nfrom codeferry._exec.engines.hf_engine import bind_cores\n"
            "now = lambda: sorted(os.sched_getaffinity(0))\n"
            f"refused = bind_cores((10**6,)); after = now(); bound = bind_cores(({usable[-1]},))\n"
            "print(json.dumps([refused, after, bound, now()]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    assert json.loads(out) == [[], usable, [usable[-1]], [usable[-1]]]


@pytest.mark.parametrize(("workers", "threads"), [(0, None), (-1, None), (None, 0)])
def test_counts_below_one_are_refused(workers: int | None, threads: int | None) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        layout("cpu", "local", workers, threads, cpus=2)


def test_the_cores_are_those_this_process_may_use() -> None:
    import os

    assert cpus() == len(os.sched_getaffinity(0))


def test_vllm_workers_of_one_machine_divide_half_its_free_memory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's own default asks for 92% of a CPU machine's memory per engine: the second
    worker's was killed for memory. Without ``VLLM_CPU_KVCACHE_SPACE`` or the caller's own
    option, the workers divide half the memory free now."""
    import os
    from types import SimpleNamespace

    from codeferry._exec.engines.vllm_engine import _memory_share
    from codeferry._exec.generate.packing import available_bytes

    def spec(device: str = "cpu", sharing: int = 2, **options: float) -> SimpleNamespace:
        return SimpleNamespace(device=device, place=SimpleNamespace(sharing=sharing),
                               engine=SimpleNamespace(vllm_options=tuple(options.items())))

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    free, total = available_bytes(), os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert free is not None
    share = _memory_share(spec())["gpu_memory_utilization"]
    assert abs(share * total * 2 - free / 2) < 0.05 * total  # two shares: half of what is free
    assert _memory_share(spec(sharing=1))["gpu_memory_utilization"] > share
    assert _memory_share(spec(gpu_memory_utilization=0.3)) == {}  # the caller's wins
    assert _memory_share(spec(device="cuda:0")) == {}  # a device's memory is vLLM's to share
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    assert _memory_share(spec()) == {}


@pytest.mark.parametrize("engine", ["auto", "vllm", "transformers"])
def test_codeferry_run_starts_the_layouts_workers_whichever_engine(engine: str) -> None:
    from types import SimpleNamespace

    from codeferry._commands.run import _workers
    from codeferry._exec.options import WorkerOptions

    plan: Any = SimpleNamespace(device="cpu")
    assert _workers(plan, WorkerOptions(engine=engine)) == layout("cpu", "local", None, None,
                                                                  cpus=cpus())[0]
    assert _workers(plan, WorkerOptions(engine=engine, workers=3)) == 3
