"""Pools started before the load: ``ProcessPoolExecutor`` and ``multiprocessing.Pool`` under
spawn, forkserver and fork; and ``joblib.Parallel(backend="loky")``. The parent sends the
config; each worker builds the model from it.

The script calling ``codeferry.install()``, and the plain script under ``codeferry exec``,
on a flat layout, a sub-package layout and a hub repo id offline; plain transformers on the
flat layout, which shows its failures (the sub-package layout's ``utils.rope.py`` is shown
by ``test_torchrun.py``).
(``tests/runtime/test_travel.py`` sends every kind of object to such pools after
``codeferry.load``; this adds plain transformers and ``codeferry exec`` side by side.)
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

from _contexts import LAYOUTS, MODES, last_json, only, run, script, show

METHODS = ("spawn", "forkserver", "fork")
WORKS = "ok"

#: Plain transformers today (one process, pools started before the load), on the flat
#: layout: a worker started before the load cannot import ``transformers_modules``: the
#: executors break, and the Pool's worker dies (``Pool.apply`` would wait forever; the Pool
#: starts another). loky starts its workers at the call, after the load: they build it.
PLAIN: dict[str, dict[str, str]] = {
    "flat": {"parent": WORKS, "loky": WORKS,
             **{f"executor-{m}": "BrokenProcessPool" for m in METHODS},
             **{f"pool-{m}": "WorkerDied" for m in METHODS}},
}


def outcomes(report: dict[str, Any]) -> dict[str, str]:
    """``{"parent" | "loky" | "executor-spawn" ...: "ok" | error type}`` of one layout."""
    stdlib = report["stdlib"]
    found = {"parent": WORKS if "error" not in stdlib else stdlib["error"],
             "loky": report["loky"].get("error", WORKS)}
    for key, value in stdlib.items():
        if key != "parent" and isinstance(value, dict):
            found[key] = value.get("error", WORKS)
    return found


def test_pools_started_before_the_load_in_every_mode(
    tmp_path: Path, context_layouts: Path, context_hub_cache: Path
) -> None:
    reports = {}
    for mode in MODES:
        out = tempfile.mkdtemp(prefix=f"pools-{mode}-", dir=tmp_path)
        layouts = only(context_layouts, *PLAIN) if mode == "plain" else context_layouts
        argv = [sys.executable, script("pools.py"), str(layouts), out]
        reports[mode] = last_json(run(mode, argv, root=tmp_path, hub_cache=context_hub_cache))
    show("pools", reports)
    assert {layout: outcomes(reports["plain"][layout]) for layout in PLAIN} == PLAIN
    routed = {"config": "codeferry", "model": "codeferry", "same_config_class": True,
              "generate_hook": "codeferry"}
    for mode in ("codeferry", "exec"):
        for layout in LAYOUTS:
            report = reports[mode][layout]
            assert report["stdlib"]["parent"] == "codeferry", (mode, layout, report)
            built = [v for k, v in report["stdlib"].items() if k != "parent"]
            assert built == [routed] * 2 * len(METHODS), (mode, layout, report)
            # loky's workers do not run the main script, so its `codeferry.install()` does
            # not reach them: the config arrives with its code, but the worker's
            # from_pretrained builds the model with plain transformers. Under exec every
            # worker is routed.
            if mode == "exec":
                assert report["loky"] == routed, (mode, layout, report)
            elif layout == "subpackage":  # plain transformers in the worker: no helper
                assert report["loky"]["error"] == "FileNotFoundError", report
            else:
                assert report["loky"] == {**routed, "model": "transformers_modules",
                                          "generate_hook": "transformers"}, report
