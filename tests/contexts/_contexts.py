"""Runs a context script in up to three modes, each from empty caches, and reads back its
JSON report.

The modes (``MODES``): ``plain`` (transformers alone, as users run it today), ``codeferry``
(the script's own ``codeferry.install()``, switched on by ``CTX_MODE``) and ``exec`` (the same
plain script, unchanged, under ``python -m codeferry exec --trust-remote-code --``). Every run
gets a fresh ``HF_MODULES_CACHE`` and ``CODEFERRY_HOME``, so every process of it loads from
nothing; hub models are read from the session's offline hub cache.

Each run costs seconds of fresh interpreters, so a context runs plain transformers only
where plain fails (``ROUTED`` where it works: its success claims nothing about codeferry),
and over only the layouts that show the failure (``only``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from codeferry.testing import ModelSpec

#: layout -> (spec, hub repo id or None): the models every context loads, each with a remote
#: tokenizer (``conftest.py`` writes them once per session).
LAYOUT_SPECS: dict[str, tuple[ModelSpec, str | None]] = {
    "flat": (ModelSpec(name="ctxflat", helpers=("flat",), tokenizer=True), None),
    "subpackage": (ModelSpec(name="ctxsub", helpers=("subpackage",), tokenizer=True), None),
    "hub": (ModelSpec(name="ctxhub", helpers=("flat",), tokenizer=True), "acme/ctx-hub"),
}
LAYOUTS = tuple(LAYOUT_SPECS)

#: The three ways a context may run.
MODES = ("plain", "codeferry", "exec")
#: The two modes in which codeferry routes remote code: every context runs both.
ROUTED = ("codeferry", "exec")
#: The context scripts (plain transformers; ``_ctx.py`` is what they share).
SCRIPTS = Path(__file__).resolve().with_name("scripts")
#: torchrun and accelerate next to this interpreter.
BIN = Path(sys.executable).parent


def environment(root: Path, hub_cache: Path, mode: str) -> dict[str, str]:
    """This session's environment, offline, with a module cache and a store nothing used yet."""
    fresh = Path(tempfile.mkdtemp(prefix=f"{mode}-", dir=root))
    env = {**os.environ, "HF_MODULES_CACHE": str(fresh / "modules"),
           "CODEFERRY_HOME": str(fresh / "codeferry"), "HF_HUB_CACHE": str(hub_cache),
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_DATASETS_CACHE": str(fresh / "datasets"), "HF_HUB_DISABLE_PROGRESS_BARS": "1",
           "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("CODEFERRY_INSTALL", None)
    env.pop("CTX_MODE", None)
    if mode == "codeferry":
        env["CTX_MODE"] = "codeferry"
    return env


def command(mode: str, argv: list[str]) -> list[str]:
    """``argv`` as the mode runs it."""
    if mode == "exec":
        return [sys.executable, "-m", "codeferry", "exec", "--trust-remote-code", "--", *argv]
    return argv


def run(mode: str, argv: list[str], *, root: Path, hub_cache: Path,
        timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` (which ends with the script and its layouts file and out folder) in ``mode``;
    fails the test with the stderr tail when the command fails."""
    proc = subprocess.run(command(mode, argv), env=environment(root, hub_cache, mode), cwd=root,
                          capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, f"{mode}: exit {proc.returncode}\n{proc.stderr[-6000:]}"
    return proc


def last_json(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def script(name: str) -> str:
    return str(SCRIPTS / name)


def only(layouts: Path, *names: str) -> Path:
    """A layouts file beside ``layouts`` (``[[layout, model], ...]``) with only ``names``: a
    plain-transformers run needs only the layouts that show its failure."""
    pairs = [pair for pair in json.loads(layouts.read_text(encoding="utf-8")) if pair[0] in names]
    assert [name for name, _ in pairs] == list(names), (names, pairs)
    path = layouts.with_name(f"layouts-{'-'.join(names)}.json")
    path.write_text(json.dumps(pairs), encoding="utf-8")
    return path


def outcomes(report: dict[str, Any], layouts: tuple[str, ...]) -> dict[str, str]:
    """``{layout: "ok" | error type}``: what the test's tables compare."""
    return {name: report[name].get("error", "ok") for name in layouts}


def show(name: str, reports: dict[str, Any]) -> None:
    """Print every mode's report: ``pytest -s`` (or a failure) shows the side-by-side table."""
    print(f"\n== {name}")
    for mode, report in reports.items():
        print(f"{mode:>9}: {json.dumps(report, sort_keys=True)}")


#: What plain transformers raises when ranks copy the module cache at once (failure-modes F5:
#: a file another rank is still writing): a plain run may hit one, by chance, where it
#: otherwise loads. ``benchmarks/bench_cold_ranks.py`` counts them.
RACE_ERRORS = frozenset({"FileNotFoundError", "AttributeError", "PermissionError",
                         "ModuleNotFoundError", "ImportError", "SyntaxError", "OSError",
                         "ValueError", "KeyError"})


def assert_codeferry(report: dict[str, Any], layouts: tuple[str, ...], **facts: Any) -> None:
    """Every layout loaded, with codeferry's classes, and every fact in ``facts`` holds."""
    for name in layouts:
        got = report[name]
        assert "error" not in got, (name, got)
        assert got.get("config", "codeferry") == "codeferry", (name, got)
        for key, value in facts.items():
            assert got[key] == value, (name, key, got)


def rank_reports(mode: str, launcher: list[str], flavour: str, *, layouts: Path, root: Path,
                 hub_cache: Path, ranks: int) -> list[dict[str, Any]]:
    """``scripts/ranks.py`` under ``launcher`` (torchrun or accelerate) in ``mode``: each rank's
    report."""
    out = Path(tempfile.mkdtemp(prefix=f"ranks-{mode}-", dir=root))
    run(mode, [*launcher, script("ranks.py"), str(layouts), str(out), flavour], root=root,
        hub_cache=hub_cache)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(ranks)]


def check_ranks(reports: dict[str, list[dict[str, Any]]], layouts: tuple[str, ...],
                ranks: int) -> None:
    """What every rank of each mode run must report (``ranks.py``), plain transformers
    included when it ran."""
    plains = reports.get("plain", [])
    # a rank whose load raced gathers None: every other rank then sees another class
    raced = {name for name in ("flat", "hub") for plain in plains
             if plain[name].get("error") in RACE_ERRORS
             or plain[name].get("gather", {}).get("error") in RACE_ERRORS}
    for plain in plains:
        assert plain["world"] == ranks
        # transformers copies `utils/rope.py` as `utils.rope.py`: no rank loads the sub-package
        # (a rank that read a module another rank was writing fails first, with the race's error)
        sub = plain["subpackage"]
        assert sub["error"] in RACE_ERRORS, plain
        assert sub["error"] != "FileNotFoundError" or "utils.rope.py" in sub["message"], plain
        for name in ("flat", "hub"):
            if plain[name].get("error") in RACE_ERRORS:
                continue  # this rank read a file another was writing (the race codeferry ends)
            assert plain[name]["config"] == "transformers_modules", plain
            if name not in raced:
                assert plain[name]["gathered_same_class"] is True, plain
        # a local folder: the model's config_class is a second copy of the config module
        if "error" not in plain["flat"]:
            assert plain["flat"]["config_class"] is False, plain
        if "error" not in plain["hub"]:
            assert plain["hub"]["config_class"] is True, plain
    assert set(reports) & set(ROUTED), reports
    for mode, got_all in reports.items():
        assert len(got_all) == ranks, mode
        if mode == "plain":
            continue
        for got in got_all:
            assert got["world"] == ranks
            assert_codeferry(got, layouts, model="codeferry", same_config_class=True,
                             config_class=True, gathered_same_class=True)
