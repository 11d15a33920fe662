"""Every digest codeferry computes, in one place: the resolver, the lock, the store and
tickets compare these strings, so a second copy of a formula is a future mismatch (or a
future security bug, where one side would accept what the other never checked).

All but git's blob id are sha256, in lowercase hex, over text that is the same on every machine::

    file     sha256(bytes)                                           FileEntry.sha256
    unit     "sha256:" + sha256(for path in sorted(paths):           a store entry, the package
                                 path "\\0" file "\\n")                codeferry._dyn.u<token>
    bundle   "sha256:" + sha256(for (repo, path) in sorted(...):     Bundle.digest, a lock's
                                 repo-or-"" "\\0" path "\\0" file "\\n")  digest, what trust decides on
    token    the first 32 hex digits of a unit digest                store folders, module names
    key      "sha256:" + sha256(DER SubjectPublicKeyInfo)           a public key a lock requires a
                                                                     model signature by
    git blob sha1("blob <size>\\0" bytes)                            the Hub's id of a file that
                                                                     is not in LFS (``--verify-hub``)

A *unit* is one repo's code (the model's own, or a cross-repo reference's); a *bundle* is
all of it. Changing a formula changes every lock file and store entry: ``tests/golden``
pins them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Mapping
from typing import Protocol

__all__ = [
    "TOKEN_LENGTH", "HashedFile", "file_sha256", "unit_digest", "unit_digest_of", "bundle_digest",
    "token_of", "is_digest", "is_token", "git_blob_sha1", "is_commit", "public_key_id",
]

#: Hex digits of a unit digest that name it in the store and in module names.
TOKEN_LENGTH = 32

_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_TOKEN = re.compile(rf"[0-9a-f]{{{TOKEN_LENGTH}}}")
_COMMIT = re.compile(r"[0-9a-f]{40}")


def file_sha256(data: bytes) -> str:
    """The hex sha256 of one file's bytes."""
    return hashlib.sha256(data).hexdigest()


def path_sha256(path: str | os.PathLike[str]) -> str:
    """The hex sha256 of a file read in chunks (weights do not fit in memory twice)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def manifest_token(manifest: Mapping[str, object]) -> str:
    """A short name for a file manifest (path -> hash and size): what a Ray node's copy of a
    model folder is called, so that two drivers shipping the same files share one copy."""
    text = json.dumps(manifest, sort_keys=True).encode()
    return hashlib.sha256(text).hexdigest()[:TOKEN_LENGTH]


def text_digest(text: str) -> str:
    """A short digest of one input's text (16 hex digits of its UTF-8 sha256): what a run's
    record keeps per id, to notice an input edited under the same id."""
    return file_sha256(text.encode("utf-8"))[:16]


def unit_digest(files: Mapping[str, bytes]) -> str:
    """The digest of one unit from its files (path -> bytes)."""
    return unit_digest_of({path: file_sha256(data) for path, data in files.items()})


def unit_digest_of(hashes: Mapping[str, str]) -> str:
    """The digest of one unit from its files' hashes (path -> hex sha256)."""
    lines = "".join(f"{path}\0{hashes[path]}\n" for path in sorted(hashes))
    return "sha256:" + file_sha256(lines.encode("utf-8"))


class HashedFile(Protocol):
    """A file of a bundle as its digest sees it: ``FileEntry`` (resolved), ``LockedFile``."""

    @property
    def repo(self) -> str | None: ...
    @property
    def path(self) -> str: ...
    @property
    def sha256(self) -> str: ...


def bundle_digest(files: Iterable[HashedFile]) -> str:
    """The digest of a bundle from its files' ``(repo, path, sha256)``, in any order."""
    ordered = sorted(files, key=lambda f: (f.repo or "", f.path))
    lines = "".join(f"{f.repo or ''}\0{f.path}\0{f.sha256}\n" for f in ordered)
    return "sha256:" + file_sha256(lines.encode("utf-8"))


def token_of(digest: str) -> str:
    """The store's and module names' short form of a unit digest (or of a token itself)."""
    return digest.removeprefix("sha256:")[:TOKEN_LENGTH]


def is_digest(text: object) -> bool:
    """Whether ``text`` is a whole ``sha256:<64 hex>`` digest."""
    return isinstance(text, str) and _DIGEST.fullmatch(text) is not None


def is_token(text: object) -> bool:
    """Whether ``text`` is a whole token (``token_of`` a digest)."""
    return isinstance(text, str) and _TOKEN.fullmatch(text) is not None


def git_blob_sha1(data: bytes) -> str:
    """Git's id of a file's bytes (``git hash-object``): the sha1 of ``blob <size>\\0`` and
    the bytes. The Hub names every file that is not stored through LFS by it (an LFS file by
    the sha256 of its bytes, ``file_sha256``): what ``--verify-hub`` compares a file with."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def is_commit(text: object) -> bool:
    """Whether ``text`` is a whole git commit id (40 lowercase hex digits), as a lock pins."""
    return isinstance(text, str) and _COMMIT.fullmatch(text) is not None


def public_key_id(pem: bytes) -> str:
    """A public key's id, as a lock names the key a model's signature must verify with: the
    sha256 of its DER SubjectPublicKeyInfo, the same whatever the PEM file's line breaks or
    comments. Needs ``cryptography`` (the ``signing`` extra); ``ValueError``: not a key."""
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_public_key(pem)
    der = key.public_bytes(serialization.Encoding.DER,
                           serialization.PublicFormat.SubjectPublicKeyInfo)
    return "sha256:" + file_sha256(der)
