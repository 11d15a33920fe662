"""Repos of the Hugging Face Hub: found in the local cache, downloaded when they are not.

``source`` reads what is on disk. This module is the one place that goes to the network,
through huggingface_hub's own client (its cache layout, file locks, retries, tokens), and
only for a repo id whose snapshot the cache lacks or holds in part::

    locate("org/name", revision="v1", need="code")
      cached, and complete for `need`  ->  that snapshot; no request at all
      else, downloads allowed          ->  snapshot_download(...), then that snapshot
      else                             ->  ModelNotCachedError

What each need fetches:

    "code"   every file but the weights (``WEIGHT_SUFFIXES``) and files above
             ``MAX_ASSET_BYTES``: code, configs, tokenizer files and any data file the code
             may name. An asset the code names is hashed into the digest, so a file left out
             here would give ``inspect``/``lock`` another digest than ``load``.
             (``resolve``, inspect, lock, verify, audit, doctor: nothing executes.)
    "model"  every file, which the workers' ``from_pretrained`` reads. (load, Executor, run)

Complete means: huggingface_hub (1.26 and later) keeps each commit's file list in
``models--org--name/trees/<commit>.json`` once it has listed the repo. A snapshot that lacks
a needed file of that list was fetched for its code only, or cut short, and is completed (or,
offline, refused). A snapshot without a list (written by another tool, an older
huggingface_hub, or plain transformers, which fetches file by file) is taken as it is, until
its code imports at load a file it lacks: ``resolve`` then has it completed (``complete``),
or, offline, refused with each missing file and the ``hf download`` command that fetches it.

``--verify-hub`` asks the Hub two more things, never downloading (``hub_commit``: the
commit a branch or tag points at now; ``hub_files``: the Hub's hash of every file of a
commit, from ``model_info(files_metadata=True)``, which huggingface_hub 0.30 has too)::

    offline, no connection, an HTTP error     ->  HubUncheckedError (nothing was checked)
    the Hub has no such repo or commit        ->  HubMismatchError (the cache names a commit
                                                  the Hub never had)

A download cut short leaves nothing half-written in a snapshot: huggingface_hub writes each
file to a temporary file unique to its process (``blobs/<etag>.<id>.incomplete``), removes it
on failure, and renames it into ``blobs/`` and links it from the snapshot only once whole.

Settings are read at each call: ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``),
``HF_ENDPOINT``, the cache (``_settings.hub_cache``) and, by huggingface_hub, ``HF_TOKEN``.
huggingface_hub reads ``HF_HUB_OFFLINE`` and ``HF_ENDPOINT`` once, when it is imported: the
endpoint is passed to it explicitly, and its offline switch is set to what the environment
says now for the duration of a download.
"""

from __future__ import annotations

import glob
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from .. import _settings
from ..errors import (
    GatedRepoError,
    HubDownloadError,
    HubMismatchError,
    HubRepoNotFoundError,
    HubRevisionNotFoundError,
    HubUncheckedError,
    ModelNotCachedError,
    ModelNotFoundError,
    _HubError,
)
from . import source as _source
from .source import MAX_ASSET_BYTES, WEIGHT_SUFFIXES, ModelOrigin

__all__ = ["HubFile", "Need", "complete", "follow", "hub_commit", "hub_files", "locate"]

Need = Literal["code", "model"]

#: One download at a time in this process: each one flips huggingface_hub's offline switch.
_download_lock = threading.Lock()


def locate(
    model: str | os.PathLike[str],
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    token: str | bool | None = None,
    local_files_only: bool | None = None,
    need: Need = "code",
    is_repo_id: bool = False,
) -> ModelOrigin:
    """``model``'s folder, or the cached snapshot of a repo id at ``revision``, downloaded
    first if need be (what ``need`` takes, of a repo the cache lacks or holds in part).

    A folder (a snapshot folder included) is read as it is: it is never fetched.
    ``is_repo_id=True``: ``model`` is a repo id whatever the file system holds (the other
    repo of a cross-repo reference).
    """
    if not is_repo_id and Path(model).expanduser().is_dir():
        return _source.locate(model, revision=revision, cache_dir=cache_dir)
    repo_id = str(model) if is_repo_id else _source.repo_id_of(model)
    cache = Path(cache_dir) if cache_dir is not None else _settings.hub_cache()
    absent: ModelNotFoundError | None = None
    missing: tuple[str, ...] = ()
    try:
        origin = _source.locate_repo(repo_id, revision=revision, cache_dir=cache)
    except ModelNotFoundError as exc:
        absent = exc
    else:
        missing = _missing(origin, cache, need)
        if not missing:
            return origin
    reason = _settings.offline_reason(local_files_only)
    if reason is not None:
        raise _not_cached(repo_id, revision, reason, absent, missing,
                          commit=None if absent else origin.commit)
    _download(repo_id, revision, cache, token, need)
    return _source.locate_repo(repo_id, revision=revision, cache_dir=cache)


def complete(
    origin: ModelOrigin, files: tuple[str, ...], *, token: str | bool | None = None,
    local_files_only: bool | None = None, need: Need = "code",
) -> bool:
    """Complete the cached snapshot ``origin``, whose code imports ``files`` it lacks.

    Returns whether it downloaded (then resolve again). Nothing to do when huggingface_hub
    keeps the snapshot's file list (``locate`` completed it by that list: these files are not
    in the repo); offline, a ``ModelNotCachedError`` naming each file.
    """
    assert origin.repo_id is not None and origin.commit is not None
    if (origin.fence / "trees" / f"{origin.commit}.json").is_file():
        return False
    reason = _settings.offline_reason(local_files_only)
    if reason is not None:
        raise _not_cached(origin.repo_id, origin.revision, reason, None, files,
                          commit=origin.commit, imported=True)
    _download(origin.repo_id, origin.commit, origin.fence.parent, token, need)
    return True


def _needed(path: str, size: int | None, need: Need) -> bool:
    if need == "model":
        return True
    return not path.endswith(WEIGHT_SUFFIXES) and (size or 0) <= MAX_ASSET_BYTES


def _missing(origin: ModelOrigin, cache: Path, need: Need) -> tuple[str, ...]:
    """The needed files a cached snapshot lacks, by the file list huggingface_hub kept."""
    assert origin.repo_id is not None and origin.commit is not None
    if not (origin.fence / "trees" / f"{origin.commit}.json").is_file():
        return ()  # no list to compare with (and no reason to import huggingface_hub)
    import huggingface_hub
    from huggingface_hub import errors as hub_errors

    cached_tree = getattr(huggingface_hub, "get_cached_repo_tree", None)
    unlisted = getattr(hub_errors, "CachedRepoTreeNotFoundError", None)
    if cached_tree is None or unlisted is None:
        return ()
    try:
        files = cached_tree(origin.repo_id, revision=origin.commit, cache_dir=str(cache))
    except unlisted:
        return ()
    return tuple(sorted(
        f.path for f in files
        if _needed(f.path, f.size, need)
        and not origin.root.joinpath(*f.path.split("/")).is_file()  # a broken link is missing
    ))


def _fetch_command(repo_id: str, revision: str | None, files: tuple[str, ...]) -> str:
    """The ``hf download`` command that fetches ``files`` (all of the repo past ten)."""
    named = "".join(f" {f}" for f in files) if len(files) <= 10 else ""
    return f"hf download {repo_id}{named}" + (f" --revision {revision}" if revision else "")


def _not_cached(
    repo_id: str, revision: str | None, reason: str, absent: ModelNotFoundError | None,
    missing: tuple[str, ...], *, commit: str | None = None, imported: bool = False,
) -> ModelNotCachedError:
    undo = ("pass local_files_only=False (no --local-files-only)" if reason.startswith("local")
            else f"unset {reason.split('=')[0]}")
    if absent is not None:
        return ModelNotCachedError(
            f"{absent.message.rstrip('.')}, and {reason} forbids downloading it.",
            path=absent.path, repo_id=repo_id, revision=revision,
            fix=f"{(absent.fix or '').rstrip('.')}; or {undo} to let codeferry download it.",
        )
    if imported:
        return ModelNotCachedError(
            f"the cached snapshot of {repo_id!r} at {commit} lacks {len(missing)} file(s) its "
            f"code imports ({', '.join(missing)}): it was fetched in part (plain transformers "
            "fetches only the files it finds by name), or the repo lacks them; "
            f"{reason} forbids downloading them.",
            repo_id=repo_id, revision=revision, missing=missing,
            fix=f"{undo} to let codeferry download them, or run "
            f"`{_fetch_command(repo_id, commit, missing)}`.",
        )
    sample = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
    return ModelNotCachedError(
        f"the cached snapshot of {repo_id!r} lacks {len(missing)} file(s) it needs here "
        f"({sample}): it was fetched in part, or its download was cut short; {reason} "
        "forbids downloading them.",
        repo_id=repo_id, revision=revision, missing=missing,
        fix=f"{undo} to let codeferry download them, or run "
        f"`{_fetch_command(repo_id, commit or revision, missing)}`.",
    )


def _download(
    repo_id: str, revision: str | None, cache: Path, token: str | bool | None, need: Need
) -> None:
    """``snapshot_download`` what ``need`` takes of ``repo_id`` into ``cache``, errors typed."""
    from huggingface_hub import HfApi, snapshot_download

    endpoint = _settings.hub_endpoint()
    with _download_lock, _online(), _typed_errors(repo_id, revision, endpoint):
        patterns: list[str] | None = None
        if need == "code":
            # The file list with sizes, to leave out the weights and what no asset can be.
            # (Pushed to in between, the branch may then give files of another commit; the
            # file list snapshot_download keeps shows the snapshot incomplete next time.)
            info = HfApi(endpoint=endpoint, token=token).model_info(
                repo_id, revision=revision, files_metadata=True)
            patterns = [glob.escape(s.rfilename) for s in info.siblings or ()
                        if _needed(s.rfilename, s.size, "code")]
        snapshot_download(repo_id, revision=revision, cache_dir=cache, token=token,
                          endpoint=endpoint, allow_patterns=patterns)


@contextmanager
def _online() -> Iterator[None]:
    """huggingface_hub's offline switch as the environment says now (it read it at import).

    Entered only when ``offline_reason()`` found downloads allowed; restored afterwards.
    """
    from huggingface_hub import constants

    was = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = False
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = was


def _transport_errors() -> tuple[type[BaseException], ...]:
    """The HTTP client's connection errors, and every ``OSError``.

    huggingface_hub 2 talks through httpx2, 1.x through httpx, 0.x through requests (whose
    errors, like huggingface_hub's own and a consistency check on a short file, are OSErrors).
    """
    found: list[type[BaseException]] = [OSError]
    for name in ("httpx2", "httpx"):
        error = getattr(sys.modules.get(name), "TransportError", None)
        if isinstance(error, type) and issubclass(error, BaseException):
            found.append(error)
    return tuple(found)


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


_TOKEN_FIX = "pass token=... (--token TOKEN), or set HF_TOKEN, to a token of an account"

#: huggingface_hub's errors as codeferry's, tried in order (subclasses before their bases,
#: as the ``except`` clauses they replace): the error's name in ``huggingface_hub.errors``
#: (``None``: a connection error of the HTTP client, ``_transport_errors``), the HTTP
#: statuses it applies to (``None``: any), then codeferry's error, its message and its fix,
#: formatted with ``asked``, ``endpoint``, ``repo_id``, ``revision``, ``status``, ``kind``
#: (the error's type), ``first`` (its first line) and ``token_fix``.
_HUB_ERRORS: tuple[tuple[str | None, tuple[int, ...] | None, type[_HubError], str, str],
                   ...] = (
    ("GatedRepoError", None, GatedRepoError,
     "{asked} is a gated repo on {endpoint}: its files need a token with access ({first}).",
     "accept the repo's conditions on its Hub page, then {token_fix} that did."),
    ("RepositoryNotFoundError", None, HubRepoNotFoundError,
     "{endpoint} has no repo {repo_id!r}, or it is private and no token with access was sent.",
     "check the repo id; for a private repo, {token_fix} with access."),
    ("RevisionNotFoundError", None, HubRevisionNotFoundError,
     "{repo_id} on {endpoint} has no branch, tag or commit {revision!r}.",
     "pass a revision the repo has (default: main)."),
    ("HFValidationError", None, HubRepoNotFoundError,
     "{repo_id!r} is not a repo id of the Hub ({first})",
     "pass a folder that holds config.json, or a repo id such as org/name."),
    ("HfHubHTTPError", (401, 403), GatedRepoError,
     "{endpoint} refused access to {asked} ({status}: {first}).", "{token_fix} with access."),
    ("HfHubHTTPError", None, HubDownloadError,
     "{endpoint} answered {status} while {asked} was downloaded: {first}",
     "run the same command again later; what was downloaded whole is kept."),
    (None, None, HubDownloadError,
     "downloading {asked} from {endpoint} failed ({kind}: {first}); nothing half-written "
     "is kept.",
     "check the connection (and HF_ENDPOINT), then run the same command again: it "
     "downloads only what is missing."),
)


@contextmanager
def _typed_errors(repo_id: str, revision: str | None, endpoint: str) -> Iterator[None]:
    """huggingface_hub's errors as codeferry's (``_HUB_ERRORS``), the original as the cause."""
    try:
        yield
    except Exception as exc:
        typed = _typed(exc, repo_id, revision, endpoint)
        if typed is None:
            raise
        raise typed from exc


def _typed(exc: Exception, repo_id: str, revision: str | None,
           endpoint: str) -> _HubError | None:
    """The first row of ``_HUB_ERRORS`` that ``exc`` matches, as an error (``None``: none)."""
    from huggingface_hub import errors as hub

    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None) if response is not None else None
    fields = {"asked": repo_id + (f"@{revision}" if revision else ""), "endpoint": endpoint,
              "repo_id": repo_id, "revision": revision, "status": status,
              "kind": type(exc).__name__, "first": _first_line(exc), "token_fix": _TOKEN_FIX}
    for name, statuses, error, message, fix in _HUB_ERRORS:
        kinds = _transport_errors() if name is None else getattr(hub, name)
        if isinstance(exc, kinds) and (statuses is None or status in statuses):
            return error(message.format(**fields), repo_id=repo_id, revision=revision,
                         fix=fix.format(**fields))
    return None


# -- what the Hub says, for --verify-hub ---------------------------------------------------


@dataclass(frozen=True)
class HubFile:
    """One file of a commit as the Hub lists it: its git blob id, and the sha256 of its bytes
    when it is stored through LFS (then the blob id is the pointer's, not the file's)."""

    size: int | None
    blob_id: str | None
    lfs_sha256: str | None


def hub_commit(repo_id: str, revision: str | None, *, token: str | bool | None = None,
               endpoint: str | None = None) -> str:
    """The commit ``revision`` (default ``main``) of ``repo_id`` points at on the Hub now."""
    with _asking(repo_id, revision, endpoint) as api:
        info = api(token).model_info(repo_id, revision=revision)
    return str(info.sha)


def hub_files(repo_id: str, commit: str, *, token: str | bool | None = None,
              endpoint: str | None = None) -> dict[str, HubFile]:
    """Every file of ``repo_id`` at ``commit`` with the Hub's own hashes of it."""
    with _asking(repo_id, commit, endpoint) as api:
        info = api(token).model_info(repo_id, revision=commit, files_metadata=True)
    if info.sha is not None and info.sha != commit:  # a mirror answering for another commit
        raise HubMismatchError(
            f"{endpoint_of(endpoint)} answered for commit {info.sha} of {repo_id} when asked for "
            f"{commit}.", repo_id=repo_id, revision=commit, mismatches=((repo_id, commit, info.sha),),
            fix="check HF_ENDPOINT (or the endpoint given to --verify-hub): it should be the Hub.")
    out: dict[str, HubFile] = {}
    for sibling in info.siblings or ():
        lfs = sibling.lfs
        sha256 = (lfs.get("sha256") if isinstance(lfs, dict) else getattr(lfs, "sha256", None))
        out[sibling.rfilename] = HubFile(sibling.size, sibling.blob_id, sha256)
    return out


def follow(repo_id: str, revision: str | None, *, cache_dir: str | os.PathLike[str] | None = None,
           token: str | bool | None = None, endpoint: str | None = None) -> str:
    """Bring the cache's ``revision`` (a branch or tag, default ``main``) to the commit it
    points at on the Hub now, downloading that commit's code if the cache lacks it (which
    moves the cache's ref too, as huggingface_hub does), and return that commit.

    What ``codeferry lock --verify-hub`` locks: a branch pins what it points at on the Hub,
    not what it pointed at when the cache last fetched it.
    """
    commit = hub_commit(repo_id, revision, token=token, endpoint=endpoint)
    cache = Path(cache_dir) if cache_dir is not None else _settings.hub_cache()
    try:
        cached = _source.locate_repo(repo_id, revision=revision, cache_dir=cache).commit
    except ModelNotFoundError:
        cached = None
    if cached != commit:
        _download(repo_id, revision, cache, token, "code")
    return commit


def endpoint_of(endpoint: str | None) -> str:
    """The Hub asked: ``endpoint``, else ``HF_ENDPOINT``, else huggingface.co."""
    return (endpoint or _settings.hub_endpoint()).rstrip("/")


@contextmanager
def _asking(repo_id: str, revision: str | None, endpoint: str | None) -> Iterator[Any]:
    """An ``HfApi`` factory (by token) for one question to the Hub; offline, a connection
    error or an HTTP error is a ``HubUncheckedError``, a repo or commit the Hub lacks a
    ``HubMismatchError``, a refused token a ``GatedRepoError``."""
    url = endpoint_of(endpoint)
    reason = _settings.offline_reason()
    if reason is not None:
        raise HubUncheckedError(
            f"could not check {repo_id} against the Hub: {reason} forbids asking {url}.",
            repo_id=repo_id, revision=revision, reason=reason,
            fix=f"unset {reason.split('=')[0]} where {url} can be reached, and run it again.")
    from huggingface_hub import HfApi

    def api(token: str | bool | None) -> Any:
        return HfApi(endpoint=url, token=token)

    try:
        with _download_lock, _online(), _typed_errors(repo_id, revision, url):
            yield api
    except (HubRepoNotFoundError, HubRevisionNotFoundError) as exc:
        raise HubMismatchError(
            f"{url} has no commit {revision} of {repo_id}: the local cache (or the mirror it "
            "came from) names a commit the Hub never had, or the repo is private and no token "
            "with access was sent.", repo_id=repo_id, revision=revision,
            mismatches=((repo_id, "absent", revision or "main"),),
            fix=f"{(exc.fix or '').rstrip('.')}; else delete the cached repo and download it "
            "again from the Hub, then lock it again.") from exc
    except HubDownloadError as exc:
        why = _first_line(exc.__cause__ or exc)
        raise HubUncheckedError(
            f"could not check {repo_id} against {url}: {why}", repo_id=repo_id,
            revision=revision, reason=why,
            fix="check the connection (and HF_ENDPOINT), then run the same command again.",
        ) from exc
