"""What a run did: ``RunResult``, kept in the output's record and said on stderr at its end."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .progress import clock

__all__ = ["RunResult"]


@dataclass
class RunResult:
    """What a run did. ``failed`` counts the error lines of the whole output (this run's and
    earlier runs'); ``skipped`` the inputs an earlier run had written already (and this run
    did not run again)."""

    total: int
    skipped: int = 0
    written: int = 0
    failed: int = 0
    output: str | None = None
    #: Tokens of this run's prompts and completions (``generate``), and its seconds.
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    #: Results finished but not yet written (behind an unfinished input) when the run
    #: stopped, kept beside the output for the next run (``spill``).
    kept: int = 0

    @property
    def complete(self) -> bool:
        return self.skipped + self.written == self.total

    def summary(self) -> dict[str, Any]:
        """What the run did, as the record keeps it."""
        rate = self.completion_tokens / self.seconds if self.seconds > 0 else 0.0
        return {"total": self.total, "skipped": self.skipped, "written": self.written,
                "failed": self.failed, **({"kept": self.kept} if self.kept else {}),
                "seconds": round(self.seconds, 3),
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "tokens_per_second": round(rate, 1)}

    def line(self) -> str:
        """The closing line on stderr: ``N written, K failed, in T; X tokens/s``."""
        more = f" ({self.kept} more finished, kept for the resume)" if self.kept else ""
        text = f"{self.written} written{more}, {self.failed} failed, in {clock(self.seconds)}"
        if self.completion_tokens:
            return f"{text}; {self.summary()['tokens_per_second']} tokens/s"
        rate = self.written / self.seconds if self.seconds > 0 else 0.0
        return f"{text}; {rate:.1f} inputs/s"
