"""The ``codeferry`` command line.

Exit codes: 0 success, 1 the model has blocking problems (or a command found them),
2 usage errors (bad arguments, a model that is not there, a device this machine lacks),
3 ``--verify-hub`` could not ask the Hub (offline, no connection): nothing was checked.
Errors print one line (``codeferry: error: ...``), after the last frames of the worker's
traceback when a worker failed; ``--debug`` (or ``CODEFERRY_DEBUG=1``, or huggingface_hub's
``HF_DEBUG=1``) adds the whole traceback. Nothing is written
when a command fails: outputs go to a temporary file that is renamed into place at the end.
Every command's MODEL is optional: without it, the command works on the bundled demo.
"""

from __future__ import annotations

import argparse
import io
import shlex
import sys
import traceback
from collections.abc import Callable, Sequence

from . import _settings
from ._commands import audit, doctor, lock, release, run, verify
from ._commands import exec as exec_command
from ._commands import inspect as inspect_command
from ._commands.command import Commands, UsageError, demo
from ._commands.render import remote_tail
from ._version import package_version
from .errors import (
    CodeferryError,
    CommandNotRunError,
    DeviceError,
    HubUncheckedError,
    InputNotFoundError,
    ModelNotFoundError,
    RunStoppedError,
)

__all__ = ["main"]

#: Each command's ``register``, in the order of ``codeferry --help``: the command's module
#: (``_commands``) holds its flags, its checks and the function that runs it.
_COMMANDS: tuple[Callable[[Commands], None], ...] = (
    inspect_command.register, doctor.register, audit.register, run.register, lock.register,
    verify.register, release.register, exec_command.register)


def _demo() -> str:
    """The bundled demo model's folder: every command's MODEL when none is given."""
    return demo()


def _parser() -> argparse.ArgumentParser:
    """The whole command line: codeferry's own options, then every command's parser."""
    parser = argparse.ArgumentParser(
        prog="codeferry",
        description="Load Hugging Face remote code correctly in every process and on every node.",
    )
    parser.add_argument("--version", action="version", version=f"codeferry {package_version()}")
    parser.add_argument("--debug", action="store_true",
                        help="show tracebacks (also CODEFERRY_DEBUG=1 or HF_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", required=True)
    for register in _COMMANDS:
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``codeferry`` console script."""
    parser = _parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    debug: bool = args.debug or _settings.debug()
    func: Callable[[argparse.Namespace], int] = args.func
    for stream in (sys.stdout, sys.stderr):
        # Names from the model (JSON keys, file names) may hold lone surrogates, which a
        # strict UTF-8 terminal cannot encode: print them escaped instead of crashing.
        if isinstance(stream, io.TextIOWrapper) and stream.errors == "strict":
            stream.reconfigure(errors="backslashreplace")
    try:
        return func(args)
    except (UsageError, ModelNotFoundError, InputNotFoundError, DeviceError) as exc:
        if debug:
            traceback.print_exc()
        print(f"codeferry: error: {exc}", file=sys.stderr)
        return 2
    except CodeferryError as exc:
        if debug:
            traceback.print_exc()  # the worker's whole traceback included
        else:
            tail = remote_tail(exc)
            if tail:
                print(tail, file=sys.stderr, end="")
        print(f"codeferry: error: {exc}", file=sys.stderr)
        if isinstance(exc, RunStoppedError) and exc.output is not None:
            exc.resume = "codeferry " + shlex.join(argv)
            print(f"codeferry: to resume, run: {exc.resume}", file=sys.stderr)
        elif args.command == "run" and args.output not in (None, "-") and _machine_fault(exc):
            # e.g. no worker could start: nothing was written for any input, and the same
            # command, once the machine is fixed, runs (or resumes) the whole input
            print(f"codeferry: to resume, run: codeferry {shlex.join(argv)}", file=sys.stderr)
        if isinstance(exc, HubUncheckedError):
            return 3  # not checked: neither success nor a mismatch
        return exc.status if isinstance(exc, CommandNotRunError) else 1  # 127, 126 as a shell
    except KeyboardInterrupt:
        return 130


def _machine_fault(exc: BaseException) -> bool:
    from ._commands.faults import is_machine_fault

    return is_machine_fault(exc)


if __name__ == "__main__":
    sys.exit(main())
