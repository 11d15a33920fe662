"""Results finished ahead of the write position, kept beside the output until written.

The output is written in input order, so a result that finishes behind a slow input waits.
Each waiting line is also appended to ``<output>.codeferry.spill`` (one ``os.write`` per
entry, under the output's lock), so an interrupt, a crash or ``kill -9`` loses none of them:
the next run of the same command writes them where they belong without computing them again.
The file is removed when a run has written every input.

Each entry is one JSON line: ``{"id": ..., "digest": ..., "failed": ..., "usage": [p, c],
"line": "<the output line>"}``; the first line names the producer
(``{"producer": "<digest>"}``). An entry is taken only when its producer and its input's
request digest (``record.input_digests``) are this run's, so an edited input or another
model computes again; an entry torn by a kill is skipped.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._code.digest import text_digest
from ..errors import OutputError
from .inputs import Id, InputItem
from .record import input_digests

__all__ = ["Kept", "Spill", "spill_path"]


def spill_path(output: Path) -> Path:
    """Where the results waiting to be written to ``output`` are kept."""
    return output.with_name(output.name + ".codeferry.spill")


@dataclass(frozen=True)
class Kept:
    """A finished result kept in the spill: its output line, whether it is an error line,
    its prompt and completion tokens."""

    line: bytes
    failed: bool
    prompt_tokens: int = 0
    completion_tokens: int = 0


class Spill:
    """The spill of one output, for one producer (``producer``: the record's)."""

    def __init__(self, output: Path, producer: dict[str, Any],
                 items: Sequence[InputItem]) -> None:
        self.path = spill_path(output)
        self.producer = text_digest(json.dumps(producer, sort_keys=True, default=str))
        self.digests = input_digests(items)
        self.fd: int | None = None
        self.unsynced = False
        #: What ``read`` found: the kept results this run writes without computing them.
        self.kept: dict[Id, Kept] = {}

    def read(self, wanted: set[Id]) -> dict[Id, Kept]:
        """The kept results of the ids in ``wanted`` that this run would compute alike (also
        ``self.kept``)."""
        self.kept = self._read(wanted)
        return self.kept

    def _read(self, wanted: set[Id]) -> dict[Id, Kept]:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise _error(self.path, exc) from None
        lines = data.split(b"\n")
        if not lines or _load(lines[0]).get("producer") != self.producer:
            return {}  # another producer's (a forced resume): computed again
        kept: dict[Id, Kept] = {}
        for raw in lines[1:]:
            entry = _load(raw)
            ident = entry.get("id")
            if (isinstance(ident, (str, int)) and not isinstance(ident, bool)
                    and ident in wanted and isinstance(entry.get("line"), str)
                    and entry.get("digest") == self.digests.get(json.dumps(ident))):
                usage = entry.get("usage") or [0, 0]
                kept[ident] = Kept(entry["line"].encode("utf-8"), bool(entry.get("failed")),
                                   int(usage[0]), int(usage[1]))
        return kept

    def keep(self, ident: Id, kept: Kept) -> None:
        """Append one finished result (the file started with its producer line)."""
        if self.fd is None:
            try:
                self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT
                                  | os.O_CLOEXEC, 0o644)
                if not self._ours():  # new, or another producer's: started over
                    os.ftruncate(self.fd, 0)
                    self._write({"producer": self.producer})
            except OSError as exc:
                raise _error(self.path, exc) from None
        self._write({"id": ident, "digest": self.digests.get(json.dumps(ident)),
                     "failed": kept.failed, "usage": [kept.prompt_tokens, kept.completion_tokens],
                     "line": kept.line.decode("utf-8")})
        self.unsynced = True

    def _ours(self) -> bool:
        with contextlib.suppress(OSError), self.path.open("rb") as source:
            return _load(source.readline()).get("producer") == self.producer
        return False

    def _write(self, entry: dict[str, Any]) -> None:
        assert self.fd is not None
        data = (json.dumps(entry, ensure_ascii=False) + "\n").encode("utf-8")
        try:
            done = os.write(self.fd, data)
            while done < len(data):
                done += os.write(self.fd, data[done:])
        except OSError as exc:
            raise _error(self.path, exc) from None

    def sync(self) -> None:
        """On disk with the output's lines."""
        if self.fd is not None and self.unsynced:
            os.fsync(self.fd)
            self.unsynced = False

    def close(self, *, complete: bool) -> None:
        """Close; ``complete`` (every input is in the output): nothing is left to keep."""
        if self.fd is not None:
            fd, self.fd = self.fd, None
            with contextlib.suppress(OSError):
                if self.unsynced and not complete:
                    os.fsync(fd)
            os.close(fd)
        if complete:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


def _load(raw: bytes) -> dict[str, Any]:
    try:
        entry = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        return {}
    return entry if isinstance(entry, dict) else {}


def _error(path: Path, exc: OSError) -> OutputError:
    return OutputError(f"cannot keep finished results in {path}: {exc.strerror or exc}.",
                       path=str(path), fix="free space or make the output's folder writable, "
                       "then rerun to resume.")
