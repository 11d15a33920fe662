"""``--verify-hub``: the Hub vouches for a lock, file by file, at the commits it pins.

A lock lists each file's sha256, which says what the code is, not where it came from: a
lock made from a tampered cache or mirror locks the tampering. The Hub keeps its own hash of
every file of every commit (huggingface_hub's ``model_info(files_metadata=True)``)::

    a file stored through LFS     sha256 of its bytes         (what the lock also lists)
    any other file                git's blob sha1 of them      (``digest.git_blob_sha1``)

so each locked file's bytes, as the resolver read them from the cache, are hashed the Hub's
way and compared with what the Hub holds at the locked commit: the model's own files at the
lock's ``revision``, a cross-repo reference's at its ``pin``. Static: nothing executes, and
any mismatch is raised before anything runs. Nothing here is cached: each check asks the Hub.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..errors import HubMismatchError, HubUncheckedError
from . import digest as _digest
from . import hub as _hub
from .automap import qualified

__all__ = ["HubCheck", "check_hub"]


@dataclass(frozen=True)
class HubCheck:
    """What the Hub vouched for: ``units`` as ``(repo, commit, files)``, at ``endpoint``."""

    endpoint: str
    units: tuple[tuple[str, str, int], ...]

    @property
    def files(self) -> int:
        return sum(count for _, _, count in self.units)

    def lines(self) -> list[str]:
        return [f"  {repo}@{commit}: {count} file(s) match the Hub's hashes"
                for repo, commit, count in self.units]


def check_hub(
    model: str, revision: str | None, pins: Mapping[str, str], files: Iterable[_digest.HashedFile],
    contents: Mapping[tuple[str | None, str], bytes], *, token: str | bool | None = None,
    endpoint: str | None = None,
) -> HubCheck:
    """Check every file of a lock (``model`` at ``revision``, the ``pins``, ``files``) against
    the Hub's hashes; ``contents`` holds each file's bytes as they were read, by
    ``(repo, path)``. ``HubMismatchError`` lists every file that differs,
    ``HubUncheckedError`` says why nothing could be checked."""
    url = (endpoint or "").rstrip("/") or None
    by_repo: dict[str | None, list[_digest.HashedFile]] = {}
    for f in files:
        by_repo.setdefault(f.repo, []).append(f)
    if None in by_repo and (revision is None or not _digest.is_commit(revision)):
        raise HubUncheckedError(
            f"{model} is a local folder (its lock pins no commit): no Hub holds its files, so "
            "the Hub cannot vouch for them.", reason="a local folder",
            fix="lock the model by its repo id (`codeferry lock org/name --verify-hub -o "
            "FILE`), or drop --verify-hub.")
    mismatches: list[tuple[str, str, str]] = []
    units: list[tuple[str, str, int]] = []
    for repo in sorted(by_repo, key=lambda r: r or ""):
        repo_id = repo or model
        commit = revision if repo is None else pins.get(repo)
        assert commit is not None
        listing = _hub.hub_files(repo_id, commit, token=token, endpoint=url)
        for f in sorted(by_repo[repo], key=lambda f: f.path):
            data = contents.get((repo, f.path))
            expected, actual = _compare(listing.get(f.path), f.sha256, data)
            if expected != actual:
                mismatches.append((qualified(repo, f.path), expected, actual))
        units.append((repo_id, commit, len(by_repo[repo])))
    where = url or _hub.endpoint_of(None)
    if mismatches:
        raise HubMismatchError(
            f"{len(mismatches)} file(s) are not what {where} holds at the locked commit: "
            + "; ".join(_line(*row) for row in mismatches)
            + ". A tampered cache or mirror, or a lock made from one; nothing ran.",
            repo_id=model, revision=revision, path=mismatches[0][0], mismatches=tuple(mismatches),
            fix="delete the cached repo (`hf cache delete`, or its models--org--name folder) and "
            "download it again from the Hub, review the code, then lock it again: "
            f"`codeferry lock {model} --verify-hub -o FILE`.")
    return HubCheck(where, tuple(units))


def _compare(hub: _hub.HubFile | None, locked: str, data: bytes | None) -> tuple[str, str]:
    """``(expected, actual)`` of one file: the Hub's hash and the local bytes' (equal: fine)."""
    if data is None or _digest.file_sha256(data) != locked:
        return f"sha256:{locked}", "absent" if data is None else f"sha256:{_digest.file_sha256(data)}"
    if hub is None:
        return "absent", f"sha256:{locked}"
    if hub.lfs_sha256:
        return f"sha256:{hub.lfs_sha256}", f"sha256:{locked}"
    if not hub.blob_id:
        raise HubUncheckedError(
            "the Hub listed the files without their hashes (no blob ids): nothing was checked.",
            reason="no file metadata", fix="check HF_ENDPOINT: it should be the Hub, or a "
            "mirror that serves files_metadata.")
    return f"git-sha1:{hub.blob_id}", f"git-sha1:{_digest.git_blob_sha1(data)}"


def _line(name: str, expected: str, actual: str) -> str:
    if expected == "absent":
        return f"{name}: not in the Hub's commit (here {actual})"
    if actual == "absent":
        return f"{name}: locked ({expected}) but not read here"
    return f"{name}: expected {expected}, actual {actual}"
