"""``codeferry doctor``: prove, with real workers, that a model's code survives the trip.

The parent loads the model, builds its config and sends it to N fresh workers of the
chosen start method (or Ray actors, one per node where it can), exactly as an engine would. Each worker unpickles the config,
loads every ``auto_map`` class, checks that the config's class is the one its own
process resolves, and builds each model class from the config (random weights). With the
causal LM built (the model's own, or transformers' for a plain architecture), each worker
then generates one token through its engine's generate path, the one ``codeferry run``
takes, with the model's tokenizer: a model ``run`` cannot generate with fails the doctor.

The config travels as bytes that the worker unpickles itself, inside ``try``: a worker
that cannot materialize the code reports the typed error with its traceback, instead of
dying while multiprocessing unpickles its arguments (which a pool reports as a bare
``BrokenProcessPool``, or not at all).
"""

from __future__ import annotations

import argparse
import pickle
import queue
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from .._code import removed
from .._exec.engines.base import Rpc
from .._exec.engines.spec import EngineChoice
from .._exec.files import missing_tokenizer
from .._exec.layout import bindings, cpus, layout, reason
from .._exec.options import WorkerOptions, sandbox_request
from .._exec.plan import prepare
from .._exec.workers.checks import check_main_guard
from .._exec.workers.release import for_workers
from .._exec.workers.transport import Event, LocalTransport, Transport
from .._exec.workers.worker import WorkerSpec
from .._load import load_pinned
from .._trust.options import ModelOptions
from ..errors import CodeferryError, DoctorCheckError, RemoteTraceback, WorkerError
from .command import Commands, add_command, demo, model_options, show, worker_options
from .flags import add_common_flags, add_sandbox_flag, add_trust_flags, add_worker_flags
from .keywords import DOCTOR_KEYWORDS, options_of

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .keywords import DoctorKeywords

__all__ = ["DoctorReport", "StartMethod", "WorkerReport", "doctor", "doctor_command",
           "doctor_with", "register"]

StartMethod = Literal["spawn", "forkserver", "fork"]


@dataclass
class WorkerReport:
    """What one worker found: ``error`` is ``None`` when it succeeded."""

    worker: int
    pid: int | None = None
    seconds: float | None = None
    checks: dict[str, Any] = field(default_factory=dict)
    error: BaseException | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"worker": self.worker, "ok": self.ok, "pid": self.pid,
                               "seconds": self.seconds, "checks": self.checks}
        if self.error is not None:
            cause = self.error.__cause__
            out["error"] = {
                "type": type(self.error).__name__,
                "message": str(self.error),
                "traceback": str(cause) if isinstance(cause, RemoteTraceback) else None,
            }
        return out


@dataclass
class DoctorReport:
    model: str
    digest: str
    start_method: str
    workers: list[WorkerReport]
    #: Names later transformers releases removed that the code uses (``_code.removed``).
    removed: list[tuple[str, removed.Use]] = field(default_factory=list)
    #: What ``codeferry run`` and ``Executor`` start here when not told (``_exec.layout``):
    #: ``workers``, ``threads`` (each), ``cpus`` (this process may use), ``cores`` (each
    #: worker's, ``layout.cores``; empty: unbound), ``reason``.
    layout: dict[str, Any] = field(default_factory=dict)
    #: The transformers release line the workers ran the code on (``None``: the installed).
    release: str | None = None

    @property
    def ok(self) -> bool:
        return all(w.ok for w in self.workers)

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "digest": self.digest, "start_method": self.start_method,
                "ok": self.ok, "workers": [w.to_json() for w in self.workers],
                "removed_names": removed.to_json(self.removed, removed.installed()),
                "layout": self.layout, "release": self.release}


def doctor_checks(worker: Any, config_bytes: bytes) -> dict[str, Any]:
    """Runs in each worker, after it loaded and verified the code (strictly: every class).

    The config arrives as bytes unpickled here, inside the worker's error handling, so a
    worker that cannot materialize it reports the typed error with its traceback. No bytes:
    the worker runs another transformers release than the doctor (``release``), whose objects
    do not cross releases, and reads the config from the folder itself.
    """
    spec = worker.spec
    config = pickle.loads(config_bytes) if config_bytes else None  # before the load: it travels
    classes = load_pinned(spec.code or spec.model, spec.digest, spec.options, strict=True)
    if config is None:
        config = classes["AutoConfig"].from_pretrained(spec.model)
    worker.classes = classes
    config_cls = classes.get("AutoConfig")
    checks: dict[str, Any] = {"config_class_is_loaded_class": type(config) is config_cls,
                              "classes": sorted(classes)}
    built = []
    causal = None
    for key, cls in sorted(classes.items()):
        if key.startswith("AutoModel") and isinstance(cls, type) and config_cls is not None:
            model_obj = cls(config)
            if model_obj.config_class is not type(config):
                raise TypeError(f"{cls.__name__}.config_class is not the config's class")
            built.append(key)
            if key == "AutoModelForCausalLM":
                causal = model_obj
    checks["models_built"] = built
    from .._exec.engines.vllm_engine import auto_engine, half_without_kernels

    engine, why = auto_engine(list(getattr(config, "architectures", None) or []),
                              classes.get("AutoModelForCausalLM"))
    slow = half_without_kernels(spec.dtype, spec.device, spec.model)
    if engine == "vllm" and slow is not None:
        engine, why = "transformers", slow
    checks["engine"] = {"auto": engine, "reason": why}
    if causal is None:  # a plain architecture: transformers' own class
        causal = _plain_causal_lm(config)
    if config_cls is not None and type(config) is not config_cls:
        raise TypeError("the received config is not an instance of the loaded config class")
    if causal is not None:
        checks["generate_path"] = _generate_path(causal)
        checks["generate"] = _generate_check(worker, causal, config)
        if "path" in checks["generate"]:  # the path this worker's engine took, not a guess
            checks["generate_path"]["cpu"] = checks["generate"]["path"]
    return checks


#: What the doctor's workers generate from: one token, as ``codeferry run`` would.
PROMPT = "Hello"


def _generate_check(worker: Any, model: Any, config: Any) -> dict[str, Any]:
    """One token generated in this worker through the engine's own generate path (the one
    ``codeferry run`` takes: its tokenizer, padding, path choice and options) from the model
    built here; a failure is a ``DoctorCheckError``, as ``run`` would fail on every input."""
    spec = worker.spec
    missing = missing_tokenizer(Path(spec.model), Path(spec.code) if spec.code else None)
    if missing is not None:
        return {"skipped": f"the model has no tokenizer ({' or '.join(missing)}), which "
                           "`codeferry run` needs"}
    try:
        worker.load_tokenizer(config)
        worker.adopt("generate", model)
        text = worker.generate([PROMPT], {"max_new_tokens": 1})[0]
    except Exception as exc:
        raise DoctorCheckError(
            f"generating one token the way `codeferry run` does failed: "
            f"{type(exc).__name__}: {exc}", check="generate",
            fix="the worker's traceback (the cause) shows where; `codeferry run` would fail "
            "the same way on every input.") from exc
    path, why = worker.generate_path
    return {"path": path, "reason": why, "text": text}


def _plain_causal_lm(config: Any) -> Any:
    """transformers' own causal LM for ``config`` (random weights), or ``None``."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]  # untyped upstream
    except (ValueError, KeyError, TypeError):  # no causal head for this config
        return None


def _generate_path(model: Any) -> dict[str, str]:
    """Whether the decode loop works for this architecture (its greedy probe on the random
    weights, without codeferry's CPU attention): the path an executor worker takes on an
    accelerator. (On CPU it is the one the generate check took.)"""
    from .._exec.generate.stream import probe

    failure = probe(model.eval(), 0)
    if failure is None:
        return {"cpu": "batched", "accelerator": "decode",
                "reason": "a greedy probe of the decode loop matched generate token for token"}
    return {"cpu": "batched", "accelerator": "batched",
            "reason": f"the decode loop does not work for this model: {failure}"}


def doctor(model: str, *, timeout: float = 300.0,
           **options: Unpack[DoctorKeywords]) -> DoctorReport:
    """Load ``model`` here, send its config to ``workers`` fresh workers, report each.

    The workers are the executor's own (``_exec.workers.transport``): local processes of
    ``start_method``, or Ray actors (``backend="ray"``), which also report their node and
    how the code reached it. A repo id the cache lacks has its code downloaded first
    (``token``, ``local_files_only`` as for ``load``): the doctor loads classes and
    configs, never weights. Trust is ``_trust.decide``'s, as for ``run``: the bundled demo
    needs neither ``trust_remote_code`` nor a ``lock``. ``code_revision`` as for
    ``Executor``: that revision's classes build ``revision``'s config. ``workers``: 2 when
    not given; ``timeout`` (seconds) for every worker to report. Every keyword with its
    type: ``keywords.DoctorKeywords``.
    """
    models, places = options_of("doctor", {"workers": 2, **options}, DOCTOR_KEYWORDS)
    return doctor_with(model, models, places, timeout)


def doctor_with(model: str, options: ModelOptions, places: WorkerOptions,
                timeout: float = 300.0) -> DoctorReport:
    """``doctor`` on its options as values: ``doctor`` builds them from its keywords,
    ``codeferry doctor`` from its flags. Of ``places``, the doctor takes how many workers
    (2 when ``None``), started how and where."""
    from transformers import AutoConfig

    backend, address, start_method = places.backend, places.address, places.start_method
    workers = places.workers if places.workers is not None else 2
    if backend == "local":
        check_main_guard(start_method)  # a worker would die bootstrapping, with exit code 1
    # The workers' box (--sandbox), refused here, typed, where it cannot be built; the doctor's
    # own load below runs the code outside it, as without the box.
    boxed = sandbox_request(places, "transformers")  # its workers build no engine
    # configs only: a repo's code is fetched for the doctor, never its weights
    plan = prepare(model, options, device="cpu", demo=True, need="code")
    bundle, configs, decided = plan.bundle, plan.weights, plan.for_workers()
    # strict: the doctor's verdict covers every class, so one that cannot load fails it (but
    # code that needs another transformers release is for its workers, on it, to load).
    classes = load_pinned(bundle.origin.root, bundle.digest, decided, strict=not plan.release)
    # The config of ``revision``, built by the class of the code loaded (code_revision's).
    config_class: Any = AutoConfig if options.own_code else classes.get("AutoConfig",
                                                                        AutoConfig)
    config = config_class.from_pretrained(str(configs.root))
    transport: Transport
    if backend == "ray":
        from .._exec.workers.ray_backend import RayTransport

        transport = RayTransport(plan.bundle, weights=plan.separate_weights, address=address)
    else:
        transport = LocalTransport(start_method)
    spec = WorkerSpec(str(configs.root), decided, "cpu", None, 1, (), bundle.digest,
                      EngineChoice(sandbox=boxed, release=for_workers(plan.release, backend)),
                      serve=False, code=plan.code_folder)
    request = transport.pack(Rpc(doctor_checks, (b"" if plan.release else transport.pack(config),)))
    events: queue.SimpleQueue[Event] = queue.SimpleQueue()
    channels = [transport.start(index, spec, events.put) for index in range(workers)]
    reports = {index: WorkerReport(index) for index in range(workers)}
    started = {index: time.perf_counter() for index in range(workers)}
    deadline = time.monotonic() + timeout
    try:
        while any(r.seconds is None and r.error is None for r in reports.values()):
            try:
                event = events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                for report in reports.values():
                    if report.seconds is None and report.error is None:
                        report.error = WorkerError(
                            f"worker {report.worker} timed out before reporting.",
                            worker=report.worker, fix="run again with --debug.")
                break
            report = reports[event.channel.slot]
            if report.seconds is not None or report.error is not None:
                continue
            report.pid = event.channel.pid
            if event.kind == "ready":
                report.checks["worker"] = {k: v for k, v in event.body.items()
                                           if k in ("node_ip", "node_id", "ferry")}
                event.channel.send(0, request)
            elif event.kind == "reply":
                _, ok, value = event.body
                if ok:
                    report.checks = {**value, **report.checks}
                    report.seconds = time.perf_counter() - started[report.worker]
                else:
                    report.error = value
            elif event.kind == "failed":
                report.error = event.body
            else:
                report.error = WorkerError(
                    f"worker {report.worker} ({event.channel.where}) {event.body[0] if isinstance(event.body, tuple) else event.body} "
                    "before reporting.", worker=report.worker,
                    fix="run again with --debug; a segfault or the OOM killer leaves no traceback.")
    finally:
        for channel in channels:
            channel.stop(5.0)
        transport.close()
    how = "ray" if backend == "ray" else start_method
    return DoctorReport(bundle.origin.name, bundle.digest, how, list(reports.values()),
                        removed.uses_in(bundle.contents), _default_layout(backend), plan.release)


def _default_layout(backend: str) -> dict[str, Any]:
    """The workers and threads ``codeferry run`` starts here on the CPU when not told, and
    why: a user reads what the machine gets before a long run."""
    here = cpus()
    count, threads = layout("cpu", backend, None, None, cpus=here)
    bound = [list(c) for c in bindings("cpu", backend, count, threads)]
    return {"workers": count, "threads": threads, "cpus": here, "cores": bound,
            "reason": reason("cpu", backend, None, None, cpus=here, bound=any(bound))}


def render_doctor(report: DoctorReport) -> str:
    lines = [f"model    {report.model}", f"digest   {report.digest}",
             f"workers  {len(report.workers)} ({report.start_method})"]
    if report.layout:
        shape = report.layout
        lines.append(f"layout   codeferry run here: {shape['workers']} worker"
                     f"{'s' if shape['workers'] > 1 else ''} of {shape['threads']} thread"
                     f"{'s' if shape['threads'] > 1 else ''} ({shape['reason']})")
    for w in report.workers:
        node = w.checks.get("worker", {}).get("node_ip")
        at = f" on node {node}" if node else ""
        if w.ok:
            built = ", ".join(w.checks.get("models_built", [])) or "no model classes"
            lines.append(f"  worker {w.worker}  ok     {w.seconds or 0:.2f}s  built {built}{at}")
            engine = w.checks.get("engine")
            if engine:
                lines.append(f"    engine: {engine['auto']} (--engine auto, the default: "
                             f"{engine['reason']})")
            gen = w.checks.get("generate_path")
            if gen:
                lines.append(f"    generate: {gen['cpu']} on cpu, {gen['accelerator']} on an "
                             f"accelerator ({gen['reason']})")
            done = w.checks.get("generate") or {}
            if "skipped" in done:
                lines.append(f"    generate: not tried: {done['skipped']}")
            elif done:
                lines.append(f"    generated 1 token ({done['path']}: {done['reason']}): "
                             f"{done['text']!r}")
        else:
            err = w.error
            kind = type(err).__name__
            lines.append(f"  worker {w.worker}  FAILED {kind}: {err}")
            if isinstance(err, CodeferryError) is False and err is not None and err.__cause__:
                lines.append("    " + str(err.__cause__).strip().splitlines()[-1])
    lines.append(removed.render(report.removed, removed.installed(), report.release).rstrip("\n"))
    lines.append("ok" if report.ok else "FAILED")
    return "\n".join(line for line in lines if line) + "\n"


def doctor_command(args: argparse.Namespace) -> int:
    """Load a model here and in N fresh workers, and report what each worker saw.

    Executes the model's code here and in every worker: needs --trust-remote-code or
    --lock (except for the bundled demo).
    """
    report = doctor_with(args.model or demo(), model_options(args), worker_options(args))
    show(args, report.to_json(), render_doctor(report))
    return 0 if report.ok else 1


def register(sub: Commands) -> None:
    """Add ``doctor`` to the command line."""
    command = add_command(sub, "doctor", doctor_command, model_help="; the demo's code is "
                          "trusted by its pinned digest, any other needs --trust-remote-code "
                          "or --lock)")
    add_trust_flags(command)
    add_worker_flags(command, workers=2)
    add_sandbox_flag(command)
    command.add_argument("--json", action="store_true", help="print one JSON object")
    add_common_flags(command)
