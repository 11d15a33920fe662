"""``codeferry verify``: check a model's code against a lock file."""

from __future__ import annotations

import argparse
import sys

from .command import Commands, add_command, bundle, demo
from .flags import add_common_flags
from .vouch import hub_options

__all__ = ["register", "verify_command"]


def verify_command(args: argparse.Namespace) -> int:
    """Check a model's code against a lock file (exit 1 on any difference).

    Static: executes nothing.
    """
    from .._code.lockfile import read_lock
    from .vouch import show_check, signed

    lock = read_lock(args.lock)
    model = args.model or demo()
    code = bundle(args)
    diff = lock.diff(code)
    if code.digest == lock.digest:
        check = lock.check_hub(code, token=args.token, endpoint=args.hub_endpoint) \
            if args.verify_hub else None
        signed(args, lock, code, sys.stdout)
        print(f"ok: {code.origin.name} matches {args.lock} ({lock.digest})")
        if check is not None:
            show_check(check, sys.stdout)
        return 0
    print(f"MISMATCH: {code.origin.name} is not the code locked in {args.lock}")
    print(f"  locked  {lock.digest}\n  actual  {code.digest}")
    for line in diff.lines():
        print(f"  {line}")
    if lock.is_for(code):
        print(f"after reviewing the changes, re-lock: codeferry lock {model} -o {args.lock}")
    else:
        print(f"{args.lock} is the lock of another model ({lock.model}); to lock "
              f"{code.origin.name}, write a new lock file (locking into {args.lock} would "
              f"overwrite it): codeferry lock {model} -o {lock.new_path(code)}")
    return 1


def register(sub: Commands) -> None:
    """Add ``verify`` to the command line."""
    command = add_command(sub, "verify", verify_command)
    command.add_argument("--lock", metavar="FILE", required=True, help="the lock file")
    hub_options(command, "(after the code matched the lock)")
    add_common_flags(command)
