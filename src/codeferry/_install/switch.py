"""The environment switch: every Python process of a command loads remote code through codeferry.

``codeferry exec -- COMMAND`` (or the two variables alone, where the command line is not
the user's: a Slurm script, a Ray ``runtime_env``) starts COMMAND with

- ``PYTHONPATH`` beginning with ``BOOT``, a folder that holds one file, ``sitecustomize.py``,
  which Python imports at the start of every process (``site``), and
- ``CODEFERRY_INSTALL=1``, the switch it reads (through ``_settings``); ``CODEFERRY_LOCK``
  adds a lock every process enforces.

The environment reaches every process COMMAND starts and every process those start (spawn,
forkserver, ``subprocess``, ``torchrun``'s ranks...), so each one does what ``install()``
does in the calling process: it routes transformers' ``get_class_from_dynamic_module``
through codeferry. Nothing happens at start-up beyond reading the switch: the boot waits for
``transformers.dynamic_module_utils`` to be imported and calls ``route`` then, so a process
that never imports transformers pays for nothing more (nor imports codeferry), and one that
does is routed before its first remote class.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from .. import _settings
from .._trust.decide import environment_lock
from . import adopt

__all__ = ["BOOT", "WATCHED", "completed", "route", "variables"]

logger = logging.getLogger(__name__)

#: The folder ``codeferry exec`` puts first on ``PYTHONPATH``: ``sitecustomize.py`` only.
BOOT = Path(__file__).resolve().with_name("boot")


def variables(lock: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """The environment variables that switch codeferry on in every process started with them:
    ``PYTHONPATH`` (``BOOT`` first, then this process's entries, in order), ``CODEFERRY_INSTALL``
    and, with ``lock``, ``CODEFERRY_LOCK`` (its absolute path)."""
    boot = str(BOOT)
    rest = [p for p in _settings.python_path() if not p or os.path.abspath(p) != boot]
    out = {"PYTHONPATH": os.pathsep.join([boot, *rest]), "CODEFERRY_INSTALL": "1"}
    if lock is not None:
        out["CODEFERRY_LOCK"] = os.path.abspath(lock)
    return out


def route(dmu: Any) -> None:
    """The boot calls this once transformers' ``dynamic_module_utils`` (``dmu``) has executed,
    in a process started with the switch on: from now on every remote class transformers asks
    for goes through codeferry, checked against ``CODEFERRY_LOCK`` when it names a lock (a lock
    that cannot be read raises ``LockFormatError`` here, so the import of transformers fails
    and nothing runs unchecked)."""
    adopt.install_while_importing(dmu, environment_lock(), log=logger)


#: The modules the boot hands to ``completed`` once each has executed.
WATCHED = adopt.WATCHED


def completed(module: Any) -> None:
    """The boot calls this right after a module of ``WATCHED`` executes, in a process started
    with the switch on: the Hub kernel gates and the ``generate()`` hook that belong to it go
    in now (``adopt.module_completed``), before any model of it can load."""
    adopt.module_completed(module)
