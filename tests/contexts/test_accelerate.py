"""``accelerate launch``, 4 processes on CPU: every rank loads at once from empty caches.

In accelerate 1.15 ``accelerate launch --cpu --num_processes 4`` starts ONE process (several
CPU processes go through ``mpirun``); the way to 4 CPU ranks without MPI is its torch
launcher, ``--multi_gpu``, with ``Accelerator(cpu=True)`` in the script (gloo). Three modes,
three layouts, as ``test_torchrun.py``.
"""

from __future__ import annotations

from pathlib import Path

from _contexts import BIN, LAYOUTS, MODES, check_ranks, rank_reports, show

RANKS = 4


def test_accelerate_ranks_load_at_once_in_every_mode(
    tmp_path: Path, context_layouts: Path, context_hub_cache: Path
) -> None:
    launcher = [str(BIN / "accelerate"), "launch", "--multi_gpu", f"--num_processes={RANKS}",
                "--num_machines=1", "--mixed_precision=no", "--dynamo_backend=no"]
    reports = {mode: rank_reports(mode, launcher, "accelerate", layouts=context_layouts,
                                  root=tmp_path, hub_cache=context_hub_cache, ranks=RANKS)
               for mode in MODES}
    show("accelerate", {mode: got[0] for mode, got in reports.items()})
    check_ranks(reports, LAYOUTS, RANKS)
    assert {got["distributed"] for got in reports["exec"]} == {"MULTI_CPU"}
