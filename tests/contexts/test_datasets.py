"""``datasets.Dataset.map(fn, num_proc=2)`` with the remote tokenizers in ``fn``, under fork,
spawn and forkserver; the fingerprint is the same in a second run, which reuses the cache.

Plain transformers, the script calling ``codeferry.install()``, and the plain script under
``codeferry exec``; on a flat layout, a sub-package layout and a hub repo id offline.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from _contexts import LAYOUTS, MODES, last_json, run, script, show

METHODS = ("fork", "spawn", "forkserver")
#: The module the classes of each mode come from, in the parent and in datasets' workers.
LOADED_BY = {"plain": "transformers_modules", "codeferry": "codeferry", "exec": "codeferry"}


def test_datasets_map_with_a_remote_tokenizer_in_every_mode(
    tmp_path: Path, context_layouts: Path, context_hub_cache: Path
) -> None:
    reports, again = {}, {}
    for mode in MODES:
        out = tempfile.mkdtemp(prefix=f"datasets-{mode}-", dir=tmp_path)
        argv = [script("datasets_map.py"), str(context_layouts), out]
        reports[mode] = last_json(run(mode, [sys.executable, *argv, "first"], root=tmp_path,
                                      hub_cache=context_hub_cache))
        again[mode] = last_json(run(mode, [sys.executable, *argv, "again"], root=tmp_path,
                                    hub_cache=context_hub_cache))
    show("datasets.map", reports)
    show("datasets.map again", again)
    for mode in MODES:
        report = reports[mode]
        for layout in LAYOUTS:  # the tokenizer is no sub-package user: plain loads all three
            assert report[layout] == {"tokenizer": LOADED_BY[mode]}, (mode, report)
        for method in METHODS:
            assert report[method]["ran"] == 4, (mode, method, report)  # 8 rows, batches of 2
            for layout in LAYOUTS:
                assert report[method][layout] == {"right": True,
                                                  "worker_tokenizer": [LOADED_BY[mode]]}
        # a second run, in a new process: same fingerprint, cache reused, fn not called
        assert again[mode]["fork"]["fingerprint"] == report["fork"]["fingerprint"], mode
        assert again[mode]["fork"]["ran"] == 0, (mode, again[mode])

