"""How many workers an executor starts, and threads each (``_exec/layout.py``): pure."""

from __future__ import annotations

import pytest

from codeferry._exec.layout import RAY_WORKERS, cpus, layout


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


@pytest.mark.parametrize(("workers", "threads"), [(0, None), (-1, None), (None, 0)])
def test_counts_below_one_are_refused(workers: int | None, threads: int | None) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        layout("cpu", "local", workers, threads, cpus=2)


def test_the_cores_are_those_this_process_may_use() -> None:
    import os

    assert cpus() == len(os.sched_getaffinity(0))
