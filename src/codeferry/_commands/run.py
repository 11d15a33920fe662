"""``codeferry run``: batch inference from an input file to a resumable JSONL output file.

``run`` takes its options as keywords (``keywords.RunKeywords``) and builds them once into
values (``ModelOptions``, ``WorkerOptions``, ``RunOptions``); ``codeferry run`` builds the
same values from its flags (``register``, ``run_command``), and both hand them to
``run_with``, which runs in stages. It reads its input whole (``inputs``) and plans the
model once, checking what would fail every worker first (``preflight``); it takes the output's lock and checks what is already there (``output``),
records what produces the output and its inputs (``record``), starts the executor, then
drains its outcomes into the output in input order (``drain``) with a progress bar
(``progress``), each line as ``lines`` writes it, those finished ahead of the write
position kept in the meantime (``spill``). An outcome that is a fault of the
machine, not an answer for its input (``faults``), stops the run with ``RunStoppedError``:
it is never written, and the same command resumes. Every run ends with a summary line on
stderr (``N written, K failed, in T; X tokens/s``), a terminal or not, and in the record.

``generate`` inputs are requests (``_exec.generate.params.Request``): a prompt or chat
messages, with per-input sampling parameters over the run's defaults (``params``, the
command line's flags).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from .. import _settings
from .._exec.engines.vllm_engine import choose_engine
from .._exec.executor import Executor
from .._exec.files import model_context
from .._exec.generate.params import SamplingParams
from .._exec.layout import cpus, devices, layout
from .._exec.options import WorkerOptions
from .._exec.plan import Plan, prepare
from .._trust.options import ModelOptions
from ..errors import CodeferryError, HubDownloadError
from .command import Commands, add_command, demo, model_options, worker_options
from .drain import drain, outcomes
from .flags import (
    add_common_flags,
    add_sampling_flags,
    add_sandbox_flag,
    add_trust_flags,
    add_worker_flags,
)
from .inputs import TASKS, Id, InputItem, Task, read_inputs
from .keywords import RUN_KEYWORDS, RunOptions, options_of, too_small
from .output import Existing, Sink, lock_path
from .preflight import (
    check_chat_template,
    check_model_files,
    checked_flags,
    engine_options,
    paths,
    read_template,
    refused,
    unknown_model,
)
from .progress import Progress, quiet_workers
from .record import check_record, producer, record_path, write_record, write_summary
from .result import RunResult
from .spill import Spill

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .keywords import RunKeywords

__all__ = ["TASKS", "InputItem", "RunResult", "lock_path", "read_inputs", "record_path",
           "register", "run", "run_command", "run_with"]

logger = logging.getLogger(__name__)


# -- the run ----------------------------------------------------------------------------


def run(
    model: str | os.PathLike[str],
    input_path: str | os.PathLike[str],
    output: str | os.PathLike[str] | None = None,
    *,
    task: Task = "generate",
    params: SamplingParams | None = None,
    **options: Unpack[RunKeywords],
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
    reads standard input. ``max_model_len``: a line's most tokens, prompt and ``max_tokens``
    (default: the model's config.json); a line over it gets an error line, the others run.
    The same options as ``codeferry run``; see docs/executor.md.
    Every keyword with its type: ``keywords.RunKeywords``.
    """
    models, workers = options_of("run", options, RUN_KEYWORDS)
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    if too_small(workers=workers.workers, batch_size=workers.batch_size,
                 max_model_len=options.get("max_model_len"),
                 max_batch_tokens=workers.max_batch_tokens):
        raise ValueError("workers, batch_size, max_batch_tokens and max_model_len must be at "
                         "least 1")
    return run_with(model, input_path, output, task, params, models, workers,
                    RunOptions.of(options))


@dataclass(frozen=True)
class _Inputs:
    """What the run reads before it decides anything: its inputs and their options."""

    path: str | os.PathLike[str]
    task: Task
    items: list[InputItem]
    #: The ``--chat-template`` file's text (``None``: the model's).
    template: str | None
    params: SamplingParams | None
    #: ``params`` over ``max_new_tokens``: what an input that sets nothing is sampled with.
    defaults: SamplingParams
    options: RunOptions
    #: The context lines are checked against, and the lines over it (``over_context``).
    context: int | None = None
    refused: dict[Id, CodeferryError] = field(default_factory=dict)


@dataclass
class _Opened:
    """The output, opened (locked, read and checked against its record), and what is left."""

    path: Path | None
    sink: Sink
    state: Existing
    #: The record to write before the first line (``None``: the one there is right).
    record: dict[str, Any] | None
    #: The ids of the error lines run again (``retry_errors``).
    retried: set[Id]
    result: RunResult
    remaining: list[InputItem]
    #: What the record cannot say before the workers start: ``auto``'s engine.
    pending: tuple[str, ...] = ()
    #: Whether the workers answered: a run stopped from then on is summarized too.
    started: bool = False
    #: Where finished results wait to be written (``None``: stdout or a stream), with those
    #: an earlier run kept there (its ``kept``).
    spill: Spill | None = None

    @property
    def checked(self) -> bool:
        """Whether the output has a record (a file, not a stream)."""
        return self.path is not None and not self.sink.stream


def run_with(model: str | os.PathLike[str], input_path: str | os.PathLike[str],
             output: str | os.PathLike[str] | None, task: Task, params: SamplingParams | None,
             models: ModelOptions, workers: WorkerOptions, options: RunOptions) -> RunResult:
    """``run`` on its options as values, checked already: ``run`` builds them from its
    keywords, ``codeferry run`` from its flags. The stages: read, plan, open, start, drain,
    summarize."""
    err = sys.stderr if options.stderr is None else options.stderr
    show = err.isatty() if options.progress is None else options.progress
    inputs = _read(input_path, task, params, options)
    plan = _plan(model, inputs, models, workers)
    context = options.max_model_len or model_context(plan.weights.root)
    names = {plan.weights.name, *([options.served_model_name] if options.served_model_name else [])}
    inputs = replace(inputs, context=context, refused=refused(
        model, names, inputs.items, inputs.path, inputs.defaults, context, task))
    opened = _open(output, plan, inputs, workers)
    count = _workers(plan, workers)
    bar = Progress(len(opened.remaining), err, enabled=show)
    try:
        if not opened.remaining:
            opened.sink.close()
            _summarize(opened, err)
            return opened.result
        with quiet_workers():
            executor, size = _start(plan, opened, workers, count, bar, err, inputs.context)
        with executor:
            try:
                _drain(executor, plan, inputs, opened, workers, bar, size)
            except BaseException:
                # The run is abandoned: stop now, rather than wait (as leaving the block does)
                # for batches whose results nothing will write.
                executor.close()
                raise
        opened.sink.close()
    except BaseException as exc:
        bar.finish()  # off the screen before the error (or the interruption) is printed
        if opened.started:
            opened.result.seconds = time.monotonic() - bar.started
            with contextlib.suppress(Exception):
                _summarize(opened, err)
        if not isinstance(exc, KeyboardInterrupt):
            raise
        if opened.checked:
            kept = f" (and kept {opened.result.kept} more finished ones)" \
                if opened.result.kept else ""
            err.write(f"codeferry: interrupted after writing "
                      f"{opened.result.skipped + opened.result.written} of {opened.result.total} "
                      f"outputs to {opened.path}{kept}; run the same command again to "
                      "resume.\n")
        raise
    finally:
        opened.sink.close()
        if opened.spill is not None:
            opened.spill.close(complete=opened.result.complete)
    bar.finish()
    opened.result.seconds = time.monotonic() - bar.started
    _summarize(opened, err)
    return opened.result


def _read(input_path: str | os.PathLike[str], task: Task, params: SamplingParams | None,
          options: RunOptions) -> _Inputs:
    """The first stage: the inputs read whole and checked, the chat template read, the
    sampling defaults made."""
    items = read_inputs(input_path, task)
    template = read_template(options.chat_template)
    return _Inputs(input_path, task, items, template, params,
                   _defaults(params, options.max_new_tokens), options)


def _plan(model: str | os.PathLike[str], inputs: _Inputs, models: ModelOptions,
          workers: WorkerOptions) -> Plan:
    """The model, its code, the trust decision, the device and dtype, decided once, before
    the output is opened: the executor takes the plan as it is. Chat inputs need a chat
    template: the model's, or ``--chat-template``'s."""
    try:
        plan = prepare(model, models, tasks=(inputs.task,), device=workers.device,
                       dtype=workers.dtype, demo=True, local_device=workers.backend == "local")
    except HubDownloadError as exc:
        better = unknown_model(model, models.cache_dir, exc)
        if better is exc:
            raise
        raise better from exc
    check_model_files(plan.weights.root)
    check_chat_template(plan.weights.root, plan.bundle.origin.root, inputs.items, inputs.template,
                        inputs.path)
    return plan


def _producer(plan: Plan, inputs: _Inputs, engine: str | None) -> dict[str, Any]:
    """What produces the output's lines, as its record keeps it (``record.producer``)."""
    params = inputs.params.set_fields() if inputs.params else None
    return producer(plan.bundle, plan.weights.name, inputs.task, inputs.options.max_new_tokens,
                    inputs.options.pooling, plan.dtype, params=params,
                    chat_template=inputs.template, engine=engine)


def _open(output: str | os.PathLike[str] | None, plan: Plan, inputs: _Inputs,
          workers: WorkerOptions) -> _Opened:
    """The output locked and read, checked against its record (what produced it) and
    repaired; nothing in it changed yet. What it holds already is skipped, its error lines
    too unless ``retry_errors``."""
    options = inputs.options
    engine = choose_engine(workers.engine, workers.backend, (inputs.task,))[0]
    pending = ("engine",) if engine == "auto" else ()  # known once the workers start
    path = None if output is None or str(output) == "-" else Path(output)
    sink = Sink(path, sys.stdout if options.stdout is None else options.stdout)
    state = sink.open(inputs.items, inputs.task)  # locked and read; nothing in it changed yet
    record, spill = None, None
    if path is not None and not sink.stream:
        try:
            made = _producer(plan, inputs, None if pending else engine)
            record = check_record(path, made, inputs.items, state.ids, options.force_resume,
                                  pending=pending, unused=_unused(inputs, state))
            spill = Spill(path, made, inputs.items)
            sink.repair(state)
        except BaseException:
            sink.close(discard=True)
            raise
    retried = state.errors if options.retry_errors else set()
    done = state.ids - retried
    result = RunResult(total=len(inputs.items), skipped=len(done),
                       failed=state.failed - len(retried),
                       output=None if path is None else str(path))
    remaining = [item for item in inputs.items if item.id not in done]
    if spill is not None:
        spill.read({item.id for item in remaining})
    return _Opened(path, sink, state, record, retried, result, remaining, pending,
                   spill=spill)


def _unused(inputs: _Inputs, state: Existing) -> tuple[str, ...]:
    """The options no written line depended on: the chat template while the output holds
    no chat line (so ``--chat-template``, the fix of a run stopped at its first chat line,
    resumes it)."""
    chats = any(i.id in state.ids and i.request and i.request.messages for i in inputs.items)
    return () if chats else ("chat_template",)


def _workers(plan: Plan, workers: WorkerOptions) -> int:
    """The workers asked for, else the executor's default (``layout``), whichever engine
    generates: one vLLM of every thread stalls beside other work as one transformers
    worker of every thread does."""
    if workers.workers is not None:
        return workers.workers
    return layout(plan.device, workers.backend, None, None, cpus=cpus(),
                  devices=devices(plan.device, workers.backend))[0]


def _start(plan: Plan, opened: _Opened, workers: WorkerOptions, count: int, bar: Progress,
           err: TextIO, context: int | None) -> tuple[Executor, int]:
    """The record written and the executor started on the plan (its workers verify they
    run exactly its digest), no more workers than batches; with the inputs per batch the
    output is synced after. A failed start leaves the output as it was."""
    remaining = opened.remaining
    size = workers.batch_size or max(1, min(8, math.ceil(len(remaining) / max(1, count))))
    count = max(1, min(count, math.ceil(len(remaining) / size)))
    cores = os.cpu_count() or 1
    if workers.backend == "local" and count > cores:
        err.write(f"codeferry: warning: {count} workers on {cores} core"
                  f"{'s' if cores > 1 else ''}: the extra ones only take turns (and "
                  f"memory), no faster; pass --workers {cores}.\n")
        err.flush()
    if opened.result.skipped:
        bar.note(f"resuming: {opened.result.skipped} of {opened.result.total} already in "
                 f"{opened.path}")
    how = "Ray actors" if workers.backend == "ray" else workers.start_method
    bar.message(f"starting {count} worker{'s' if count > 1 else ''} ({how})...")
    path, record = opened.path, opened.record
    try:
        if path is not None and record is not None:
            write_record(path, record)
        keywords = {**workers.keywords(), "workers": count, "max_model_len": context}
        return Executor(plan, **keywords), size
    except BaseException:
        opened.sink.close(discard=True)
        if path is not None and record is not None and not path.exists():
            with contextlib.suppress(OSError):
                record_path(path).unlink()
        raise


def _drain(executor: Executor, plan: Plan, inputs: _Inputs, opened: _Opened,
           workers: WorkerOptions, bar: Progress, size: int) -> None:
    """With the workers up: ``auto``'s engine, now known, checked against the record and
    recorded; the output rewritten for ``retry_errors``; then every outcome into the output
    in input order (``drain``), synced every ``size`` lines; batches of ``batch_size``
    when given, else planned by tokens."""
    path, sink = opened.path, opened.sink
    if opened.pending and path is not None and not sink.stream:
        ran = {i.get("engine", "transformers") for i in executor.worker_info}
        late = check_record(path, _producer(plan, inputs, "vllm" if "vllm" in ran
                                            else "transformers"),
                            inputs.items, opened.state.ids, inputs.options.force_resume,
                            unused=_unused(inputs, opened.state))
        if late is not None:
            write_record(path, late)
    if opened.retried:
        sink.rewrite([item.id for item in inputs.items], opened.state)
    if inputs.task == "generate":
        info = executor.worker_info[0]
        text = (f"generating by {info.get('generate_path')} batching "
                f"({info.get('generate_reason')})")
        logger.info("codeferry run: %s", text)
        bar.note(text)
    bar.start()
    opened.started = True
    found = outcomes(executor, inputs.task, opened.remaining, workers.batch_size,
                     inputs.defaults, inputs.options.pooling, inputs.template,
                     inputs.refused, opened.spill.kept if opened.spill else ())
    drain(found, opened.remaining, inputs.task, sink, bar, opened.result, size,
          plan.weights.name, opened.spill)


def _summarize(opened: _Opened, err: TextIO) -> None:
    """The last stage: the closing line on stderr, in every mode, and the summary in the
    record."""
    err.write(opened.result.line() + "\n")
    err.flush()
    if opened.path is not None and not opened.sink.stream:
        write_summary(opened.path, opened.result.summary())


def _defaults(params: SamplingParams | None, max_new_tokens: int | None) -> SamplingParams:
    """The run's sampling defaults: ``params``, ``max_new_tokens`` as its ``max_tokens``."""
    base = SamplingParams(max_tokens=max_new_tokens)
    return base if params is None else params.over(base)


# -- the command line --------------------------------------------------------------------


def run_command(args: argparse.Namespace) -> int:
    """Run a model on every line of a file (generate, embed or score) into resumable JSONL.

    Batch inference on worker processes. Input: JSONL objects with an "id" and a
    "prompt" (or "text"), or plain text lines (id: the line number). Output: one JSON
    line per input, in input order; rerunning with the same --output resumes (and
    --retry-errors runs the error lines again). A fault of the machine (a broken
    executor, changed code, a batch timeout) stops the run, never written as a line: the
    same command resumes. With no arguments, runs the bundled demo model on its prompts
    and prints JSONL. Exit 0: every input has a result; 1: some failed (error lines) or an
    error; 2: usage.
    """
    params = checked_flags(args)
    inputs, output = paths(args)
    args.engine_options = engine_options(args.engine_option)
    # The workers' "Loading weights" bars would garble ours (and clutter logs).
    _settings.quiet_hub_progress()
    try:
        result = run_with(args.model or demo(), inputs, output, args.task, params,
                          model_options(args), worker_options(args), RunOptions.of(vars(args)))
    except BrokenPipeError:  # `codeferry run | head`: the reader left; stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    return 0 if result.failed == 0 else 1


def register(sub: Commands) -> None:
    """Add ``run`` to the command line."""
    command = add_command(sub, "run", run_command, model_help=", whose code is trusted by "
                          "its pinned digest; then --input defaults to its prompts)")
    command.add_argument("--input", metavar="FILE",
                         help="JSONL (OpenAI batch lines too) or plain text, one input per line; "
                         "- reads stdin (needed with a MODEL; default: the demo's prompts.txt)")
    command.add_argument("-o", "--output", metavar="FILE",
                         help="JSONL results; an existing file is resumed (default: stdout)")
    add_trust_flags(command.add_mutually_exclusive_group())
    command.add_argument("--task", choices=["generate", "embed", "score"], default="generate")
    add_worker_flags(command, workers_help="worker processes (default: 2 on CPU, 1 on a 1-core "
                     "machine, one per GPU; never more than batches)")
    command.add_argument("--batch-size", type=int, metavar="B",
                         help="inputs per batch (default: batches of --max-batch-tokens)")
    command.add_argument("--max-batch-tokens", type=int, metavar="T",
                         help="padded tokens per batch, rows x longest (default: 2048 on CPU, "
                         "16384 on an accelerator)")
    command.add_argument("--max-new-tokens", "--max-tokens", type=int, metavar="K",
                         help="most tokens to generate per input (--task generate; default: the "
                         "model's generation_config, else 16)")
    command.add_argument("--max-model-len", type=int, metavar="N",
                         help="most tokens of a line, prompt and max_tokens; a line over it "
                         "gets an error line (default: the model's config.json)")
    command.add_argument("--device", default="cpu", metavar="D",
                         help="cpu, cuda (one GPU per worker, round robin), cuda:N... "
                         "(default: cpu)")
    command.add_argument("--dtype", choices=["float32", "float16", "bfloat16", "float64"],
                         help="weights dtype (default: the model's)")
    command.add_argument("--pooling", choices=["mean", "cls", "last"],
                         help="how token vectors become one embedding (--task embed; default: "
                         "mean)")
    command.add_argument("--force-resume", action="store_true",
                         help="resume an --output that another model, code digest, task option "
                         "or dtype produced (OUTPUT.codeferry.json records what did; a mismatch "
                         "is refused without this flag; so is an input edited under ids "
                         "already answered, or an output without its record)")
    command.add_argument("--retry-errors", action="store_true",
                         help="run the inputs of the output's error lines again (the output is "
                         "rewritten whole, each id once, in input order, and renamed into place)")
    command.add_argument("--batch-timeout", type=float, metavar="SECONDS",
                         help="a worker whose batch runs longer is killed and replaced, the "
                         "batch retried; a batch that times out every attempt stops the run "
                         "(default: none)")
    command.add_argument("--engine", choices=["transformers", "vllm", "auto"], default="auto",
                         help="what generates in each worker: auto (the default: vLLM where it "
                         "is installed and runs the model, the model's transformers code "
                         "otherwise, the reason printed), transformers, or vllm (a model vLLM "
                         "cannot run fails at start-up); see docs/executor.md")
    command.add_argument("--engine-option", action="append", metavar="KEY=VALUE",
                         help="a keyword of vllm.LLM for the vLLM engine, repeatable; VALUE is "
                         "read as JSON where it parses (0.5, false, {...}), else as a string")
    command.add_argument("--served-model-name", metavar="NAME",
                         help="the name OpenAI lines' \"model\" may give, as vLLM's flag (also "
                         "accepted: the model's path, repo id or folder name)")
    command.add_argument("--no-progress", dest="progress", action="store_false", default=None,
                         help="no progress bar, even on a terminal")
    add_sampling_flags(command)
    add_sandbox_flag(command)
    add_common_flags(command)
