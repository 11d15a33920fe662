"""``codeferry lock``: write a lock file, the exact code of a model, to review and to pin."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .command import Commands, add_command, bundle, demo
from .flags import add_common_flags
from .render import write_atomic
from .vouch import hub_options

__all__ = ["lock_command", "register"]


def lock_command(args: argparse.Namespace) -> int:
    """Write a lock file: the exact code of a model, to review and to pin.

    Static: executes nothing. See the README for the format.
    """
    from .._code.lockfile import Lock
    from .._exec.plan import release_line
    from .vouch import follow_branch, show_check, signed

    if args.verify_hub:
        follow_branch(args, args.model or demo())
    code = bundle(args)
    code.check_classes()  # refused only when no class can load
    line = release_line(code)
    if line is not None:  # names a release serves: the executor's workers run it there
        print(f"codeferry: note: the executor's workers run this code on transformers {line} "
              "(`codeferry inspect` says why); load() in your process cannot", file=sys.stderr)
    for ref in code.classes:
        for problem in (code.on_release() if line else code).problems_for(ref)[:1]:
            print(f"codeferry: note: {ref.key} cannot load: {problem}", file=sys.stderr)
    lock = signed(args, Lock.from_bundle(code), code, sys.stderr, locking=True)
    if args.verify_hub:  # before anything is written
        show_check(lock.check_hub(code, token=args.token, endpoint=args.hub_endpoint), sys.stderr)
    text = lock.dumps()
    if args.output:
        write_atomic(Path(args.output), text.encode("utf-8"))
        print(f"wrote {args.output} ({len(code.files)} files, {code.digest})", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def register(sub: Commands) -> None:
    """Add ``lock`` to the command line."""
    command = add_command(sub, "lock", lock_command)
    command.add_argument("-o", "--output", metavar="FILE", help="write here (default: stdout)")
    hub_options(command, "first (a branch: where it points on the Hub now); write nothing else")
    add_common_flags(command)
