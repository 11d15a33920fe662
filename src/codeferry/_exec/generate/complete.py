"""Generation per request, inside a worker: parameters → groups → ``generate`` calls → results.

A batch arrives as ``Request`` values (``params``), each with its own ``SamplingParams``.
The worker

1. renders each request: a ``prompt`` is tokenized as it is (special tokens added, as
   vLLM's completions do), chat ``messages`` through the chat template (the request's, the
   call's ``chat_template``, or the tokenizer's: ``ChatTemplateMissingError`` when none),
   tokenized without adding special tokens (the template holds them; vLLM does the same);
2. resolves each request's parameters over the call's defaults and the model's
   ``generation_config`` (``params.resolve``) and groups them (``params.group_key``):
   each group is one ``generate`` call over left-padded rows, run to the group's longest
   ``max_tokens``; a seeded request is a group of its own, under its own seed
   (``torch.random.fork_rng``), so its text is the same alone or in any batch;
3. cuts each row at its end (``_finish``): the first end-of-sequence or stop token (in the
   token ids and counted, not in the text, as vLLM does), its own ``max_tokens``, or the
   first stop string (the text ends before it; the tokens up to the one that completed it
   are counted).

A worker that decodes (``stream.py``) runs steps 1 and 2 (``plan``) as a batch arrives, its
groups the loop does (``loop_rows``) in its running decode loop, and step 3 as they end.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from ...errors import ChatTemplateMissingError
from .params import (
    Completion,
    GenerateResult,
    Request,
    Resolved,
    SamplingParams,
    cut_at_stop,
    eos_ids,
    group_key,
    resolve,
)

__all__ = ["Generator", "Planned", "Planner", "Renderer", "Requests", "complete", "loop_rows", "plan"]


class Renderer(Protocol):
    """What ``plan`` reads of an engine: its tokenizer and the model's generation defaults."""

    @property
    def tokenizer(self) -> Any: ...

    def generation_config(self) -> Any: ...


class Planner(Renderer, Protocol):
    """What ``loop_rows`` reads of an engine besides: the path it generates on."""

    @property
    def generate_path(self) -> tuple[str, str] | None: ...


class Generator(Planner, Protocol):
    """What ``complete`` reads of an engine besides: the model."""

    def model_for(self, kind: str) -> Any: ...


class Requests(Protocol):
    """A batch to generate (``engines.base.Complete``): requests over the call's defaults."""

    @property
    def requests(self) -> Sequence[Request]: ...

    @property
    def defaults(self) -> SamplingParams | None: ...

    @property
    def chat_template(self) -> str | None: ...

#: What of the model's ``generation_config`` is a default of ``SamplingParams``.
_MODEL_DEFAULTS = ("do_sample", "temperature", "top_p", "top_k", "min_p", "max_new_tokens",
                   "min_new_tokens", "repetition_penalty")


class _Penalties:
    """OpenAI's presence and frequency penalties, as vLLM applies them: on the raw logits,
    counting only the tokens generated so far (``prompt_width`` on, padding excluded)."""

    def __init__(self, presence: float, frequency: float, prompt_width: int) -> None:
        self.presence, self.frequency, self.width = presence, frequency, prompt_width

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        generated = input_ids[:, self.width:]
        if generated.shape[1] == 0:
            return scores
        counts = torch.zeros_like(scores).scatter_add_(
            1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - counts * self.frequency - (counts > 0).to(scores.dtype) * self.presence


def render(tokenizer: Any, request: Request, chat_template: str | None) -> tuple[str, list[int]]:
    """The prompt text the model sees, and its token ids."""
    if request.messages is None:
        text = request.prompt or ""
        return text, list(tokenizer(text)["input_ids"])
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ChatTemplateMissingError(
            f"a chat request (messages) for a model whose tokenizer "
            f"({type(tokenizer).__name__}) has no chat template.",
            fix="pass a Jinja chat template: --chat-template FILE (chat_template= in Python), "
            "or send a prompt instead of messages.")
    text = str(tokenizer.apply_chat_template(
        [dict(m) for m in request.messages], chat_template=template, tokenize=False,
        add_generation_prompt=request.add_generation_prompt, **request.template_kwargs))
    return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])


Row = list[tuple[list[int], list[dict[str, Any]] | None]]


@dataclass
class Planned:
    """A batch of requests rendered, resolved and grouped (steps 1 and 2), its results
    filled in group by group (step 3)."""

    rendered: list[tuple[str, list[int]]]
    resolved: list[Resolved]
    ends: list[int]
    #: The requests of each ``generate`` call, by index.
    groups: list[list[int]]
    results: list[GenerateResult | None]

    def fill(self, tokenizer: Any, members: list[int], rows: list[Row]) -> None:
        """Step 3 for one group: ``rows``, per member, its rows of tokens and logprobs."""
        for i, row in zip(members, rows, strict=True):
            completions = tuple(_finish(tokenizer, tokens, lp, self.resolved[i], self.ends)
                                for tokens, lp in row)
            self.results[i] = GenerateResult(len(self.rendered[i][1]), completions,
                                             self.rendered[i][0])

    def done(self) -> list[GenerateResult]:
        return [r for r in self.results if r is not None]


def plan(engine: Renderer, requests: Sequence[Request], defaults: SamplingParams | None,
         chat_template: str | None) -> Planned:
    """Steps 1 and 2 of the module docstring."""
    tokenizer = engine.tokenizer
    rendered = [render(tokenizer, r, chat_template) for r in requests]
    config = engine.generation_config()
    from_model = {name: getattr(config, name, None) for name in _MODEL_DEFAULTS}
    resolved = [resolve((r.params or SamplingParams()).over(defaults), from_model)
                for r in requests]
    ends = eos_ids(config.eos_token_id if config.eos_token_id is not None
                   else tokenizer.eos_token_id)
    groups: dict[tuple[Any, ...], list[int]] = {}
    for index, params in enumerate(resolved):
        groups.setdefault(group_key(params, index), []).append(index)
    return Planned(rendered, resolved, ends, list(groups.values()), [None] * len(requests))


def complete(engine: Generator, requests: Sequence[Request], defaults: SamplingParams | None,
             chat_template: str | None, planned: Planned | None = None) -> list[GenerateResult]:
    """One ``GenerateResult`` per request, in order (see the module docstring);
    ``planned``: the batch already planned (``plan``: a stream that did not take it)."""
    planned = planned or plan(engine, requests, defaults, chat_template)
    model = engine.model_for("generate")
    if any(r.structured is not None for r in planned.resolved):
        from .structured import check

        check(engine.tokenizer, model, [r.structured for r in planned.resolved])
    for members in planned.groups:
        planned.fill(engine.tokenizer, members, _generate(
            engine, model, [planned.rendered[i][1] for i in members],
            [planned.resolved[i] for i in members], planned.ends))
    return planned.done()


def loop_rows(engine: Planner, group: list[Resolved], ends: list[int]) -> list[Any] | None:
    """The decode loop's ``RowOptions`` for a group, or ``None`` when the loop does not do
    it (``n`` above 1, logprobs, penalties, ``min_p``: ``generate`` does those). A sampled
    row draws from its own generator when it has a seed: the same seed, the same tokens; a
    structured row is masked by its own matcher (``structured.Mask``)."""
    first = group[0]
    assert engine.generate_path is not None  # set when the model was built
    if (engine.generate_path[0] != "decode" or first.n != 1 or first.logprobs is not None
            or first.repetition_penalty != 1.0 or first.presence_penalty
            or first.frequency_penalty or (first.do_sample and first.min_p)):
        return None
    from .decode import RowOptions

    stops = tuple(sorted(set(ends) | set(first.stop_token_ids)))
    return [RowOptions(max_new_tokens=p.max_tokens, eos=stops,
                       min_new_tokens=min(p.min_tokens or 0, p.max_tokens),
                       do_sample=p.do_sample, temperature=p.temperature if p.do_sample else 1.0,
                       top_k=p.top_k if p.do_sample else 0,
                       top_p=p.top_p if p.do_sample else 1.0, seed=p.seed,
                       structured=p.structured) for p in group]




def _generate(engine: Generator, model: Any, prompts: list[list[int]], group: list[Resolved],
              ends: list[int]) -> list[Row]:
    """Per request, its ``n`` rows of new tokens (and logprobs): one ``generate`` call."""
    import torch

    from .generation import (
        continuous_supports,
        echoes_prompt,
        generate_continuous,
        lighter_min_new_tokens,
        pads_safely,
    )

    first, new = group[0], max(p.max_tokens for p in group)
    pad = engine.tokenizer.pad_token_id
    pad = 0 if pad is None else int(pad)
    stops = sorted(set(ends) | set(first.stop_token_ids))
    options: dict[str, Any] = {"max_new_tokens": new, "pad_token_id": pad}
    if first.min_tokens:
        options["min_new_tokens"] = min(first.min_tokens, new)
    plain = (first.n == 1 and first.logprobs is None and first.repetition_penalty == 1.0
             and not first.presence_penalty and not first.frequency_penalty
             and not first.stop_token_ids and first.structured is None)
    looped = loop_rows(engine, group, ends)
    assert engine.generate_path is not None  # set when the model was built
    if looped is not None:
        # the decode loop (decode.py): each row to its own max_tokens, ended rows leave
        from .decode import decode

        return [[(row, None)] for row in decode(model, prompts, looped, pad_token_id=pad,
                                                tokenizer=engine.tokenizer)]
    if engine.generate_path[0] == "continuous" and plain and not first.do_sample \
            and continuous_supports(options):
        rows = generate_continuous(model, prompts, options, ends or None)
        return [[(row, None)] for row in rows]
    if len({len(p) for p in prompts}) > 1 and pads_safely(
            model, min(prompts, key=len), max(prompts, key=len), pad) is False:
        return _by_length(engine, model, prompts, group, ends)
    # greedy: the n completions are one (transformers refuses n > 1 without sampling)
    n = first.n if first.do_sample else 1
    options.update(do_sample=first.do_sample, num_return_sequences=n,
                   repetition_penalty=first.repetition_penalty)
    if stops:
        options["eos_token_id"] = stops
    if first.do_sample:
        options.update(temperature=first.temperature, top_p=first.top_p, top_k=first.top_k,
                       min_p=first.min_p or None)
    width = max(len(p) for p in prompts)
    device = model.device
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    # the width of the prompt in what generate returns and its processors see (none: the
    # model's generate returns and sees the new tokens only)
    seen = width if echoes_prompt(model, pad) else 0
    processors: list[Any] = []
    if first.structured is not None:
        processors += _constrained(engine, model, first, seen, set(stops), options)
    if first.presence_penalty or first.frequency_penalty:
        processors.insert(1 if first.structured is not None else 0, _Penalties(
            first.presence_penalty, first.frequency_penalty, seen))
    if processors:
        from transformers import LogitsProcessorList

        options["logits_processor"] = LogitsProcessorList(processors)
    options = lighter_min_new_tokens(options, seen, model.generation_config)
    if first.logprobs is not None:
        options.update(return_dict_in_generate=True, output_logits=True)
    with torch.inference_mode(), _seeded(first, device):
        out = model.generate(input_ids=ids, attention_mask=mask, **options)
    sequences = out.sequences if first.logprobs is not None else out
    tokens = sequences[:, seen:].tolist()
    picked = _logprobs(engine.tokenizer, out, sequences[:, seen:],
                       max(p.logprobs or 0 for p in group)) if first.logprobs is not None else None
    return [[(tokens[i * n + j % n], None if picked is None else picked[i * n + j % n])
             for j in range(first.n)] for i in range(len(prompts))]


def _by_length(engine: Generator, model: Any, prompts: list[list[int]], group: list[Resolved],
               ends: list[int]) -> list[Row]:
    """``_generate`` once per prompt length, with no padding: for a model whose tokens left
    padding changes (``generation.pads_safely``)."""
    out: list[Row] = [[] for _ in prompts]
    for length in sorted({len(p) for p in prompts}):
        at = [i for i, p in enumerate(prompts) if len(p) == length]
        rows = _generate(engine, model, [prompts[i] for i in at], [group[i] for i in at], ends)
        for i, row in zip(at, rows, strict=True):
            out[i] = row
    return out


def _constrained(engine: Generator, model: Any, first: Resolved, width: int, ends: set[int],
                 options: dict[str, Any]) -> list[Any]:
    """The logits processors of a structured group: the grammar's mask first, then, when it
    samples, temperature, top-k, top-p and min-p. ``generate`` runs custom processors after
    its own, and a top-k taken before the mask could keep only tokens the grammar forbids;
    so ``generate``'s own are turned off (``options``) and run here, after the mask."""
    from .structured import Constrained, grammars

    assert first.structured is not None
    found: list[Any] = [Constrained(grammars(engine.tokenizer, model), first.structured, width,
                                    ends)]
    if first.do_sample:
        from transformers import (
            MinPLogitsWarper,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        options.update(temperature=1.0, top_k=0, top_p=1.0, min_p=None)
        if first.temperature != 1.0:
            found.append(TemperatureLogitsWarper(first.temperature))
        if first.top_k:
            found.append(TopKLogitsWarper(first.top_k))
        if first.top_p < 1.0:
            found.append(TopPLogitsWarper(first.top_p))
        if first.min_p:
            found.append(MinPLogitsWarper(first.min_p))
    return found


@contextmanager
def _seeded(params: Resolved, device: Any) -> Iterator[None]:
    """Sampling under the request's own seed, the process's random state left as it was."""
    if params.seed is None or not params.do_sample:
        yield
        return
    import torch

    cuda = [device] if getattr(device, "type", "cpu") == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(params.seed)
        yield


def _logprobs(tokenizer: Any, out: Any, chosen: Any, top: int) -> list[list[dict[str, Any]]]:
    """Per row and step: the chosen token's logprob (of the raw logits, as vLLM's default
    ``raw_logprobs``) and the ``top`` most likely tokens."""
    import torch

    logits = torch.stack(out.logits, dim=1).float()  # (rows, steps, vocab)
    logp = torch.log_softmax(logits, dim=-1)
    values = logp.gather(-1, chosen.unsqueeze(-1)).squeeze(-1).tolist()
    best = torch.topk(logp, top, dim=-1) if top else None
    rows: list[list[dict[str, Any]]] = []
    for r, row in enumerate(chosen.tolist()):
        steps = []
        for s, token in enumerate(row):
            entry: dict[str, Any] = {"token": tokenizer.decode([token]),
                                     "token_id": token, "logprob": values[r][s], "top": []}
            if best is not None:
                entry["top"] = [{"token": tokenizer.decode([t]), "token_id": t,
                                 "logprob": v} for t, v in zip(best.indices[r, s].tolist(),
                                                               best.values[r, s].tolist(),
                                                               strict=True)]
            steps.append(entry)
        rows.append(steps)
    return rows


def _finish(tokenizer: Any, row: list[int], logprobs: list[dict[str, Any]] | None,
            params: Resolved, ends: list[int]) -> Completion:
    """One completion cut at its end: a stop token, ``max_tokens``, or a stop string."""
    row = row[:params.max_tokens]
    finish = "length"
    reason: str | int | None = None
    stops = set(ends) | set(params.stop_token_ids)
    for at, token in enumerate(row):
        if token in stops:
            row = row[:at + 1]
            finish = "stop"
            reason = token if token in params.stop_token_ids and token not in ends else None
            break
    # a stop token (end of sequence too) is counted, not shown: as vLLM's detokenizer
    text = str(tokenizer.decode(row[:-1] if finish == "stop" else row, skip_special_tokens=True))
    if params.stop:
        cut, which = cut_at_stop(text, params.stop)
        if which is not None:
            for k in range(1, len(row) + 1):  # the token that completed the stop string
                if cut_at_stop(str(tokenizer.decode(row[:k], skip_special_tokens=True)),
                               params.stop)[1] is not None:
                    row = row[:k]
                    break
            text, finish, reason = cut, "stop", which
    return Completion(text, tuple(row), finish,  # type: ignore[arg-type]  # a FinishReason
                      reason, None if logprobs is None else tuple(logprobs[:len(row)]))
