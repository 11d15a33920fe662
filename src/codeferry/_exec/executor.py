"""The executor: batch inference of one model across workers that survive crashes.

::

    caller threads                        workers (local processes, or Ray actors)
    ──────────────                        ────────────────────────────────────────
    generate/embed/score(inputs)          each loads and verifies the model's code
      │ split into batches                 itself, builds the model, serves batches
      ▼
    scheduler.Scheduler ─── transport ───▶  (request_id, Work): Complete|Embed|Score|Rpc
      one manager thread owns every      ◀──  (request_id, "ok"|"error", ...), or death
      batch, attempt and outcome

Every worker runs exactly the code digest the parent checked (``Executor.digest``): one
started or replaced after the model folder changed fails with ``CodeChangedError``,
naming both digests, before it executes anything; that is not retried, and every later
call raises it too. The scheduler's docstring says what happens when a worker dies, a
batch raises or runs past ``batch_timeout``: every input gets exactly one outcome.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, overload

from .._code.lockfile import Lock
from .._runtime.loader import units_of
from .._trust.decide import record
from .._trust.options import ModelOptions
from .batching import batch_limits, estimate_tokens, fixed_batches, grouped_batches, plan_batches
from .engines.base import Complete, Embed, Rpc, Score, Work
from .engines.spec import EngineChoice, Placement
from .engines.vllm_engine import choose_engine
from .files import model_context
from .generate.params import Conversation, GenerateResult, Request, SamplingParams, conversations
from .layout import bindings, cpus, device_for, devices, layout
from .options import Backend, EngineName, GeneratePath, StartMethod, WorkerOptions, sandbox_request
from .plan import Plan, prepare
from .scheduler import STREAM_DEPTH, Batch, Call, Outcome, Scheduler
from .workers.checks import check_main_guard
from .workers.release import for_workers
from .workers.transport import LocalTransport, Transport
from .workers.worker import WorkerSpec

__all__ = ["Executor", "Outcome"]

Params = SamplingParams | Sequence[SamplingParams] | None

#: Inputs sorted by length together: a stream's outputs are held back at most this many.
BATCH_WINDOW = 1024
#: Planned batches per worker (at least): one running, the next already sent. Every
#: transport keeps at least this many in flight (``Transport.depth``), so the plan, and
#: the outputs, are the same whichever transport runs them.
PIPELINE = 2


class Executor:
    """Batch inference of ``model`` on ``workers`` processes or Ray actors.

    ``model`` is a folder, a cached repo id or a snapshot folder of the hub cache, remote
    code or not; workers get the snapshot folder, fenced like the repo. It may also be a
    ``Plan`` that ``prepare`` made (``run`` does): the model, its code, the trust decision,
    the device and dtype are then the plan's, decided once. Remote code runs only with
    ``trust_remote_code=True`` or a ``lock``, in the parent's decision and again in each
    worker, which loads and verifies the code itself. The keywords that say how workers run
    are one ``WorkerOptions`` value inside (``options``), the model's one ``ModelOptions``.

    ``dtype`` is a ``torch.dtype`` or its name (``"float16"``), as for ``from_pretrained``;
    ``cache_dir`` the hub cache that holds ``model`` (a repo id) and cross-repo code; a repo
    id it lacks is downloaded whole first (``token``, ``local_files_only`` as for ``load``).
    ``code_revision`` is the revision whose code the workers load and verify (default:
    ``revision``), as in transformers: the model is built from ``revision``'s config and
    weights with that code's classes.

    ``digest``: the code digest the caller checked, if any (other code raises
    ``CodeChangedError``); every worker and replacement verifies ``self.digest`` first.

    ``warm=True`` forks workers from a zygote with torch and transformers imported (one per
    process, see ``zygote``) instead of ``start_method``: seconds saved per worker; each still
    loads and verifies the code itself.

    ``workers`` (default: two sharing a CPU machine's cores, one on a one-core machine; one
    per visible GPU; two Ray actors: ``layout``) and ``threads_per_worker`` (default: the
    cores shared out) say how the work is spread.

    Batches: ``batch_size`` fixes the inputs per batch; by default inputs of similar length
    are batched together, ``max_batch_tokens`` padded tokens a batch (``batching``).
    ``generate_path``: ``"auto"`` (the decode loop, ``decode.py``, when a probe shows it
    gives ``generate``'s tokens for the model, on CPU and on an accelerator; batched
    ``generate`` otherwise), ``"decode"``, ``"continuous"`` or ``"batched"``; each worker's
    choice is in ``worker_info`` (``stream.choose``).

    Refused before any worker starts (``checks``): a ``device`` this machine's torch cannot
    use (``DeviceError``), spawn or forkserver workers started by a main script outside ``if
    __name__ == "__main__":`` (``MainGuardError``). ``sandbox=True`` (``None``:
    ``CODEFERRY_SANDBOX``) runs each worker in the box (``_sandbox``, docs/security.md), or
    fails, typed, where the kernel cannot build it.

    ``batch_timeout`` (seconds, default off): a worker whose batch runs longer is killed
    and replaced and the batch retried (``BatchTimeoutError`` is the last cause), so a
    hung forward pass cannot hang the caller. ``max_model_len``: a request's most tokens, prompt
    and ``max_tokens`` (default: config.json's; more raises ``SamplingParamsError``, unsent).

    ``engine``: ``"auto"`` (the default: vLLM where it is installed and runs the model, else
    transformers, the reason in ``worker_info``), ``"transformers"`` (the model's own code, on
    the paths above) or ``"vllm"`` (one ``vllm.LLM`` in one worker, bound to the verified
    code; a model it cannot run raises ``EngineRefusedError``); ``engine_options``: keyword
    arguments of ``vllm.LLM`` (``vllm_engine``; docs/executor.md "Engines").

    ``backend="ray"`` runs the workers as Ray actors across a cluster (``address`` or
    ``RAY_ADDRESS`` as for ``ray.init``, else a local cluster), ``ray_resources`` per actor
    (``num_cpus``, ``num_gpus``, ``resources``; ``ray_backend``): same methods and guarantees.

    The ``concurrent.futures`` shape: ``submit``, ``map``, ``shutdown``, ``with``; leaving
    ``with`` waits for what was submitted (``shutdown(wait=True)``), unless a Ctrl-C leaves
    it. Any number of threads and open iterators may use one executor at once.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | Plan,
        *,
        workers: int | None = None,
        start_method: StartMethod = "spawn",
        device: str = "cpu",
        dtype: str | Any | None = None,
        trust_remote_code: bool = False,
        lock: Lock | str | os.PathLike[str] | None = None,
        revision: str | None = None,
        batch_size: int | None = None,
        max_batch_tokens: int | None = None,
        generate_path: GeneratePath = "auto",
        max_retries: int = 2,
        threads_per_worker: int | None = None,
        preload: Sequence[str] = ("generate",),
        warm: bool = False,
        startup_timeout: float = 600.0,
        digest: str | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        batch_timeout: float | None = None,
        backend: Backend = "local",
        address: str | None = None,
        ray_resources: dict[str, Any] | None = None,
        token: str | bool | None = None,
        local_files_only: bool | None = None,
        code_revision: str | None = None,
        engine: EngineName = "auto",
        engine_options: dict[str, Any] | None = None,
        max_model_len: int | None = None,
        sandbox: bool | None = None,
    ) -> None:
        self._open(model, ModelOptions.of(locals()), WorkerOptions.of(locals()),
                   tuple(preload), digest, max_model_len)

    def _open(self, model: str | os.PathLike[str] | Plan, options: ModelOptions,
              worker: WorkerOptions, preload: tuple[str, ...], digest: str | None,
              max_model_len: int | None) -> None:
        """Decide on the model (or take the ``Plan``), lay the workers out, start them."""
        if worker.backend == "local":  # what a worker would report as an exit code only
            check_main_guard("spawn" if worker.warm else worker.start_method)  # the zygote is spawned
        choose_engine(worker.engine, worker.backend,  # its refusals before any download
                      model.tasks if isinstance(model, Plan) else preload)
        plan = model if isinstance(model, Plan) else prepare(
            model, options, tasks=preload, device=worker.device, dtype=worker.dtype,
            digest=digest, local_device=worker.backend == "local")
        #: The engine the workers get, and why; either is laid out alike (``layout``).
        self.engine, self.engine_reason = choose_engine(worker.engine, worker.backend,
                                                        plan.tasks, plan.release)
        request = sandbox_request(worker, self.engine)  # before any model code runs
        bundle, decision, device = plan.bundle, plan.decision, plan.device
        release = for_workers(plan.release, worker.backend)  # local: made here, once
        count, threads = layout(device, worker.backend, worker.workers, worker.threads_per_worker,
                                cpus=cpus(), devices=devices(device, worker.backend),
                                ray_cpus=(worker.ray_resources or {}).get("num_cpus", 1))
        if decision.lock is not None:
            # The parent unpickles its workers' replies (results, errors of classes the
            # model defines): it must refuse what its workers would refuse, from now on,
            # as ``load(model, lock=...)`` here would.
            record(decision, units_of(bundle).values())
        #: The folder the workers build the model from (config, tokenizer, weights).
        self.model = str(plan.weights.root)
        self.max_model_len = max_model_len or model_context(plan.weights.root)
        #: The code decided on here; every worker, and every replacement, runs exactly it.
        self.digest = bundle.digest
        #: A fixed count per batch, in input order; ``None``: batches planned by tokens.
        self.batch_size = worker.batch_size
        #: Padded tokens and rows per planned batch (the device's defaults: ``batching``).
        self.max_batch_tokens, self.max_batch_size = batch_limits(device, worker.max_batch_tokens)
        self.max_retries = worker.max_retries
        self.startup_timeout = worker.startup_timeout
        self.batch_timeout = worker.batch_timeout
        self.warm = worker.warm
        self.backend = worker.backend
        choice = EngineChoice(self.engine, worker.generate_path,
                              tuple((worker.engine_options or {}).items()), request, release)
        bound = bindings(device, worker.backend, count, threads)
        specs = [WorkerSpec(self.model, plan.for_workers(),
                            device if worker.backend == "ray" else device_for(device, slot),
                            plan.dtype, threads, plan.tasks, self.digest, choice,
                            code=plan.code_folder, place=Placement(count, bound[slot]))
                 for slot in range(count)]
        transport: Transport
        if worker.backend == "ray":
            from .workers.ray_backend import RayTransport

            transport = RayTransport(plan.bundle, weights=plan.separate_weights,
                                     address=worker.address,
                                     resources=dict(worker.ray_resources or {}))
        else:
            transport = LocalTransport(worker.start_method, warm=worker.warm)
        self._scheduler = Scheduler(transport, specs, max_retries=worker.max_retries,
                                    startup_timeout=worker.startup_timeout,
                                    batch_timeout=worker.batch_timeout)
        self._closed = False
        self._scheduler.start()

    # -- lifecycle ------------------------------------------------------------------------

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """As ``concurrent.futures.Executor.shutdown``: no new work; with ``cancel_futures``
        what has not started is cancelled; with ``wait`` return once the workers stopped."""
        self._closed = True
        self._scheduler.shutdown(wait=wait, cancel=cancel_futures)

    def close(self) -> None:
        """Stop now: what is not done fails with ``BrokenExecutorError``; workers that do not
        stop within a few seconds are killed."""
        if not self._scheduler.alive and self._closed:
            return
        self._closed = True
        self._scheduler.shutdown(wait=True, abort=True)

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        """As ``concurrent.futures``: ``shutdown(wait=True)``, so what was submitted in the
        block completes, an error leaving it or not. But a ``KeyboardInterrupt`` or
        ``SystemExit`` leaving it stops now (``close``): a Ctrl-C does not wait for the rest."""
        if kind is not None and not issubclass(kind, Exception):
            self.close()
        else:
            self.shutdown(wait=True)

    def __del__(self) -> None:
        # At interpreter shutdown the modules close() needs may already be gone.
        with contextlib.suppress(Exception):
            self.close()

    @property
    def pids(self) -> list[int | None]:
        """Each worker's pid (``None`` while one is down); Ray actors' pids on their nodes."""
        return self._scheduler.pids

    @property
    def worker_info(self) -> list[dict[str, Any]]:
        """Each worker's ready message: ``classes``, ``generate_path`` and its reason (and
        with Ray its node and what reached it there)."""
        return self._scheduler.info()

    # -- scheduling -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._scheduler.failure is not None or self._closed:
            raise self._scheduler.failure or RuntimeError("this executor is closed")

    def _batches(self, work: Work, inputs: Sequence[Any], batch_size: int | None,
                 call: Call | None = None, shown: Sequence[Any] | None = None) -> list[Batch]:
        """A fixed ``batch_size``: consecutive batches of that many. Otherwise inputs of
        similar length, within windows of ``BATCH_WINDOW``, ``max_batch_tokens`` padded
        tokens a batch (generation counts the new tokens of every row), cut into batches of
        about equal cost, a multiple of workers x ``PIPELINE`` (``batching``): each worker
        runs one while the next waits in its queue, so fewer would leave a worker idle.
        Each batch carries ``work`` for its own inputs; ``shown``: the inputs as the caller
        gave them, which a failed batch's error names (``inputs``: what the worker gets)."""
        size = batch_size or self.batch_size
        if isinstance(work, Complete):
            plan = grouped_batches(inputs, work.defaults, size, self._plan, BATCH_WINDOW,
                                   context=self.max_model_len)  # over it: nothing is sent
        elif size:
            plan = fixed_batches(len(inputs), size)
        else:
            plan = self._plan([estimate_tokens(x) for x in inputs], generating=False)
        owner = call or Call(len(inputs))  # (no call: only the plan is looked at)
        named = inputs if shown is None else shown
        return [Batch(indices, work.part([inputs[i] for i in indices]),
                      [named[i] for i in indices], owner) for indices in plan]

    def _plan(self, lengths: Sequence[int], *, generating: bool = True) -> list[list[int]]:
        budget, spread = self.max_batch_tokens, len(self._scheduler.specs) * PIPELINE
        size = self.max_batch_size
        if generating and self._decoding(streams=True):
            # Each worker merges the batches in its pipe into one decode
            # loop (stream.py), STREAM_DEPTH at a time: small batches keep its rows full, and
            # come back one by one as their rows end (a first result long before the last).
            size = max(1, size // STREAM_DEPTH)
            budget, spread = max(lengths, default=1) * size, len(self._scheduler.specs)
        elif generating and self._decoding():
            # Ray actors that decode, one call at a time (they do not stream): the loop pads
            # nothing across the rows it refills and drops rows as they end, so a batch is
            # sized by rows (its KV cache is bounded in the worker, decode.rows_for): one
            # batch a worker at a time, as wide as the planner allows.
            budget, spread = max(lengths, default=1) * self.max_batch_size, len(self._scheduler.specs)
        return plan_batches(lengths, max_batch_tokens=budget, max_batch_size=size,
                            window=BATCH_WINDOW, spread=spread)

    def _decoding(self, *, streams: bool = False) -> bool:
        """Whether every worker generates with the decode loop (``decode.py``) or vLLM
        (``vllm_engine.py``), and with ``streams`` merges its batches into one running batch
        (``stream.py``, ``VllmStream``)."""
        info = self._scheduler.info()
        return bool(info) and all(i.get("generate_path") in ("decode", "vllm") and
                                  (not streams or i.get("streams")) for i in info)

    def _submit(self, work: Work, inputs: Sequence[Any], batch_size: int | None, *,
                stream: bool, shown: Sequence[Any] | None = None) -> Call:
        self._check_open()
        call = Call(len(inputs), stream=stream)
        self._scheduler.submit(self._batches(work, inputs, batch_size, call, shown))
        return call

    def _iterate(self, work: Work, inputs: Sequence[Any], batch_size: int | None,
                 shown: Sequence[Any] | None = None) -> Iterator[Outcome]:
        return self._scheduler.iterate(self._submit(work, inputs, batch_size, stream=True,
                                                    shown=shown))

    def _result(self, call: Call) -> list[Any]:
        return call.future.result()

    # -- the API --------------------------------------------------------------------------

    def _plain(self, prompts: Sequence[str], options: Mapping[str, Any]) -> tuple[Complete, list[Request]]:
        """A ``generate`` without ``params``: its ``model.generate`` keywords as the call's
        parameters (``SamplingParams.from_generate_options``), plain strings back."""
        temperature = next((i["temperature"] for i in self._scheduler.info()
                            if i.get("temperature") is not None), None)
        params = SamplingParams.from_generate_options(options, temperature)
        return Complete((), params, texts=True), [Request(prompt=p) for p in prompts]

    def generate_iter(self, prompts: Sequence[str], params: Params = None, *,
                      batch_size: int | None = None, **options: Any) -> Iterator[Outcome]:
        """``generate``'s results as they complete (any order); see ``Outcome``. Work starts
        at once; closing the iterator early cancels what has not been sent."""
        if params is None:
            work, requests = self._plain(prompts, options)
            return self._iterate(work, requests, batch_size, shown=prompts)
        _no_options(options)
        return self.complete_iter([Request(prompt=p) for p in prompts], params,
                                  batch_size=batch_size)

    @overload
    def generate(self, prompts: Sequence[str], params: None = None, *,
                 batch_size: int | None = None, **options: Any) -> list[str]: ...

    @overload
    def generate(self, prompts: Sequence[str], params: SamplingParams | Sequence[SamplingParams],
                 *, batch_size: int | None = None) -> list[GenerateResult]: ...

    def generate(self, prompts: Sequence[str], params: Params = None, *,
                 batch_size: int | None = None, **options: Any) -> list[Any]:
        """Complete each prompt.

        With ``params`` (one ``SamplingParams`` for all, or one per prompt, as vLLM's
        ``LLM.generate``): a ``GenerateResult`` per prompt (text, finish reason, token
        counts, logprobs), unset parameters taken from the model's ``generation_config``.
        Without: plain strings, ``options`` in ``model.generate``'s words (``max_new_tokens``,
        ``min_new_tokens``, ``do_sample``, ``temperature``, ``top_p``, ``top_k``, ``min_p``,
        ``repetition_penalty``), the same request underneath
        (``SamplingParams.from_generate_options``); another keyword raises
        ``SamplingParamsError``. Sampling as the model's ``generation_config`` says when
        neither ``do_sample`` nor ``temperature`` is given (greedy when it says nothing).
        """
        if params is None:
            work, requests = self._plain(prompts, options)
            return self._result(self._submit(work, requests, batch_size, stream=False,
                                             shown=prompts))
        _no_options(options)
        return self.complete([Request(prompt=p) for p in prompts], params,
                             batch_size=batch_size)

    def chat(self, messages: Conversation | Sequence[Conversation], params: Params = None, *,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             batch_size: int | None = None) -> list[GenerateResult]:
        """Answer each conversation (a list of ``{"role", "content"}`` messages; one
        conversation or a list of them), rendered by the model's chat template
        (``chat_template``: a Jinja template instead). ``params`` as for ``generate``."""
        return self.complete([Request(messages=tuple(c),
                                      add_generation_prompt=add_generation_prompt)
                              for c in conversations(messages)], params,
                             batch_size=batch_size, chat_template=chat_template)

    def _requests(self, requests: Sequence[Request], params: Params) -> list[Request]:
        """Each request with its own parameters: ``params`` one for all, or one each."""
        if isinstance(params, SamplingParams) or params is None:
            return list(requests)
        if len(params) != len(requests):
            raise ValueError(f"{len(params)} SamplingParams for {len(requests)} requests: "
                             "give one for all, or one per request")
        return [Request(r.prompt, r.messages, p, r.add_generation_prompt, r.template_kwargs)
                for r, p in zip(requests, params, strict=True)]

    def complete_iter(self, requests: Sequence[Request], params: Params = None, *,
                      batch_size: int | None = None,
                      chat_template: str | None = None) -> Iterator[Outcome]:
        """``complete``'s results as they come (any order; see ``Outcome``)."""
        defaults = params if isinstance(params, SamplingParams) else None
        return self._iterate(Complete((), defaults, chat_template),
                             self._requests(requests, params), batch_size)

    def complete(self, requests: Sequence[Request], params: Params = None, *,
                 batch_size: int | None = None,
                 chat_template: str | None = None) -> list[GenerateResult]:
        """A ``GenerateResult`` per ``Request`` (a prompt or chat messages, each with its own
        ``SamplingParams`` or none); a single ``params`` is the default of every request
        that leaves a field unset (``run``'s flags), a sequence one per request."""
        defaults = params if isinstance(params, SamplingParams) else None
        return self._result(self._submit(Complete((), defaults, chat_template),
                                         self._requests(requests, params), batch_size,
                                         stream=False))

    def embed_iter(self, texts: Sequence[str], *, pooling: str = "mean",
                   batch_size: int | None = None) -> Iterator[Outcome]:
        return self._iterate(Embed((), pooling), texts, batch_size)

    def embed(self, texts: Sequence[str], *, pooling: str = "mean",
              batch_size: int | None = None) -> list[list[float]]:
        """One vector per text: ``mean`` (attention-masked), ``cls`` or ``last`` pooling."""
        return self._result(self._submit(Embed((), pooling), texts, batch_size, stream=False))

    def score_iter(self, texts: Sequence[str], *, batch_size: int | None = None) -> Iterator[Outcome]:
        return self._iterate(Score(()), texts, batch_size)

    def score(self, texts: Sequence[str], *, batch_size: int | None = None) -> list[dict[str, Any]]:
        """Per text: ``tokens``, ``token_logprobs`` (of each token after the first), ``logprob``."""
        return self._result(self._submit(Score(()), texts, batch_size, stream=False))

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        """Run ``fn(worker, *args, **kwargs)`` on one free worker; a ``Future`` of its result.

        As ``concurrent.futures.Executor.submit``, with the worker (``models``,
        ``tokenizer``, ``classes``, ``spec``, ``generate``/``embed``/``score``) as the
        first argument. ``fn`` must be importable by name. An exception ``fn`` raises is
        the future's; a worker that dies running it is replaced and ``fn`` sent again,
        up to ``max_retries`` times.
        """
        self._check_open()
        call = Call(1)
        self._scheduler.submit([Batch([0], Rpc(fn, args, kwargs), [args], call,
                                      final_errors=True)])
        outer: Future[Any] = Future()

        def relay(done: Future[list[Any]]) -> None:
            if done.cancelled():
                outer.cancel()
            elif done.exception() is not None:
                outer.set_exception(done.exception())
            else:
                outer.set_result(done.result()[0])

        outer.add_done_callback(lambda f: f.cancelled() and call.future.cancel())
        call.future.add_done_callback(relay)
        return outer

    def map(self, fn: Callable[..., Any], *iterables: Iterable[Any],
            timeout: float | None = None, chunksize: int = 1) -> Iterator[Any]:
        """As ``concurrent.futures.Executor.map``: ``fn(worker, *items)`` for each tuple of
        items, results in order; ``chunksize`` is accepted for the signature, and ignored."""
        futures = [self.submit(fn, *items) for items in zip(*iterables, strict=False)]

        def results() -> Iterator[Any]:
            try:
                for future in futures:
                    yield future.result(timeout=timeout)
            finally:
                for future in futures:
                    future.cancel()

        return results()

    def collective_rpc(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``func(worker, *args, **kwargs)`` on every worker; one result per worker.

        For control messages only; ``func`` is module-level, ``worker`` has ``models``,
        ``tokenizer``, ``classes``, ``spec``. The first error is raised (a death: ``WorkerError``).
        """
        self._check_open()
        calls = [Call(1) for _ in self._scheduler.specs]
        self._scheduler.submit([Batch([0], Rpc(func, args, kwargs), [], call, slot=slot)
                                for slot, call in enumerate(calls)])
        return [call.future.result()[0] for call in calls]


def _no_options(options: dict[str, Any]) -> None:
    if options:
        raise TypeError(f"generate() with params takes no model.generate options "
                        f"({', '.join(sorted(options))}): set them in SamplingParams")
