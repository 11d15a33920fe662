"""``accelerate launch``, 4 processes on CPU: every rank loads at once from empty caches, the
plain script launched unchanged under ``codeferry exec``.

In accelerate 1.15 ``accelerate launch --cpu --num_processes 4`` starts ONE process (several
CPU processes go through ``mpirun``); the way to 4 CPU ranks without MPI is its torch
launcher, ``--multi_gpu``, with ``Accelerator(cpu=True)`` in the script (gloo). accelerate's
launcher is torch's elastic agent, as torchrun's: ``test_torchrun.py`` runs the same script
plain (its failures) and with ``codeferry.install()`` at its top; what accelerate adds is its
own launcher in front, the one ``codeferry exec`` must reach through, so only that mode runs
here. Three layouts, as ``test_torchrun.py``.
"""

from __future__ import annotations

from pathlib import Path

from _contexts import BIN, LAYOUTS, check_ranks, rank_reports, show

RANKS = 4


def test_accelerate_ranks_load_at_once_under_codeferry_exec(
    tmp_path: Path, context_layouts: Path, context_hub_cache: Path
) -> None:
    launcher = [str(BIN / "accelerate"), "launch", "--multi_gpu", f"--num_processes={RANKS}",
                "--num_machines=1", "--mixed_precision=no", "--dynamo_backend=no"]
    reports = {"exec": rank_reports("exec", launcher, "accelerate", layouts=context_layouts,
                                    root=tmp_path, hub_cache=context_hub_cache, ranks=RANKS)}
    show("accelerate", {mode: got[0] for mode, got in reports.items()})
    check_ranks(reports, LAYOUTS, RANKS)
    assert {got["distributed"] for got in reports["exec"]} == {"MULTI_CPU"}
