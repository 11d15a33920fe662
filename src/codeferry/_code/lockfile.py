"""Lock files: the exact remote code of one model, as a reviewable, diffable text file.

Format, version 1 (one record per line, fields separated by one space, a path is the
rest of its line, ``-`` stands for "none", lines sorted within each kind)::

    # codeferry lock file: the exact remote code a model may run. Regenerate: ...
    codeferry-lock 1
    model org/name
    revision 0123456789abcdef0123456789abcdef01234567
    digest sha256:<64 hex>
    pin org/other 89abcdef...                      (one per cross-repo unit)
    file - <sha256 hex> <size> configuration_x.py  (repo "-": the model's own code)
    file org/other <sha256 hex> <size> modeling_heads.py
    requirement torch required                     ("guarded": its imports handle absence)
    end

Version 2 is version 1 with one more record, written only when the lock requires an OpenSSF
model signature (so a lock without one still reads in a codeferry that knows version 1 only,
and one with it is refused there as a newer format, not read without its requirement)::

    signature key sha256:<64 hex>                  (after the pins: the signer's key id)

``digest`` is the bundle digest ``codeferry inspect`` prints; it is recomputed from the
``file`` lines when the lock is read, so a lock whose digest does not match its own file
list is refused, as is one without its ``end`` line (truncated) or of an unknown version.
A lock is trust for exactly the code it lists: ``codeferry.load(model, lock=...)``
refuses any other byte.

``revision`` and each ``pin`` are commits (40 hex digits), never a branch: a model named by
a branch (``main`` by default) is locked at the commit the branch pointed at, and a lock
whose revision or pin is anything else is refused. ``Lock.check_hub`` has the Hub vouch for
the files at those commits (``hubcheck``: ``--verify-hub``).
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from ..errors import LockFormatError, LockMismatchError
from . import digest as _digest
from .automap import qualified
from .hubcheck import HubCheck, check_hub
from .resolve import Bundle
from .signature import SignatureCheck, check_signature

__all__ = ["FORMAT_VERSION", "Lock", "LockedFile", "LockDiff", "read_lock", "unit_digests"]

FORMAT_VERSION = 2  # the newest this codeferry writes and reads; 1 is written when it suffices
_VERSIONS = ("1", "2")
_HEADER = "# codeferry lock file: the exact remote code a model may run. Regenerate: codeferry lock MODEL -o FILE"


@dataclass(frozen=True)
class LockedFile:
    repo: str | None
    path: str
    sha256: str
    size: int

    @property
    def key(self) -> tuple[str, str]:
        return (self.repo or "", self.path)


@dataclass(frozen=True)
class LockDiff:
    """How a model's code differs from a lock (empty lists: identical)."""

    added: tuple[LockedFile, ...]
    removed: tuple[LockedFile, ...]
    changed: tuple[tuple[LockedFile, LockedFile], ...]  # (expected, actual)

    @property
    def same(self) -> bool:
        return not (self.added or self.removed or self.changed)

    def lines(self) -> list[str]:
        def name(f: LockedFile) -> str:
            return qualified(f.repo, f.path)

        out = [f"added    {name(f)}  sha256:{f.sha256}" for f in self.added]
        out += [f"removed  {name(f)}  sha256:{f.sha256}" for f in self.removed]
        out += [
            f"changed  {name(e)}  expected sha256:{e.sha256}  actual sha256:{a.sha256}"
            for e, a in self.changed
        ]
        return out


def unit_digests(files: list[LockedFile]) -> set[str]:
    """The digest of each unit (per repo) the locked files make up, as tickets name them."""
    by_repo: dict[str | None, dict[str, str]] = defaultdict(dict)
    for f in files:
        by_repo[f.repo][f.path] = f.sha256
    return {_digest.unit_digest_of(hashes) for hashes in by_repo.values()}


@dataclass(frozen=True)
class Lock:
    model: str
    revision: str | None
    digest: str
    files: tuple[LockedFile, ...]
    pins: tuple[tuple[str, str], ...] = ()
    requirements: tuple[tuple[str, str], ...] = ()
    read_from: str | None = None  # the file it was read from, for messages
    signature: str | None = None  # the key id a model signature must verify with (version 2)

    @classmethod
    def from_bundle(cls, bundle: Bundle) -> Lock:
        src = bundle.origin
        model = src.repo_id or src.root.name
        files = tuple(sorted((LockedFile(f.repo, f.path, f.sha256, f.size) for f in bundle.files),
                            key=lambda f: f.key))
        # What the code imports, not what this machine has installed: a lock is a fact
        # about the code and reads the same on every machine.
        reqs = tuple(sorted((r.name, "guarded" if r.guarded else "required")
                            for r in bundle.requirements))
        return cls(model, src.commit, bundle.digest, files, tuple(sorted(bundle.pins.items())), reqs)

    def dumps(self) -> str:
        version = 2 if self.signature else 1
        lines = [_HEADER, f"codeferry-lock {version}", f"model {self.model}",
                 f"revision {self.revision or '-'}", f"digest {self.digest}"]
        lines += [f"pin {repo} {commit}" for repo, commit in self.pins]
        lines += [f"signature key {self.signature}"] if self.signature else []
        lines += [f"file {f.repo or '-'} {f.sha256} {f.size} {f.path}" for f in self.files]
        lines += [f"requirement {name} {how}" for name, how in self.requirements]
        lines.append("end")
        return "\n".join(lines) + "\n"

    @classmethod
    def loads(cls, text: str, *, read_from: str | None = None) -> Lock:
        def fail(line: int | None, what: str, fix: str | None = None) -> LockFormatError:
            return LockFormatError(
                f"lock file {what}.", path=read_from, line=line,
                fix=fix or "regenerate it: `codeferry lock MODEL -o FILE`.",
            )

        rows = [(n, ln) for n, ln in enumerate(text.splitlines(), 1) if ln and not ln.startswith("#")]
        if not rows or not rows[0][1].startswith("codeferry-lock "):
            raise fail(rows[0][0] if rows else 1, "does not start with 'codeferry-lock <version>'")
        version = rows[0][1].split(" ", 1)[1]
        if version not in _VERSIONS:
            raise fail(rows[0][0], f"has format version {version!r}; this codeferry reads "
                       f"versions {', '.join(_VERSIONS)}", "upgrade codeferry, or regenerate the lock "
                       "with this version: `codeferry lock MODEL -o FILE`.")
        if rows[-1][1] != "end":
            raise fail(rows[-1][0], "is truncated (no 'end' line)")
        fields: dict[str, str] = {}
        files: list[LockedFile] = []
        pins: list[tuple[str, str]] = []
        reqs: list[tuple[str, str]] = []
        signature: str | None = None
        for number, line in rows[1:-1]:
            kind, _, rest = line.partition(" ")
            try:
                if kind in ("model", "revision", "digest"):
                    if not rest or kind in fields or (
                            kind == "revision" and rest != "-" and not _digest.is_commit(rest)):
                        raise ValueError
                    fields[kind] = rest
                elif kind == "file":
                    repo, sha, size, path = rest.split(" ", 3)
                    if len(sha) != 64 or not path:
                        raise ValueError
                    files.append(LockedFile(None if repo == "-" else repo, path, sha, int(size)))
                elif kind == "pin":
                    repo, commit = rest.split(" ")
                    if not _digest.is_commit(commit):
                        raise ValueError
                    pins.append((repo, commit))
                elif kind == "signature" and version == "2" and signature is None:
                    how, key = rest.split(" ")
                    if how != "key" or not _digest.is_digest(key):
                        raise ValueError
                    signature = key
                elif kind == "requirement":
                    name, how = rest.split(" ")
                    if how not in ("required", "guarded"):
                        raise ValueError
                    reqs.append((name, how))
                else:
                    raise ValueError
            except ValueError:
                pinned = kind in ("revision", "pin")
                raise fail(number, f"has a malformed line: {line[:80]!r}" + (
                    " (a revision or pin is a commit: 40 hex digits, or '-' for a folder)"
                    if pinned else "")) from None
        missing = {"model", "revision", "digest"} - set(fields)
        if missing:
            raise fail(None, f"lacks {', '.join(sorted(missing))}")
        lock = cls(fields["model"], None if fields["revision"] == "-" else fields["revision"],
                   fields["digest"], tuple(sorted(files, key=lambda f: f.key)), tuple(pins), tuple(reqs), read_from,
                   signature)
        if version == "2" and signature is None:
            raise fail(rows[0][0], "is version 2 without a 'signature' line (version 2 exists "
                       "for it)")
        actual = _digest.bundle_digest(files)
        if actual != lock.digest:
            at = next(n for n, ln in rows if ln.startswith("digest "))
            raise fail(at, f"says digest {lock.digest}, but its own file list hashes to {actual} "
                       "(edited by hand?)")
        return lock

    def diff(self, bundle: Bundle) -> LockDiff:
        expected = {(f.repo, f.path): f for f in self.files}
        actual = {(f.repo, f.path): LockedFile(f.repo, f.path, f.sha256, f.size) for f in bundle.files}
        return LockDiff(
            added=tuple(actual[k] for k in sorted(actual.keys() - expected.keys(), key=str)),
            removed=tuple(expected[k] for k in sorted(expected.keys() - actual.keys(), key=str)),
            changed=tuple(
                (expected[k], actual[k]) for k in sorted(expected.keys() & actual.keys(), key=str)
                if expected[k].sha256 != actual[k].sha256
            ),
        )

    def check_hub(self, bundle: Bundle, *, token: str | bool | None = None,
                  endpoint: str | None = None) -> HubCheck:
        """Raise unless ``bundle`` is exactly the locked code (``check``) and every locked
        file is what the Hub holds at the locked commits (``hubcheck``): ``HubMismatchError``
        lists each file that is not, ``HubUncheckedError`` says the Hub could not be asked
        (offline, no connection, or a lock of a local folder). ``endpoint``: the Hub to ask
        (default ``HF_ENDPOINT``), e.g. huggingface.co while the files came from a mirror."""
        self.check(bundle)
        return check_hub(self.model, self.revision, dict(self.pins), self.files, bundle.contents,
                         token=token, endpoint=endpoint)

    def check_signature(self, bundle: Bundle, public_key: str | os.PathLike[str] | None
                        ) -> SignatureCheck:
        """Raise unless ``bundle`` is exactly the locked code (``check``) and its folder's
        ``model.sig`` verifies with ``public_key`` (a PEM file), which must be the key this
        lock requires if it requires one: ``ModelSignatureError``; without the
        ``model-signing`` package, ``ExtraMissingError``."""
        self.check(bundle)
        return check_signature(bundle.origin.root, public_key, required=self.signature)

    def is_for(self, bundle: Bundle) -> bool:
        """Whether this lock was made for ``bundle``'s model (by name: a repo id, or its
        last part, or a folder's name), whatever its code is now."""
        return bool(_names(self.model) & _model_names(bundle))

    def new_path(self, bundle: Bundle) -> str:
        """Where a lock of ``bundle``'s model can go without overwriting this one: next to
        it, named after the model."""
        stem = re.sub(r"[^A-Za-z0-9._-]+", "-", _model_name(bundle).rsplit("/", 1)[-1]).strip("-.")
        folder = Path(self.read_from).parent if self.read_from else Path()
        candidate = folder / f"{stem or 'model'}.lock"
        number = 2
        while candidate.exists() or (self.read_from and str(candidate) == self.read_from):
            candidate = folder / f"{stem or 'model'}-{number}.lock"
            number += 1
        return str(candidate)

    def check(self, bundle: Bundle) -> None:
        """Raise ``LockMismatchError`` unless ``bundle`` is exactly the locked code."""
        src = bundle.origin
        where = self.read_from or "the lock"
        if src.repo_id and "/" in self.model and src.repo_id != self.model:
            raise LockMismatchError(
                f"{where} is the lock of another model: {self.model}, not {src.repo_id}.",
                path=self.read_from,
                fix=f"use the lock of {src.repo_id}, or create one in a new file: "
                f"`codeferry lock {src.repo_id} -o {self.new_path(bundle)}`.",
            )
        if bundle.digest == self.digest:
            return
        diff = self.diff(bundle)
        if not self.is_for(bundle):
            raise LockMismatchError(
                f"{where} is the lock of another model: {self.model}, not {src.name} "
                f"(lock digest {self.digest}, code digest {bundle.digest}): "
                + "; ".join(diff.lines()),
                path=self.read_from, diff=diff,
                fix=f"use the lock of {src.name}, or create one in a new file: `codeferry lock "
                f"{src.repo_id or src.root} -o {self.new_path(bundle)}` (locking into "
                f"{where} would overwrite the lock of {self.model}).",
            )
        raise LockMismatchError(
            f"the code of {src.name} is not the locked code (lock digest {self.digest}, "
            f"code digest {bundle.digest}): " + "; ".join(diff.lines()),
            path=self.read_from, diff=diff,
            fix=f"review the changes, then re-lock: `codeferry lock {src.root} -o "
            f"{self.read_from or 'FILE'}`.",
        )


def _model_name(bundle: Bundle) -> str:
    """The name ``Lock.from_bundle`` records for ``bundle``'s model."""
    return bundle.origin.repo_id or bundle.origin.root.name


def _names(model: str) -> set[str]:
    return {model, model.rsplit("/", 1)[-1]}


def _model_names(bundle: Bundle) -> set[str]:
    """Every name a lock of ``bundle``'s model may carry: a folder inside a hub cache
    (``models--org--name/snapshots/<commit>``) also answers to its repo id."""
    names = _names(_model_name(bundle))
    root = bundle.origin.root
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith("models--"):
        names |= _names(root.parent.parent.name[len("models--"):].replace("--", "/"))
    return names


def read_lock(path: str | os.PathLike[str]) -> Lock:
    """Read and validate a lock file."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise LockFormatError(f"lock file {file} does not exist.", path=str(file),
                              fix="create it: `codeferry lock MODEL -o FILE`.") from None
    except UnicodeDecodeError:
        raise LockFormatError(f"lock file {file} is not UTF-8 text.", path=str(file),
                              fix="regenerate it: `codeferry lock MODEL -o FILE`.") from None
    except OSError as exc:  # a folder, no permission: a lock that cannot be read binds nothing
        raise LockFormatError(f"lock file {file} cannot be read ({exc.strerror or exc}).",
                              path=str(file), fix="make it a readable file, or create it: "
                              "`codeferry lock MODEL -o FILE`.") from None
    return Lock.loads(text, read_from=str(file))
