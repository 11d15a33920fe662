"""How long static resolution takes, and what it finds, next to transformers' own scanner.

Builds the largest factory model (every helper kind, tokenizer, processor, nested sub-config,
asset, config helper, in hub layout with cross-repo code) in a temporary hub cache, then times:

* ``codeferry.resolve`` in-process (median of ``--runs`` after one warm-up);
* ``codeferry inspect --json`` as a subprocess (median of ``--cli-runs``; includes the interpreter
  start and imports);
* the plain-transformers way of discovering the same code:
  ``transformers.dynamic_module_utils.get_relative_import_files`` plus ``get_imports`` over every
  ``auto_map`` module file.

transformers' regex scanner cannot scan every variant (``from .pkg.mod import x`` becomes a file
``pkg.mod.py``, an optional import in ``try`` must exist), so it is also timed on the largest
variant it *can* scan, where it completes but misses files (``from . import x``, data files).

Run: ``HF_HUB_OFFLINE=1 python benchmarks/bench_inspect.py [--runs 20] [--cli-runs 5]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"

import codeferry
from codeferry._code import resolve as _resolve
from codeferry.testing import HELPER_KINDS, LARGEST_SPEC, ModelSpec, write_hub_model

AUTO_MAP_FILES = (
    "config.json",
    "tokenizer_config.json",
    "processor_config.json",
    "preprocessor_config.json",
)

LARGEST = LARGEST_SPEC
# The largest variant transformers' scanner gets through: no sub-package, no optional import.
SCANNABLE = ModelSpec(
    name="scan",
    model_keys_first=True,
    helpers=tuple(k for k in HELPER_KINDS if k not in {"subpackage", "try_except"}),
    config_helper=True,
    tokenizer=True,
    processor=True,
    nested_subconfig=True,
    asset=True,
    cross_repo="org/scan-heads",
)


class _Timed:
    """Wraps a function and adds up the time spent in it (to split ``resolve`` in parts)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.times: list[float] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.times.append(time.perf_counter() - start)


def median_ms(fn: Callable[[], Any], runs: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def auto_map_values(data: Any) -> Iterator[str]:
    """Every ``module.Class`` string under any ``auto_map`` key (nested configs included)."""
    if isinstance(data, dict):
        for key, value in data.items():
            if key == "auto_map":
                for entry in value.values():
                    entries = entry if isinstance(entry, list) else [entry]
                    yield from (e for e in entries if isinstance(e, str))
            else:
                yield from auto_map_values(value)


def snapshot_of(cache: Path, repo_id: str) -> Path:
    repo_dir = cache / ("models--" + repo_id.replace("/", "--"))
    return repo_dir / "snapshots" / (repo_dir / "refs" / "main").read_text().strip()


def auto_map_module_files(cache: Path, repo_id: str) -> set[Path]:
    """The module file of every ``auto_map`` entry (cross-repo ones in their own snapshot)."""
    root = snapshot_of(cache, repo_id)
    module_files: set[Path] = set()
    for name in AUTO_MAP_FILES:
        if (root / name).is_file():
            for ref in auto_map_values(json.loads((root / name).read_text())):
                repo, _, rest = ref.rpartition("--")
                base = snapshot_of(cache, repo) if repo else root
                module_files.add(base / (rest.rsplit(".", 1)[0].replace(".", "/") + ".py"))
    return module_files


def transformers_scan(cache: Path, repo_id: str) -> tuple[set[Path], set[Path]]:
    """What transformers' scanner says the code is: (files that exist, files named but absent).

    Raises what transformers raises (``FileNotFoundError`` for a file it invents).
    """
    from transformers.dynamic_module_utils import get_imports, get_relative_import_files

    module_files = auto_map_module_files(cache, repo_id)
    found: set[Path] = set(module_files)
    for module_file in sorted(module_files):
        found.update(Path(f) for f in get_relative_import_files(module_file))
    for path in sorted(found):
        get_imports(path)
    return {p for p in found if p.is_file()}, {p for p in found if not p.is_file()}


def invented_files(cache: Path, repo_id: str) -> list[str]:
    """Absent files transformers' walk asks for (its loop, but stepping over absent files)."""
    from transformers.dynamic_module_utils import get_relative_imports

    root = snapshot_of(cache, repo_id)
    todo = [p for p in auto_map_module_files(cache, repo_id) if p.parent == root]
    seen: set[Path] = set(todo)
    while todo:
        path = todo.pop()
        for name in get_relative_imports(path):
            target = root / f"{name}.py"  # transformers' own rule: always next to the module
            if target not in seen:
                seen.add(target)
                if target.is_file():
                    todo.append(target)
    return sorted(p.name for p in seen if not p.is_file())


def cli_ms(cache: Path, repo_id: str, runs: int) -> tuple[float, int]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    cmd = [sys.executable, "-m", "codeferry.cli", "inspect", repo_id, "--json"]
    out: dict[str, Any] = {}

    def once() -> None:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        out.update(json.loads(proc.stdout))

    return median_ms(once, runs), len(out["files"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="in-process runs (median)")
    parser.add_argument("--cli-runs", type=int, default=5, help="subprocess runs (median)")
    args = parser.parse_args()
    started = time.perf_counter()
    rows: list[tuple[str, str, str, str, str, str]] = []
    with tempfile.TemporaryDirectory(prefix="codeferry-bench-") as tmp:
        cache = Path(tmp) / "hub"
        variants = {"acme/largest": LARGEST, "acme/scannable": SCANNABLE}
        for repo_id, spec in variants.items():
            write_hub_model(cache, repo_id, spec)
        for repo_id in variants:
            label = repo_id.split("/")[1]
            bundle = codeferry.resolve(repo_id, cache_dir=cache)
            assert not bundle.problems, bundle.problems
            ours = {(f.repo, f.path) for f in bundle.files}
            timed = _Timed(_resolve.check_transformers_names)
            _resolve.check_transformers_names = timed
            try:
                resolve_ms = median_ms(
                    lambda r=repo_id: codeferry.resolve(r, cache_dir=cache), args.runs
                )
            finally:
                _resolve.check_transformers_names = timed.fn
            names_note = (
                f"of which {statistics.median(timed.times[1:]) * 1000:.0f} ms (median) check "
                "imported names against the installed transformers"
            )
            cli, cli_files = cli_ms(cache, repo_id, args.cli_runs)
            try:
                found, absent = transformers_scan(cache, repo_id)
            except OSError as exc:
                invented = ", ".join(f"`{name}`" for name in invented_files(cache, repo_id))
                rows += [
                    (label, "codeferry.resolve (in-process)", f"{resolve_ms:.1f}", "-",
                     str(len(ours)), names_note),
                    (label, "codeferry inspect --json (subprocess)", f"{cli:.0f}", "-",
                     str(cli_files), "incl. interpreter start"),
                    (label, "transformers get_relative_import_files + get_imports", "fails", "-",
                     "-", f"{type(exc).__name__}; looks for absent {invented}"),
                ]  # fmt: skip
                continue
            hf_ms = median_ms(lambda r=repo_id: transformers_scan(cache, r), args.runs)
            roots = {None: snapshot_of(cache, repo_id)}
            roots.update({repo: snapshot_of(cache, repo) for repo in bundle.pins})
            theirs = {
                (repo, p.relative_to(root).as_posix())
                for p in found
                for repo, root in roots.items()
                if p.is_relative_to(root)
            }
            missed = sorted(path for repo, path in ours - theirs)
            rows += [
                (label, "codeferry.resolve (in-process)", f"{resolve_ms:.1f}",
                 f"{resolve_ms / hf_ms:.1f}x", str(len(ours)), names_note),
                (label, "codeferry inspect --json (subprocess)", f"{cli:.0f}",
                 f"{cli / hf_ms:.0f}x", str(cli_files), "incl. interpreter start"),
                (label, "transformers get_relative_import_files + get_imports", f"{hf_ms:.1f}",
                 "1.0x", str(len(theirs)),
                 "misses " + ", ".join(f"`{m}`" for m in missed)
                 + (f"; names {len(absent)} absent file(s)" if absent else "")),
            ]  # fmt: skip
    header = ("variant", "method", "median ms", "vs transformers", "files found", "notes")
    print(f"| {' | '.join(header)} |")
    print("|" + "|".join("---" for _ in header) + "|")
    for row in rows:
        print(f"| {' | '.join(row)} |")
    print(
        f"\nlargest = {len(LARGEST.helpers)} helper kinds + config helper + tokenizer + processor"
        " + nested sub-config + asset + cross repo, hub layout; scannable = the same without the"
        " `subpackage` and `try_except` helpers. In-process: median of"
        f" {args.runs} after one warm-up; subprocess: median of {args.cli_runs}."
        f" Python {sys.version.split()[0]}; total {time.perf_counter() - started:.0f} s."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
