"""The seam between a worker and its engine: what a worker asks (``Work``), and what every
engine answers (``Engine``).

A worker receives one ``Work`` value per message and hands it to its engine; both engines
(``hf_engine.TransformersEngine``, ``vllm_engine.VllmEngine``) implement ``Engine``. There
is one way to generate: ``Complete``, a batch of ``Request`` values over a call's default
``SamplingParams``. ``Executor.generate`` without ``params`` sends the same ``Complete``
with ``texts=True`` (plain strings come back), its ``model.generate`` keywords mapped onto
``SamplingParams`` once, in the parent (``SamplingParams.from_generate_options``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..generate.complete import Planned, Planner
from ..generate.params import GenerateResult, Request, SamplingParams

__all__ = ["Complete", "Embed", "Engine", "EngineStream", "Rpc", "Score", "Work", "StepReply"]


@dataclass(frozen=True)
class Complete:
    """Generate for each request: a ``GenerateResult`` each, or its text with ``texts``."""

    requests: Sequence[Request]
    #: The call's parameters, under each request's own (``None``: the model's defaults).
    defaults: SamplingParams | None = None
    #: A Jinja chat template for chat requests (``None``: the tokenizer's).
    chat_template: str | None = None
    #: Answer plain strings (the first completion's text), as ``Executor.generate`` without
    #: ``params`` returns them.
    texts: bool = False

    def part(self, inputs: Sequence[Any]) -> Complete:
        """This work for ``inputs``, one batch of its requests."""
        return dataclasses.replace(self, requests=inputs)

    def answer(self, results: Sequence[GenerateResult]) -> list[Any]:
        """What travels back for ``results``."""
        return [r.text for r in results] if self.texts else list(results)


@dataclass(frozen=True)
class Embed:
    """One vector per text, pooled as ``pooling`` says (``mean``, ``cls`` or ``last``)."""

    texts: Sequence[str]
    pooling: str = "mean"

    def part(self, inputs: Sequence[Any]) -> Embed:
        return dataclasses.replace(self, texts=inputs)


@dataclass(frozen=True)
class Score:
    """Per text: its tokens and their logprobs."""

    texts: Sequence[str]

    def part(self, inputs: Sequence[Any]) -> Score:
        return dataclasses.replace(self, texts=inputs)


@dataclass(frozen=True)
class Rpc:
    """``func(engine, *args, **kwargs)`` in the worker (``submit``, ``collective_rpc``)."""

    func: Callable[..., Any]
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def part(self, inputs: Sequence[Any]) -> Rpc:
        return self


Work = Complete | Embed | Score | Rpc

#: One reply of a stream's step: ``(request id, True, value)`` or ``(request id, False, error)``.
StepReply = tuple[int, bool, Any]


class EngineStream(Protocol):
    """Every ``Complete`` a worker holds, in one running batch (``stream.Stream``,
    ``vllm_engine.VllmStream``): batches join as they arrive and leave as they end."""

    @property
    def busy(self) -> bool: ...

    def take(self, request_id: int, engine: Planner, work: Complete) -> Planned | None:
        """Join the running batch: ``None``, or the batch as planned when a part of it is one
        the stream does not run (the worker then answers it with ``Engine.complete``)."""
        ...

    def step(self) -> list[StepReply]: ...


class Engine(Planner, Protocol):
    """What a worker's serving loop asks of its engine: besides a ``Planner``'s tokenizer,
    generation defaults and ``generate_path`` (``(path, why)``: ``decode``, ``batched``,
    ``continuous`` or ``vllm``; ``None`` until the generating model is built):"""

    def info(self) -> dict[str, Any]:
        """What the ready message tells the parent."""
        ...

    def stream(self) -> EngineStream | None:
        """The engine's running batch, or ``None`` when it answers one batch at a time."""
        ...

    def complete(self, work: Complete, planned: Planned | None = None) -> list[GenerateResult]:
        """``work``'s results in order; ``planned``: the batch as a stream planned it."""
        ...

    def embed(self, texts: Sequence[str], pooling: str) -> list[list[float]]: ...

    def score(self, texts: Sequence[str]) -> list[dict[str, Any]]: ...
