"""The version of codeferry, written once: ``version`` in ``pyproject.toml``.

An installed codeferry (``pip install``, ``pip install -e``) reads it from the package
metadata pip wrote from that file; a source tree used without installing it
(``PYTHONPATH=src``) reads it from the ``pyproject.toml`` above ``src/``.
"""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

__all__ = ["package_version", "from_pyproject"]

#: What a source tree without a readable ``pyproject.toml`` reports (PEP 440 local version).
UNKNOWN = "0+unknown"

_VERSION = re.compile(r'^version\s*=\s*["\']([^"\']+)["\']', re.MULTILINE)
_PROJECT = re.compile(r"^\[project\]\s*$", re.MULTILINE)


def from_pyproject(path: Path) -> str | None:
    """The ``[project]`` version of the ``pyproject.toml`` at ``path`` (``None``: none there).

    A regular expression, not ``tomllib``: Python 3.10 has no TOML reader, and codeferry
    takes no dependency for reading one line of its own file.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    start = _PROJECT.search(text)
    if start is None:
        return None
    table = text[start.end():]
    following = re.search(r"^\[", table, re.MULTILINE)
    found = _VERSION.search(table[:following.start()] if following else table)
    return found.group(1) if found else None


def package_version() -> str:
    """This codeferry's version: its metadata, else its source tree's ``pyproject.toml``."""
    try:
        return version("codeferry")
    except PackageNotFoundError:
        return from_pyproject(Path(__file__).resolve().parents[2] / "pyproject.toml") or UNKNOWN
