"""The ``codeferry`` command line.

Exit codes: 0 success, 1 the model has blocking problems (or a command found them),
2 usage errors (bad arguments, a model that is not there). Errors print one line
(``codeferry: error: ...``); ``--debug`` adds the traceback. Nothing is written when a
command fails: outputs go to a temporary file that is renamed into place at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from . import __version__
from ._render import render_dot, render_report
from ._resolve import resolve
from .errors import CodeferryError, ModelNotFoundError

__all__ = ["main"]


class UsageError(Exception):
    """Bad arguments: exit 2."""


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all (temp file in the same folder, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _write_graph(path: Path, dot: str) -> None:
    fmt = path.suffix.lower().lstrip(".")
    if fmt in {"dot", "gv", ""}:
        _write_atomic(path, dot.encode("utf-8"))
        return
    if fmt not in {"svg", "png"}:
        raise UsageError(f"--graph {path}: use a .dot, .svg or .png file name")
    exe = shutil.which("dot")
    if exe is None:
        raise UsageError(
            f"--graph {path}: rendering {fmt.upper()} needs Graphviz's `dot` "
            "(apt-get install graphviz); or write .dot instead"
        )
    rendered = subprocess.run(
        [exe, f"-T{fmt}"], input=dot.encode("utf-8"), capture_output=True, check=True
    ).stdout
    _write_atomic(path, rendered)


def _demo() -> str:
    return str(Path(__file__).with_name("demo"))


def _cmd_inspect(args: argparse.Namespace) -> int:
    bundle = resolve(args.model or _demo(), revision=args.revision)
    if args.graph:
        _write_graph(Path(args.graph), render_dot(bundle))
    if args.json:
        print(json.dumps(bundle.to_json(), indent=2))
    else:
        sys.stdout.write(render_report(bundle))
    return 1 if bundle.blocking else 0


def _cmd_lock(args: argparse.Namespace) -> int:
    from ._lockfile import Lock

    bundle = resolve(args.model or _demo(), revision=args.revision)
    bundle.check()
    text = Lock.from_bundle(bundle).dumps()
    if args.output:
        _write_atomic(Path(args.output), text.encode("utf-8"))
        print(f"wrote {args.output} ({len(bundle.files)} files, {bundle.digest})", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from ._lockfile import read_lock

    lock = read_lock(args.lock)
    bundle = resolve(args.model, revision=args.revision)
    diff = lock.diff(bundle)
    if bundle.digest == lock.digest:
        print(f"ok: {bundle.source.name} matches {args.lock} ({lock.digest})")
        return 0
    print(f"MISMATCH: {bundle.source.name} is not the code locked in {args.lock}")
    print(f"  locked  {lock.digest}\n  actual  {bundle.digest}")
    for line in diff.lines():
        print(f"  {line}")
    print(f"after reviewing the changes, re-lock: codeferry lock {args.model} -o {args.lock}")
    return 1


def _cmd_doctor(args: argparse.Namespace) -> int:
    from ._doctor import doctor, render_doctor

    report = doctor(
        args.model, trust_remote_code=args.trust_remote_code, workers=args.workers,
        start_method=args.start_method, revision=args.revision, lock=args.lock,
    )
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        sys.stdout.write(render_doctor(report))
    return 0 if report.ok else 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="codeferry",
        description="Load Hugging Face remote code correctly in every process and on every node.",
    )
    parser.add_argument("--version", action="version", version=f"codeferry {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)

    inspect = sub.add_parser(
        "inspect",
        help="show the classes, files, load order, requirements and problems of a model's code",
        description="Static analysis of a model's remote code. Executes nothing.",
    )
    inspect.add_argument(
        "model", nargs="?", default=None,
        help="a model folder, or a repo id in the local Hugging Face cache (default: the bundled demo)",
    )
    inspect.add_argument("--revision", help="branch, tag or commit of a cached repo (default: main)")
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    inspect.add_argument("--graph", metavar="FILE", help="write the import graph (.dot, .svg, .png)")
    inspect.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    inspect.set_defaults(func=_cmd_inspect)

    doc = sub.add_parser(
        "doctor",
        help="load a model here and in N fresh workers, and report what each worker saw",
        description="Executes the model's code here and in every worker: needs --trust-remote-code.",
    )
    doc.add_argument("model", help="a model folder, or a repo id in the local Hugging Face cache")
    doc.add_argument("--revision", help="branch, tag or commit of a cached repo (default: main)")
    doc.add_argument("--trust-remote-code", action="store_true",
                     help="allow the model's code to run here and in the workers")
    doc.add_argument("--lock", metavar="FILE", help="allow exactly the code this lock file lists")
    doc.add_argument("--workers", type=int, default=2, metavar="N")
    doc.add_argument("--start-method", choices=["spawn", "forkserver", "fork"], default="spawn")
    doc.add_argument("--json", action="store_true", help="print one JSON object")
    doc.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    doc.set_defaults(func=_cmd_doctor)

    lock = sub.add_parser(
        "lock", help="write a lock file: the exact code of a model, to review and to pin",
        description="Static: executes nothing. See the README for the format.",
    )
    lock.add_argument("model", nargs="?", default=None,
                      help="a model folder or cached repo id (default: the bundled demo)")
    lock.add_argument("--revision", help="branch, tag or commit of a cached repo (default: main)")
    lock.add_argument("-o", "--output", metavar="FILE", help="write here (default: stdout)")
    lock.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    lock.set_defaults(func=_cmd_lock)

    verify = sub.add_parser(
        "verify", help="check a model's code against a lock file (exit 1 on any difference)",
        description="Static: executes nothing.",
    )
    verify.add_argument("model", help="a model folder, or a repo id in the local Hugging Face cache")
    verify.add_argument("--lock", metavar="FILE", required=True, help="the lock file")
    verify.add_argument("--revision", help="branch, tag or commit of a cached repo (default: main)")
    verify.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    verify.set_defaults(func=_cmd_verify)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``codeferry`` console script."""
    parser = _parser()
    args = parser.parse_args(argv)
    debug: bool = args.debug
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except (UsageError, ModelNotFoundError) as exc:
        if debug:
            traceback.print_exc()
        print(f"codeferry: error: {exc}", file=sys.stderr)
        return 2
    except CodeferryError as exc:
        if debug:
            traceback.print_exc()
        print(f"codeferry: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
