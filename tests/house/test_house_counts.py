"""The house's counts (``house_counts.py``) stay within their limits, and the counting
itself sees what it claims to."""

from __future__ import annotations

import ast

import house_counts
import pytest


@pytest.mark.parametrize("what", sorted(house_counts.LIMITS))
def test_count_within_its_limit(what: str) -> None:
    value = house_counts.counts()[what]
    assert value <= house_counts.LIMITS[what], f"{what}: {value}"


def test_the_counts_see_folders_constructors_and_signatures() -> None:
    folders = house_counts.exec_folders()
    assert {"_exec", "_exec/generate", "_exec/engines", "_exec/workers"} <= set(folders)
    assert folders["_exec/workers"] >= 6  # worker, transport, zygote, ray_backend, ...
    built = house_counts.constructors()
    assert built["_exec/scheduler.py:Scheduler"] >= 2 and "_exec/engines/spec.py:WorkerSpec" in built
    assert "_exec/executor.py:Executor" not in built  # the public keywords stay
    function = ast.parse("def f(a, b=1, *args, c, **kw): ...").body[0]
    assert isinstance(function, ast.FunctionDef) and house_counts._parameters(function) == 5
    assert house_counts.generating_requests() == ["complete"]
