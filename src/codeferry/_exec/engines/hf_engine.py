"""transformers as an executor worker's engine (the default): the model's own modeling code,
built on first use of each kind of request, generating on the path ``stream.choose`` picks
(the decode loop, continuous batching or ``generate``). ``vllm_engine`` is the other
engine; ``workers.worker.build_engine`` picks between them; ``base.Engine`` is what both
answer.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping, Sequence
from typing import Any

from ... import _settings
from ..generate.complete import Planned
from ..generate.params import GenerateResult, Request, SamplingParams
from .base import Complete
from .spec import WorkerSpec

__all__ = ["GENERATING_HEADS", "TransformersEngine", "bind_cores"]

#: The ``auto_map`` keys that may generate, in the order a worker looks for one.
GENERATING_HEADS = ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModel")


def bind_cores(cores: tuple[int, ...]) -> tuple[int, ...]:
    """Bind this thread, and the threads it starts from now on, to ``cores`` (a worker, before
    torch starts its own); the cores it then runs on, or none when there were none to bind
    to or the OS refused them (a cpuset changed since the parent looked): every core."""
    if not cores:
        return ()
    try:
        os.sched_setaffinity(0, cores)
    except (OSError, ValueError):
        return ()
    return tuple(sorted(os.sched_getaffinity(0)))


class TransformersEngine:
    """The models of one worker, built on first use of each kind of request."""

    def __init__(self, spec: WorkerSpec) -> None:
        import torch
        from transformers.utils import logging as hf_logging

        from ..._load import load_pinned, load_with

        hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]  # load reports of heads a task does not use
        #: The cores it is bound to (``layout.cores``), before torch starts its threads.
        self.cores = bind_cores(spec.place.cores)
        torch.set_num_threads(max(1, spec.threads))
        self.spec = spec
        self.models: dict[str, Any] = {}
        #: Linear layers packed for oneDNN, per model (``packing.py``; CPU only).
        self.packed: dict[str, int] = {}
        self._accepted: dict[int, tuple[set[str], bool]] = {}
        #: (path, why) once the generate model is built: see ``stream.choose``.
        self.generate_path: tuple[str, str] | None = None
        #: ``config=`` for ``from_pretrained`` when the code is another revision's: ``model``'s
        #: config built by the loaded config class, so that transformers neither reads the
        #: code of ``model``'s own revision nor asks which config class owns its model_type.
        self._with_config: dict[str, Any] = {}
        code, options = spec.code or spec.model, spec.options
        if not spec.serve:
            # ``codeferry doctor``: the code arrives with the config, by ticket, first; a
            # lock binds this process before anything arrives.
            self.classes = (load_pinned(code, str(spec.digest), options)
                            if options.lock is not None else {})
            return
        if spec.digest is None:
            self.classes = load_with(code, options)
        else:
            self.classes = load_pinned(code, spec.digest, options)
        config_class: Any = self.classes.get("AutoConfig")
        if spec.code not in (None, spec.model) and config_class is not None:
            self._with_config["config"] = config_class.from_pretrained(spec.model)
        self.load_tokenizer()
        for kind in spec.preload:
            self.model_for(kind)

    def load_tokenizer(self, config: Any = None) -> None:
        """``AutoTokenizer`` of the model's folder, with a pad token (batches are padded).
        ``config``: the model's config, built by the loaded code (the doctor has it)."""
        from transformers import AutoTokenizer

        if config is not None and self.spec.code not in (None, self.spec.model):
            self._with_config["config"] = config
        self.tokenizer = AutoTokenizer.from_pretrained(
            self.spec.model, revision=self.spec.options.revision, **self._with_config)
        if self.tokenizer.pad_token is None:
            fallback = self.tokenizer.eos_token or self.tokenizer.unk_token
            if fallback is not None:
                self.tokenizer.pad_token = fallback

    def head_for(self, kind: str) -> str:
        """The ``auto_map`` key whose class serves ``kind``: ``AutoModel`` embeds; ``score``
        reads a causal LM's logits; ``generate`` takes the first generative head the model
        maps, ``AutoModelForCausalLM``, else ``AutoModelForSeq2SeqLM``, else an ``AutoModel``
        class with ``generate`` (ChatGLM-6B maps only those two, to its causal LM)."""
        if kind == "embed":
            return "AutoModel"
        if kind != "generate" or "AutoModelForCausalLM" in self.classes:
            return "AutoModelForCausalLM"
        for key in GENERATING_HEADS[1:]:
            if hasattr(self.classes.get(key), "generate"):
                return key
        return "AutoModelForCausalLM"  # a native head, or the model's own class's error

    def model_for(self, kind: str) -> Any:
        import torch
        import transformers

        key = self.head_for(kind)
        auto = getattr(transformers, key)
        failed = getattr(self.classes, "failed", {})
        if key in failed:  # the model's own class could not load: say why, not "not found"
            raise failed[key]
        if key not in self.models:
            # only a dtype asked for, in the word this release reads (``dtype`` where its
            # configs have one, ``torch_dtype`` before): an unknown keyword reaches the
            # model's own ``__init__``, which remote code written for transformers 4 refuses
            dtype = {} if not self.spec.dtype else {
                "dtype" if hasattr(transformers.PretrainedConfig, "dtype") else "torch_dtype":
                getattr(torch, self.spec.dtype)}
            self.adopt(kind, auto.from_pretrained(self.spec.model,
                                                  revision=self.spec.options.revision,
                                                  **dtype, **self._with_config))
        return self.models[key]

    def adopt(self, kind: str, model: Any) -> None:
        """Serve ``kind`` with ``model`` (built by ``model_for``, or by the doctor from the
        config): on the device, in eval mode; for ``generate`` the path it takes
        (``stream.choose``, which needs the tokenizer's pad token)."""
        key = self.head_for(kind)
        self.models[key] = model.to(self.spec.device).eval()
        if self.spec.device.split(":")[0] == "cpu" and _settings.cpu_pack_enabled():
            from ..generate.packing import pack_linears

            self.packed[key] = pack_linears(self.models[key], sharing=self.spec.place.sharing)
        if kind == "generate":
            from ..generate.stream import choose

            self.generate_path = choose(self.models[key], self.spec.engine.generate_path,
                                        self.spec.device, self.tokenizer.pad_token_id)
            if self.generate_path[0] == "batched":
                from ..generate.generation import padding_note

                pad = self.tokenizer.pad_token_id
                path, why = self.generate_path
                self.generate_path = path, why + padding_note(
                    self.models[key], self.tokenizer, 0 if pad is None else int(pad))

    def info(self) -> dict[str, Any]:
        """What the ready message tells the parent: classes, and how ``generate`` runs."""
        path, why = self.generate_path or (None, "generate is not preloaded")
        model = self.models.get(self.head_for("generate"))
        temperature = getattr(getattr(model, "generation_config", None), "temperature", None)
        return {"classes": sorted(self.classes), "generate_path": path, "generate_reason": why,
                "packed_linears": sum(self.packed.values()), "engine": "transformers",
                "temperature": temperature, "cores": list(self.cores)}

    def _encode(self, texts: Sequence[str], *, left: bool, model: Any) -> tuple[Any, Any]:
        """Model inputs (only those ``forward`` takes), and the attention mask."""
        self.tokenizer.padding_side = "left" if left else "right"
        enc = self.tokenizer(texts, return_tensors="pt", padding=True)
        # Tokenizers of BERT lineage also return token_type_ids, which a causal LM's
        # forward (and generate's kwarg check) refuses: pass only what forward takes.
        if id(model) not in self._accepted:  # inspect.signature costs ~0.1 ms a call
            parameters = inspect.signature(model.forward).parameters
            self._accepted[id(model)] = (set(parameters), any(
                p.kind is p.VAR_KEYWORD for p in parameters.values()))
        accepted, takes_any = self._accepted[id(model)]
        inputs = {k: v.to(self.spec.device) for k, v in enc.items()
                  if k in accepted or (takes_any and k != "token_type_ids")}
        inputs.setdefault("input_ids", enc["input_ids"].to(self.spec.device))
        return inputs, enc["attention_mask"].to(self.spec.device)

    def generation_config(self) -> Any:
        """The generate model's ``generation_config``: the defaults requests resolve over."""
        return self.model_for("generate").generation_config

    def stream(self) -> Any:
        """A ``stream.Stream`` when this worker generates with the decode loop, else ``None``."""
        if self.generate_path is None or self.generate_path[0] != "decode":
            return None
        from ..generate.stream import Stream

        return Stream(self.model_for("generate"), self.tokenizer)

    def complete(self, work: Complete, planned: Planned | None = None) -> list[GenerateResult]:
        """``work``'s ``GenerateResult`` values: see ``generate.complete``."""
        from ..generate.complete import complete

        return complete(self, work.requests, work.defaults, work.chat_template, planned)

    def generate(self, texts: Sequence[str], options: Mapping[str, Any] | None = None) -> list[str]:
        """Plain texts for ``texts``, ``options`` as ``Executor.generate``'s keywords: for a
        function sent to the worker (``Executor.submit``)."""
        config = self.generation_config()
        params = SamplingParams.from_generate_options(options or {}, config.temperature)
        work = Complete([Request(prompt=t) for t in texts], params, texts=True)
        return work.answer(self.complete(work))

    def embed(self, texts: Sequence[str], pooling: str) -> list[list[float]]:
        import torch

        model = self.model_for("embed")
        enc, attention = self._encode(texts, left=False, model=model)
        with torch.inference_mode():
            hidden = model(**enc).last_hidden_state
        mask = attention.unsqueeze(-1).to(hidden.dtype)
        if pooling == "mean":
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        elif pooling == "cls":
            pooled = hidden[:, 0]
        elif pooling == "last":
            last = attention.sum(1) - 1
            pooled = hidden[torch.arange(hidden.shape[0]), last]
        else:
            raise ValueError(f"unknown pooling {pooling!r}: use 'mean', 'cls' or 'last'")
        return [row.float().tolist() for row in pooled]

    def score(self, texts: Sequence[str]) -> list[dict[str, Any]]:
        import torch

        model = self.model_for("score")
        enc, attention = self._encode(texts, left=False, model=model)
        with torch.inference_mode():
            logits = model(**enc).logits.float()
        logprobs = torch.log_softmax(logits[:, :-1], dim=-1)
        targets = enc["input_ids"][:, 1:]
        picked = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        mask = attention[:, 1:].bool()
        results = []
        for row in range(len(texts)):
            ids = targets[row][mask[row]].tolist()
            values = picked[row][mask[row]].tolist()
            results.append({
                "tokens": self.tokenizer.convert_ids_to_tokens(ids),
                "token_logprobs": values,
                "logprob": float(sum(values)),
            })
        return results
