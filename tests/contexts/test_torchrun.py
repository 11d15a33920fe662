"""torchrun, 4 ranks (gloo, CPU): every rank loads at once from an empty module cache and store.

Plain transformers, the script calling ``codeferry.install()``, and the plain script under
``codeferry exec``; on a flat layout, a sub-package layout and a hub repo id offline.
"""

from __future__ import annotations

from pathlib import Path

from _contexts import BIN, LAYOUTS, MODES, check_ranks, rank_reports, show

RANKS = 4


def test_torchrun_ranks_load_at_once_in_every_mode(
    tmp_path: Path, context_layouts: Path, context_hub_cache: Path
) -> None:
    launcher = [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={RANKS}"]
    reports = {mode: rank_reports(mode, launcher, "torchrun", layouts=context_layouts,
                                  root=tmp_path, hub_cache=context_hub_cache, ranks=RANKS)
               for mode in MODES}
    show("torchrun", {mode: got[0] for mode, got in reports.items()})
    check_ranks(reports, LAYOUTS, RANKS)
