"""The input file of ``codeferry run``: read and checked whole before anything starts.

Input (UTF-8, one input per line; blank lines are skipped):

* a JSON object ``{"id": ..., "prompt": "..."}`` (``"text"`` is accepted for every task too;
  ``generate``/``score`` prefer ``"prompt"``, ``embed`` prefers ``"text"``). ``id`` is a
  non-empty string or an integer; other keys are ignored. A line is read as JSON when its
  first non-blank character is ``{``;
* any other line is plain text, used whole (without its line ending); its ``id`` is its
  1-based line number in the file, as an integer.

Ids must be unique; a string holding a lone surrogate (JSON ``"\\udfff"``) is refused. Bad
input raises ``InputFormatError`` naming ``file:line`` before anything is written.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..errors import (
    InputFormatError,
    InputNotFoundError,
)

__all__ = ["TASKS", "Id", "InputItem", "Task", "read_inputs"]

Task = Literal["generate", "embed", "score"]
TASKS: tuple[Task, ...] = ("generate", "embed", "score")
#: The key an output line of each task is recognised by.
_RESULT_KEY = {"generate": "output", "embed": "embedding", "score": "logprob"}
#: Ids are JSON strings or integers.
Id = str | int


@dataclass(frozen=True)
class InputItem:
    """One input: its ``id``, its text, and the line of the input file it came from."""

    id: Id
    text: str
    line: int


# -- input ------------------------------------------------------------------------------


def _input_error(path: Path, line: int, message: str, fix: str) -> InputFormatError:
    return InputFormatError(message, path=str(path), line=line, fix=fix)


def read_inputs(path: str | os.PathLike[str], task: Task = "generate") -> list[InputItem]:
    """Read and check an input file (see the module docstring for the format)."""
    path = Path(path)
    try:
        data = path.read_bytes()
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
    keys = ("text", "prompt") if task == "embed" else ("prompt", "text")
    items: list[InputItem] = []
    seen: dict[Id, int] = {}
    for number, raw in enumerate(data.split(b"\n"), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _input_error(path, number, f"the line is not UTF-8 (byte {exc.start + 1} of the line).",
                               "save the file as UTF-8.") from None
        if number == 1:
            line = line.removeprefix("\ufeff")
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            item = _json_item(path, number, line, keys)
        else:
            item = InputItem(number, line, number)
        if item.id in seen:
            raise _input_error(
                path, number, f"id {item.id!r} is already used on line {seen[item.id]}.",
                "give every input a unique id (a plain text line's id is its line number).",
            )
        seen[item.id] = number
        items.append(item)
    return items


def _json_item(path: Path, number: int, line: str, keys: tuple[str, str]) -> InputItem:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise _input_error(
            path, number, f"invalid JSON: {exc.msg} (column {exc.colno}).",
            'write one JSON object per line, e.g. {"id": "a1", "prompt": "Hello"}; a line '
            "that does not start with '{' is read as plain text.",
        ) from None
    if not isinstance(row, dict):
        raise _input_error(path, number, "the line is not a JSON object.",
                           'write one JSON object per line, e.g. {"id": "a1", "prompt": "Hello"}.')
    if "id" not in row:
        raise _input_error(path, number, 'the object has no "id".',
                           'add a unique "id" (a string or an integer) to every object.')
    ident = row["id"]
    if isinstance(ident, bool) or not isinstance(ident, (str, int)) or ident == "":
        raise _input_error(path, number, f'"id" {json.dumps(ident)} is not a non-empty string '
                           "or an integer.", 'make "id" a non-empty string or an integer.')
    key = next((k for k in keys if k in row), None)
    if key is None:
        raise _input_error(path, number, f'the object has neither "{keys[0]}" nor "{keys[1]}".',
                           f'add the input text as "{keys[0]}".')
    text = row[key]
    if not isinstance(text, str) or not text:
        raise _input_error(path, number, f'"{key}" is not a non-empty string.',
                           f'make "{key}" the input text.')
    for name, value in (("id", ident), (key, text)):
        _check_encodable(path, number, name, value)
    return InputItem(ident, text, number)


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
