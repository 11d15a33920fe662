"""The run's last stage: the executor's outcomes into the output, in input order.

Outcomes arrive in any order; each line is written as soon as those before it are out. An
outcome that is a fault of the machine, not an answer for its input (``faults``), stops the
run: nothing from its input on is written, and ``RunStoppedError`` says how to resume.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Collection, Iterator

from .._exec.batching import context_error
from .._exec.executor import Executor, Outcome
from .._exec.generate.params import Request, SamplingParams
from ..errors import (
    ChatTemplateMissingError,
    CodeChangedError,
    CodeferryError,
    RunStoppedError,
    SamplingParamsError,
    WorkerError,
)
from .faults import machine_fault
from .inputs import Id, InputItem, Task
from .lines import line as output_line
from .lines import usage
from .output import Sink
from .progress import Progress
from .result import RunResult
from .spill import Kept, Spill

__all__ = ["drain", "outcomes", "over_context"]


def over_context(items: list[InputItem], path: object, defaults: SamplingParams,
                 context: int | None) -> dict[Id, SamplingParamsError]:
    """The ``generate`` lines whose prompt and ``max_tokens`` cannot fit the model's
    ``context`` (``batching.context_error``), each with its error naming ``path`` and its
    line: written as that line's error, as vLLM answers such a request, the others run."""
    refused = {}
    for item in items:
        error = context_error(item.request, defaults, context) if item.request else None
        if error is not None:
            refused[item.id] = SamplingParamsError(error.message, field=error.field,
                                                   path=str(path), line=item.line, fix=error.fix)
    return refused


def outcomes(executor: Executor, task: Task, items: list[InputItem], size: int | None,
              defaults: SamplingParams, pooling: str | None, template: str | None,
              refused: dict[Id, CodeferryError] | None = None,
              kept: Collection[Id] = ()) -> Iterator[Outcome]:
    """``size``: the user's fixed batch size; ``None`` lets the executor plan by tokens.
    ``refused``: lines answered by their error here, never sent (``over_context``, the
    fields refused, ``fields``); ``kept``: lines an earlier run finished (``spill``), not
    sent and not answered here."""
    refused = refused or {}
    sent = [n for n, i in enumerate(items) if i.id not in refused and i.id not in kept]
    texts = [items[n].text for n in sent]
    found: Iterator[Outcome]
    if task == "generate":
        requests = [items[n].request or Request(prompt=items[n].text) for n in sent]
        found = executor.complete_iter(requests, defaults, batch_size=size,
                                       chat_template=template)
    elif task == "embed":
        found = executor.embed_iter(texts, pooling=pooling or "mean", batch_size=size)
    else:
        found = executor.score_iter(texts, batch_size=size)
    if len(sent) == len(items):
        return found
    errors = [Outcome(n, error=refused[i.id]) for n, i in enumerate(items) if i.id in refused]
    return _with(errors, found, sent)


def _with(errors: list[Outcome], found: Iterator[Outcome], sent: list[int]) -> Iterator[Outcome]:
    """``errors``, then ``found``'s outcomes at the places of the inputs sent."""
    try:
        yield from errors
        for outcome in found:
            yield Outcome(sent[outcome.index], outcome.value, outcome.error)
    finally:
        close = getattr(found, "close", None)
        if close is not None:
            close()


def drain(outcomes: Iterator[Outcome], remaining: list[InputItem], task: Task, sink: Sink,
          bar: Progress, result: RunResult, size: int, model: str,
          spill: Spill | None = None) -> None:
    """Write outcomes (any order) in input order, each as soon as those before it are out.

    A line that must wait for an earlier one is kept in ``spill`` meanwhile, so an interrupt
    loses no finished result; the lines an earlier run kept there (its ``kept``) are written
    in their places, not computed again (``outcomes`` is not given them). A fault of the
    machine at input k stops the run: what comes before k is still written as it arrives,
    nothing from k on; then ``RunStoppedError``.
    """
    waiting: dict[int, tuple[bytes, bool]] = {}
    kept = spill.kept if spill is not None else {}
    for n, item in enumerate(remaining):
        if item.id in kept:
            found = kept[item.id]
            waiting[n] = (found.line, found.failed)
            result.prompt_tokens += found.prompt_tokens
            result.completion_tokens += found.completion_tokens
    bar.advance(len(waiting))
    following = 0
    stop: tuple[int, BaseException] | None = None

    def flush() -> None:
        nonlocal following
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
            if spill is not None:
                spill.sync()

    try:
        flush()
        while stop is None or following < stop[0]:
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
                line, failed = output_line(remaining[outcome.index], task, outcome.value,
                                           outcome.error, model)
                waiting[outcome.index] = (line, failed)
                prompt, completion = usage(task, outcome.value)
                result.prompt_tokens += prompt
                result.completion_tokens += completion
                if spill is not None and outcome.index != following:
                    spill.keep(remaining[outcome.index].id,
                               Kept(line, failed, prompt, completion))
            flush()
    finally:
        result.kept = len(waiting) if spill is not None else 0
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
