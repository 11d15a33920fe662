"""Which fields of an input line ``codeferry run`` honours, and what it does with the rest.

A request is answered only for what it asked: a field that would change the answer and that
codeferry does not implement refuses that line (``RequestRefusedError``, status 400 in the
OpenAI output, the field named), never a 200 that ignored it. The other lines run.

* **honoured**: the sampling fields ``SamplingParams.from_body`` reads (its dataclass
  fields, their aliases, ``top_logprobs``: a field added there is honoured here with no
  change), and each endpoint's own keys (``messages``, ``prompt``, ``input``, ``model``...);
* **harmless**: fields that cannot change an answer (``user``, ``metadata``, ``priority``...);
* **neutral values**: a known field at the value that asks for nothing (``"echo": false``,
  ``"logit_bias": {}``, ``"tools": []``, ``"best_of": 1``, ``null``) is accepted;
* everything else is refused: a known OpenAI or vLLM field (``tools``, ``logit_bias``,
  ``echo``, ``prompt_logprobs``, ``suffix``...) as not implemented, an unknown key with the
  nearest field's name (vLLM ignores unknown keys with a warning; a typo'd ``temprature``
  would then sample at the default, silently).

A plain (non-OpenAI) line passes its other keys through to its output line; a key within
one or two edits of a sampling field's name (``temprature``, ``max_token``) is taken for a
typo and stops the run before it starts (``did_you_mean``).

Chat ``content`` given as OpenAI content parts is joined as vLLM's OpenAI server joins it
(its text parts, ``"\\n"`` between them), so the prompt is the plain-text form's; a part
that is not text (an image, audio) refuses the line.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Mapping
from typing import Any

from .._exec.generate import params
from .._exec.generate.params import SamplingParams
from ..errors import RequestRefusedError

__all__ = ["did_you_mean", "honoured", "join_parts", "refusal", "same_model"]

#: The keys of each endpoint's body that are the request itself (not sampling parameters).
_ENDPOINT_KEYS = {
    "/v1/chat/completions": {"messages", "model", "chat_template_kwargs",
                             "add_generation_prompt", "stream"},
    "/v1/completions": {"prompt", "model", "stream"},
    "/v1/embeddings": {"input", "model"},
}
#: Fields that cannot change an answer, whatever their value.
_HARMLESS = frozenset({"user", "metadata", "store", "service_tier", "request_id", "priority",
                       "session_id", "stream_options", "parallel_tool_calls", "cache_salt",
                       "stream_interval"})
#: Known fields, accepted only at a value that asks for nothing (``None`` always is).
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "echo": (False,), "logit_bias": ({},), "tools": ([],), "tool_choice": ("none",),
    "functions": ([],), "function_call": ("none",), "best_of": (1,), "suffix": ("",),
    "use_beam_search": (False,), "include_stop_str_in_output": (False,),
    "ignore_eos": (False,), "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,), "continue_final_message": (False,),
    "length_penalty": (1, 1.0), "bad_words": ([],), "return_tokens_as_token_ids": (False,),
    "return_token_ids": (False,), "encoding_format": ("float",), "documents": ([],),
    "response_format": ({"type": "text"},), "include_reasoning": (True,), "modalities": (["text"],),
}
#: Known OpenAI and vLLM request fields that codeferry does not implement (refused unless
#: at a neutral value, or honoured once ``SamplingParams`` reads them).
_KNOWN = frozenset(_NEUTRAL) | {
    "prompt_logprobs", "response_format", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "guided_decoding_backend", "structured_outputs", "truncate_prompt_tokens",
    "truncation_side", "allowed_token_ids", "logprob_token_ids", "chat_template",
    "mm_processor_kwargs", "media_io_kwargs", "add_special_tokens", "reasoning_effort",
    "thinking_token_budget", "watermarking", "kv_transfer_params", "ec_transfer_params",
    "vllm_xargs", "repetition_detection", "prompt_embeds", "dimensions", "audio",
    "prediction", "web_search_options", "return_prompt_text", "return_token_offsets",
    "return_mm_kwargs", "mm_payload", "routed_experts_prompt_start"}
#: The sampling fields' names a typo on a plain line is checked against: the longer ones,
#: so that short pass-through keys (``speed``, ``step``) are not taken for ``seed``, ``stop``.
_TYPO_MIN = 6


def honoured() -> frozenset[str]:
    """The body keys ``SamplingParams.from_body`` reads, read from it each time (its fields,
    and the other keys its module names in ``BODY_KEYS``, where it has one)."""
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    return frozenset(names | set(getattr(params, "BODY_KEYS", ())) | {
        "max_completion_tokens", "max_new_tokens", "min_new_tokens", "top_logprobs"})


def _neutral(key: str, value: Any) -> bool:
    if value is None:
        return True
    return any(type(value) is type(v) and value == v for v in _NEUTRAL.get(key, ()))


def refusal(body: Mapping[str, Any], url: str) -> RequestRefusedError | None:
    """The first field of an OpenAI ``body`` that codeferry would not honour, as the error
    its line is answered with (``path``/``line`` are the caller's); ``None``: none."""
    sampling = honoured() if url != "/v1/embeddings" else frozenset()  # nothing to sample
    accepted = sampling | _ENDPOINT_KEYS[url] | _HARMLESS
    if url == "/v1/completions":  # ``best_of`` equal to ``n`` asks for nothing more
        if body.get("best_of") is not None and body.get("best_of") == body.get("n", 1):
            accepted = accepted | {"best_of"}
    for key, value in body.items():
        if key in accepted or _neutral(key, value):
            continue
        if key in _KNOWN:
            return RequestRefusedError(
                f'the request sets "{key}" ({_shown(value)}), which codeferry does not '
                "implement: it was not run rather than answered without it.", field=key,
                fix=f'remove "{key}" from the body, or send this request to a server that '
                "implements it.")
        near = difflib.get_close_matches(key, sorted(accepted | _KNOWN), n=1, cutoff=0.75)
        return RequestRefusedError(
            f'"{key}" is not a field of a {url} request'
            + (f' (did you mean "{near[0]}"?).' if near else "."), field=key,
            fix=f'rename it to "{near[0]}".' if near else f'remove "{key}" from the body.')
    return None


def _shown(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 40 else text[:37] + "..."


def _distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions)."""
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        current = [i]
        for j, y in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return previous[-1]


def did_you_mean(key: str) -> str | None:
    """The sampling field a plain line's ``key`` is a typo of (one edit, two for names of
    nine letters or more; case, ``-`` for ``_`` and spaces ignored), or ``None``."""
    known = honoured()
    if key in known:
        return None
    names = [n for n in known if len(n) >= _TYPO_MIN]
    folded = key.lower().replace("-", "_").replace(" ", "_")
    best = min(names, key=lambda n: (_distance(folded, n), n))
    allowed = 2 if len(best) >= 9 else 1
    return best if _distance(folded, best) <= allowed else None


def join_parts(messages: tuple[Mapping[str, Any], ...]) -> tuple[
        tuple[Mapping[str, Any], ...], RequestRefusedError | None]:
    """``messages`` with each list of content parts joined into one string as vLLM's OpenAI
    server does (text parts, ``"\\n"`` between them), and the error of a part that is not
    text (``None``: every part is)."""
    joined = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            joined.append(message)
            continue
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
                continue
            kind = part.get("type", "text") if isinstance(part, dict) else None
            key = {"text": "text", "input_text": "text", "output_text": "text",
                   "refusal": "refusal"}.get(kind) if isinstance(kind, str) else None
            text = part.get(key) if key else None
            if key is None or not isinstance(text, str):
                shown = kind if isinstance(kind, str) else _shown(part)
                return messages, RequestRefusedError(
                    f'a message has a content part of type "{shown}": codeferry runs text '
                    "only, so the request was not run.", field="messages",
                    fix='send text parts only ({"type": "text", "text": ...}), or send this '
                    "request to a server that runs this model's processor.")
            texts.append(text)
        joined.append({**message, "content": "\n".join(texts)})
    return tuple(joined), None


def same_model(asked: str, names: set[str], **where: Any) -> RequestRefusedError | None:
    """The error of a body whose ``model`` is not the model run (``names``: the path or repo
    id given, its last part, the weights' name), as vLLM refuses a model it does not serve;
    ``where``: its ``path`` and ``line``."""
    if asked in names or asked.rstrip("/") in names:
        return None
    return RequestRefusedError(
        f'the request asks for model "{asked}", and this run serves '
        f'"{sorted(names, key=len)[0]}".', field="model",
        fix='set "model" to the model run (its path, repo id or folder name), or run this '
        "line with that model.", **where)
