"""How the workers run a model, as one value from the command line to the scheduler.

``ModelOptions`` (``_trust.options``) says which model and whose code; ``WorkerOptions``
says how many workers run it, how they start, on which device and engine, how batches are
cut and how long anything may take. ``Executor``, ``run`` and ``doctor`` list these
keywords for their users and their help; ``WorkerOptions.of`` takes them from there once,
and everything below passes the one value on: a new option is a field here plus the public
signatures.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["Backend", "EngineName", "GeneratePath", "StartMethod", "WorkerOptions"]

StartMethod = Literal["spawn", "forkserver", "fork"]
Backend = Literal["local", "ray"]
EngineName = Literal["transformers", "vllm", "auto"]
GeneratePath = Literal["auto", "decode", "continuous", "batched"]
GENERATE_PATHS: tuple[str, ...] = ("auto", "decode", "continuous", "batched")


@dataclass(frozen=True)
class WorkerOptions:
    """How an executor's workers run one model; every field is an ``Executor`` keyword."""

    workers: int | None = None
    start_method: StartMethod = "spawn"
    device: str = "cpu"
    #: A ``torch.dtype`` or its name; ``None``: the model's own.
    dtype: Any = None
    batch_size: int | None = None
    max_batch_tokens: int | None = None
    generate_path: GeneratePath = "auto"
    max_retries: int = 2
    threads_per_worker: int | None = None
    warm: bool = False
    startup_timeout: float = 600.0
    batch_timeout: float | None = None
    backend: Backend = "local"
    address: str | None = None
    ray_resources: Mapping[str, Any] | None = None
    engine: EngineName = "auto"
    #: Keyword arguments of ``vllm.LLM`` for the vLLM engine.
    engine_options: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.generate_path not in GENERATE_PATHS:
            raise ValueError(f"generate_path must be 'auto', 'decode', 'continuous' or "
                             f"'batched', got {self.generate_path!r}")
        if self.backend not in ("local", "ray"):
            raise ValueError(f"unknown backend {self.backend!r}: use 'local' or 'ray'")

    @classmethod
    def of(cls, arguments: Mapping[str, Any]) -> WorkerOptions:
        """The options among a public function's ``arguments`` (its ``locals()``): each
        field present there, the rest at their defaults."""
        return cls(**{f.name: arguments[f.name] for f in dataclasses.fields(cls)
                      if f.name in arguments})

    def keywords(self) -> dict[str, Any]:
        """The options as ``Executor``'s keyword arguments."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
