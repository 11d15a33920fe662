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
from typing import TYPE_CHECKING, Any, Literal

from .. import _settings

if TYPE_CHECKING:
    from .._sandbox.policy import Request

__all__ = ["Backend", "EngineName", "GeneratePath", "StartMethod", "WorkerOptions",
           "sandbox_request"]

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
    #: Run every worker in the box (``_sandbox``); ``None``: ``CODEFERRY_SANDBOX`` says.
    sandbox: bool | None = None

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


def sandbox_request(options: WorkerOptions, engine: str) -> Request | None:
    """The box each worker enters (``None``: no box), checked here first, so a kernel that
    cannot build it fails in the parent, typed (``SandboxUnavailableError``), before any
    worker starts. The Ray backend is refused (``SandboxUnsupportedError``): its actors run
    in Ray's own processes, which would run unboxed. Either engine runs in the box;
    ``engine`` is the one the workers get: vLLM's makes torch.distributed groups even alone
    (``Request.groups``)."""
    wanted = options.sandbox if options.sandbox is not None else _settings.sandbox_switch()
    if not wanted:
        return None
    from .._sandbox.box import check_available, request_from_settings
    from ..errors import SandboxUnsupportedError

    if options.backend == "ray":
        raise SandboxUnsupportedError(
            "the sandbox cannot hold the Ray backend yet; refused rather than run unboxed.",
            where="the Ray backend", fix="use backend='local' with the sandbox, or run "
            "without it only if you trust this code.")
    check_available()
    return request_from_settings(groups=engine != "transformers")
