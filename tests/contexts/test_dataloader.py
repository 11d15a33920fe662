"""``torch.utils.data.DataLoader(num_workers=2)`` under spawn and forkserver, the dataset
holding the remote tokenizers.

The script calling ``codeferry.install()``, and the plain script under ``codeferry exec``;
on a flat layout, a sub-package layout and a hub repo id offline. Plain transformers works
here (the loader's workers start after the load), so it is not run: its success would claim
nothing about codeferry.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from _contexts import LAYOUTS, ROUTED, last_json, run, script, show


def test_dataloader_workers_get_the_remote_tokenizer_routed_by_codeferry(
    tmp_path: Path, context_layouts: Path, context_hub_cache: Path
) -> None:
    reports = {}
    for mode in ROUTED:
        out = tempfile.mkdtemp(prefix=f"loader-{mode}-", dir=tmp_path)
        argv = [sys.executable, script("dataloader.py"), str(context_layouts), out]
        reports[mode] = last_json(run(mode, argv, root=tmp_path, hub_cache=context_hub_cache))
    show("DataLoader", reports)
    for mode, report in reports.items():
        for layout in LAYOUTS:
            assert report[layout] == {"tokenizer": "codeferry"}, (mode, report)
            for method in ("spawn", "forkserver"):
                assert report[method][layout] == {"right": True,
                                                  "worker_tokenizer": ["codeferry"]}
