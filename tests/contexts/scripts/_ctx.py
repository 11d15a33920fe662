"""What every context script shares: its models, the mode's one codeferry line, one JSON report.

A context script is plain transformers, written as its library's users write it. It is run
three ways by ``tests/contexts/_contexts.py``: as it is; with ``CTX_MODE=codeferry``, where
``codeferry_if_asked()`` is the line a user adds at the top of the script
(``codeferry.install()``); and unchanged under ``codeferry exec``. ``argv[1]`` is a JSON file
of ``[[layout, model], ...]`` (a folder, or a repo id in the offline hub cache); ``argv[2]``
a folder the script may write to.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any


def codeferry_if_asked() -> None:
    """``codeferry.install()``, in the mode that tests a script calling codeferry; called at
    the top of the script, so spawn and forkserver children (which import the main module
    again) run it too."""
    if os.environ.get("CTX_MODE") == "codeferry":
        import codeferry

        codeferry.install()


def layouts() -> list[tuple[str, str]]:
    with open(sys.argv[1], encoding="utf-8") as handle:
        return [(name, model) for name, model in json.load(handle)]


def out_dir() -> str:
    return sys.argv[2]


def error(exc: BaseException) -> dict[str, str]:
    """An error as the report carries it: type and message (short), and where it was raised."""
    where = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    return {"error": type(exc).__name__, "message": str(exc)[:400],
            "at": f"{where[0].filename}:{where[0].lineno}" if where else ""}


def attempt(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return fn()
    except Exception as exc:  # the report says what failed; the test decides
        return error(exc)


def module_of(obj: Any) -> str:
    """``codeferry._dyn`` or ``transformers_modules``: who loaded the class of ``obj``."""
    cls = obj if isinstance(obj, type) else type(obj)
    return "codeferry" if cls.__module__.startswith("codeferry._dyn") else cls.__module__.split(".")[0]


def report(result: dict[str, Any], path: str | None = None) -> None:
    text = json.dumps(result, sort_keys=True)
    if path is None:
        print(text, flush=True)
    else:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
