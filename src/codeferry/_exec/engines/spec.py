"""What an executor worker starts from (``WorkerSpec``): pure data, pickled to each worker
(and to each Ray actor), read by the worker's serving loop and by both engines."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..._sandbox.policy import Request
    from ..._trust.options import ModelOptions

__all__ = ["EngineChoice", "Placement", "WorkerSpec"]


@dataclass(frozen=True)
class EngineChoice:
    """Which engine a worker builds, how it generates, in which box, on which transformers."""

    #: ``transformers``, ``vllm`` or ``auto`` (vLLM, else transformers with the reason):
    #: see ``workers.worker.build_engine`` (the parent resolved ``auto`` when vLLM is not
    #: installed).
    name: str = "transformers"
    #: ``auto``, ``decode``, ``continuous`` or ``batched``: see ``stream.choose``.
    generate_path: str = "auto"
    #: Keyword arguments of ``vllm.LLM`` for the vLLM engine (``Executor(engine_options=)``).
    vllm_options: tuple[tuple[str, Any], ...] = ()
    #: The box the worker enters before it builds the engine and imports the model's code
    #: (``None``: no box; ``workers.worker.worker_main``).
    sandbox: Request | None = None
    #: The transformers release line the code needs (``"4.53"``): its environment
    #: (``workers.release``, made on each machine) comes first on the worker's path;
    #: ``None``: the installed transformers.
    release: str | None = None


@dataclass(frozen=True)
class Placement:
    """How a worker shares its machine with the executor's other workers there."""

    #: How many of them may build their models on it at once: they share its free memory
    #: (``packing.pack_linears``' float32 copies, vLLM's cache).
    sharing: int = 1
    #: The cores the worker binds itself to (``layout.cores``); empty: every core this
    #: process may use.
    cores: tuple[int, ...] = ()


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker starts from; it travels pickled (to a Ray actor too)."""

    #: The folder the model is built from: config, tokenizer, weights.
    model: str
    #: Where the code is and whether it may run: the parent's ``ModelOptions.for_workers``,
    #: its trust decision made and no token.
    options: ModelOptions
    device: str
    dtype: str | None
    threads: int
    preload: tuple[str, ...]
    #: The digest the parent checked: the worker runs exactly this code or fails with
    #: ``CodeChangedError`` (``None``: whatever the trust or lock allows).
    digest: str | None = None
    engine: EngineChoice = EngineChoice()
    #: ``False``: load and verify every class strictly, build nothing (``codeferry doctor``).
    serve: bool = True
    #: The folder of the code when it is another revision's than ``model``'s
    #: (``code_revision``, as in transformers): the classes are loaded and verified from
    #: here, the config, tokenizer and weights read from ``model`` with them.
    #: ``None``: ``model``'s own code.
    code: str | None = None
    #: Where it runs beside the executor's other workers on its machine.
    place: Placement = Placement()
