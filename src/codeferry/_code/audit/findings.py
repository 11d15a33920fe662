"""The findings of ``codeferry audit``: categories, one ``Finding`` per place, the report.

The categories and what each covers are described in ``report``; the ``--json`` shape of a
report is ``AuditReport.to_json``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..automap import qualified

__all__ = ["CATEGORIES", "Finding", "AuditReport"]

CATEGORIES: tuple[str, ...] = (
    "process",
    "network",
    "dynamic-code",
    "native-code",
    "file-read",
    "file-write",
    "unpickle",
    "environment",
)


@dataclass(frozen=True)
class Finding:
    """One thing the code can do: ``path`` is relative to its repo (``repo=None``: the model's).

    ``box`` says what the box (``--sandbox``) does with it, so a user knows before running
    which lines would fail there: ``refused...``, or how it is limited; empty when the box
    lets it be.
    """

    repo: str | None
    path: str
    line: int
    col: int
    category: str
    code: str
    reason: str
    box: str = ""

    @property
    def refused(self) -> bool:
        """Whether the box refuses it (surely, or unless what the note names holds)."""
        return self.box.startswith("refused")

    @property
    def file(self) -> str:
        """The file as ``inspect`` shows it: ``org/repo--path`` for another repo's code."""
        return qualified(self.repo, self.path)

    @property
    def location(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"

    def to_json(self) -> dict[str, Any]:
        return {
            "category": self.category,
            "file": self.path,
            "repo": self.repo,
            "line": self.line,
            "col": self.col,
            "code": self.code,
            "reason": self.reason,
            "sandbox": self.box or None,
        }


@dataclass(frozen=True)
class AuditReport:
    """The findings of one model; ``skipped`` lists files that are not Python (with why)."""

    model: str
    digest: str
    findings: tuple[Finding, ...]
    skipped: tuple[tuple[str, str], ...] = ()

    @property
    def counts(self) -> dict[str, int]:
        """Findings per category, every category included."""
        counts = dict.fromkeys(CATEGORIES, 0)
        for finding in self.findings:
            counts[finding.category] += 1
        return counts

    @property
    def refused(self) -> tuple[Finding, ...]:
        """The findings the box (``--sandbox``) refuses."""
        return tuple(f for f in self.findings if f.refused)

    def in_categories(self, categories: Iterable[str]) -> tuple[Finding, ...]:
        wanted = set(categories)
        return tuple(f for f in self.findings if f.category in wanted)

    def to_json(self) -> dict[str, Any]:
        """The ``codeferry audit --json`` object."""
        return {
            "model": self.model,
            "digest": self.digest,
            "findings": [f.to_json() for f in self.findings],
            "counts": self.counts,
            "skipped": [{"file": file, "reason": why} for file, why in self.skipped],
        }
