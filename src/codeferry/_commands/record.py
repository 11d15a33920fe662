"""What produced an output of ``codeferry run``, recorded next to it.

What produced an output is recorded next to it, in ``<output>.codeferry.json`` (written
atomically before the first line; the JSONL lines themselves stay as above)::

    {"format": "codeferry-run/1", "model": "org/name@<commit>", "digest": "sha256:...",
     "task": "generate", "options": {"max_new_tokens": 16, "dtype": null}, "earlier": []}

A resume whose model, code digest, task or options differ from the record is refused
with ``ResumeMismatchError`` naming each difference, so one output never silently mixes
them; ``force_resume`` (``--force-resume``) appends anyway and keeps the earlier record
in ``earlier``. An output written before records existed is resumed as before.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from .. import _settings
from .._code.resolve import Bundle
from ..errors import (
    OutputError,
    ResumeMismatchError,
)

# -- what produced the output ----------------------------------------------------------
from .inputs import Task

__all__ = ["check_record", "producer", "record_path", "write_record"]

_RECORD_FORMAT = "codeferry-run/1"


def record_path(output: Path) -> Path:
    """Where the record of what produced ``output`` lives: next to it."""
    return output.with_name(output.name + ".codeferry.json")


def producer(bundle: Bundle, weights: str, task: Task, max_new_tokens: int | None,
              pooling: str | None, dtype: str | None) -> dict[str, Any]:
    """What decides an output's lines: the model (``weights``: where its weights are from,
    its name), its code, the task and its options."""
    options: dict[str, Any] = {"dtype": dtype}
    if task == "generate":
        options["max_new_tokens"] = max_new_tokens or _settings.DEFAULT_MAX_NEW_TOKENS
    elif task == "embed":
        options["pooling"] = pooling or "mean"
    return {"model": weights, "digest": bundle.digest, "task": task,
            "options": options}


def _flat(producer: dict[str, Any]) -> dict[str, Any]:
    fields = {k: producer.get(k) for k in ("model", "digest", "task")}
    options = producer.get("options")
    for key, value in sorted((options if isinstance(options, dict) else {}).items()):
        fields[key] = value
    return fields


def check_record(output: Path, producer: dict[str, Any], resuming: bool,
                  force: bool) -> dict[str, Any] | None:
    """The record to write before the first line (``None``: the one there is right).

    Raises ``ResumeMismatchError`` when resuming an output another producer wrote.
    """
    path = record_path(output)
    fresh = {"format": _RECORD_FORMAT, **producer, "earlier": []}
    try:
        recorded: Any = json.loads(path.read_bytes())
    except FileNotFoundError:
        return fresh  # a new output, or one written before records existed
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        if not resuming or force:
            return fresh
        raise OutputError(
            f"cannot read {path}, the record of what produced {output}: {exc}.",
            path=str(path), fix="delete the output and its record to start over, or pass "
            "--force-resume to append to it anyway.") from None
    if not resuming:
        return fresh
    if not isinstance(recorded, dict) or recorded.get("format") != _RECORD_FORMAT:
        recorded = {}
    before, now = _flat(recorded), _flat(producer)
    differences = {key: (before.get(key), now[key]) for key in now if before.get(key) != now[key]}
    if not differences:
        return None
    if force:
        earlier = recorded.get("earlier")
        previous = {k: v for k, v in recorded.items() if k not in ("format", "earlier")}
        return {**fresh, "earlier": [*(earlier if isinstance(earlier, list) else []), previous]}
    shown = "; ".join(f"{key} was {json.dumps(old)}, is {json.dumps(new)}"
                      for key, (old, new) in differences.items())
    raise ResumeMismatchError(
        f"the existing output was produced by another {', '.join(differences)}: {shown} "
        f"(recorded in {path}).",
        path=str(output), differences=differences,
        fix="rerun with what produced it, choose another --output, delete the output and "
        "its record to start over, or pass --force-resume to append to it anyway.",
    )


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
