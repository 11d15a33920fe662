"""``codeferry release``: make the transformers release a model's code needs, ahead of a run."""

from __future__ import annotations

import argparse
import time

from .._code import removed
from .._exec.plan import release_line
from .._exec.workers import release
from .command import Commands, add_command, bundle, show
from .flags import add_common_flags

__all__ = ["register", "release_command"]


def release_command(args: argparse.Namespace) -> int:
    """Make the older transformers release MODEL's code needs, ahead of an offline run.

    Runs none of the model's code: pip (or uv) installs the release into
    CODEFERRY_RELEASES. Ray: run it on each offline node.
    """
    code = bundle(args)
    version = removed.installed()
    line = release_line(code)
    data: dict[str, object] = {"model": code.origin.name, "installed": version, "line": line}
    if line is None:
        show(args, data, f"{code.origin.name} runs on the installed transformers {version}: "
                         "nothing to make\n")
        return 0
    before = release.made(line)
    started = time.monotonic()
    where = release.ensure(line, say=not args.json)
    data.update(folder=str(where), transformers=release.made(line), made=before is None,
                seconds=round(time.monotonic() - started, 1))
    how = f"made in {data['seconds']} s" if before is None else "already made"
    show(args, data, f"{code.origin.name}: transformers {data['transformers']} ({how}) in "
                     f"{where}\n")
    return 0


def register(sub: Commands) -> None:
    """Add ``release`` to the command line."""
    command = add_command(sub, "release", release_command, with_json=True)
    add_common_flags(command)
