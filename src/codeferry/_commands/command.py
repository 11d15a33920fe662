"""What every command of the command line shares: its parser's shape, its MODEL, its output.

Each command's module (``inspect``, ``doctor``, ``audit``, ``run``, ``lock``, ``verify``,
``exec``) has a ``register(subparsers)`` that adds the command's parser (``add_command``,
then its own flags and the shared groups of ``flags``), and the function that runs it on
the parsed ``argparse.Namespace``; ``cli`` only builds the parser from the registrations and
maps errors to exit codes. A command's bad arguments raise ``UsageError`` (exit 2).
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeAlias

from .._code.resolve import Bundle
from .._exec.options import WorkerOptions
from .._trust.options import ModelOptions
from .flags import MODEL_HELP

__all__ = ["Commands", "UsageError", "add_command", "bundle", "demo", "model_options", "show",
           "worker_options"]


class UsageError(Exception):
    """Bad arguments: exit 2."""


#: What ``add_subparsers`` returns: each command's ``register`` adds its parser to it.
Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def demo() -> str:
    """The bundled demo model's folder: every command's MODEL when none is given."""
    return str(Path(__file__).parent.parent / "demo")


def show(args: argparse.Namespace, data: object, text: str) -> None:
    """A command's result on stdout: ``data`` as one JSON object with ``--json``, else ``text``."""
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        sys.stdout.write(text)


def model_options(args: argparse.Namespace) -> ModelOptions:
    """The command's ``ModelOptions``: its options of the same names (``common_options``,
    and ``--trust-remote-code``, ``--lock`` where it has them)."""
    return ModelOptions.of({"trust_remote_code": False, "lock": None, **vars(args)})


def worker_options(args: argparse.Namespace) -> WorkerOptions:
    """The command's ``WorkerOptions``: its options of the same names (``worker_options`` of
    ``flags``, and ``run``'s own: ``--device``, ``--batch-size``...)."""
    return WorkerOptions.of(vars(args))


def bundle(args: argparse.Namespace) -> Bundle:
    """The code of the command's MODEL (the demo without one), as a static command reads it."""
    return model_options(args).resolve_code(args.model or demo())


def add_command(sub: Commands, name: str, func: Callable[[argparse.Namespace], int], *,
                model_help: str | None = ")", with_json: bool = False) -> argparse.ArgumentParser:
    """The subcommand ``name`` that ``func`` runs: its help and description are the
    function's docstring, its first line and the rest; then its optional MODEL (none with
    ``model_help=None``; and ``--json``)."""
    summary, _, description = inspect.cleandoc(func.__doc__ or "").partition("\n\n")
    command = sub.add_parser(name, help=summary.rstrip("."), description=description)
    if model_help is not None:
        command.add_argument("model", nargs="?", default=None, help=MODEL_HELP + model_help)
    if with_json:
        command.add_argument("--json", action="store_true", help="print one JSON object")
    command.set_defaults(func=func)
    return command
