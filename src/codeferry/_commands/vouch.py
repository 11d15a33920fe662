"""``--verify-hub`` of ``codeferry lock`` and ``codeferry verify``: the command line's part.

The check itself is ``Lock.check_hub`` (``_code.vouch``); here the branch a lock follows
and what the commands print. Exit codes (``cli``): 0 vouched for, 1 a file differs from the
Hub's (``HubMismatchError``), 3 the Hub could not be asked (``HubUncheckedError``: offline,
no connection, a local folder), so that a script never reads "not checked" as "checked".
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TextIO

from .._code import hub as _hub
from .._code.digest import is_commit
from .._code.source import repo_id_of
from .._code.vouch import HubCheck

__all__ = ["follow_branch", "hub_options", "show_check"]


def follow_branch(args: argparse.Namespace, model: str) -> None:
    """Before ``lock --verify-hub`` of a repo id at a branch or tag: bring the cache's ref to
    the commit the Hub's points at now, so that the lock pins that commit (a plain ``lock``
    pins what the cache last fetched). A folder, a commit, or --local-files-only: as it is."""
    revision = args.code_revision or args.revision
    if Path(model).expanduser().is_dir() or is_commit(revision) or args.local_files_only:
        return
    _hub.follow(repo_id_of(model), revision, cache_dir=args.cache_dir, token=args.token,
                endpoint=args.hub_endpoint)


def show_check(check: HubCheck, stream: TextIO) -> None:
    print(f"hub: {check.endpoint} vouches for all {check.files} locked file(s):", file=stream)
    for line in check.lines():
        print(line, file=stream)


def hub_options(command: argparse.ArgumentParser, what: str) -> None:
    """``--verify-hub`` and ``--hub-endpoint`` of ``lock`` and ``verify``."""
    command.add_argument("--verify-hub", action="store_true", help="check every locked file "
                         f"against the Hub's own hashes at the locked commit {what} (exit 3: "
                         "the Hub could not be asked)")
    command.add_argument("--hub-endpoint", metavar="URL", help="the Hub --verify-hub asks "
                         "(default: HF_ENDPOINT, else huggingface.co), e.g. when the files "
                         "came from a mirror")
