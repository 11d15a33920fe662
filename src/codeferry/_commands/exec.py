"""``codeferry exec``: run a command whose every Python process loads remote code through
codeferry (``launch`` does the work)."""

from __future__ import annotations

import argparse
import sys

from .. import _settings
from .command import Commands, UsageError, add_command
from .flags import add_trust_flags

__all__ = ["exec_command", "register"]


def exec_command(args: argparse.Namespace) -> int:
    """Run COMMAND so that its every Python process loads remote code through codeferry.

    As after `codeferry.install()`, in each process COMMAND starts and each one those start,
    through the variables PYTHONPATH (codeferry's boot folder first), CODEFERRY_INSTALL=1
    and, with --lock, CODEFERRY_LOCK. The exit code is COMMAND's. Not reached: processes that
    clear the environment or PYTHONPATH, other interpreters, `python -S`/`-I`/`-E`.
    --sandbox (or CODEFERRY_SANDBOX=1) boxes this process before COMMAND replaces it: the
    kernel holds COMMAND and all it starts, whatever their flags.
    """
    from .launch import exec_variables, launch, render_variables

    if (args.print_env or args.json) and args.sandbox:
        raise UsageError("exec: --sandbox boxes the command it runs; variables cannot carry the "
                         "box to another one (run the command under `codeferry exec --sandbox`)")
    if args.print_env or args.json:
        sys.stdout.write(render_variables(exec_variables(args.lock), as_json=args.json))
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise UsageError("exec: give the command after `--` (codeferry exec --lock FILE -- CMD ...)")
    sandbox = args.sandbox or _settings.sandbox_switch()
    launch(command, lock=args.lock, sandbox=sandbox)  # replaces this process: COMMAND's exit code


def register(sub: Commands) -> None:
    """Add ``exec`` to the command line: no MODEL (the command's own processes load the
    models), and none of the common flags."""
    command = add_command(sub, "exec", exec_command, model_help=None)
    add_trust_flags(command.add_mutually_exclusive_group(required=True))
    command.add_argument("--print-env", action="store_true",
                         help="print the variables (`export` lines) instead of running COMMAND")
    command.add_argument("--json", action="store_true", help="--print-env as one JSON object")
    command.add_argument("--sandbox", action="store_true",
                         help="run COMMAND and all it starts in the box (docs/security.md): "
                         "no home, no network, no credentials, no other programs")
    command.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")
