"""docs/settings.md lists every environment variable and option codeferry reads.

The table lies between the markers ``<!-- settings:begin -->`` and ``<!-- settings:end -->``
(where it can be regenerated)."""

from __future__ import annotations

import argparse
import re
import sys

from _helpers import ROOT

from codeferry import _settings, cli

sys.path.insert(0, str(ROOT / "tools" / "docs"))
import gen_settings

PAGE = (ROOT / "docs" / "settings.md").read_text(encoding="utf-8")
BEGIN, END = "<!-- settings:begin -->", "<!-- settings:end -->"
SETTINGS = PAGE[PAGE.index(BEGIN) + len(BEGIN):PAGE.index(END)]


def _variables_read() -> set[str]:
    """The variables ``_settings`` reads (the only module that reads any: test_layers)."""
    pattern = re.compile(r"""(?:environ(?:\.get|\.setdefault)?\(?\[?|getenv\(|_get\()\s*["']([A-Z][A-Z0-9_]+)["']""")
    text = (ROOT / "src" / "codeferry" / "_settings.py").read_text(encoding="utf-8")
    return set(pattern.findall(text)) | set(_settings.DEBUG_VARIABLES)


def test_every_environment_variable_read_is_in_the_table() -> None:
    read = _variables_read()
    assert {"CODEFERRY_HOME", "HF_HUB_CACHE", "HF_DEBUG", "CODEFERRY_LOCK"} <= read  # the scan works
    assert sorted(read - _settings.names()) == []


def test_the_page_shows_the_table_of_settings() -> None:
    assert PAGE == gen_settings.render(PAGE), "run: python tools/docs/gen_settings.py"
    for name in _settings.names():
        assert f"`{name}`" in SETTINGS, name


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
