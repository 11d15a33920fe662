"""``codeferry run``: batch inference from an input file to a resumable JSONL output file.

The run reads its input whole (``inputs``), takes the output's lock and checks what is
already there (``output``), records what produces the output and its inputs (``record``),
then drains the executor's outcomes into the output in input order with a progress bar
(``progress``), each line as ``lines`` writes it. An outcome that is a fault of the
machine, not an answer for its input (``faults``), stops the run with ``RunStoppedError``:
it is never written, and the same command resumes. Every run ends with a summary line on
stderr (``N written, K failed, in T; X tokens/s``), a terminal or not, and in the record.

``generate`` inputs are requests (``_exec.params.Request``): a prompt or chat messages, with
per-input sampling parameters over the run's defaults (``params``, the command line's flags).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TextIO

from .._code.lockfile import Lock
from .._exec.engines.vllm_engine import choose_engine
from .._exec.executor import Executor, Outcome
from .._exec.files import may_have_chat_template
from .._exec.generate.params import Request, SamplingParams
from .._exec.layout import cpus, devices, layout
from .._exec.plan import prepare
from .._trust.options import ModelOptions
from ..errors import (
    ChatTemplateMissingError,
    CodeChangedError,
    CodeferryError,
    RunStoppedError,
    WorkerError,
)
from .faults import machine_fault
from .inputs import TASKS, InputItem, Task, read_inputs
from .lines import line as output_line
from .lines import usage
from .output import Sink, lock_path
from .progress import Progress, clock
from .record import check_record, producer, record_path, write_record, write_summary

__all__ = ["TASKS", "InputItem", "RunResult", "lock_path", "read_inputs", "record_path", "run"]

logger = logging.getLogger(__name__)


@dataclass
class RunResult:
    """What a run did. ``failed`` counts the error lines of the whole output (this run's and
    earlier runs'); ``skipped`` the inputs an earlier run had written already (and this run
    did not run again)."""

    total: int
    skipped: int = 0
    written: int = 0
    failed: int = 0
    output: str | None = None
    #: Tokens of this run's prompts and completions (``generate``), and its seconds.
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0

    @property
    def complete(self) -> bool:
        return self.skipped + self.written == self.total

    def summary(self) -> dict[str, Any]:
        """What the run did, as the record keeps it."""
        rate = self.completion_tokens / self.seconds if self.seconds > 0 else 0.0
        return {"total": self.total, "skipped": self.skipped, "written": self.written,
                "failed": self.failed, "seconds": round(self.seconds, 3),
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "tokens_per_second": round(rate, 1)}

    def line(self) -> str:
        """The closing line on stderr: ``N written, K failed, in T; X tokens/s``."""
        text = f"{self.written} written, {self.failed} failed, in {clock(self.seconds)}"
        if self.completion_tokens:
            return f"{text}; {self.summary()['tokens_per_second']} tokens/s"
        rate = self.written / self.seconds if self.seconds > 0 else 0.0
        return f"{text}; {rate:.1f} inputs/s"


# -- the run ----------------------------------------------------------------------------


def run(
    model: str | os.PathLike[str],
    input_path: str | os.PathLike[str],
    output: str | os.PathLike[str] | None = None,
    *,
    task: Task = "generate",
    trust_remote_code: bool = False,
    lock: Lock | str | os.PathLike[str] | None = None,
    workers: int | None = None,
    start_method: Literal["spawn", "forkserver", "fork"] = "spawn",
    batch_size: int | None = None,
    max_new_tokens: int | None = None,
    device: str = "cpu",
    dtype: str | Any | None = None,
    pooling: str | None = None,
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    token: str | bool | None = None,
    local_files_only: bool | None = None,
    code_revision: str | None = None,
    progress: bool | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    force_resume: bool = False,
    backend: Literal["local", "ray"] = "local",
    address: str | None = None,
    retry_errors: bool = False,
    batch_timeout: float | None = None,
    params: SamplingParams | None = None,
    chat_template: str | os.PathLike[str] | None = None,
    engine: Literal["transformers", "vllm", "auto"] = "auto",
) -> RunResult:
    """Run ``task`` on every input of ``input_path``; write JSONL to ``output`` (``None``:
    ``stdout``), resuming an output that already holds some ids.

    ``batch_size`` fixes the inputs per batch; by default the executor groups inputs of
    similar length into batches of a token budget (``Executor(max_batch_tokens=)``).
    ``workers``: as ``Executor``'s default when not given. No more workers start than there
    are inputs (or batches of ``batch_size``). ``progress`` (default: whether ``stderr``
    is a terminal) draws a progress bar on ``stderr``. ``force_resume`` appends to an output
    that another model, code digest or option set produced, whose input changed under the
    same ids, or whose record is missing (refused otherwise). ``retry_errors`` runs the
    inputs of the output's error lines again, the output rewritten whole (each id once, in
    input order) and renamed into place. ``batch_timeout`` (seconds) as for ``Executor``.
    A fault of the machine (see ``faults``) stops the run with ``RunStoppedError``, its
    inputs unwritten; the same call resumes. ``dtype``
    is a ``torch.dtype`` or its name; ``cache_dir`` the hub cache that holds ``model``, a
    repo id it lacks being downloaded whole first (``token``, ``local_files_only`` as for
    ``load``); ``code_revision`` as for ``Executor``.
    ``backend="ray"`` runs the workers as Ray actors on the cluster at ``address`` (or
    ``RAY_ADDRESS``); the output and its resumption are the same.

    ``params``: the sampling parameters of every ``generate`` input that does not set its
    own (``max_new_tokens`` is its ``max_tokens``); ``chat_template``: a file holding the
    Jinja chat template for chat inputs (default: the model's). ``input_path`` ``"-"``
    reads standard input. The same options as ``codeferry run``; see docs/executor.md.
    """
    options = ModelOptions.of(locals())
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    if (workers is not None and workers < 1) or (batch_size is not None and batch_size < 1):
        raise ValueError("workers and batch_size must be at least 1")
    out = sys.stdout if stdout is None else stdout
    err = sys.stderr if stderr is None else stderr
    show = err.isatty() if progress is None else progress
    items = read_inputs(input_path, task)
    template = _template(chat_template)
    defaults = _defaults(params, max_new_tokens)
    # Decided once, before the output is opened; the executor takes the plan as it is.
    plan = prepare(model, options, tasks=(task,), device=device, dtype=dtype, demo=True,
                   local_device=backend == "local")
    if template is None and any(i.request and i.request.messages for i in items) \
            and not may_have_chat_template(plan.weights.root):
        raise ChatTemplateMissingError(
            f"the input has chat messages, and the model's tokenizer has no chat template "
            f"(no chat_template.jinja, nor a chat_template in tokenizer_config.json in "
            f"{plan.weights.root}).", path=str(input_path),
            fix="pass --chat-template FILE (a Jinja template), or send prompts instead.")

    chosen = choose_engine(engine, backend, (task,))[0]
    pending = ("engine",) if chosen == "auto" else ()  # known once the workers start

    def made(engine_name: str | None) -> dict[str, Any]:
        return producer(plan.bundle, plan.weights.name, task, max_new_tokens, pooling,
                        plan.dtype, params=params.set_fields() if params else None,
                        chat_template=template, engine=engine_name)

    path = None if output is None or str(output) == "-" else Path(output)
    sink = Sink(path, out)
    state = sink.open(items, task)  # locked and read; nothing in it changed yet
    record = None
    if path is not None and not sink.stream:
        try:
            record = check_record(path, made(chosen if chosen != "auto" else None), items,
                                  state.ids, force_resume, pending=pending)
            sink.repair(state)
        except BaseException:
            sink.close(discard=True)
            raise
    retried = state.errors if retry_errors else set()
    done = state.ids - retried
    result = RunResult(total=len(items), skipped=len(done), failed=state.failed - len(retried),
                       output=None if path is None else str(path))
    remaining = [item for item in items if item.id not in done]
    if workers is None and chosen != "transformers":
        workers = 1  # the executor's default: one vLLM engine batches every row itself
    if workers is None:  # the executor's default (layout.py)
        workers = layout(plan.device, backend, None, None, cpus=cpus(),
                         devices=devices(plan.device, backend))[0]
    bar = Progress(len(remaining), err, enabled=show)
    started = False  # the workers answer: a run stopped from now on is summarized too
    try:
        if not remaining:
            sink.close()
            _summarize(result, path, sink, err)
            return result
        size = batch_size or max(1, min(8, math.ceil(len(remaining) / max(1, workers))))
        count = max(1, min(workers, math.ceil(len(remaining) / size)))
        cores = os.cpu_count() or 1
        if backend == "local" and count > cores:
            err.write(f"codeferry: warning: {count} workers on {cores} core"
                      f"{'s' if cores > 1 else ''}: the extra ones only take turns (and "
                      f"memory), no faster; pass --workers {cores}.\n")
            err.flush()
        if result.skipped:
            bar.note(f"resuming: {result.skipped} of {result.total} already in {path}")
        how = "Ray actors" if backend == "ray" else start_method
        bar.message(f"starting {count} worker{'s' if count > 1 else ''} ({how})...")
        try:
            if path is not None and record is not None:
                write_record(path, record)
            # The plan checked above: workers verify they run exactly its digest.
            executor = Executor(plan, workers=count, start_method=start_method,
                                batch_size=batch_size, backend=backend, address=address,
                                batch_timeout=batch_timeout, engine=engine)
        except BaseException:
            sink.close(discard=True)
            if path is not None and record is not None and not path.exists():
                with contextlib.suppress(OSError):
                    record_path(path).unlink()
            raise
        with executor:
            try:
                if pending and path is not None and not sink.stream:
                    # auto's engine, now known: checked against the record, then recorded
                    ran = {i.get("engine", "transformers") for i in executor.worker_info}
                    late = check_record(path, made("vllm" if "vllm" in ran else "transformers"),
                                        items, state.ids, force_resume)
                    if late is not None:
                        write_record(path, late)
                if retried:
                    sink.rewrite([item.id for item in items], state)
                if task == "generate":
                    info = executor.worker_info[0]
                    text = (f"generating by {info.get('generate_path')} batching "
                            f"({info.get('generate_reason')})")
                    logger.info("codeferry run: %s", text)
                    bar.note(text)
                bar.start()
                started = True
                outcomes = _outcomes(executor, task, remaining, batch_size, defaults, pooling,
                                     template)
                _drain(outcomes, remaining, task, sink, bar, result, size, plan.weights.name)
            except BaseException:
                # The run is abandoned: stop now, rather than wait (as leaving the block does)
                # for batches whose results nothing will write.
                executor.close()
                raise
        sink.close()
    except BaseException as exc:
        bar.finish()  # off the screen before the error (or the interruption) is printed
        if started:
            result.seconds = time.monotonic() - bar.started
            with contextlib.suppress(Exception):
                _summarize(result, path, sink, err)
        if not isinstance(exc, KeyboardInterrupt):
            raise
        if path is not None and not sink.stream:
            err.write(f"codeferry: interrupted after writing {result.skipped + result.written} "
                      f"of {result.total} outputs to {path}; run the same command again to "
                      "resume.\n")
        raise
    finally:
        sink.close()
    bar.finish()
    result.seconds = time.monotonic() - bar.started
    _summarize(result, path, sink, err)
    return result


def _summarize(result: RunResult, path: Path | None, sink: Sink, err: TextIO) -> None:
    """The closing line on stderr, in every mode, and the summary in the record."""
    err.write(result.line() + "\n")
    err.flush()
    if path is not None and not sink.stream:
        write_summary(path, result.summary())


def _template(chat_template: str | os.PathLike[str] | None) -> str | None:
    """The text of the ``--chat-template`` file."""
    if chat_template is None:
        return None
    try:
        return Path(chat_template).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ChatTemplateMissingError(f"cannot read the chat template {chat_template}: "
                                       f"{getattr(exc, 'strerror', None) or exc}.",
                                       path=str(chat_template),
                                       fix="pass a readable UTF-8 Jinja file to --chat-template.") from None


def _defaults(params: SamplingParams | None, max_new_tokens: int | None) -> SamplingParams:
    """The run's sampling defaults: ``params``, ``max_new_tokens`` as its ``max_tokens``."""
    base = SamplingParams(max_tokens=max_new_tokens)
    return base if params is None else params.over(base)


def _outcomes(executor: Executor, task: Task, items: list[InputItem], size: int | None,
              defaults: SamplingParams, pooling: str | None,
              template: str | None) -> Iterator[Outcome]:
    """``size``: the user's fixed batch size; ``None`` lets the executor plan by tokens."""
    texts = [i.text for i in items]
    if task == "generate":
        requests = [i.request or Request(prompt=i.text) for i in items]
        return executor.complete_iter(requests, defaults, batch_size=size,
                                       chat_template=template)
    if task == "embed":
        return executor.embed_iter(texts, pooling=pooling or "mean", batch_size=size)
    return executor.score_iter(texts, batch_size=size)


def _drain(outcomes: Iterator[Outcome], remaining: list[InputItem], task: Task, sink: Sink,
           bar: Progress, result: RunResult, size: int, model: str) -> None:
    """Write outcomes (any order) in input order, each as soon as those before it are out.

    A fault of the machine at input k stops the run: what comes before k is still written
    as it arrives, nothing from k on; then ``RunStoppedError``.
    """
    waiting: dict[int, tuple[bytes, bool]] = {}
    following = 0
    stop: tuple[int, BaseException] | None = None
    try:
        while True:
            try:
                outcome = next(outcomes)
            except StopIteration:
                break
            except (WorkerError, CodeChangedError) as exc:  # the scheduler itself is gone
                if stop is None or following < stop[0]:
                    stop = (following, exc)
                break
            bar.advance()
            fault = None if outcome.error is None else machine_fault(outcome.error)
            if fault is not None and (stop is None or outcome.index < stop[0]):
                stop = (outcome.index, fault)
            elif fault is None and (stop is None or outcome.index < stop[0]):
                waiting[outcome.index] = output_line(remaining[outcome.index], task, outcome.value,
                                                     outcome.error, model)
                prompt, completion = usage(task, outcome.value)
                result.prompt_tokens += prompt
                result.completion_tokens += completion
            end = len(remaining) if stop is None else stop[0]
            if following < end and following in waiting:
                # stdout may be the bar's terminal: the lines go above the bar, drawn again
                with bar.printing() if sink.fd is None else contextlib.nullcontext():
                    while following < end and following in waiting:
                        line, failed = waiting.pop(following)
                        sink.write(line, remaining[following].id)
                        result.written += 1
                        result.failed += failed
                        following += 1
                sink.sync(size)
            if stop is not None and following == stop[0]:
                break
    finally:
        close = getattr(outcomes, "close", None)
        if close is not None:
            close()  # what has not been sent is cancelled
    if stop is not None:
        raise _stopped(remaining[stop[0]], stop[1], result, sink)


def _stopped(item: InputItem, fault: BaseException, result: RunResult,
             sink: Sink) -> RunStoppedError:
    what = fault.message if isinstance(fault, CodeferryError) else str(fault)
    where = "stdout" if sink.path is None else str(sink.path)
    fix = fault.fix if isinstance(fault, CodeferryError) and fault.fix else ""
    error = RunStoppedError(
        f"the run stopped at input {json.dumps(item.id)} (line {item.line} of the input): "
        f"{type(fault).__name__}: {what.rstrip('.')}. That is a fault of "
        f"{'how the run was started' if isinstance(fault, ChatTemplateMissingError) else 'the machine'}"
        f", not an answer for the input, so none of it was written: {where} holds "
        f"{result.skipped + result.written} of {result.total} lines.",
        path=None if sink.path is None else str(sink.path),
        written=result.skipped + result.written, total=result.total,
        output=None if sink.path is None or sink.stream else str(sink.path), stopped_at=item.id,
        fix=(f"{fix.rstrip('.')}; then " if fix else "")
        + ("rerun the same command: it resumes at that input." if sink.path is not None
           and not sink.stream else "rerun it (with --output FILE a run resumes)."))
    error.__cause__ = fault
    return error
