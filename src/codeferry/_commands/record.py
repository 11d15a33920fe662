"""What produced an output of ``codeferry run``, recorded next to it.

What produced an output is recorded next to it, in ``<output>.codeferry.json`` (written
atomically before the first line; the JSONL lines themselves stay as they are)::

    {"format": "codeferry-run/2", "model": "org/name@<commit>", "digest": "sha256:...",
     "task": "generate", "options": {"max_new_tokens": 16, "dtype": null}, "earlier": [],
     "inputs": {"\\"a1\\"": "<16 hex digits>", "2": "...", ...}}

``inputs`` maps each input id (as JSON) to a digest of its request (the text sent to the
model), for every input of the run that wrote the record. A resume is checked against it:

* another model, code digest, task or options: ``ResumeMismatchError`` naming each;
* an id already answered in the output whose request is another now (an input edited under
  the same id): ``InputChangedError`` naming the ids and their lines;
* output lines with no record beside them (an output moved away from its record, one
  written before records existed) or a record without input digests: nothing can be
  checked, ``ResumeUncheckedError``.

``options`` holds the sampling defaults (``params``) and the chat template's digest only
when a run sets them, and the engine (``engine``) only when it is not transformers (every
record before engines existed was written by transformers), so records written before they
existed still match. A run whose engine is ``auto`` learns it when its workers start:
it is checked then (``pending``), against the engine recorded. When a run ends
(complete or not), ``summary`` records what it did: written, failed, skipped, seconds,
prompt and completion tokens, tokens per second.

``force_resume`` (``--force-resume``) resumes anyway, and keeps an earlier producer that
differs in ``earlier``. So one output never silently mixes producers or inputs.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .. import _settings
from .._code.digest import text_digest
from .._code.resolve import Bundle
from ..errors import (
    InputChangedError,
    OutputError,
    ResumeMismatchError,
    ResumeUncheckedError,
)
from .inputs import Id, InputItem, Task

__all__ = ["check_record", "input_digests", "producer", "record_path", "write_record",
           "write_summary"]

_RECORD_FORMAT = "codeferry-run/2"
#: Records of this format are read too: the same fields, without ``inputs``.
_FORMATS = (_RECORD_FORMAT, "codeferry-run/1")
_FORCE = "pass --force-resume to resume it anyway"


def record_path(output: Path) -> Path:
    """Where the record of what produced ``output`` lives: next to it."""
    return output.with_name(output.name + ".codeferry.json")


def producer(bundle: Bundle, weights: str, task: Task, max_new_tokens: int | None,
             pooling: str | None, dtype: str | None, *, params: dict[str, Any] | None = None,
             chat_template: str | None = None, engine: str | None = None) -> dict[str, Any]:
    """What decides an output's lines: the model (``weights``: where its weights are from,
    its name), its code, the task and its options (``params``: the sampling defaults set;
    ``chat_template``: the digest of the template given; ``engine``: what generates, ``None``
    while not known)."""
    options: dict[str, Any] = {"dtype": dtype}
    if task == "generate":
        options["max_new_tokens"] = max_new_tokens or _settings.DEFAULT_MAX_NEW_TOKENS
        if params:
            options["params"] = params
        if chat_template is not None:
            options["chat_template"] = text_digest(chat_template)
        if engine not in (None, "transformers"):
            options["engine"] = engine
    elif task == "embed":
        options["pooling"] = pooling or "mean"
    return {"model": weights, "digest": bundle.digest, "task": task,
            "options": options}


def _key(ident: Id) -> str:
    return json.dumps(ident)  # 1 and "1" stay apart


def input_digests(items: Sequence[InputItem]) -> dict[str, str]:
    """Each input's id (as JSON) -> the first 16 hex digits of the sha256 of its request."""
    return {_key(item.id): text_digest(item.digest_text) for item in items}


def _flat(producer: dict[str, Any]) -> dict[str, Any]:
    fields = {k: producer.get(k) for k in ("model", "digest", "task")}
    options = producer.get("options")
    for key, value in sorted((options if isinstance(options, dict) else {}).items()):
        fields[key] = value
    if fields["task"] == "generate":  # a record that names no engine: transformers wrote it
        fields.setdefault("engine", "transformers")
    return fields


def check_record(output: Path, producer: dict[str, Any], items: Sequence[InputItem],
                 written: set[Id], force: bool, pending: Sequence[str] = (),
                 unused: Sequence[str] = ()) -> dict[str, Any] | None:
    """The record to write before the first line (``None``: the one there is right).

    ``written``: the ids the output holds already. Raises ``ResumeMismatchError`` (or its
    ``InputChangedError``, ``ResumeUncheckedError``) when they cannot be resumed, unless
    ``force``. ``pending``: options not known yet (the engine of ``auto``, until the workers
    start); the record's own values stand for them, and the caller checks again once known.
    ``unused``: options no written line depended on (the chat template while no chat line
    is written): another value now is no mismatch.
    """
    path = record_path(output)
    recorded: Any = None
    failure: OSError | ValueError | None = None
    try:
        recorded = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:  # ValueError: not UTF-8, not JSON, a huge integer
        failure = exc
    except RecursionError:
        failure = ValueError("it nests too deep to read")
    kept = recorded.get("options") if isinstance(recorded, dict) else None
    if pending and isinstance(kept, dict):
        producer = {**producer, "options": {**producer["options"],
                                            **{k: kept[k] for k in pending if k in kept}}}
    fresh = {"format": _RECORD_FORMAT, **producer, "earlier": [], "inputs": input_digests(items)}
    if isinstance(failure, FileNotFoundError):
        if written and not force:
            raise ResumeUncheckedError(
                f"the output holds {len(written)} lines but no record of what produced them is "
                f"beside it ({path.name}): a resume cannot check the model, its options or "
                "the input they answer.", path=str(output),
                fix=f"move the record back beside it, choose another --output, or {_FORCE} "
                "(trusting the lines there).")
        return fresh
    if failure is not None:
        if not written or force:
            return fresh
        raise OutputError(
            f"cannot read {path}, the record of what produced {output}: {failure}.",
            path=str(path), fix="delete the output and its record to start over, or pass "
            "--force-resume to append to it anyway.") from None
    if not written:
        return fresh
    if not isinstance(recorded, dict) or recorded.get("format") not in _FORMATS:
        recorded = {}
    before, now = _flat(recorded), _flat(producer)
    # both ways: an option the record has and this run lacks (an engine, sampling defaults)
    keys = [*now, *(key for key in before if key not in now)]
    differences = {key: (before.get(key), now.get(key)) for key in keys
                   if before.get(key) != now.get(key) and key not in unused}
    earlier = recorded.get("earlier")
    earlier = earlier if isinstance(earlier, list) else []
    if differences:
        if not force:
            shown = "; ".join(f"{key} was {json.dumps(old)}, is {json.dumps(new)}"
                              for key, (old, new) in differences.items())
            raise ResumeMismatchError(
                f"the existing output was produced by another {', '.join(differences)}: "
                f"{shown} (recorded in {path}).", path=str(output), differences=differences,
                fix="rerun with what produced it, choose another --output, delete the output "
                "and its record to start over, or pass --force-resume to append to it anyway.",
            )
        previous = {k: v for k, v in recorded.items()
                    if k not in ("format", "earlier", "inputs", "summary")}
        earlier = [*earlier, previous]
    if not force:
        _check_inputs(output, path, recorded.get("inputs"), items, written)
    new = {**fresh, "earlier": earlier}
    return None if new == {k: v for k, v in recorded.items() if k != "summary"} else new


def _check_inputs(output: Path, path: Path, recorded: Any, items: Sequence[InputItem],
                  written: set[Id]) -> None:
    if not isinstance(recorded, dict):
        raise ResumeUncheckedError(
            f"the output's record {path.name} predates input digests: a resume cannot check "
            "that the input still holds the requests its lines answer.", path=str(output),
            fix=f"{_FORCE} (trusting the lines there), or choose another --output.")
    now = input_digests(items)
    changed = [item for item in items if item.id in written
               and recorded.get(_key(item.id)) != now[_key(item.id)]]
    if not changed:
        return
    first = ", ".join(f"line {item.line} (id {_key(item.id)})" for item in changed[:3])
    more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
    raise InputChangedError(
        f"the input changed since the output was written: {first}{more} now hold"
        f"{'s' if len(changed) == 1 else ''} another request than the one its output line "
        "answers.", path=str(output), ids=tuple(item.id for item in changed),
        lines=tuple(item.line for item in changed),
        differences={f"input {_key(i.id)}": (recorded.get(_key(i.id)), now[_key(i.id)])
                     for i in changed},
        fix="restore the input, choose another --output, delete the output and its record to "
        "start over, or pass --force-resume to keep the old lines anyway.")


def write_record(output: Path, record: dict[str, Any]) -> None:
    """Replace the record whole or not at all: a temporary file, fsync'd, then renamed."""
    path = record_path(output)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, (json.dumps(record, indent=1) + "\n").encode("utf-8"))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}.", path=str(path),
                          fix="choose a writable --output folder.") from None


def write_summary(output: Path, summary: dict[str, Any]) -> None:
    """Add what a run did (``summary``) to the record beside ``output``, replaced whole."""
    try:
        record = json.loads(record_path(output).read_bytes())
    except (OSError, ValueError, RecursionError):
        return  # no record to add it to (a record that cannot be read is refused on resume)
    if isinstance(record, dict):
        write_record(output, {**record, "summary": summary})
