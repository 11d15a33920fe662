"""Importing codeferry changes nothing global; the first ``load``/``install()``/ticket does.

Each case runs in a fresh interpreter (this one has loaded models long ago) and prints
what it saw as JSON.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import codeferry
from codeferry import cli

DEMO = Path(cli._demo())

# What codeferry could touch: the import system, cloudpickle's Pickler, multiprocessing's
# reducers, copyreg, and transformers' remote-code entry point.
STATE = textwrap.dedent("""
    import copyreg, json, sys
    from multiprocessing.reduction import ForkingPickler

    def state():
        import cloudpickle
        return {
            "meta_path": [type(f).__module__ + "." + type(f).__qualname__ for f in sys.meta_path],
            "cloudpickle_patched": bool(getattr(cloudpickle.Pickler, "_codeferry_patched", False)),
            "reducer_override": id(cloudpickle.Pickler.reducer_override),
            "forking_reducers": len(ForkingPickler._extra_reducers),
            "copyreg": len(copyreg.dispatch_table),
        }
""")


def fresh(body: str, *args: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", STATE + textwrap.dedent(body), *args],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
    return result


def test_importing_codeferry_changes_nothing_and_load_installs_what_it_needs() -> None:
    seen = fresh("""
        import cloudpickle  # imported first: codeferry would patch it at once
        import torch  # noqa: F401  (torch registers reducers of its own at import)
        before = state()
        import codeferry, codeferry.cli, codeferry._commands.run, codeferry._exec.executor, codeferry.testing
        imported = state()
        codeferry.load(sys.argv[1], trust_remote_code=True)
        print(json.dumps({"before": before, "imported": imported, "loaded": state()}))
    """, str(DEMO))
    assert seen["imported"] == seen["before"]
    loaded = seen["loaded"]
    assert "codeferry._runtime.loader._Finder" in loaded["meta_path"]
    assert "codeferry._runtime.pickling._PostImportHook" in loaded["meta_path"]
    assert loaded["cloudpickle_patched"] and not seen["before"]["cloudpickle_patched"]


def test_cloudpickle_imported_after_codeferry_is_left_alone_until_install() -> None:
    seen = fresh("""
        import codeferry
        untouched = state()  # imports cloudpickle after codeferry
        codeferry.install()
        print(json.dumps({"untouched": untouched, "installed": state()}))
    """)
    assert not seen["untouched"]["cloudpickle_patched"]
    assert not any(f.startswith("codeferry.") for f in seen["untouched"]["meta_path"])
    installed = seen["installed"]
    assert installed["cloudpickle_patched"]
    assert {"codeferry._runtime.loader._Finder", "codeferry._runtime.pickling._PostImportHook"} <= set(
        installed["meta_path"])


def test_an_unpickled_ticket_installs_what_it_needs() -> None:
    """A receiver that only imports codeferry to unpickle: the ticket brings the finder."""
    config = codeferry.load(DEMO, trust_remote_code=True)["AutoConfig"]()
    blob = pickle.dumps(config)  # embeds its code: the receiver needs no store entry
    seen = fresh("""
        import pickle
        before = state()
        config = pickle.loads(bytes.fromhex(sys.argv[1]))
        after = state()
        print(json.dumps({"before": before, "after": after, "module": type(config).__module__}))
    """, blob.hex())
    assert not any(f.startswith("codeferry.") for f in seen["before"]["meta_path"])
    assert "codeferry._runtime.loader._Finder" in seen["after"]["meta_path"]
    assert seen["after"]["cloudpickle_patched"]
    assert seen["module"] == type(config).__module__
