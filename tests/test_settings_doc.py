"""docs/settings.md lists every environment variable and option codeferry reads.

The table lies between the markers ``<!-- settings:begin -->`` and ``<!-- settings:end -->``
(where it can be regenerated)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from codeferry import cli

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "settings.md").read_text(encoding="utf-8")
BEGIN, END = "<!-- settings:begin -->", "<!-- settings:end -->"
SETTINGS = PAGE[PAGE.index(BEGIN) + len(BEGIN):PAGE.index(END)]


def _variables_read() -> set[str]:
    """``os.environ.get("X")``, ``os.environ["X"]``, ``setdefault("X")``, ``getenv("X")`` in src."""
    found: set[str] = set()
    pattern = re.compile(r"""(?:environ(?:\.get|\.setdefault)?\(?\[?|getenv\()\s*["']([A-Z][A-Z0-9_]+)["']""")
    for path in (ROOT / "src" / "codeferry").rglob("*.py"):
        parts = path.relative_to(ROOT / "src" / "codeferry").parts
        if parts[0] in ("demo", "testing") or path.name.startswith("_audit"):
            continue  # the demo's code, test models' code, and audit rules about model code
        found.update(pattern.findall(path.read_text(encoding="utf-8")))
    return found | set(cli.DEBUG_VARIABLES)


def test_every_environment_variable_is_in_the_settings_table() -> None:
    read = _variables_read()
    assert {"CODEFERRY_HOME", "HF_HUB_CACHE", "HF_DEBUG"} <= read  # the scan finds them
    missing = sorted(name for name in read if f"`{name}`" not in SETTINGS)
    assert not missing, f"add these to docs/settings.md (between the settings markers): {missing}"


def test_every_command_line_option_is_in_the_settings_table() -> None:
    parser = cli._parser()
    options: set[str] = set()
    parsers = [parser]
    while parsers:
        current = parsers.pop()
        for action in current._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers.extend(action.choices.values())
            options.update(o for o in action.option_strings if o.startswith("--") and o != "--help")
    assert {"--cache-dir", "--revision", "--debug", "--version"} <= options
    missing = sorted(o for o in options if f"`{o}" not in SETTINGS)
    assert not missing, f"add these to docs/settings.md (between the settings markers): {missing}"


def test_from_pretrained_vocabulary_is_in_the_settings_table() -> None:
    for name in ("revision", "trust_remote_code", "cache_dir", "token", "local_files_only",
                 "code_revision", "dtype"):
        assert f"`{name}`" in SETTINGS, name
