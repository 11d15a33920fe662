"""``--verify-hub`` and ``--signature`` of ``codeferry lock`` and ``codeferry verify``: the
command line's part.

The checks themselves are ``Lock.check_hub`` (``_code.hubcheck``) and ``Lock.check_signature``
(``_code.signature``); here the branch a lock follows, what a lock requires, and what the
commands print. Exit codes (``cli``): 0 vouched for, 1 a file differs from the
Hub's (``HubMismatchError``), 3 the Hub could not be asked (``HubUncheckedError``: offline,
no connection, a local folder), so that a script never reads "not checked" as "checked".
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import TextIO

from .._code import hub as _hub
from .._code.digest import is_commit
from .._code.hubcheck import HubCheck
from .._code.lockfile import Lock
from .._code.resolve import Bundle
from .._code.source import repo_id_of

__all__ = ["follow_branch", "hub_options", "show_check", "signed"]


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


def signed(args: argparse.Namespace, lock: Lock, bundle: Bundle, stream: TextIO,
           *, locking: bool = False) -> Lock:
    """``--signature`` (or a lock that requires one, whatever the options): the model's
    ``model.sig`` must verify with ``--public-key``. Locking, the lock returned requires that
    key; else ``lock`` as it is."""
    if not (args.signature or lock.signature):
        return lock
    check = lock.check_signature(bundle, args.public_key)
    print(f"signature: {check.signature} verifies with key {check.key}", file=stream)
    return dataclasses.replace(lock, signature=check.key) if locking else lock


def hub_options(command: argparse.ArgumentParser, what: str) -> None:
    """``--verify-hub``, ``--hub-endpoint``, ``--signature`` and ``--public-key`` of ``lock``
    and ``verify``."""
    command.add_argument("--verify-hub", action="store_true", help="check every locked file "
                         f"against the Hub's own hashes at the locked commit {what} (exit 3: "
                         "the Hub could not be asked)")
    command.add_argument("--hub-endpoint", metavar="URL", help="the Hub --verify-hub asks "
                         "(default: HF_ENDPOINT, else huggingface.co), e.g. when the files "
                         "came from a mirror")
    command.add_argument("--signature", action="store_true", help="check the model's OpenSSF "
                         "signature (model.sig, the model-signing package's format) with "
                         "--public-key (`lock`: the lock then requires it; needs "
                         "`pip install 'codeferry[signing]'`)")
    command.add_argument("--public-key", metavar="KEY.pem", help="the signer's public key "
                         "(PEM) for --signature, or for a lock that requires a signature")
