"""``codeferry doctor``: prove, with real workers, that a model's code survives the trip.

The parent loads the model, builds its config and sends it to N fresh workers of the
chosen start method, exactly as an engine would. Each worker unpickles the config,
loads every ``auto_map`` class, checks that the config's class is the one its own
process resolves, and builds each model class from the config (random weights).

The config travels as bytes that the worker unpickles itself, inside ``try``: a worker
that cannot materialize the code reports the typed error with its traceback, instead of
dying while multiprocessing unpickles its arguments (which a pool reports as a bare
``BrokenProcessPool``, or not at all).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Literal

from ._api import load_pinned
from ._checks import check_main_guard
from ._lockfile import Lock, read_lock
from ._resolve import resolve
from ._worker import error_payload, remote_error
from .errors import CodeferryError, RemoteTraceback, WorkerError

__all__ = ["StartMethod", "WorkerReport", "DoctorReport", "doctor"]

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

    @property
    def ok(self) -> bool:
        return all(w.ok for w in self.workers)

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "digest": self.digest, "start_method": self.start_method,
                "ok": self.ok, "workers": [w.to_json() for w in self.workers]}


def _worker(index: int, model: str, revision: str | None, lock: Lock | None,
            config_bytes: bytes, conn: Connection, digest: str,
            cache_dir: str | None = None) -> None:
    """Runs in the worker. Always answers on ``conn``, with a result or the error.

    It loads only ``digest``, the code the parent checked (``CodeChangedError`` if the
    folder holds other code by now).
    """
    start = time.perf_counter()
    try:
        if lock is not None:  # bind this worker to the lock before anything arrives
            load_pinned(model, digest, lock=lock, revision=revision, cache_dir=cache_dir)
        config = pickle.loads(config_bytes)
        classes = load_pinned(model, digest, trust_remote_code=lock is None, revision=revision,
                              cache_dir=cache_dir,
                              lock=lock, strict=True)
        config_cls = classes.get("AutoConfig")
        checks: dict[str, Any] = {
            "config_class_is_loaded_class": type(config) is config_cls,
            "classes": sorted(classes),
        }
        built = []
        for key, cls in sorted(classes.items()):
            if key.startswith("AutoModel") and isinstance(cls, type):
                model_obj = cls(config) if config_cls is not None else None
                if model_obj is not None:
                    if model_obj.config_class is not type(config):
                        raise TypeError(f"{cls.__name__}.config_class is not the config's class")
                    built.append(key)
                    if key == "AutoModelForCausalLM":
                        checks["generate_path"] = _generate_path(model_obj)
        checks["models_built"] = built
        if "generate_path" not in checks:  # a plain architecture: transformers' own class
            causal = _plain_causal_lm(config)
            if causal is not None:
                checks["generate_path"] = _generate_path(causal)
        if config_cls is not None and type(config) is not config_cls:
            raise TypeError("the received config is not an instance of the loaded config class")
        conn.send(("ok", os.getpid(), time.perf_counter() - start, checks))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        conn.send(("error", os.getpid(), time.perf_counter() - start, error_payload(exc)))
    finally:
        conn.close()


def _plain_causal_lm(config: Any) -> Any:
    """transformers' own causal LM for ``config`` (random weights), or ``None``."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]  # untyped upstream
    except (ValueError, KeyError, TypeError):  # no causal head for this config
        return None


def _generate_path(model: Any) -> dict[str, str]:
    """Whether continuous batching works for this architecture (a greedy probe on the
    random weights), and the path an executor worker takes on CPU and on an accelerator."""
    from ._generation import choose_path

    path, reason = choose_path(model.eval(), "continuous", "cpu", None)
    return {"cpu": "batched", "accelerator": path, "reason": reason.rstrip(":")}


def doctor(
    model: str,
    *,
    trust_remote_code: bool = False,
    workers: int = 2,
    start_method: StartMethod = "spawn",
    revision: str | None = None,
    lock: Lock | str | None = None,
    timeout: float = 300.0,
    cache_dir: str | None = None,
) -> DoctorReport:
    """Load ``model`` here, send its config to ``workers`` fresh processes, report each."""
    from transformers import AutoConfig

    check_main_guard(start_method)  # a worker would die bootstrapping, with exit code 1
    bundle = resolve(model, revision=revision, cache_dir=cache_dir)
    locked = read_lock(lock) if isinstance(lock, str) else lock
    # strict: the doctor's verdict covers every class, so one that cannot load fails it.
    load_pinned(model, bundle.digest, trust_remote_code=trust_remote_code, revision=revision,
                lock=locked, strict=True, cache_dir=cache_dir)
    config = AutoConfig.from_pretrained(str(bundle.source.root))
    from multiprocessing.reduction import ForkingPickler

    config_bytes = bytes(ForkingPickler.dumps(config))
    ctx: Any = mp.get_context(start_method)
    procs = []
    for index in range(workers):
        parent_end, child_end = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_worker,
            args=(index, str(bundle.source.root), revision, locked, config_bytes, child_end,
                  bundle.digest, cache_dir),
            name=f"codeferry-doctor-{index}", daemon=True,
        )
        proc.start()
        child_end.close()
        procs.append((index, proc, parent_end))
    reports = []
    deadline = time.monotonic() + timeout
    for index, proc, conn in procs:
        report = WorkerReport(index, pid=proc.pid)
        try:
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                raise TimeoutError
            status, pid, seconds, data = conn.recv()
            report.pid, report.seconds = pid, seconds
            if status == "ok":
                report.checks = data
            else:
                report.error = remote_error(data, index)
        except (EOFError, OSError, TimeoutError):
            proc.join(5)
            how = "timed out" if proc.exitcode is None else f"died with exit code {proc.exitcode}"
            report.error = WorkerError(
                f"worker {index} (pid {proc.pid}) {how} before reporting.", worker=index,
                fix="run again with --debug; a segfault or the OOM killer leaves no traceback.",
            )
        finally:
            conn.close()
            if proc.is_alive():
                proc.kill()
            proc.join(5)
        reports.append(report)
    return DoctorReport(bundle.source.name, bundle.digest, start_method, reports)


def render_doctor(report: DoctorReport) -> str:
    lines = [f"model    {report.model}", f"digest   {report.digest}",
             f"workers  {len(report.workers)} ({report.start_method})"]
    for w in report.workers:
        if w.ok:
            built = ", ".join(w.checks.get("models_built", [])) or "no model classes"
            lines.append(f"  worker {w.worker}  ok     {w.seconds or 0:.2f}s  built {built}")
            gen = w.checks.get("generate_path")
            if gen:
                lines.append(f"    generate: {gen['cpu']} on cpu, {gen['accelerator']} on an "
                             f"accelerator ({gen['reason']})")
        else:
            err = w.error
            kind = type(err).__name__
            lines.append(f"  worker {w.worker}  FAILED {kind}: {err}")
            if isinstance(err, CodeferryError) is False and err is not None and err.__cause__:
                lines.append("    " + str(err.__cause__).strip().splitlines()[-1])
    lines.append("ok" if report.ok else "FAILED")
    return "\n".join(lines) + "\n"
