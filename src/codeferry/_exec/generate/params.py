"""Per-request generation: the parameters (``SamplingParams``), what a request is, what comes back.

Pure: no torch, no I/O. The worker turns these values into ``generate`` calls
(``generation.complete``); the parent plans batches with ``group_key``, so that requests
that can share one ``generate`` call land in the same batch.

The path a request takes, in order::

    SamplingParams (request) ─┐
    SamplingParams (defaults: --temperature ..., run(params=)) ─┼─▶ resolve() ─▶ Resolved
    the model's generation_config (only what it sets) ─────────┘        │
                                                                        ▼
                            group_key(): requests with equal keys share one generate call
                                                                        │
                                                                        ▼
                            generate ─▶ new tokens ─▶ finish() cuts each row at its end
                            (end of sequence, a stop token, a stop string, max_tokens)

``SamplingParams`` follows vLLM's (same names, same meaning) with every field optional:
``None`` means "not set here", so a request's value wins over the run's default, which wins
over the model's ``generation_config.json``, which wins over the neutral value. Whether to
sample follows transformers: ``temperature`` set by the request or the run samples when it
is above 0 (0 is greedy, as in vLLM); when neither sets it, the model's ``do_sample`` (and
``temperature``) decide, and a model that sets nothing is greedy. (vLLM's OpenAI server
samples at temperature 1 there instead: set ``temperature`` to get the same in both.)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ... import _settings
from ...errors import SamplingParamsError
from .structured import GUIDED, StructuredOutput, structured_in

__all__ = ["BODY_KEYS", "Completion", "Conversation", "GenerateResult", "Request", "Resolved",
           "SamplingParams", "StructuredOutput", "conversations",
           "cut_at_stop", "eos_ids", "group_key", "resolve"]

FinishReason = Literal["stop", "length"]
Conversation = Sequence[Mapping[str, Any]]

#: The fields of ``SamplingParams`` a request body may carry, with the names vLLM's OpenAI
#: server also reads (``max_completion_tokens`` is the chat API's newer name).
_ALIASES = {"max_completion_tokens": "max_tokens", "max_new_tokens": "max_tokens",
            "min_new_tokens": "min_tokens"}
#: ``model.generate`` keywords that have a ``SamplingParams`` field, and its name.
_GENERATE_OPTIONS = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens",
                     "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                     "min_p": "min_p", "repetition_penalty": "repetition_penalty"}
#: ``model.generate`` keywords that change nothing here: the pad token of rows that are
#: cut at their own end, and whether to sample (``temperature`` says it).
_GENERATE_NEUTRAL = ("pad_token_id", "do_sample")


def _error(name: str, message: str, fix: str) -> SamplingParamsError:
    return SamplingParamsError(f"{name} {message}", field=name, fix=fix)


def _number(name: str, value: Any, low: float | None = None, high: float | None = None, *,
            integer: bool = False, open_low: bool = False) -> Any:
    """``value`` checked: a number (an ``int`` for ``integer``) within ``[low, high]``."""
    if value is None:
        return None
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or (
            isinstance(value, float) and not math.isfinite(value)):
        raise _error(name, f"is {value!r}, not {'an integer' if integer else 'a number'}.",
                     f"give {name} as a JSON {'integer' if integer else 'number'}.")
    if low is not None and (value < low or (open_low and value == low)):
        raise _error(name, f"is {value}, below {'or at ' if open_low else ''}{low}.",
                     f"give {name} {'above' if open_low else 'at least'} {low}.")
    if high is not None and value > high:
        raise _error(name, f"is {value}, above {high}.", f"give {name} at most {high}.")
    return value if integer else float(value)


@dataclass(frozen=True)
class SamplingParams:
    """How one request is generated; every field ``None`` (unset) by default.

    As vLLM's ``SamplingParams``: ``temperature`` (0: greedy), ``top_p``, ``top_k`` (0 or
    -1: off), ``min_p``, ``seed`` (the request's text is the same whatever batch it shares),
    ``max_tokens``, ``min_tokens``, ``stop`` (strings: the text ends before the first, the
    finish reason is "stop"), ``stop_token_ids`` (end at such a token: counted, not in the
    text), ``n`` (completions per request), ``presence_penalty``/``frequency_penalty``
    (OpenAI's, on the tokens generated so far), ``repetition_penalty`` (transformers', prompt included), ``logprobs``
    (the chosen token's logprob, and this many alternatives per token; 0: the chosen only),
    ``structured_outputs`` (a ``StructuredOutput``, or vLLM's ``{"json": SCHEMA}`` spelling:
    what the text must match). Out-of-range values raise ``SamplingParamsError``.
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    max_tokens: int | None = None
    min_tokens: int | None = None
    stop: tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logprobs: int | None = None
    structured_outputs: StructuredOutput | None = None

    def __post_init__(self) -> None:
        checked = {
            "temperature": _number("temperature", self.temperature, 0.0),
            "top_p": _number("top_p", self.top_p, 0.0, 1.0, open_low=True),
            "top_k": _number("top_k", self.top_k, -1, integer=True),
            "min_p": _number("min_p", self.min_p, 0.0, 1.0),
            "seed": _number("seed", self.seed, 0, 2**63 - 1, integer=True),
            "max_tokens": _number("max_tokens", self.max_tokens, 1, integer=True),
            "min_tokens": _number("min_tokens", self.min_tokens, 0, integer=True),
            "n": _number("n", self.n, 1, 128, integer=True),
            "presence_penalty": _number("presence_penalty", self.presence_penalty, -2.0, 2.0),
            "frequency_penalty": _number("frequency_penalty", self.frequency_penalty, -2.0, 2.0),
            "repetition_penalty": _number("repetition_penalty", self.repetition_penalty, 0.0,
                                          open_low=True),
            "logprobs": _number("logprobs", self.logprobs, 0, 20, integer=True),
            "stop": _strings(self.stop),
            "stop_token_ids": _token_ids(self.stop_token_ids),
        }
        for name, value in checked.items():
            object.__setattr__(self, name, value)
        if self.structured_outputs is not None:
            object.__setattr__(self, "structured_outputs",
                               structured_in({"structured_outputs": self.structured_outputs}))
        if (self.min_tokens is not None and self.max_tokens is not None
                and self.min_tokens > self.max_tokens):
            raise _error("min_tokens", f"is {self.min_tokens}, above max_tokens "
                         f"{self.max_tokens}.", "make min_tokens at most max_tokens.")

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> SamplingParams:
        """The parameters an OpenAI request body (or a plain input line) sets; other keys
        are not parameters and are left alone (``BODY_KEYS``: those read). ``logprobs``: an
        integer (completions), or ``true`` with ``top_logprobs`` (chat). Structured output
        under any of its spellings (``structured_outputs``, ``response_format``,
        ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``) is
        ``structured_outputs``; two at once raise ``SamplingParamsError``."""
        values: dict[str, Any] = {}
        names = {f.name for f in dataclasses.fields(cls)} - {"structured_outputs"}
        structured = structured_in(body)
        if structured is not None:
            values["structured_outputs"] = structured
        for key, value in body.items():
            name = _ALIASES.get(key, key)
            if name in names and value is not None:
                values[name] = value
        logprobs = values.get("logprobs")
        if isinstance(logprobs, bool):  # the chat API: a switch, and a count beside it
            top = body.get("top_logprobs")
            values["logprobs"] = (top or 0) if logprobs else None
        if isinstance(values.get("stop"), list):
            values["stop"] = tuple(values["stop"])
        if isinstance(values.get("stop_token_ids"), list):
            values["stop_token_ids"] = tuple(values["stop_token_ids"])
        return cls(**values)

    @classmethod
    def from_generate_options(cls, options: Mapping[str, Any],
                              model_temperature: float | None = None) -> SamplingParams:
        """``model.generate`` keywords (``Executor.generate`` without ``params``) as the
        parameters they mean: ``max_new_tokens`` is ``max_tokens``, ``do_sample=False`` is
        temperature 0, ``do_sample=True`` samples at the given ``temperature`` or else the
        model's (``model_temperature``, 1.0 when the model sets none), as ``generate`` does.
        A keyword with no such meaning raises ``SamplingParamsError`` naming it."""
        fields: dict[str, Any] = {}
        for name, value in options.items():
            if name in _GENERATE_NEUTRAL:
                continue
            if name not in _GENERATE_OPTIONS:
                raise SamplingParamsError(
                    f"generate option {name!r} is not one the executor takes.", field=name,
                    fix=f"use {', '.join(sorted(_GENERATE_OPTIONS))} or do_sample, or pass "
                    "SamplingParams (generate(prompts, params)).")
            fields[_GENERATE_OPTIONS[name]] = value
        sample = options.get("do_sample")
        if sample is False:
            fields["temperature"] = 0.0
        elif sample and fields.get("temperature") is None:
            fields["temperature"] = float(model_temperature or 1.0)
        return cls(**fields)

    def set_fields(self) -> dict[str, Any]:
        """The fields set here, as JSON-ready values (the run record keeps them)."""
        out: dict[str, Any] = {}
        for name, value in self._set().items():
            out[name] = (value.to_vllm() if isinstance(value, StructuredOutput)
                         else list(value) if isinstance(value, tuple) else value)
        return out

    def _set(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None}

    def over(self, defaults: SamplingParams | None) -> SamplingParams:
        """These parameters, each unset one taken from ``defaults``."""
        if defaults is None:
            return self
        return dataclasses.replace(defaults, **self._set())


def _strings(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    items = (value,) if isinstance(value, str) else value
    if not isinstance(items, (tuple, list)) or not all(isinstance(s, str) and s for s in items):
        raise _error("stop", f"is {value!r}, not a string or a list of non-empty strings.",
                     'give stop as "END" or ["END", "\\n\\n"].')
    return tuple(items)


def eos_ids(value: Any) -> list[int]:
    """A model's ``eos_token_id`` (none, one id, or several) as a list of ids."""
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def _token_ids(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, (tuple, list)) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise _error("stop_token_ids", f"is {value!r}, not a list of token ids.",
                     "give stop_token_ids as a list of non-negative integers.")
    return tuple(value)


@dataclass(frozen=True)
class Resolved:
    """Every parameter of one request, decided: what the worker generates with."""

    do_sample: bool
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    max_tokens: int
    min_tokens: int
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    n: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logprobs: int | None
    #: What the text must match (``None``: anything).
    structured: StructuredOutput | None = None


def resolve(params: SamplingParams, model: Mapping[str, Any]) -> Resolved:
    """``params`` (a request's over the run's defaults) completed from ``model``, the
    model's ``generation_config`` values that it sets (``None`` for what it does not)."""
    def pick(name: str, config_name: str, neutral: Any) -> Any:
        value = getattr(params, name)
        if value is None:
            value = model.get(config_name)
        return neutral if value is None else value

    if params.temperature is not None:
        sample = params.temperature > 0
    else:
        sample = bool(model.get("do_sample")) and (model.get("temperature") or 1.0) > 0
    top_k = int(pick("top_k", "top_k", 0))
    return Resolved(
        do_sample=sample, temperature=float(pick("temperature", "temperature", 1.0)),
        top_p=float(pick("top_p", "top_p", 1.0)), top_k=0 if top_k < 0 else top_k,
        min_p=float(pick("min_p", "min_p", 0.0)), seed=params.seed,
        max_tokens=int(pick("max_tokens", "max_new_tokens", _settings.DEFAULT_MAX_NEW_TOKENS)),
        min_tokens=int(pick("min_tokens", "min_new_tokens", 0)),
        stop=params.stop or (), stop_token_ids=params.stop_token_ids or (),
        n=params.n or 1, presence_penalty=params.presence_penalty or 0.0,
        frequency_penalty=params.frequency_penalty or 0.0,
        repetition_penalty=float(pick("repetition_penalty", "repetition_penalty", 1.0)),
        logprobs=params.logprobs, structured=params.structured_outputs)


def group_key(resolved: Resolved, index: int) -> tuple[Any, ...]:
    """Requests with equal keys share one ``generate`` call.

    Everything ``generate`` takes per call is in the key; ``max_tokens`` and ``stop`` are
    not (the call runs to the longest ``max_tokens``, and each row is cut at its own end:
    a causal model's first k tokens do not depend on the steps after them). A seeded
    request is a group of its own (``index`` makes its key unique): its random numbers then
    depend on its seed alone, not on the rows beside it. A structured output constraint is in
    the key: a call's rows share one grammar (each row its own matcher over it).
    """
    sampling = ((resolved.temperature, resolved.top_p, resolved.top_k, resolved.min_p)
                if resolved.do_sample else ())
    return (resolved.do_sample, *sampling, resolved.repetition_penalty,
            resolved.presence_penalty, resolved.frequency_penalty, resolved.min_tokens,
            resolved.stop_token_ids, resolved.n, resolved.logprobs is not None,
            index if resolved.seed is not None and resolved.do_sample else None,
            resolved.structured)


#: Every body key ``SamplingParams.from_body`` reads: the fields, their aliases, the chat
#: API's ``top_logprobs`` and the spellings of structured output. A key outside it is not a
#: sampling parameter (a batch line's other keys are the caller's to judge).
BODY_KEYS: frozenset[str] = frozenset(
    {f.name for f in dataclasses.fields(SamplingParams)} | set(_ALIASES) | set(GUIDED)
    | {"top_logprobs", "response_format"})


@dataclass(frozen=True)
class Request:
    """One generation request: a ``prompt`` or chat ``messages`` (rendered by the model's
    chat template in the worker), its parameters (``None``: the call's), and for chat
    ``add_generation_prompt`` and extra template variables."""

    prompt: str | None = None
    messages: tuple[Mapping[str, Any], ...] | None = None
    params: SamplingParams | None = None
    add_generation_prompt: bool = True
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def size_hint(self) -> str:
        """Text whose length is about the request's, for batch planning."""
        if self.prompt is not None:
            return self.prompt
        return "".join(str(m.get("content", "")) + "    " for m in self.messages or ())


@dataclass(frozen=True)
class Completion:
    """One completion of a request (``n`` of them per request)."""

    text: str
    token_ids: tuple[int, ...]
    #: "stop" (end of sequence, a stop token or string) or "length" (``max_tokens``).
    finish_reason: FinishReason
    #: What stopped it when not end of sequence: the stop string or stop token id.
    stop_reason: str | int | None = None
    #: Per token: ``{"token": str, "token_id": int, "logprob": float, "top": [...]}``, with
    #: ``logprobs``; ``top`` holds that many ``{"token", "token_id", "logprob"}``.
    logprobs: tuple[dict[str, Any], ...] | None = None


@dataclass(frozen=True)
class GenerateResult:
    """What one request gave: its completions (``n``), and its prompt's token count.

    ``text``, ``finish_reason`` and ``logprobs`` are the first completion's (``str(result)``
    is its text, today's plain-string form)."""

    prompt_tokens: int
    completions: tuple[Completion, ...]
    #: The prompt as the model saw it (a chat request's rendered template).
    prompt: str = ""

    @property
    def text(self) -> str:
        return self.completions[0].text

    @property
    def finish_reason(self) -> FinishReason:
        return self.completions[0].finish_reason

    @property
    def logprobs(self) -> tuple[dict[str, Any], ...] | None:
        return self.completions[0].logprobs

    @property
    def completion_tokens(self) -> int:
        """Tokens generated over every completion (the ``usage`` of the OpenAI API)."""
        return sum(len(c.token_ids) for c in self.completions)

    def __str__(self) -> str:
        return self.text


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, str | None]:
    """``text`` up to the first of the ``stop`` strings, and that string (``None``: none)."""
    found = [(text.find(s), s) for s in stop if s in text]
    if not found:
        return text, None
    at, which = min(found)
    return text[:at], which


def conversations(messages: Conversation | Sequence[Conversation]) -> list[Conversation]:
    """One conversation (its first item a message) or a list of them."""
    items = list(messages)
    if items and isinstance(items[0], Mapping):
        return [items]  # type: ignore[list-item]  # one conversation
    return items  # type: ignore[return-value]  # a list of conversations
