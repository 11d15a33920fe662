"""``torch.utils.data.DataLoader(num_workers=2)`` under spawn and forkserver, the dataset
holding the remote tokenizers.

Plain transformers, the script calling ``codeferry.install()``, and the plain script under
``codeferry exec``; on a flat layout, a sub-package layout and a hub repo id offline.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from _contexts import LAYOUTS, MODES, last_json, run, script, show

LOADED_BY = {"plain": "transformers_modules", "codeferry": "codeferry", "exec": "codeferry"}


def test_dataloader_workers_get_the_remote_tokenizer_in_every_mode(
    tmp_path: Path, context_layouts: Path, context_hub_cache: Path
) -> None:
    reports = {}
    for mode in MODES:
        out = tempfile.mkdtemp(prefix=f"loader-{mode}-", dir=tmp_path)
        argv = [sys.executable, script("dataloader.py"), str(context_layouts), out]
        reports[mode] = last_json(run(mode, argv, root=tmp_path, hub_cache=context_hub_cache))
    show("DataLoader", reports)
    for mode, report in reports.items():
        for layout in LAYOUTS:
            # the loader's workers start after the load: plain transformers works here too
            assert report[layout] == {"tokenizer": LOADED_BY[mode]}, (mode, report)
            for method in ("spawn", "forkserver"):
                if mode == "plain" and "error" in report[method]:
                    # plain transformers' spawned loader workers died in the full suite under
                    # load (seen once in CI, "DataLoader worker exited unexpectedly") and
                    # work alone: its outcome here depends on the machine; codeferry's may not
                    assert "exited unexpectedly" in report[method]["message"], report
                    continue
                assert report[method][layout] == {"right": True,
                                                  "worker_tokenizer": [LOADED_BY[mode]]}
