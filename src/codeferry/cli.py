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
import inspect
import io
import json
import os
import shlex
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeAlias

from . import _settings
from ._code.resolve import Bundle
from ._commands.flags import add_sampling_flags
from ._commands.render import inspected, remote_tail, render_dot, write_atomic, write_graph
from ._commands.vouch import hub_options
from ._trust.options import ModelOptions
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


class UsageError(Exception):
    """Bad arguments: exit 2."""


def _demo() -> str:
    return str(Path(__file__).with_name("demo"))


def _show(args: argparse.Namespace, data: object, text: str) -> None:
    """A command's result on stdout: ``data`` as one JSON object with ``--json``, else ``text``."""
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        sys.stdout.write(text)


def _options(args: argparse.Namespace) -> ModelOptions:
    """The command's ``ModelOptions``: its options of the same names (``_common_options``,
    and ``--trust-remote-code``, ``--lock`` where it has them)."""
    return ModelOptions.of({"trust_remote_code": False, "lock": None, **vars(args)})


def _bundle(args: argparse.Namespace) -> Bundle:
    """The code of the command's MODEL (the demo without one), as a static command reads it."""
    return _options(args).resolve_code(args.model or _demo())


def _cmd_inspect(args: argparse.Namespace) -> int:
    """Show the classes, files, load order, requirements and problems of a model's code.

    Static analysis of a model's remote code. Executes nothing.
    """
    bundle = _bundle(args)
    if args.graph:
        try:
            write_graph(Path(args.graph), render_dot(bundle))
        except ValueError as exc:
            raise UsageError(f"--graph {args.graph}: {exc}") from None
    _show(args, *inspected(bundle))
    return 1 if bundle.blocking else 0


def _cmd_lock(args: argparse.Namespace) -> int:
    """Write a lock file: the exact code of a model, to review and to pin.

    Static: executes nothing. See the README for the format.
    """
    from ._code.lockfile import Lock
    from ._commands.vouch import follow_branch, show_check, signed

    if args.verify_hub:
        follow_branch(args, args.model or _demo())
    bundle = _bundle(args)
    bundle.check_classes()  # refused only when no class can load
    for ref in bundle.classes:
        for problem in bundle.problems_for(ref)[:1]:
            print(f"codeferry: note: {ref.key} cannot load: {problem}", file=sys.stderr)
    lock = signed(args, Lock.from_bundle(bundle), bundle, sys.stderr, locking=True)
    if args.verify_hub:  # before anything is written
        show_check(lock.check_hub(bundle, token=args.token, endpoint=args.hub_endpoint), sys.stderr)
    text = lock.dumps()
    if args.output:
        write_atomic(Path(args.output), text.encode("utf-8"))
        print(f"wrote {args.output} ({len(bundle.files)} files, {bundle.digest})", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    """Check a model's code against a lock file (exit 1 on any difference).

    Static: executes nothing.
    """
    from ._code.lockfile import read_lock
    from ._commands.vouch import show_check, signed

    lock = read_lock(args.lock)
    model = args.model or _demo()
    bundle = _bundle(args)
    diff = lock.diff(bundle)
    if bundle.digest == lock.digest:
        check = lock.check_hub(bundle, token=args.token, endpoint=args.hub_endpoint) \
            if args.verify_hub else None
        signed(args, lock, bundle, sys.stdout)
        print(f"ok: {bundle.origin.name} matches {args.lock} ({lock.digest})")
        if check is not None:
            show_check(check, sys.stdout)
        return 0
    print(f"MISMATCH: {bundle.origin.name} is not the code locked in {args.lock}")
    print(f"  locked  {lock.digest}\n  actual  {bundle.digest}")
    for line in diff.lines():
        print(f"  {line}")
    if lock.is_for(bundle):
        print(f"after reviewing the changes, re-lock: codeferry lock {model} -o {args.lock}")
    else:
        print(f"{args.lock} is the lock of another model ({lock.model}); to lock "
              f"{bundle.origin.name}, write a new lock file (locking into {args.lock} would "
              f"overwrite it): codeferry lock {model} -o {lock.new_path(bundle)}")
    return 1


def _cmd_doctor(args: argparse.Namespace) -> int:
    """Load a model here and in N fresh workers, and report what each worker saw.

    Executes the model's code here and in every worker: needs --trust-remote-code or
    --lock (except for the bundled demo).
    """
    from ._commands.doctor import doctor, render_doctor

    report = doctor(args.model or _demo(), workers=args.workers, start_method=args.start_method,
                    backend=args.backend, address=args.address, **_options(args).keywords())
    _show(args, report.to_json(), render_doctor(report))
    return 0 if report.ok else 1


def _cmd_audit(args: argparse.Namespace) -> int:
    """List what a model's code can do beyond computing (processes, network, files...).

    Static analysis of a model's remote code, by category. Executes nothing.
    """
    from ._code.audit.report import CATEGORIES, audit_bundle, render_audit

    fail_on = [c.strip() for text in args.fail_on for c in text.split(",") if c.strip()]
    unknown = sorted(set(fail_on) - set(CATEGORIES))
    if unknown:
        raise UsageError(
            f"--fail-on: unknown categor{'ies' if len(unknown) > 1 else 'y'} "
            f"{', '.join(map(repr, unknown))}; valid: {', '.join(CATEGORIES)}"
        )
    report = audit_bundle(_bundle(args))
    _show(args, report.to_json(), render_audit(report))
    return 1 if report.in_categories(fail_on) else 0


def _cmd_run(args: argparse.Namespace) -> int:
    """Run a model on every line of a file (generate, embed or score) into resumable JSONL.

    Batch inference on worker processes. Input: JSONL objects with an "id" and a
    "prompt" (or "text"), or plain text lines (id: the line number). Output: one JSON
    line per input, in input order; rerunning with the same --output resumes (and
    --retry-errors runs the error lines again). A fault of the machine (a broken
    executor, changed code, a batch timeout) stops the run, never written as a line: the
    same command resumes. With no arguments, runs the bundled demo model on its prompts
    and prints JSONL. Exit 0: every input has a result; 1: some failed (error lines) or an
    error; 2: usage.
    """
    from ._commands.flags import sampling_params
    from ._commands.run import run
    from .errors import SamplingParamsError

    try:
        params = sampling_params(args)
    except SamplingParamsError as exc:
        raise UsageError(f"--{exc.field.replace('_', '-')}: {exc}") from None
    if (params is not None or args.chat_template) and args.task != "generate":
        raise UsageError("sampling flags and --chat-template apply to --task generate only")
    if args.pooling is not None and args.task != "embed":
        raise UsageError("--pooling applies to --task embed only")
    if args.max_new_tokens is not None and args.task != "generate":
        raise UsageError("--max-new-tokens applies to --task generate only")
    for flag, value in (("--workers", args.workers), ("--batch-size", args.batch_size),
                        ("--max-new-tokens", args.max_new_tokens)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be at least 1, got {value}")
    if args.batch_timeout is not None and not args.batch_timeout > 0:
        raise UsageError(f"--batch-timeout must be more than 0 seconds, got {args.batch_timeout}")
    if args.input is None and args.model is not None:
        raise UsageError("--input FILE is required with a MODEL (without MODEL, the bundled "
                         "demo runs on its own prompts)")
    inputs = Path(args.input) if args.input else Path(_demo()) / "prompts.txt"
    output = args.output or "-"
    if output != "-":
        target = Path(output)
        if target.is_dir():
            raise UsageError(f"--output {output} is a folder: name a file")
        if (target.exists() and args.input != "-" and inputs.exists()
                and os.path.samefile(target, inputs)):
            raise UsageError(f"--output {output} is the input file: name another file")
    # The workers' "Loading weights" bars would garble ours (and clutter logs).
    _settings.quiet_hub_progress()
    try:
        result = run(
            args.model or _demo(), inputs, output, task=args.task, workers=args.workers,
            start_method=args.start_method, batch_size=args.batch_size,
            max_new_tokens=args.max_new_tokens, device=args.device, dtype=args.dtype,
            pooling=args.pooling, force_resume=args.force_resume, backend=args.backend,
            address=args.address, retry_errors=args.retry_errors,
            batch_timeout=args.batch_timeout, params=params, chat_template=args.chat_template,
            engine=args.engine,
            **_options(args).keywords(),
        )
    except BrokenPipeError:  # `codeferry run | head`: the reader left; stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    return 0 if result.failed == 0 else 1


def _cmd_exec(args: argparse.Namespace) -> int:
    """Run COMMAND so that its every Python process loads remote code through codeferry.

    As after `codeferry.install()`, in each process COMMAND starts and each one those start,
    through the variables PYTHONPATH (codeferry's boot folder first), CODEFERRY_INSTALL=1
    and, with --lock, CODEFERRY_LOCK. The exit code is COMMAND's. Not reached: processes that
    clear the environment or PYTHONPATH, other interpreters, `python -S`/`-I`/`-E`.
    """
    from ._commands.launch import exec_variables, launch, render_variables

    if args.print_env or args.json:
        sys.stdout.write(render_variables(exec_variables(args.lock), as_json=args.json))
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise UsageError("exec: give the command after `--` (codeferry exec --lock FILE -- CMD ...)")
    launch(command, lock=args.lock)  # replaces this process: COMMAND's exit code is ours


def _add_exec(sub: _Commands) -> argparse.ArgumentParser:
    command = _command(sub, _cmd_exec, model_help=None)
    _trust_options(command.add_mutually_exclusive_group(required=True))
    command.add_argument("--print-env", action="store_true",
                         help="print the variables (`export` lines) instead of running COMMAND")
    command.add_argument("--json", action="store_true", help="--print-env as one JSON object")
    command.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")
    return command


#: Every subcommand's MODEL: optional, the bundled demo when omitted (one rule for all).
_MODEL_HELP = ("a model folder, or a repo id of the Hugging Face Hub, downloaded unless "
               "cached or HF_HUB_OFFLINE=1 (default: the bundled demo model")


def _trust_options(command: argparse.ArgumentParser | argparse._MutuallyExclusiveGroup) -> None:
    """What the trust decision is made from, for a command that runs the model's code."""
    command.add_argument("--trust-remote-code", action="store_true",
                         help="allow the model's code to run here and in the workers")
    command.add_argument("--lock", metavar="FILE",
                         help="allow exactly the code this lock file lists")


def _worker_options(command: argparse.ArgumentParser, *, workers: int | None = None,
                    workers_help: str | None = None) -> None:
    """How many workers, started how, where: for a command that starts workers."""
    command.add_argument("--workers", type=int, default=workers, metavar="N", help=workers_help)
    command.add_argument("--start-method", choices=["spawn", "forkserver", "fork"],
                         default="spawn")
    command.add_argument("--backend", choices=["local", "ray"], default="local",
                         help="local worker processes, or Ray actors across a cluster "
                         "(needs `pip install 'codeferry[ray]'`)")
    command.add_argument("--address", metavar="ADDR",
                         help="the Ray cluster (--backend ray; default: RAY_ADDRESS, else a "
                         "local cluster)")


def _common_options(command: argparse.ArgumentParser) -> None:
    """Options every subcommand takes. ``--debug`` is also accepted before the command."""
    command.add_argument("--revision", help="branch, tag or commit of a repo (default: main)")
    command.add_argument("--code-revision", metavar="REVISION",
                         help="the revision whose code runs, as transformers' code_revision: "
                         "config and weights still come from --revision (default: --revision)")
    command.add_argument("--cache-dir", metavar="DIR",
                         help="the Hugging Face hub cache that holds MODEL (default: $HF_HUB_CACHE, "
                         "else $HF_HOME/hub, else $XDG_CACHE_HOME or ~/.cache, /huggingface/hub)")
    command.add_argument("--token", metavar="TOKEN",
                         help="Hugging Face token for a gated or private MODEL (default: $HF_TOKEN, "
                         "else the saved login)")
    command.add_argument("--local-files-only", action="store_true",
                         help="never download: MODEL must be in the hub cache already")
    command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                         help="show tracebacks")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="codeferry",
        description="Load Hugging Face remote code correctly in every process and on every node.",
    )
    parser.add_argument("--version", action="version", version=f"codeferry {package_version()}")
    parser.add_argument("--debug", action="store_true",
                        help="show tracebacks (also CODEFERRY_DEBUG=1 or HF_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", required=True)
    for add_command in (_add_inspect, _add_doctor, _add_audit, _add_run, _add_lock, _add_verify):
        _common_options(add_command(sub))  # last: after each command's own options in --help
    _add_exec(sub)  # no MODEL: the command's own processes load the models
    return parser


#: What ``add_subparsers`` returns: each ``_add_*`` adds its command's parser to it.
_Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def _command(sub: _Commands, func: Callable[[argparse.Namespace], int], *,
             model_help: str | None = ")", with_json: bool = False) -> argparse.ArgumentParser:
    """The subcommand ``_cmd_NAME`` runs: its help and description are the function's
    docstring, its first line and the rest; then its optional MODEL (none with
    ``model_help=None``; and ``--json``)."""
    summary, _, description = inspect.cleandoc(func.__doc__ or "").partition("\n\n")
    command = sub.add_parser(func.__name__.removeprefix("_cmd_"), help=summary.rstrip("."),
                             description=description)
    if model_help is not None:
        command.add_argument("model", nargs="?", default=None, help=_MODEL_HELP + model_help)
    if with_json:
        command.add_argument("--json", action="store_true", help="print one JSON object")
    command.set_defaults(func=func)
    return command


def _add_inspect(sub: _Commands) -> argparse.ArgumentParser:
    command = _command(sub, _cmd_inspect, with_json=True)
    command.add_argument("--graph", metavar="FILE", help="write the import graph (.dot, .svg, .png)")
    return command


def _add_doctor(sub: _Commands) -> argparse.ArgumentParser:
    command = _command(sub, _cmd_doctor, model_help="; the demo's code is trusted by its pinned "
                       "digest, any other needs --trust-remote-code or --lock)")
    _trust_options(command)
    _worker_options(command, workers=2)
    command.add_argument("--json", action="store_true", help="print one JSON object")
    return command


def _add_audit(sub: _Commands) -> argparse.ArgumentParser:
    command = _command(sub, _cmd_audit, with_json=True)
    command.add_argument("--fail-on", action="append", default=[], metavar="CATEGORY[,...]",
                         help="exit 1 when anything is found in these categories")
    return command


def _add_run(sub: _Commands) -> argparse.ArgumentParser:
    run = _command(sub, _cmd_run, model_help=", whose code is trusted by its pinned digest; "
                   "then --input defaults to its prompts)")
    run.add_argument("--input", metavar="FILE",
                     help="JSONL (OpenAI batch lines too) or plain text, one input per line; "
                     "- reads stdin (needed with a MODEL; default: the demo's prompts.txt)")
    run.add_argument("-o", "--output", metavar="FILE",
                     help="JSONL results; an existing file is resumed (default: stdout)")
    _trust_options(run.add_mutually_exclusive_group())
    run.add_argument("--task", choices=["generate", "embed", "score"], default="generate")
    _worker_options(run, workers_help="worker processes (default: 2 on CPU, 1 on a 1-core machine, "
                    "one per GPU; never more than batches)")
    run.add_argument("--batch-size", type=int, metavar="B",
                     help="inputs per batch (default: 8, fewer to give every worker a batch)")
    run.add_argument("--max-new-tokens", "--max-tokens", type=int, metavar="K",
                     help="most tokens to generate per input (--task generate; default: the "
                     "model's generation_config, else 16)")
    run.add_argument("--device", default="cpu", metavar="D",
                     help="cpu, cuda (one GPU per worker, round robin), cuda:N... (default: cpu)")
    run.add_argument("--dtype", choices=["float32", "float16", "bfloat16", "float64"],
                     help="weights dtype (default: the model's)")
    run.add_argument("--pooling", choices=["mean", "cls", "last"],
                     help="how token vectors become one embedding (--task embed; default: mean)")
    run.add_argument("--force-resume", action="store_true",
                     help="resume an --output that another model, code digest, task option or "
                     "dtype produced (OUTPUT.codeferry.json records what did; a mismatch is "
                     "refused without this flag; so is an input edited under ids already "
                     "answered, or an output without its record)")
    run.add_argument("--retry-errors", action="store_true",
                     help="run the inputs of the output's error lines again (the output is "
                     "rewritten whole, each id once, in input order, and renamed into place)")
    run.add_argument("--batch-timeout", type=float, metavar="SECONDS",
                     help="a worker whose batch runs longer is killed and replaced, the batch "
                     "retried; a batch that times out every attempt stops the run (default: none)")
    run.add_argument("--engine", choices=["transformers", "vllm", "auto"],
                     default="auto",
                     help="what generates in each worker: auto (the default: vLLM where it is "
                     "installed and runs the model, the model's transformers code otherwise, "
                     "the reason printed), transformers, or vllm (a model vLLM cannot run "
                     "fails at start-up); see docs/executor.md")
    add_sampling_flags(run)
    return run


def _add_lock(sub: _Commands) -> argparse.ArgumentParser:
    command = _command(sub, _cmd_lock)
    command.add_argument("-o", "--output", metavar="FILE", help="write here (default: stdout)")
    hub_options(command, "first (a branch: where it points on the Hub now); write nothing else")
    return command



def _add_verify(sub: _Commands) -> argparse.ArgumentParser:
    command = _command(sub, _cmd_verify)
    command.add_argument("--lock", metavar="FILE", required=True, help="the lock file")
    hub_options(command, "(after the code matched the lock)")
    return command


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
