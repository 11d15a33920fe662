"""What a fresh worker pays to get a remote-code model's classes, and what a config costs to send.

(a) Time in a freshly *spawned* process (a new one per sample, the ways interleaved), from
"``import transformers, torch`` done" to "every ``auto_map`` class ready",
for a factory model that plain transformers can load, four ways:

* ``codeferry.load``: the parent loaded the model already (the store is filled); the worker calls
  ``codeferry.load(path, trust_remote_code=True)``, static resolution included;
* ``codeferry, unpickle``: the worker only unpickles a config the parent sent with
  ``ForkingPickler`` (a by-reference ticket: store -> verify -> execute), then imports every
  module of the unit in its load order;
* ``transformers``: ``get_class_from_dynamic_module(ref, path)`` for each ``auto_map`` entry,
  config first, with the modules cache pre-warmed (files copied, bytecode written);
* ``floor``: the model's ``.py`` files copied into a package on ``sys.path``, each imported with
  ``importlib.import_module``, dependencies first (bytecode written beforehand, as for
  transformers' cache).

Each time includes the lazy imports of transformers' base classes the model code triggers
(``PreTrainedModel`` pulls in ``modeling_utils``), which every way pays; so the table also gives
the difference to the floor in ms. When a codeferry way is slower than 1.2x the floor (or with
``--profile``), one more worker per codeferry way runs under cProfile and the script prints where
its time goes. ``--warm-transformers`` imports those base classes before the clock starts (a
worker that has them already, e.g. one that built an engine first): what is left is the loaders'
own cost.

(b) Bytes to send the model's custom config to a worker: codeferry's ``ForkingPickler`` message
(what ``Pool``/``ProcessPoolExecutor`` send), plain ``pickle`` and cloudpickle (the code
embedded, for other machines), against vLLM's approach (plain transformers, then
``cloudpickle.register_pickle_by_value(transformers_modules)``), for the first message and a
later one (a fresh pickler per message, as a queue does), with the config's JSON as the yardstick.
Every payload is loaded once in a fresh spawned process (codeferry's ``pickle`` payload with an
empty store, so the embedded code is what runs).

Run: ``python benchmarks/bench_load.py [--samples 5] [--profile] [--warm-transformers]`` (under
two minutes on 2 cores). Caches (HF_HOME, HF_MODULES_CACHE, CODEFERRY_HOME) live in a temporary
folder, so the user's caches are never touched.
"""

from __future__ import annotations

# Only the standard library at module level: spawned workers import this file as __mp_main__
# before their clock starts, and codeferry's own import belongs inside the timed region.
import argparse
import compileall
import importlib
import json
import multiprocessing as mp
import os
import pickle
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

METHODS = ("codeferry.load", "codeferry, unpickle", "transformers", "floor")
GOAL_RATIO = 1.2
FLOOR_PACKAGE = "benchfloor"

# Functions whose cumulative time is reported from the profiled workers: (label, file part, name).
PROFILE_TARGETS: tuple[tuple[str, str, str], ...] = (
    ("import codeferry", "codeferry/__init__.py", "<module>"),
    ("resolve() (static analysis, all of it)", "codeferry/_code/resolve.py", "resolve"),
    ("  check_transformers_names", "codeferry/_code/requirements.py", "check_transformers_names"),
    ("  collect_requirements", "codeferry/_code/requirements.py", "collect_requirements"),
    ("  importlib.metadata.packages_distributions", "importlib/metadata", "packages_distributions"),
    ("loader.register (verify + store)", "codeferry/_runtime/loader.py", "register"),
    ("  store.read_unit", "codeferry/_runtime/store.py", "read_unit"),
    ("  store.write_unit", "codeferry/_runtime/store.py", "write_unit"),
    ("filelock acquire", "filelock", "acquire"),
    ("sha256", "~", "<built-in method _hashlib.openssl_sha256>"),
    ("pickling._arrive_ref (ticket -> store)", "codeferry/_runtime/pickling.py", "_arrive_ref"),
    ("module bodies (_Loader.exec_module)", "codeferry/_runtime/loader.py", "exec_module"),
    ("  compile(), ast.parse included (any caller)", "~", "<built-in method builtins.compile>"),
    ("  transformers.modeling_utils import", "transformers/modeling_utils.py", "<module>"),
    ("register_with_transformers", "codeferry/_hf/classes.py", "register_with_transformers"),
)


# -- worker side (a fresh spawned process per call) -------------------------------------------


def _load_classes(method: str, job: dict[str, Any]) -> None:
    if method == "codeferry.load":
        import codeferry

        codeferry.load(job["path"], trust_remote_code=True)
    elif method == "codeferry, unpickle":
        from multiprocessing.reduction import ForkingPickler

        config = ForkingPickler.loads(job["payload"])
        from codeferry._runtime import loader as _loader
        from codeferry._runtime import pickling as _pickling

        registration = _pickling.registration_of(type(config))
        for name in registration.unit.order:
            _loader.import_module(registration, name)
    elif method == "transformers":
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        for ref in job["refs"]:
            get_class_from_dynamic_module(ref, job["path"])
    elif method == "floor":
        sys.path.insert(0, job["floor_dir"])
        for name in job["modules"]:
            importlib.import_module(f"{FLOOR_PACKAGE}.{name}")
    else:
        raise ValueError(method)


def _profile_summary(profiler: Any) -> dict[str, float]:
    import pstats

    stats: dict[tuple[str, int, str], tuple[Any, ...]]
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    out: dict[str, float] = {}
    for label, file_part, name in PROFILE_TARGETS:
        total = 0.0
        for (filename, _line, func), (_cc, _nc, _tt, ct, _callers) in stats.items():
            if func == name and (file_part in filename if file_part != "~" else filename == "~"):
                total += ct
        out[label] = total * 1000
    return out


def timed_worker(
    method: str, job: dict[str, Any], profile: bool, warm: bool, conn: Connection
) -> None:
    try:
        import torch  # noqa: F401
        import transformers

        if warm:  # what the model's code takes from transformers, imported before the clock
            import transformers.modeling_outputs  # noqa: F401
            from transformers import (  # noqa: F401
                PretrainedConfig,
                PreTrainedModel,
                PreTrainedTokenizer,
            )

        profiler = None
        if profile:
            import cProfile

            profiler = cProfile.Profile()
        start, start_cpu = time.perf_counter(), time.process_time()
        if profiler is not None:
            profiler.enable()
        _load_classes(method, job)
        if profiler is not None:
            profiler.disable()
        elapsed = (time.perf_counter() - start, time.process_time() - start_cpu)
        summary = _profile_summary(profiler) if profiler is not None else {}
        conn.send(("ok", elapsed, summary))
    except BaseException as exc:  # reported by the parent
        import traceback

        conn.send(("error", traceback.format_exc(), {}))
        raise SystemExit(1) from exc


def vllm_sizes_worker(path: str, conn: Connection) -> None:
    """Plain transformers + cloudpickle by value, in a process where codeferry is never imported."""
    try:
        import cloudpickle
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path, trust_remote_code=True)
        import transformers_modules  # created by transformers' remote-code path

        cloudpickle.register_pickle_by_value(transformers_modules)
        first = cloudpickle.dumps(config)
        later = cloudpickle.dumps(config)
        assert "codeferry" not in sys.modules
        conn.send(("ok", first, later, config.to_json_string()))
    except BaseException as exc:
        import traceback

        conn.send(("error", traceback.format_exc()))
        raise SystemExit(1) from exc


def check_worker(payload: bytes, store: str | None, conn: Connection) -> None:
    """Load one payload; report the class and the config's JSON (compared by the parent)."""
    try:
        if store is not None:
            os.environ["CODEFERRY_HOME"] = store  # read when the store is first used
        config = pickle.loads(payload)
        conn.send(("ok", f"{type(config).__module__}.{type(config).__qualname__}",
                   config.to_json_string()))
    except BaseException as exc:
        import traceback

        conn.send(("error", traceback.format_exc()))
        raise SystemExit(1) from exc


def run_in_fresh_process(target: Any, *args: Any, timeout: float = 120) -> tuple[Any, ...]:
    ctx = mp.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(*args, sender))
    proc.start()
    sender.close()
    try:
        if not receiver.poll(timeout):
            raise TimeoutError(f"{target.__name__} gave no answer in {timeout} s")
        result: tuple[Any, ...] = receiver.recv()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    if result[0] != "ok":
        raise RuntimeError(f"{target.__name__} failed in the worker:\n{result[1]}")
    return result


# -- parent side ------------------------------------------------------------------------------


def prepare(tmp: Path) -> dict[str, Any]:
    """Write the model, fill codeferry's store and transformers' modules cache, build the floor."""
    from multiprocessing.reduction import ForkingPickler

    from transformers import AutoConfig
    from transformers.dynamic_module_utils import get_cached_module_file

    import codeferry
    from codeferry.testing import ModelSpec, write_model

    spec = ModelSpec(name="bench", helpers=("flat", "function_body", "star"), tokenizer=True,
                     config_helper=True)
    path = write_model(tmp / "bench", spec)
    bundle = codeferry.resolve(path)
    assert not bundle.blocking, bundle.blocking
    codeferry.load(path, trust_remote_code=True)  # fills the store, as a codeferry parent does
    config = AutoConfig.from_pretrained(path)
    assert type(config).__module__.startswith("codeferry._dyn."), type(config)

    # transformers' refs, config first (the order its Auto classes use), one per class.
    refs: list[str] = []
    for ref in sorted(bundle.classes, key=lambda r: (r.key != "AutoConfig", r.declared_in, r.key)):
        assert ref.repo is None
        dotted = f"{ref.module}.{ref.name}"
        if dotted not in refs:
            refs.append(dotted)
    for module in {r.rsplit(".", 1)[0] for r in refs}:  # "a second run": files already copied
        get_cached_module_file(str(path), module.replace(".", "/") + ".py")
    # ... and bytecode written, as by an earlier import (same for the floor below).
    compileall.compile_dir(os.environ["HF_MODULES_CACHE"], quiet=1)

    floor_dir = tmp / "floor"
    package = floor_dir / FLOOR_PACKAGE
    package.mkdir(parents=True)
    (package / "__init__.py").write_bytes(b"")
    for entry in bundle.files:
        if entry.kind != "asset":
            target = package / entry.path
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path / entry.path, target)
    compileall.compile_dir(str(floor_dir), quiet=1)
    return {
        "path": str(path),
        "refs": refs,
        "floor_dir": str(floor_dir),
        "modules": list(bundle.load_order),
        "payload": bytes(ForkingPickler.dumps(config)),
        "config": config,
    }


def measure_times(
    job: dict[str, Any], samples: int, warm: bool
) -> dict[str, tuple[list[float], list[float]]]:
    """Way -> (wall ms, CPU ms of the worker) per sample."""
    wire = {k: v for k, v in job.items() if k != "config"}
    times: dict[str, tuple[list[float], list[float]]] = {m: ([], []) for m in METHODS}
    for _ in range(samples):  # interleaved, so a noisy neighbour hits every way alike
        for method in METHODS:
            _, (wall, cpu), _ = run_in_fresh_process(timed_worker, method, wire, False, warm)
            times[method][0].append(wall * 1000)
            times[method][1].append(cpu * 1000)
    return times


def profile_codeferry(job: dict[str, Any], warm: bool) -> dict[str, dict[str, float]]:
    wire = {k: v for k, v in job.items() if k != "config"}
    out: dict[str, dict[str, float]] = {}
    for method in ("codeferry.load", "codeferry, unpickle", "floor"):
        _, (wall, _cpu), summary = run_in_fresh_process(timed_worker, method, wire, True, warm)
        out[method] = {"total (profiled)": wall * 1000, **summary}
    return out


def measure_sizes(job: dict[str, Any], tmp: Path) -> list[dict[str, Any]]:
    from multiprocessing.reduction import ForkingPickler

    import cloudpickle

    config = job["config"]
    config_json = config.to_json_string()
    rows: list[dict[str, Any]] = [
        {"way": "config JSON (`to_json_string()`)", "first": len(config_json.encode()),
         "later": len(config_json.encode()), "check": "-"},
    ]
    ours: list[tuple[str, Callable[[], bytes], str | None]] = [
        ("codeferry: `ForkingPickler.dumps` (Pool, ProcessPoolExecutor; digest only)",
         lambda: bytes(ForkingPickler.dumps(config)), None),
        ("codeferry: `pickle.dumps` (code embedded)", lambda: pickle.dumps(config),
         str(tmp / "empty-store-1")),
        ("codeferry: `cloudpickle.dumps` (code embedded)", lambda: cloudpickle.dumps(config),
         str(tmp / "empty-store-2")),
    ]
    for way, dump, store in ours:
        first, later = dump(), dump()
        rows.append({"way": way, "first": len(first), "later": len(later), "payload": later,
                     "store": store, "expect": "codeferry._dyn."})
    _, first, later, their_json = run_in_fresh_process(vllm_sizes_worker, job["path"])
    rows.append({
        "way": "vLLM: plain transformers, "
        "`cloudpickle.register_pickle_by_value(transformers_modules)`",
        "first": len(first), "later": len(later), "payload": later, "store": None,
        "expect": "transformers_modules.",
    })
    assert json.loads(their_json) == json.loads(config_json), "both sides load the same config"
    for row in rows[1:]:
        _, qualname, received = run_in_fresh_process(check_worker, row["payload"], row["store"])
        same = json.loads(received) == json.loads(config_json)
        ok = same and qualname.startswith(row["expect"]) and qualname.endswith(".BenchConfig")
        row["check"] = f"{'yes' if ok else 'NO'} (`{qualname.split('.', 1)[0]}...BenchConfig`)"
        if not ok:
            row["check"] = f"NO: {qualname}, same JSON: {same}"
    return rows


def machine_line() -> str:
    import torch
    import transformers

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"machine: nproc={os.cpu_count()}, {platform.machine()}, "
        f"python {platform.python_version()}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, "
        f"load average at start {load:.2f}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--samples", type=int, default=5, help="spawned workers per way (median)")
    parser.add_argument("--profile", action="store_true",
                        help="profile codeferry's workers even when within the goal")
    parser.add_argument("--warm-transformers", action="store_true",
                        help="import the transformers base classes the model uses before the "
                        "clock starts (a worker that has them already): the loaders' own cost")
    args = parser.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="codeferry-bench-load-") as name:
        tmp = Path(name)
        # Before transformers is imported (it reads these once); spawned workers inherit them.
        os.environ.update({
            "HF_HUB_OFFLINE": "1",
            "HF_HOME": str(tmp / "hf"),
            "HF_MODULES_CACHE": str(tmp / "hf" / "modules"),
            "CODEFERRY_HOME": str(tmp / "codeferry"),
            "TOKENIZERS_PARALLELISM": "false",
        })
        print(f"command: {' '.join([os.path.basename(sys.executable), *sys.argv])}")
        print(machine_line())
        job = prepare(tmp)
        times = measure_times(job, args.samples, args.warm_transformers)
        floor = statistics.median(times["floor"][0])
        floor_cpu = statistics.median(times["floor"][1])
        print()
        start = ("`import transformers, torch` + transformers' base classes"
                 if args.warm_transformers else "`import transformers, torch`")
        print(f"## (a) fresh spawned worker: {start} done -> every auto_map class ready "
              f"({args.samples} workers each, median)")
        print()
        print("| way | median wall ms | min..max | vs floor | minus floor (ms) "
              "| median CPU ms | CPU vs floor |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        slow = False
        for method in METHODS:
            walls, cpus = times[method]
            med, cpu = statistics.median(walls), statistics.median(cpus)
            ratio = med / floor
            slow |= method.startswith("codeferry") and ratio > GOAL_RATIO
            print(f"| {method} | {med:.0f} | {min(walls):.0f}..{max(walls):.0f} | {ratio:.2f}x "
                  f"| {med - floor:+.0f} | {cpu:.0f} | {cpu / floor_cpu:.2f}x |")
        print(f"\ngoal: codeferry within {GOAL_RATIO}x of the floor (median wall time): "
              f"{'NOT met' if slow else 'met'}. CPU time is the worker's own (less sensitive "
              "to other load on the machine).")
        if slow or args.profile:
            profiles = profile_codeferry(job, args.warm_transformers)
            print()
            print("### where the time goes (one worker each under cProfile, cumulative ms, "
                  "inflated by the profiler)")
            print()
            print("| part | " + " | ".join(profiles) + " |")
            print("|---|" + "---:|" * len(profiles))
            labels = ["total (profiled)"] + [label for label, _, _ in PROFILE_TARGETS]
            for label in labels:
                cells = [profiles[m].get(label, 0.0) for m in profiles]
                if any(c >= 0.05 for c in cells):
                    print(f"| {label.replace('  ', '&nbsp;&nbsp;')} | "
                          + " | ".join(f"{c:.1f}" for c in cells) + " |")
        rows = measure_sizes(job, tmp)
        json_size = rows[0]["first"]
        print()
        print("## (b) bytes to send the custom config to a worker (fresh pickler per message)")
        print()
        print("| way | first message (B) | later messages (B) | later / JSON | loads in a fresh "
              "spawned process |")
        print("|---|---:|---:|---:|---|")
        for row in rows:
            print(f"| {row['way']} | {row['first']} | {row['later']} | "
                  f"{row['later'] / json_size:.2f}x | {row['check']} |")
        later = rows[1]["later"]
        print(f"\ngoal: later codeferry (ForkingPickler) messages <= 2x the config's JSON: "
              f"{'met' if later <= 2 * json_size else 'NOT met'} ({later} B vs {json_size} B)")
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
