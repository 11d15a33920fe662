"""``datasets.Dataset.map(fn, num_proc=2)`` with the remote tokenizers in ``fn``, under fork,
spawn and forkserver; the fingerprint is the same in a second run, which reuses the cache.

The script calling ``codeferry.install()``, and the plain script under ``codeferry exec``;
on a flat layout, a sub-package layout and a hub repo id offline. Plain transformers works
here (the tokenizer is no sub-package user, and the workers find the module cache on their
path), so it is not run: its success would claim nothing about codeferry.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from _contexts import LAYOUTS, ROUTED, last_json, run, script, show

METHODS = ("fork", "spawn", "forkserver")


def test_datasets_map_with_a_remote_tokenizer_routed_by_codeferry(
    tmp_path: Path, context_layouts: Path, context_hub_cache: Path
) -> None:
    reports, again = {}, {}
    for mode in ROUTED:
        out = tempfile.mkdtemp(prefix=f"datasets-{mode}-", dir=tmp_path)
        argv = [script("datasets_map.py"), str(context_layouts), out]
        reports[mode] = last_json(run(mode, [sys.executable, *argv, "first"], root=tmp_path,
                                      hub_cache=context_hub_cache))
        again[mode] = last_json(run(mode, [sys.executable, *argv, "again"], root=tmp_path,
                                    hub_cache=context_hub_cache))
    show("datasets.map", reports)
    show("datasets.map again", again)
    for mode in ROUTED:
        report = reports[mode]
        for layout in LAYOUTS:
            assert report[layout] == {"tokenizer": "codeferry"}, (mode, report)
        for method in METHODS:
            assert report[method]["ran"] == 4, (mode, method, report)  # 8 rows, batches of 2
            for layout in LAYOUTS:
                assert report[method][layout] == {"right": True,
                                                  "worker_tokenizer": ["codeferry"]}
        # a second run, in a new process: same fingerprint, cache reused, fn not called
        assert again[mode]["fork"]["fingerprint"] == report["fork"]["fingerprint"], mode
        assert again[mode]["fork"]["ran"] == 0, (mode, again[mode])

