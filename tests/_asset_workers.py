"""Receivers for ``tests/test_assets.py``: what a fresh process makes of a config whose
model ships a big asset. Imports nothing of codeferry at module level."""

from __future__ import annotations

import hashlib
import os
import sys
from typing import Any


def asset_report(config: Any) -> dict[str, Any]:
    """The sha256 of the asset as the received code reads it (through ``__file__``), and where."""
    module = sys.modules[type(config).__module__]
    data = module.read_big_asset()
    return {
        "sha256": hashlib.sha256(data).hexdigest(),
        "size": len(data),
        "file": module.__file__,
        "pid": os.getpid(),
    }


def child_main(config: Any, queue: Any) -> None:
    """A spawned ``Process`` target: the config came through multiprocessing's pickler."""
    try:
        queue.put(asset_report(config))
    except BaseException as exc:  # report, never hang the parent
        import traceback

        queue.put({"error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()})


if __name__ == "__main__":
    # Fresh interpreter: a plain pickle of a list of configs on stdin, JSON on stdout.
    import json
    import pickle

    configs = pickle.loads(sys.stdin.buffer.read())
    print(json.dumps([asset_report(c) for c in configs]))
