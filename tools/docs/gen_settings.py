"""Write the environment table of docs/settings.md from codeferry's one table of settings.

``python tools/docs/gen_settings.py`` rewrites the lines between ``<!-- env:begin`` and
``<!-- env:end -->``; ``tests/house/test_settings_doc.py`` fails while the page and
``codeferry._settings.SETTINGS`` differ.
"""

from __future__ import annotations

import re
from pathlib import Path

from codeferry import _settings

PAGE = Path(__file__).resolve().parents[2] / "docs" / "settings.md"  # from tools/docs/
_SECTION = re.compile(r"(<!-- env:begin[^>]*-->\n)(.*?)(\n<!-- env:end -->)", re.S)


def render(text: str) -> str:
    """``text`` with its environment table regenerated."""
    return _SECTION.sub(lambda m: m.group(1) + _settings.markdown().rstrip("\n") + m.group(3), text)


if __name__ == "__main__":
    PAGE.write_text(render(PAGE.read_text(encoding="utf-8")), encoding="utf-8")
