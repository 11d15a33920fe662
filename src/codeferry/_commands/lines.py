"""The output line of one input of ``codeferry run``: codeferry's own form, or OpenAI's.

codeferry's (every line starts with ``{"id": ``, which ``output`` relies on to tell a torn
last line from a foreign file)::

    generate  {"id": ..., "output": "text", "finish_reason": "stop", "prompt_tokens": 5,
               "completion_tokens": 7, ...the input line's other keys}
              (+ "stop_reason" when a stop string or token ended it, "logprobs" when asked,
              "outputs": [every completion] when n > 1)

OpenAI's batch output, as ``vllm run-batch`` writes it, for an input in that format::

    {"id": "batch_req_...", "custom_id": ..., "error": null,
     "response": {"status_code": 200, "request_id": "req_...", "body": {"object":
       "chat.completion" | "text_completion" | "list", "choices" | "data": [...],
       "usage": {"prompt_tokens", "completion_tokens", "total_tokens"}, ...}}}

and for an input the model failed on: ``"response": {"status_code": 500, ...}, "error":
{"error": {"message", "type", "param", "code"}}`` (vLLM's ``ErrorResponse``); for one
refused before it ran (a field not implemented, over the context), status 400, ``type``
``BadRequestError`` and ``param`` the field, as vLLM answers a bad request.
"""

from __future__ import annotations

import json
import time
from typing import Any

from .._code.digest import text_digest
from .._exec.generate.params import Completion, GenerateResult
from ..errors import BatchFailedError, RequestRefusedError, SamplingParamsError
from .inputs import InputItem, Task

__all__ = ["line", "usage"]


def usage(task: Task, value: Any) -> tuple[int, int]:
    """``(prompt_tokens, completion_tokens)`` of a result (0, 0 where not counted)."""
    if task == "generate" and isinstance(value, GenerateResult):
        return value.prompt_tokens, value.completion_tokens
    return 0, 0


def _error_text(error: BaseException) -> tuple[str, str]:
    cause = error.__cause__ if isinstance(error, BatchFailedError) else None
    shown = cause if cause is not None else error
    return type(shown).__name__, f"{type(shown).__name__}: {shown}".strip()


def _encode(row: dict[str, Any]) -> bytes:
    try:
        return (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate (from a "\\ud800" in the input): escape it
        return (json.dumps(row) + "\n").encode("ascii")


def line(item: InputItem, task: Task, value: Any, error: BaseException | None,
         model: str) -> tuple[bytes, bool]:
    """The output line of ``item`` (``value`` or ``error``), and whether it is an error."""
    if item.openai is not None:
        return _encode(_openai(item, value, error, model)), error is not None
    row: dict[str, Any] = {"id": item.id}
    if error is not None:
        row["error"] = _error_text(error)[1]
    elif task == "generate":
        row.update(_generated(value))
    elif task == "embed":
        row["embedding"] = value
    else:
        row.update(logprob=value["logprob"], tokens=value["tokens"],
                   token_logprobs=value["token_logprobs"])
    row.update(item.extra)
    return _encode(row), error is not None


def _generated(value: Any) -> dict[str, Any]:
    if not isinstance(value, GenerateResult):
        return {"output": value}
    first = value.completions[0]
    row: dict[str, Any] = {"output": first.text, "finish_reason": first.finish_reason,
                           "prompt_tokens": value.prompt_tokens,
                           "completion_tokens": value.completion_tokens}
    if first.stop_reason is not None:
        row["stop_reason"] = first.stop_reason
    if first.logprobs is not None:
        row["logprobs"] = [_plain_logprob(e) for e in first.logprobs]
    if len(value.completions) > 1:
        row["outputs"] = [{"output": c.text, "finish_reason": c.finish_reason,
                           "completion_tokens": len(c.token_ids),
                           **({} if c.logprobs is None else
                              {"logprobs": [_plain_logprob(e) for e in c.logprobs]})}
                          for c in value.completions]
    return row


def _plain_logprob(entry: dict[str, Any]) -> dict[str, Any]:
    shown = {"token": entry["token"], "token_id": entry["token_id"], "logprob": entry["logprob"]}
    if entry["top"]:
        shown["top"] = [{"token": t["token"], "token_id": t["token_id"], "logprob": t["logprob"]}
                        for t in entry["top"]]
    return shown


def _openai(item: InputItem, value: Any, error: BaseException | None,
            model: str) -> dict[str, Any]:
    assert item.openai is not None
    digest = text_digest(json.dumps(item.id))
    row: dict[str, Any] = {"id": f"batch_req_{digest}", "custom_id": item.id}
    request_id = f"req_{digest}"
    if error is not None:
        kind, message = _error_text(error)
        status, param = 500, None
        if isinstance(error, (RequestRefusedError, SamplingParamsError)):
            # the request's own fault, answered before it ran: vLLM's 400
            status, kind, param = 400, "BadRequestError", error.field or None
        row["response"] = {"status_code": status, "request_id": request_id, "body": None}
        row["error"] = {"error": {"message": message, "type": kind, "param": param,
                                  "code": status}}
        return row
    name = item.openai.model or model
    created = int(time.time())
    if item.openai.url == "/v1/embeddings":
        body: dict[str, Any] = {"id": f"embd-{digest}", "object": "list", "created": created,
                                "model": name, "data": [{"index": 0, "object": "embedding",
                                                         "embedding": value}]}
    else:
        chat = item.openai.url == "/v1/chat/completions"
        choices = [_chat_choice(i, c) if chat else _text_choice(i, c)
                   for i, c in enumerate(value.completions)]
        body = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{digest}",
                "object": "chat.completion" if chat else "text_completion",
                "created": created, "model": name, "choices": choices,
                "usage": {"prompt_tokens": value.prompt_tokens,
                          "completion_tokens": value.completion_tokens,
                          "total_tokens": value.prompt_tokens + value.completion_tokens}}
    row["response"] = {"status_code": 200, "request_id": request_id, "body": body}
    row["error"] = None
    return row


def _chat_choice(index: int, completion: Completion) -> dict[str, Any]:
    logprobs = None if completion.logprobs is None else {"content": [
        {"token": e["token"], "logprob": e["logprob"], "bytes": list(e["token"].encode()),
         "top_logprobs": [{"token": t["token"], "logprob": t["logprob"],
                           "bytes": list(t["token"].encode())} for t in e["top"]]}
        for e in completion.logprobs]}
    return {"index": index, "message": {"role": "assistant", "content": completion.text},
            "logprobs": logprobs, "finish_reason": completion.finish_reason,
            "stop_reason": completion.stop_reason}


def _text_choice(index: int, completion: Completion) -> dict[str, Any]:
    logprobs = None
    if completion.logprobs is not None:
        offsets, at = [], 0
        for e in completion.logprobs:
            offsets.append(at)
            at += len(e["token"])
        logprobs = {"tokens": [e["token"] for e in completion.logprobs],
                    "token_logprobs": [e["logprob"] for e in completion.logprobs],
                    "top_logprobs": [{t["token"]: t["logprob"] for t in e["top"]} or None
                                     for e in completion.logprobs],
                    "text_offset": offsets}
    return {"index": index, "text": completion.text, "logprobs": logprobs,
            "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}
