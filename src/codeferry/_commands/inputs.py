"""The input of ``codeferry run``: read and checked whole before anything starts.

Input (UTF-8 JSON Lines or text, one input per line; blank lines are skipped; ``-``: stdin):

* an OpenAI batch request, as ``vllm run-batch`` and the OpenAI Batch API read them:
  ``{"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}``
  with ``url`` ``/v1/chat/completions`` (``body.messages``), ``/v1/completions``
  (``body.prompt``) or ``/v1/embeddings`` (``body.input``, ``--task embed``); the body's
  sampling fields are the request's parameters. Its id is ``custom_id``, and its output line
  is in the OpenAI batch output format (``output``). A file is all OpenAI lines or none;
* a JSON object ``{"id": ..., "prompt": "..."}`` (``"text"`` is accepted for every task too;
  ``generate``/``score`` prefer ``"prompt"``, ``embed`` prefers ``"text"``), or with chat
  ``"messages"`` (``--task generate``). For ``generate``, keys named as ``SamplingParams``
  fields (``temperature``, ``max_tokens``, ``stop``...) are its parameters; every other key
  is passed through to its output line. ``id`` is a non-empty string or an integer. A line
  is read as JSON when its first non-blank character is ``{``;
* any other line is plain text, used whole (without its line ending); its ``id`` is its
  1-based line number in the file, as an integer.

A request field codeferry does not implement, a content part that is not text or (for a
plain line) a key that is a parameter's name misspelt: see ``fields`` (the first two answer
their line alone, as ``InputItem.refused``; the last stops the run). Chat content parts are
joined into one string there.

Ids must be unique. A JSON line whose strings (keys too) hold a lone surrogate (JSON
``"\\udfff"``), that nests more than ``MAX_DEPTH`` levels or holds an integer of more digits
than Python reads is refused. A file that is one JSON array (``[{...}, {...}]``) is refused
with the fix. Bad input raises
``InputFormatError`` (``SamplingParamsError`` for a bad parameter) naming ``file:line``
before anything is written.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .._exec.generate.params import Request, SamplingParams
from ..errors import (
    CodeferryError,
    InputFormatError,
    InputNotFoundError,
    RequestRefusedError,
    SamplingParamsError,
)
from .fields import did_you_mean, join_parts, refusal

__all__ = ["TASKS", "Id", "InputItem", "OpenAI", "Task", "read_inputs"]

Task = Literal["generate", "embed", "score"]
TASKS: tuple[Task, ...] = ("generate", "embed", "score")
#: Ids are JSON strings or integers.
Id = str | int
#: The OpenAI endpoints a batch line may name, and the task each needs.
URLS: dict[str, Task] = {"/v1/chat/completions": "generate", "/v1/completions": "generate",
                         "/v1/embeddings": "embed"}
#: Keys an output line of a plain input writes itself: an input line may not pass them through.
RESERVED = frozenset({"id", "output", "outputs", "error", "finish_reason", "stop_reason",
                      "prompt_tokens", "completion_tokens", "logprobs", "embedding",
                      "logprob", "tokens", "token_logprobs"})
_PARAMS = frozenset(f.name for f in dataclasses.fields(SamplingParams)) | {
    "max_completion_tokens", "max_new_tokens", "min_new_tokens"}
_STDIN = "<stdin>"
#: The most levels a JSON line may nest (a chat request's content parts take 6): deeper, the
#: run record's digests, the output line or the pickle to a worker would overflow the stack.
MAX_DEPTH = 100


@dataclass(frozen=True)
class OpenAI:
    """Where an OpenAI batch line asked to go: its ``url`` and the ``model`` its body names."""

    url: str
    model: str | None = None


@dataclass(frozen=True)
class InputItem:
    """One input: its ``id``, its text, and the line of the input file it came from.

    ``text`` is the prompt (or the text to embed or score); for chat, the messages as JSON.
    ``request`` is what a ``generate`` input asks (prompt or messages, parameters);
    ``openai`` is set for an OpenAI batch line; ``extra`` the keys passed through.
    ``refused``: the error this line is answered with, never run (``fields``)."""

    id: Id
    text: str
    line: int
    request: Request | None = None
    openai: OpenAI | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    refused: CodeferryError | None = None

    @property
    def digest_text(self) -> str:
        """What the run record digests per id: the prompt alone for a plain prompt (as
        records before parameters did), else the request whole, as canonical JSON."""
        request = self.request
        if request is None or (request.messages is None and request.params is None
                               and self.openai is None):
            return self.text
        return json.dumps({"prompt": request.prompt, "messages": request.messages,
                           "params": request.params.set_fields() if request.params else None,
                           "add_generation_prompt": request.add_generation_prompt,
                           "template": dict(request.template_kwargs),
                           "url": self.openai.url if self.openai else None},
                          sort_keys=True, ensure_ascii=False)


# -- input ------------------------------------------------------------------------------


def _input_error(path: Path, line: int, message: str, fix: str) -> InputFormatError:
    return InputFormatError(message, path=str(path), line=line, fix=fix)


def _read(path: Path) -> bytes:
    if str(path) == "-":
        return sys.stdin.buffer.read()
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise InputNotFoundError(
            f"input file {path} does not exist.", path=str(path),
            fix="pass an existing JSONL or text file to --input.",
        ) from None
    except OSError as exc:
        raise InputNotFoundError(
            f"cannot read input file {path}: {exc.strerror or exc}.", path=str(path),
            fix="pass a readable JSONL or text file to --input.",
        ) from None


def read_inputs(path: str | os.PathLike[str], task: Task = "generate") -> list[InputItem]:
    """Read and check an input file (see the module docstring for the format); ``-``: stdin."""
    path = Path(path)
    data = _read(path)
    shown = Path(_STDIN) if str(path) == "-" else path
    _refuse_array(shown, data)
    keys = ("text", "prompt") if task == "embed" else ("prompt", "text")
    items: list[InputItem] = []
    seen: dict[Id, int] = {}
    for number, raw in enumerate(data.split(b"\n"), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _input_error(shown, number, f"the line is not UTF-8 (byte {exc.start + 1} of "
                               "the line).", "save the file as UTF-8.") from None
        if number == 1:
            line = line.removeprefix("\ufeff")
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            item = _json_item(shown, number, line, keys, task)
        else:
            item = InputItem(number, line, number, Request(prompt=line))
        if items and (item.openai is None) != (items[0].openai is None):
            raise _input_error(shown, number, "the file mixes OpenAI batch lines (custom_id, "
                               "url, body) and plain lines.",
                               "write every line in one format: the output follows it.")
        if item.id in seen:
            raise _input_error(
                shown, number, f"id {item.id!r} is already used on line {seen[item.id]}.",
                "give every input a unique id (a plain text line's id is its line number).",
            )
        seen[item.id] = number
        items.append(item)
    return items


def _refuse_array(path: Path, data: bytes) -> None:
    """A JSON array file would otherwise be read line by line as plain text prompts."""
    if not data.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"["):
        return
    try:
        whole = json.loads(data.decode("utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return  # text lines that start with "[": plain text
    except (ValueError, RecursionError) as exc:  # JSON, but more than Python reads
        raise _unreadable(path, 1, exc) from None
    if isinstance(whole, list):
        raise _input_error(path, 1, f"the file is one JSON array (of {len(whole)} items), not "
                           "JSON Lines.", "write one JSON object per line (JSON Lines), e.g. "
                           f"jq -c '.[]' {path} > {path.with_suffix('.jsonl').name}")


def _object(path: Path, number: int, line: str) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise _input_error(
            path, number, f"invalid JSON: {exc.msg} (column {exc.colno}).",
            'write one JSON object per line, e.g. {"id": "a1", "prompt": "Hello"}; a line '
            "that does not start with '{' is read as plain text.",
        ) from None
    except (ValueError, RecursionError) as exc:
        raise _unreadable(path, number, exc) from None
    if not isinstance(row, dict):
        raise _input_error(path, number, "the line is not a JSON object.",
                           'write one JSON object per line, e.g. {"id": "a1", "prompt": "Hello"}.')
    _check_tree(path, number, row)
    return row


def _unreadable(path: Path, number: int, exc: ValueError | RecursionError) -> InputFormatError:
    """JSON that Python's reader refuses to build: nested past the stack, or an integer of
    more digits than ``int`` converts (its only ``ValueError`` besides a syntax error)."""
    if isinstance(exc, RecursionError):
        return _too_deep(path, number)
    return _input_error(
        path, number, f"a number has more than {sys.get_int_max_str_digits()} digits, more "
        "than Python reads.", 'write a long id as a string ("id": "1234..."); no parameter '
        "takes a number that long.")


def _too_deep(path: Path, number: int) -> InputFormatError:
    return _input_error(path, number, f"the line nests arrays or objects more than {MAX_DEPTH} "
                        "levels deep.", "flatten it: no request nests that deep (a chat "
                        "message's content parts are 6 levels).")


def _check_tree(path: Path, number: int, row: dict[str, Any]) -> None:
    """Every string of the line (keys too) is text, and it nests at most ``MAX_DEPTH``
    levels: whatever encodes it later (the record's digests, the output line, a worker's
    pickle) cannot fail on it. Walked with a list, not recursion, in the line's order."""
    todo: list[tuple[Any, str, int]] = [(row, "", 1)]
    while todo:
        value, name, depth = todo.pop()
        if depth > MAX_DEPTH:
            raise _too_deep(path, number)
        if isinstance(value, dict):
            children = []
            for key, item in value.items():
                shown = key if _encodable(key) else json.dumps(key)[1:-1]  # escaped
                where = f"{name}.{shown}" if name else shown
                if shown is not key:
                    _check_encodable(path, number, where, key)
                children.append((item, where, depth + 1))
            todo.extend(reversed(children))
        elif isinstance(value, list):
            todo.extend((item, f"{name}[{i}]", depth + 1)
                        for i, item in reversed(list(enumerate(value))))
        elif isinstance(value, str) and not _encodable(value):
            _check_encodable(path, number, name, value)


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _json_item(path: Path, number: int, line: str, keys: tuple[str, str],
               task: Task) -> InputItem:
    row = _object(path, number, line)
    if "custom_id" in row and "body" in row:
        return _openai_item(path, number, row, task)
    if "id" not in row:
        raise _input_error(path, number, 'the object has no "id".',
                           'add a unique "id" (a string or an integer) to every object.')
    ident = _ident(path, number, "id", row["id"])
    request: Request | None
    if task == "generate":
        _typos(path, number, row)
    refused = None
    if task == "generate" and "messages" in row:
        messages, refused = _messages(path, number, row["messages"])
        request = Request(messages=messages, params=_params(path, number, row))
        text = json.dumps(row["messages"], ensure_ascii=False)
        used = {"id", "messages", *_PARAMS}
    else:
        key = next((k for k in keys if k in row), None)
        if key is None:
            raise _input_error(path, number, f'the object has neither "{keys[0]}" nor '
                               f'"{keys[1]}"{" nor messages" if task == "generate" else ""}.',
                               f'add the input text as "{keys[0]}".')
        text = row[key]
        if not isinstance(text, str) or not text:
            raise _input_error(path, number, f'"{key}" is not a non-empty string.',
                               f'make "{key}" the input text.')
        _check_encodable(path, number, key, text)
        params = _params(path, number, row) if task == "generate" else None
        request = Request(prompt=text, params=params) if task == "generate" else None
        used = {"id", key, *(_PARAMS if task == "generate" else ())}
    extra = {k: v for k, v in row.items() if k not in used}
    clash = sorted(set(extra) & RESERVED)
    if clash:
        raise _input_error(path, number, f"the key {json.dumps(clash[0])} is one the output "
                           "line writes itself.", f"rename {json.dumps(clash[0])} (other keys "
                           "are passed through to the output line).")
    return InputItem(ident, text, number, request, None, extra,
                     _located(refused, path, number))


def _ident(path: Path, number: int, name: str, ident: Any) -> Id:
    if isinstance(ident, bool) or not isinstance(ident, (str, int)) or ident == "":
        raise _input_error(path, number, f'"{name}" {json.dumps(ident)} is not a non-empty '
                           "string or an integer.", f'make "{name}" a non-empty string or an '
                           "integer.")
    _check_encodable(path, number, name, ident)
    return ident


def _typos(path: Path, number: int, row: Mapping[str, Any]) -> None:
    """A plain line's key that is a sampling field's name misspelt would be passed through
    and the request run at the defaults: stop before anything runs."""
    for key in row:
        near = did_you_mean(key)
        if near is not None:
            raise SamplingParamsError(
                f'the key "{key}" is not a sampling parameter; did you mean "{near}"?',
                field=key, path=str(path), line=number,
                fix=f'rename it to "{near}" (a key that is not a parameter is copied to the '
                "output line: name it further from the parameters' names).")


def _located(error: RequestRefusedError | None, path: Path,
             number: int) -> RequestRefusedError | None:
    """``error`` naming the input file and line."""
    if error is None:
        return None
    return RequestRefusedError(error.message, field=error.field, path=str(path), line=number,
                               fix=error.fix)


def _params(path: Path, number: int, body: Mapping[str, Any]) -> SamplingParams | None:
    try:
        params = SamplingParams.from_body(body)
    except SamplingParamsError as exc:
        raise SamplingParamsError(exc.message, field=exc.field, path=str(path), line=number,
                                  fix=exc.fix) from None
    return params if params.set_fields() else None


def _messages(path: Path, number: int, messages: Any) -> tuple[
        tuple[Mapping[str, Any], ...], RequestRefusedError | None]:
    """The messages checked, content parts joined (``fields.join_parts``), and the error of
    a part that is not text."""
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise _input_error(path, number, '"messages" is not a list of {"role": ..., '
                           '"content": ...} objects.', 'write "messages": [{"role": "user", '
                           '"content": "Hello"}].')
    for m in messages:
        _check_encodable(path, number, "messages", json.dumps(m, ensure_ascii=False))
    return join_parts(tuple(messages))


def _openai_item(path: Path, number: int, row: dict[str, Any], task: Task) -> InputItem:
    """An OpenAI batch line (as ``vllm run-batch`` reads it)."""
    ident = _ident(path, number, "custom_id", row["custom_id"])
    url, body = row.get("url"), row["body"]
    if row.get("method", "POST") != "POST":
        raise _input_error(path, number, f'"method" is {json.dumps(row.get("method"))}.',
                           'make "method" "POST".')
    if url not in URLS:
        raise _input_error(path, number, f'"url" {json.dumps(url)} is not an endpoint '
                           f"codeferry runs ({', '.join(URLS)}).",
                           "send those requests to a server that serves that endpoint.")
    if URLS[url] != task:
        raise _input_error(path, number, f"{url} requests need --task {URLS[url]}, not "
                           f"--task {task}.", f"run this file with --task {URLS[url]}.")
    if not isinstance(body, dict):
        raise _input_error(path, number, '"body" is not a JSON object.',
                           'make "body" the request, e.g. {"messages": [...]}.')
    if body.get("stream"):
        raise _input_error(path, number, "the request asks to stream.",
                           'remove "stream" (a batch writes whole responses).')
    model = body.get("model") if isinstance(body.get("model"), str) else None
    openai = OpenAI(url, model)
    refused = _located(refusal(body, url), path, number)
    if url == "/v1/embeddings":
        text = body.get("input")
        if not isinstance(text, str) or not text:
            raise _input_error(path, number, '"body.input" is not a non-empty string.',
                               "give one text per line as body.input.")
        _check_encodable(path, number, "input", text)
        return InputItem(ident, text, number, None, openai, refused=refused)
    params = _params(path, number, body)
    if url == "/v1/chat/completions":
        messages, parts = _messages(path, number, body.get("messages"))
        refused = refused or _located(parts, path, number)
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise _input_error(path, number, '"chat_template_kwargs" is not an object.',
                               'make "chat_template_kwargs" a JSON object.')
        request = Request(messages=messages, params=params, template_kwargs=kwargs,
                          add_generation_prompt=bool(body.get("add_generation_prompt", True)))
        return InputItem(ident, json.dumps(body["messages"], ensure_ascii=False), number,
                         request, openai, refused=refused)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise _input_error(path, number, '"body.prompt" is not a non-empty string.',
                           "give one prompt per line (a list of several prompts: one line each).")
    _check_encodable(path, number, "prompt", prompt)
    return InputItem(ident, prompt, number, Request(prompt=prompt, params=params), openai,
                     refused=refused)


def _check_encodable(path: Path, number: int, name: str, value: object) -> None:
    """A JSON escape can spell half a surrogate pair (``"\\udfff"``): no text, and nothing
    the model, the output or a terminal can encode."""
    if not isinstance(value, str):
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _input_error(
            path, number, f'"{name}" holds a lone surrogate \\u{ord(value[exc.start]):04x} '
            f"(character {exc.start + 1}), which is not text.",
            "write the character meant (an escaped pair such as \\ud83d\\ude00 is fine), or "
            "remove the escape.") from None
