"""``codeferry exec``: run a command whose every Python process loads remote code through codeferry.

The command replaces codeferry's process (``os.execvpe``: same process id, signals and exit
code), with the environment of ``codeferry._install.switch.variables`` added: codeferry's boot
folder first on ``PYTHONPATH``, ``CODEFERRY_INSTALL=1`` and, with ``--lock``, ``CODEFERRY_LOCK``.
``--print-env`` prints those variables instead, for where the command line is not the user's
(a Slurm script, a Ray ``runtime_env``).
"""

from __future__ import annotations

import errno
import json
import os
import shlex
import sys
from collections.abc import Sequence
from typing import NoReturn

from .. import _settings
from .._code.lockfile import read_lock
from .._install.switch import variables
from ..errors import CommandNotRunError

__all__ = ["exec_variables", "launch", "render_variables"]


def exec_variables(lock: str | None = None) -> dict[str, str]:
    """What ``codeferry exec`` adds to the environment; a ``lock`` that cannot be read raises
    ``LockFormatError`` here, before anything starts."""
    if lock is not None:
        read_lock(lock)
    return variables(lock)


def render_variables(found: dict[str, str], *, as_json: bool = False) -> str:
    """``export NAME=VALUE`` lines a shell can ``eval`` (a Slurm script), or one JSON object
    (a Ray ``runtime_env``'s ``env_vars``)."""
    if as_json:
        return json.dumps(found, indent=2) + "\n"
    return "".join(f"export {name}={shlex.quote(value)}\n" for name, value in found.items())


def launch(command: Sequence[str], *, lock: str | None = None, sandbox: bool = False) -> NoReturn:
    """Replace this process with ``command``, switched on (``exec_variables``); with
    ``sandbox``, in the box first (``_sandbox.box.enter_for_command``), so all it starts is."""
    env = _settings.environment_with(exec_variables(lock))
    if sandbox:
        from .._exec.engines.vllm_engine import vllm_version
        from .._sandbox.box import enter_for_command

        # Where vLLM is installed its engine runs in the command's process (unless the user
        # says otherwise): processes started in the box cannot read their own /proc files.
        vllm = vllm_version() is not None
        if vllm:
            env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **env}
        env = enter_for_command(list(command), env, groups=vllm)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    try:
        os.execvpe(command[0], list(command), env)
    except OSError as exc:
        missing = isinstance(exc, FileNotFoundError) or exc.errno == errno.ENOENT
        raise CommandNotRunError(
            f"cannot run {command[0]!r}: {exc.strerror or exc}.",
            command=command[0], status=127 if missing else 126,
            fix="check the command's name and PATH (or give its path), and that it is "
            "executable; what follows `--` is run as typed.",
        ) from None
