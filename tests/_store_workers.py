"""Functions that run in executor workers for ``test_worker_replies`` (importable by name
in a worker; nothing of codeferry imported at module level)."""

from __future__ import annotations

import sys
from typing import Any


def explode(message: str) -> None:
    """Called while unpickling a ``Bomb``: the worker cannot rebuild the object."""
    raise ValueError(message)


class Bomb:
    """Pickles fine, and raises when unpickled."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (explode, ("this object cannot be unpickled here",))


def leave(engine: Any, how: str) -> None:
    if how == "exit":
        raise SystemExit(3)
    raise KeyboardInterrupt


def echo(engine: Any, value: Any) -> Any:
    return value


def raise_foreign(engine: Any, model: str) -> None:
    """A compromised worker: drops its lock, loads code no lock lists, and raises an
    exception class that code defines (its reply names a module the parent does not have)."""
    from codeferry import load
    from codeferry._trust import policy as _policy

    _policy._locked = False
    classes = load(model, trust_remote_code=True)
    module = sys.modules[classes["AutoConfig"].__module__]
    raise module.EvilError("raised by code that no lock lists")
