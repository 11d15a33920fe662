"""``python -m codeferry``: the ``codeferry`` command, for environments without the script.

Guarded: spawn and forkserver workers import the main module again (as ``__mp_main__``),
and must not run the command a second time.
"""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
