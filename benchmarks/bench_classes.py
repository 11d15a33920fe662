"""How many ``auto_map`` classes each way loads, over the factory's variants.

Three ways, each in one fresh process that loads every variant:

* ``transformers``: plain transformers, class by class: ``get_class_from_dynamic_module(ref,
  folder)`` for each ``auto_map`` entry (config first), each in its own ``try``;
* ``codeferry``: ``codeferry.load(folder, trust_remote_code=True)``, counting the classes
  in the result (one per ``auto_map`` entry; a ``[slow, fast]`` pair counts its classes);
* ``install()``: ``codeferry.install()`` once, then the same calls as ``transformers``.

Variants: the factory's helper layouts (``codeferry.testing.HELPER_KINDS``) and the faults of
real folders (``REAL_WORLD_KINDS``: a missing package in the tokenizer or a vision tower, a
deferred helper that cannot import, a name the installed transformers lacks, a config that
needs a missing package). The goal: codeferry >= transformers on every variant, and strictly
more where transformers fails on a helper layout.

Run: ``python benchmarks/bench_classes.py`` (about a minute on 2 cores). Caches live in a
temporary folder; nothing of the user's is touched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

WAYS = ("transformers", "codeferry", "install()")


def _write_variants(root: Path) -> dict[str, Path]:
    from codeferry.testing import (
        HELPER_KINDS,
        REAL_WORLD_KINDS,
        ModelSpec,
        write_model,
        write_real_world_model,
    )

    out: dict[str, Path] = {}
    for i, kind in enumerate(HELPER_KINDS):
        out[f"helper {kind}"] = write_model(
            root / f"h{i}", ModelSpec(name=f"bh{i}", helpers=(kind,), tokenizer=True))
    for i, kind in enumerate(REAL_WORLD_KINDS):
        if kind != "lfs_config":  # nothing can load a model whose config was never pulled
            out[kind] = write_real_world_model(root / f"r{i}", kind, name=f"br{i}")
    return out


def _child(way: str, folders: dict[str, str]) -> dict[str, list[int]]:
    """Runs in a fresh process: (loaded, named) per variant."""
    import logging

    logging.disable(logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    import codeferry
    from codeferry._code.resolve import read_class_refs
    from codeferry._code.source import locate

    if way == "install()":
        codeferry.install()
    result: dict[str, list[int]] = {}
    for name, folder in folders.items():
        refs = read_class_refs(locate(folder))
        refs.sort(key=lambda r: r.key != "AutoConfig")
        if way == "codeferry":
            try:
                classes = codeferry.load(folder, trust_remote_code=True)
                loaded = sum(len([c for c in v if c is not None]) if isinstance(v, tuple) else 1
                             for v in classes.values())
            except Exception:
                loaded = 0
        else:
            from transformers.dynamic_module_utils import get_class_from_dynamic_module

            loaded = 0
            for ref in refs:
                try:
                    get_class_from_dynamic_module(ref.reference, folder)
                    loaded += 1
                except Exception:
                    pass
        result[name] = [loaded, len(refs)]
    return result


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="codeferry-bench-classes-") as tmp:
        env = {**os.environ, "HF_HOME": f"{tmp}/hf", "HF_MODULES_CACHE": f"{tmp}/hf/modules",
               "CODEFERRY_HOME": f"{tmp}/cf", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        os.environ.update(env)
        folders = {k: str(v) for k, v in _write_variants(Path(tmp) / "models").items()}
        results: dict[str, dict[str, list[int]]] = {}
        for way in WAYS:
            here = str(Path(__file__).parent)
            code = (f"import json, sys; sys.path.insert(0, {here!r}); import bench_classes as b; "
                    f"print(json.dumps(b._child({way!r}, json.loads(sys.stdin.read()))))")
            proc = subprocess.run([sys.executable, "-c", code], input=json.dumps(folders),
                                  capture_output=True, text=True, env=env, check=True)
            results[way] = json.loads(proc.stdout.strip().splitlines()[-1])
    width = max(len(k) for k in folders)
    print(f"{'variant':<{width}}  " + "  ".join(f"{w:>12}" for w in WAYS) + "  goal")
    ok = True
    for name in folders:
        row = [results[w][name] for w in WAYS]
        named = row[0][1]
        plain, ours, inst = (r[0] for r in row)
        # strictly more where transformers fails on a helper layout (a fault of its loader,
        # not of the folder); never fewer anywhere
        layout = name.startswith("helper ")
        met = ours >= plain and inst >= plain and (
            not layout or plain == named or (ours > plain and inst > plain))
        ok &= met
        print(f"{name:<{width}}  " + "  ".join(f"{r[0]:>8} / {r[1]:<2}" for r in row)
              + ("  met" if met else "  NOT MET"))
    totals = [sum(results[w][n][0] for n in folders) for w in WAYS]
    print(f"{'total':<{width}}  " + "  ".join(f"{t:>12}" for t in totals))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
