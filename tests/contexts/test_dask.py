"""``dask.distributed.LocalCluster(processes=True, n_workers=2, threads_per_worker=1)``
(127.0.0.1, no dashboard), started before the load: the config goes to a worker by
``submit`` and by ``scatter``, and the worker builds the model from it.

The script calling ``codeferry.install()``, and the plain script under ``codeferry exec``,
on a flat layout, a sub-package layout and a hub repo id offline; plain transformers on the
flat layout, which shows its failure (after it the cluster has lost its workers: another
layout would show nothing new).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from _contexts import LAYOUTS, MODES, last_json, only, run, script, show

#: Plain transformers today: the worker that receives the config cannot unpickle it
#: (``No module named 'transformers_modules'``) and loses its connection; the call would
#: never answer (``dask_cluster.answer`` reports the lost worker instead of waiting).
PLAIN = {"flat": {"submit": "WorkerLost", "scatter": "WorkerLost"}}


def test_dask_workers_started_before_the_load_in_every_mode(
    tmp_path: Path, context_layouts: Path, context_hub_cache: Path
) -> None:
    reports = {}
    for mode in MODES:
        out = tempfile.mkdtemp(prefix=f"dask-{mode}-", dir=tmp_path)
        layouts = only(context_layouts, *PLAIN) if mode == "plain" else context_layouts
        argv = [sys.executable, script("dask_cluster.py"), str(layouts), out]
        reports[mode] = last_json(run(mode, argv, root=tmp_path, hub_cache=context_hub_cache))
    show("dask", reports)
    plain = {layout: {how: reports["plain"][layout][how].get("error", "ok")
                      for how in ("submit", "scatter")} for layout in PLAIN}
    assert plain == PLAIN, reports["plain"]
    for mode in ("codeferry", "exec"):
        for layout in LAYOUTS:
            for how in ("submit", "scatter"):
                assert reports[mode][layout][how] == {
                    "config": "codeferry", "model": "codeferry", "same_config_class": True,
                }, (mode, layout, reports[mode])
