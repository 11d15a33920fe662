"""The one trust decision: may a bundle's code run in this process, and on what terms.

``load``, ``Executor``, ``run`` and ``doctor`` all execute remote code, and none of them
decides for itself whether it may (so ``run`` and ``doctor`` trust the bundled demo alike,
from the command line or not): each calls ``decide``, which applies these rules in order:

1. a ``lock`` (a ``Lock`` or the path of a lock file): the code must be exactly what it
   lists, else ``LockMismatchError``; ``trust_remote_code`` then changes nothing;
2. ``trust_remote_code=True``, or a model that ships no code: it runs;
3. the bundled demo (``demo=True``, what ``run`` and ``doctor`` pass): trusted as exactly
   the code whose digest is pinned here, ``DEMO_DIGEST``, by a lock made from it, so that
   every worker verifies those bytes again;
4. anything else: ``TrustRequiredError``, listing the files that would run.

``decide_door`` applies the same rules to code that transformers runs through a door beside
``auto_map`` (``custom_generate``) and codeferry executes in its place. Six decisions are
made for code that transformers, not codeferry, was asked to run; they are here too, so
that no other module decides trust:

- ``transformers_ran``: transformers executed code itself (its own ``trust_remote_code``
  check passed), so this process trusts exactly those bytes when codeferry adopts them;
- ``caller_trusts``: a ``from_pretrained`` call that codeferry answers instead of
  transformers carries the caller's decision in its ``trust_remote_code`` keyword;
- ``environment_lock``: the lock that binds every process of an engine (``CODEFERRY_LOCK``);
- ``kernel_refusal``: whether transformers may fetch and import a Hub kernel (the ``kernels``
  package), a door beside remote code that no lock lists;
- ``kernelize_skipped``: whether transformers' own kernelization of a model it loads is
  left out (under a lock, when the caller did not ask for it);
- ``kernelize_refused``: whether a kernelization the caller asked for is refused (under a
  lock, unless its mapping names no kernel).

A decision is about one digest, not a folder: ``code_changed`` is the error of a process
that finds other code than the digest its parent decided on. ``record`` makes a decision
this process's own (``policy``): what may run here, and whether a lock binds it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .. import _settings
from .._code.automap import qualified
from .._code.lockfile import Lock, read_lock
from .._code.resolve import Bundle
from .._code.unit import Unit
from ..errors import CodeChangedError, TrustRequiredError
from . import policy as _policy

__all__ = [
    "DEMO_DIGEST", "Decision", "caller_trusts", "code_changed", "decide", "decide_door",
    "environment_lock", "kernel_refusal", "locked_files", "record", "transformers_ran",
    "trust_error",
]

#: Digest of the code of the bundled demo model (``codeferry/demo``), the only remote code
#: ``run`` and ``doctor`` execute without ``trust_remote_code`` or a lock. A test checks it
#: against the shipped demo: regenerating the demo means updating this constant.
DEMO_DIGEST = "sha256:f1f28e68ee1e5356ef8b6c9d136a5f55a456ec2e13e7c6025902f980c2f7695a"


@dataclass(frozen=True)
class Decision:
    """What a caller passes on to its workers: ``trust_remote_code`` or the ``lock`` to verify."""

    trust_remote_code: bool
    lock: Lock | None = None


def decide(
    bundle: Bundle,
    *,
    trust_remote_code: bool = False,
    lock: Lock | str | os.PathLike[str] | None = None,
    demo: bool = False,
) -> Decision:
    """Whether ``bundle``'s code may run (the rules above); raise when it may not."""
    if lock is not None:
        locked = lock if isinstance(lock, Lock) else read_lock(lock)
        locked.check(bundle)
        return Decision(False, locked)
    if trust_remote_code or not bundle.files:
        return Decision(trust_remote_code)
    if demo and bundle.digest == DEMO_DIGEST:
        # The bundled demo: trusted as exactly this code, which every worker verifies again.
        return Decision(False, Lock.from_bundle(bundle))
    raise trust_error(bundle)


def decide_door(bundle: Bundle, *, trust_remote_code: bool, lock: Lock | None) -> Decision | None:
    """The decision for code transformers runs through a door other than ``auto_map``
    (``custom_generate``), which codeferry executes in its place.

    ``lock`` (an engine's ``CODEFERRY_LOCK``): rule 1, whatever the caller's trust says. A
    lock this process used before (``load(..., lock=...)``) binds it too: ``None`` is
    returned, nothing is recorded, and registering the code refuses any unit no lock of
    this process lists (a library's ``trust_remote_code=True`` changes nothing). Otherwise
    rules 2 and 4: the caller's ``trust_remote_code``, the same on every transformers
    release (4.x ran a local ``custom_generate/`` without it).
    """
    if lock is not None:
        return decide(bundle, lock=lock)
    if _policy.locked_files() is not None:
        return None
    return decide(bundle, trust_remote_code=trust_remote_code)


def locked_files(lock: Lock | None = None) -> frozenset[tuple[str, str]] | None:
    """``(path, sha256)`` of every file the locks that bind this process list (``lock``: an
    engine's, and any ``load(..., lock=...)`` used here), or ``None`` when none binds it."""
    used = _policy.locked_files()
    if lock is None:
        return used
    return frozenset({(f.path, f.sha256) for f in lock.files} | (used or set()))


def record(decision: Decision, units: Iterable[Unit]) -> None:
    """Make ``decision`` this process's: ``units`` may run here, and a lock binds it from now on."""
    _policy.allow({u.digest for u in units}, from_lock=decision.lock is not None)
    if decision.lock is not None:
        _policy.allow_files({(f.path, f.sha256) for f in decision.lock.files})


def transformers_ran(digest: str) -> None:
    """transformers executed the code of ``digest`` (the caller passed it
    ``trust_remote_code=True``): that decision is this process's trust in exactly those bytes."""
    _policy.allow({digest}, from_lock=False)


def caller_trusts(kwargs: Mapping[str, Any]) -> bool:
    """Whether a ``from_pretrained`` call's keywords trust the model's remote code."""
    return bool(kwargs.get("trust_remote_code"))


def environment_lock() -> Lock | None:
    """The lock ``CODEFERRY_LOCK`` names, which every process of an engine enforces, or
    ``None``. A named lock that cannot be read raises ``LockFormatError``: with a lock asked
    for, nothing runs unchecked."""
    path = _settings.lock_file()
    return read_lock(path) if path else None


def trust_error(bundle: Bundle) -> TrustRequiredError:
    """Rule 4: the code would run, and nobody decided that it may."""
    files = tuple(
        qualified(f.repo, f.path) for f in bundle.files if f.kind != "asset"
    )
    listing = ", ".join(files)
    return TrustRequiredError(
        f"the model ships code that would run in this process and in every worker: "
        f"{listing} (digest {bundle.digest}).",
        files=files,
        path=str(bundle.origin.root),
        fix="read it (`codeferry inspect MODEL`, `codeferry audit MODEL`), then pass "
        "trust_remote_code=True or lock=FILE (on the command line --trust-remote-code or "
        "--lock FILE; `codeferry lock MODEL -o FILE` writes one).",
    )


def code_changed(bundle: Bundle, expected: str) -> CodeChangedError:
    """The code found now is not the digest ``expected`` that the parent decided on."""
    return CodeChangedError(
        f"the code of {bundle.origin.name} changed since it was checked: the parent decided "
        f"on digest {expected}, this process found {bundle.digest}; none of it ran.",
        expected=expected, actual=bundle.digest, digest=bundle.digest,
        model=bundle.origin.name, path=str(bundle.origin.root),
        fix="the model folder changed while in use: restore it, or start a new Executor "
        "(rerun the command) to check the new code (`codeferry inspect MODEL` shows it).",
    )


def kernel_refusal(
    *, locked: bool, named_by_model: bool, caller_named: bool, caller_trusts: bool
) -> str | None:
    """Why a Hub kernel may not be fetched and imported here, or ``None`` when it may.

    A lock lists the exact code a process may run, and no kernel repo is ever in one: under
    a lock every kernel is refused, whoever named it. Without a lock, a kernel the caller
    asked for (``attn_implementation=``, ``use_kernels``, ``kernel_config``) is the caller's
    decision; one named only by the model's own files is remote code like ``auto_map`` code,
    and runs only with the caller's ``trust_remote_code`` (never with a file's: CVE-2026-5241,
    CVE-2026-4372).
    """
    if locked:
        return "a lock binds this process, and no lock lists a Hub kernel"
    if named_by_model and not caller_named and not caller_trusts:
        return ("the model's own files name it, and the caller did not pass "
                "trust_remote_code=True")
    return None


def kernelize_skipped(*, locked: bool, caller_asked: bool) -> bool:
    """Whether transformers' kernelization of a model it loads is left out, not refused.

    From transformers 5.25 ``from_pretrained`` kernelizes every model by default (``kernels``
    is a dependency; ``USE_HUB_KERNELS`` defaults on): each layer its kernel mapping names for
    the device is swapped for code fetched from the Hub. A lock lists the exact code a process
    may run and never a kernel, so under one a kernelization nobody asked for is left out:
    the model keeps its own torch layers, and nothing is fetched. Refusing it instead would
    refuse every locked load. A caller who asked (``use_kernels=True``, ``kernel_config``, or
    ``kernelize`` called directly) is refused by ``kernel_refusal``.
    """
    return locked and not caller_asked


def kernelize_refused(*, locked: bool, maps_kernels: bool) -> bool:
    """Whether a kernelization the caller asked for is refused.

    Under a lock it is, unless its mapping names no kernel at all: an empty mapping that
    inherits none (transformers' ``reset_kernels()`` kernelizes so) puts every layer's own
    torch forward back and fetches nothing, so refusing it would only stop a caller undoing
    kernels. Without a lock the caller decides.
    """
    return locked and maps_kernels
