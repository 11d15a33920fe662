"""``codeferry inspect``: a model's classes, files, load order, requirements and problems."""

from __future__ import annotations

import argparse
from pathlib import Path

from .._code import removed
from .._exec.plan import release_line
from .command import Commands, UsageError, add_command, bundle, show
from .flags import add_common_flags
from .render import inspected, render_dot, write_graph

__all__ = ["inspect_command", "register"]


def inspect_command(args: argparse.Namespace) -> int:
    """Show the classes, files, load order, requirements and problems of a model's code.

    Static analysis of a model's remote code. Executes nothing.
    """
    code = bundle(args)
    if args.graph:
        try:
            write_graph(Path(args.graph), render_dot(code))
        except ValueError as exc:
            raise UsageError(f"--graph {args.graph}: {exc}") from None
    from .._code.audit.report import audit_bundle, render_box

    data, text = inspected(code)
    found, version, line = removed.uses_in(code.contents), removed.installed(), release_line(code)
    data["removed_names"] = removed.to_json(found, version)  # names later releases removed
    data["release"] = line  # the transformers the executor's workers run the code on
    audited = audit_bundle(code)  # what the box would refuse, read statically too
    data["sandbox"] = [f.to_json() for f in audited.refused]
    show(args, data, text + removed.render(found, version, line) + render_box(audited))
    return 1 if (code.on_release() if line else code).blocking else 0


def register(sub: Commands) -> None:
    """Add ``inspect`` to the command line."""
    command = add_command(sub, "inspect", inspect_command, with_json=True)
    command.add_argument("--graph", metavar="FILE", help="write the import graph (.dot, .svg, .png)")
    add_common_flags(command)
