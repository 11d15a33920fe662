"""``codeferry audit``: what a model's code can do beyond computing, by category."""

from __future__ import annotations

import argparse

from .command import Commands, UsageError, add_command, bundle, show
from .flags import add_common_flags

__all__ = ["audit_command", "register"]


def audit_command(args: argparse.Namespace) -> int:
    """List what a model's code can do beyond computing (processes, network, files...).

    Static analysis of a model's remote code, by category. Executes nothing.
    """
    from .._code.audit.report import CATEGORIES, audit_bundle, render_audit

    fail_on = [c.strip() for text in args.fail_on for c in text.split(",") if c.strip()]
    unknown = sorted(set(fail_on) - set(CATEGORIES))
    if unknown:
        raise UsageError(
            f"--fail-on: unknown categor{'ies' if len(unknown) > 1 else 'y'} "
            f"{', '.join(map(repr, unknown))}; valid: {', '.join(CATEGORIES)}"
        )
    report = audit_bundle(bundle(args))
    show(args, report.to_json(), render_audit(report))
    return 1 if report.in_categories(fail_on) else 0


def register(sub: Commands) -> None:
    """Add ``audit`` to the command line."""
    command = add_command(sub, "audit", audit_command, with_json=True)
    command.add_argument("--fail-on", action="append", default=[], metavar="CATEGORY[,...]",
                         help="exit 1 when anything is found in these categories")
    add_common_flags(command)
