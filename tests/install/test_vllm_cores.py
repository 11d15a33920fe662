"""The cores a boxed vLLM process is told (``_install.vllm.cores_in``): read from ``/sys`` as
``lscpu --extended=CPU,CORE,NODE --online`` numbers them, since the box starts no ``lscpu``.
Pure: a ``/sys/devices/system/cpu`` tree written here for each topology (the real one is
compared with vLLM's own ``lscpu`` reader in ``tests/vllm/test_vllm_box.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from codeferry._install.vllm import cores_in


def _tree(root: Path, online: str, cpus: dict[int, tuple[int, int, int | None]]) -> Path:
    """``cpus``: cpu -> (package, core id, NUMA node or None)."""
    (root / "online").parent.mkdir(parents=True, exist_ok=True)
    (root / "online").write_text(online + "\n")
    for cpu, (package, core, node) in cpus.items():
        topology = root / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text(f"{package}\n")
        (topology / "core_id").write_text(f"{core}\n")
        if node is not None:
            (root / f"cpu{cpu}" / f"node{node}").mkdir()
    return root


@pytest.mark.parametrize(("online", "cpus", "expected"), [
    ("0-1", {0: (0, 0, 0), 1: (0, 1, 0)}, [(0, 0, 0), (1, 1, 0)]),
    # two threads a core, two packages whose core ids repeat, two NUMA nodes
    ("0-3", {0: (0, 0, 0), 1: (0, 1, 0), 2: (0, 0, 0), 3: (1, 0, 1)},
     [(0, 0, 0), (1, 1, 0), (2, 0, 0), (3, 2, 1)]),
    # an offline CPU is left out; a CPU outside any node is on node 0
    ("0,2-3", {0: (0, 4, None), 2: (0, 8, None), 3: (0, 4, None)},
     [(0, 0, 0), (2, 1, 0), (3, 0, 0)]),
])
def test_cores_are_numbered_as_lscpu_numbers_them(
        tmp_path: Path, online: str, cpus: dict[int, tuple[int, int, int | None]],
        expected: list[tuple[int, int, int]]) -> None:
    assert cores_in(str(_tree(tmp_path / "cpu", online, cpus))) == expected


def test_this_machines_cores() -> None:
    found = cores_in()
    assert [cpu for cpu, _, _ in found] == sorted(cpu for cpu, _, _ in found)
    assert found and all(core >= 0 and node >= 0 for _, core, node in found)
