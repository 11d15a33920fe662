"""Where a model's files are: a local folder, or a repo in the local Hugging Face cache.

No network here: a repo id is looked up in the hub cache as it is on disk (``hub``
downloads what the cache lacks, then asks here again)::

    $HF_HUB_CACHE/                       (default $HF_HOME/hub, ~/.cache/huggingface/hub)
      models--org--name/
        refs/main                        -> "<commit>"  (a branch or tag name -> commit)
        snapshots/<commit>/config.json   -> symlink into ../../blobs/<sha>
        blobs/<sha>

Every setting is read when a function is called, not when this module is imported,
so a test or a worker may change ``HF_HOME`` at any time.

Reading is fenced: a file may be a symlink only when it resolves inside its fence,
the model folder for a local model and ``models--org--name`` for a cached repo (whose
snapshots link into ``blobs``). Anything else is an ``UnsafePathError``.

A snapshot folder given as a path (what ``snapshot_download()`` returns, and what a
parent hands its workers) is the cached repo it belongs to, not a local folder: the
same fence, repo id and commit as its repo id would give, in every process.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from .. import _settings
from ..errors import (
    AssetTooLargeError,
    ModelNotFoundError,
    SourceTooLargeError,
    UnreadableFileError,
    UnsafePathError,
)
from .digest import is_commit

__all__ = [
    "WEIGHT_SUFFIXES", "ModelOrigin", "locate", "locate_repo", "list_files",
    "read_bytes", "repo_id_of", "snapshot_origin",
]

#: Far above any real modeling file (the largest on the hub are a few hundred KB).
MAX_SOURCE_BYTES = 8 * 1024 * 1024
#: Data files the code names (``tokenizer.json``, vocabularies, tables) are not source:
#: Llama-3's tokenizer.json is 9 MB. They get their own, much larger limit.
MAX_ASSET_BYTES = 1024 * 1024 * 1024
#: Weights are data, never code or an asset of it: not hashed, and not fetched for the code.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf",
                   ".onnx", ".npz")

_SKIP_DIRS = frozenset({"__pycache__", ".git", ".cache", ".hf", ".ipynb_checkpoints"})


@dataclass(frozen=True)
class ModelOrigin:
    """Where a model was found: ``root`` holds its ``config.json``.

    (Not importlib's ``ModuleSpec.origin``, the file of one module.)

    ``repo_id``/``commit`` are set for a cached hub repo (the commit a revision resolved
    to, which pins it), ``None`` for a local folder.
    """

    root: Path
    fence: Path
    repo_id: str | None = None
    revision: str | None = None
    commit: str | None = None

    @property
    def name(self) -> str:
        """What messages call the model: its repo id, or its folder."""
        if self.repo_id:
            return f"{self.repo_id}@{self.commit}" if self.commit else self.repo_id
        return str(self.root)


def locate_repo(
    repo_id: str, *, revision: str | None = None, cache_dir: str | os.PathLike[str] | None = None
) -> ModelOrigin:
    """A repo in the local hub cache, at ``revision`` (default ``main``) resolved to a commit."""
    cache = Path(cache_dir) if cache_dir is not None else _settings.hub_cache()
    repo_dir = cache / ("models--" + repo_id.replace("/", "--"))
    wanted = revision or "main"
    fix = (
        f"download it first (`hf download {repo_id}"
        + (f" --revision {revision}" if revision else "")
        + f"`), or point HF_HUB_CACHE at the cache that holds it (looked in {cache})."
    )
    if not repo_dir.is_dir():
        raise ModelNotFoundError(
            f"{repo_id!r} is neither a folder nor a repo in the local Hugging Face cache.",
            path=str(repo_dir),
            fix=fix,
        )
    commit = wanted if is_commit(wanted) else None
    if commit is None:
        ref = repo_dir / "refs" / wanted
        if not ref.is_file():
            raise ModelNotFoundError(
                f"revision {wanted!r} of {repo_id!r} is not in the local cache.",
                path=str(ref),
                fix=fix,
            )
        commit = ref.read_text(encoding="utf-8", errors="replace").strip()
        if not is_commit(commit):  # what a lock pins, and a folder name below
            raise ModelNotFoundError(
                f"revision {wanted!r} of {repo_id!r} in the local cache points at "
                f"{commit[:60]!r}, which is not a commit (40 hex digits).",
                path=str(ref), fix=f"delete {ref} and download the repo again (`hf download "
                f"{repo_id}" + (f" --revision {revision}" if revision else "") + "`).",
            )
    snapshot = repo_dir / "snapshots" / commit
    if not snapshot.is_dir():
        raise ModelNotFoundError(
            f"commit {commit} of {repo_id!r} is not in the local cache.", path=str(snapshot), fix=fix
        )
    return ModelOrigin(snapshot, repo_dir.resolve(), repo_id, revision, commit)


def locate(
    model: str | os.PathLike[str],
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> ModelOrigin:
    """A local folder if ``model`` is one, else a repo id in the local hub cache."""
    path = Path(model).expanduser()
    if path.is_dir():
        root = path.resolve()
        found = snapshot_origin(root)
        if found is not None:
            return found
        # A model in a sub-folder of a snapshot (``subfolder=``): its links reach the blobs too.
        for above in root.parents:
            if (outer := snapshot_origin(above)) is not None:
                return ModelOrigin(root, outer.fence)
        return ModelOrigin(root, root)
    return locate_repo(repo_id_of(model), revision=revision, cache_dir=cache_dir)


def repo_id_of(model: str | os.PathLike[str]) -> str:
    """``model``, which is not a folder, as a repo id; ``ModelNotFoundError`` if it is a path."""
    text = os.fspath(model)
    path = Path(text).expanduser()
    looks_like_path = path.is_absolute() or text.startswith(".") or path.exists() or text.count("/") > 1
    if looks_like_path or not text:
        raise ModelNotFoundError(
            f"model folder {text!r} does not exist" + (" (it is a file)" if path.is_file() else "") + ".",
            path=text,
            fix="pass a folder that holds config.json, or a repo id of the Hugging Face Hub.",
        )
    return text


def snapshot_origin(root: Path) -> ModelOrigin | None:
    """``root`` as a cached repo when it is ``.../models--org--name/snapshots/<commit>``.

    Its files are symlinks into ``../../blobs``, so its fence is the repo folder: fenced
    to itself, every file of a real hub download would read as an escape.
    """
    snapshots = root.parent
    repo_dir = snapshots.parent
    if not (is_commit(root.name) and snapshots.name == "snapshots"
            and repo_dir.name.startswith("models--") and len(repo_dir.name) > len("models--")):
        return None
    repo_id = repo_dir.name[len("models--"):].replace("--", "/")
    return ModelOrigin(root, repo_dir, repo_id, None, root.name)


def list_files(origin: ModelOrigin) -> dict[str, Path]:
    """Every file below the model root, as root-relative ``/``-paths (hidden folders skipped).

    Folder symlinks are not followed: code behind one must be named explicitly, and is
    then fenced by ``read_bytes``. The walk keeps its own stack (``os.walk`` of Python
    3.11 recurses, and a model a thousand folders deep would raise ``RecursionError``);
    the order is the same: folders in name order, each folder's files before its
    subfolders.
    """
    found: dict[str, Path] = {}
    root = origin.root
    stack: list[tuple[str, str]] = [(str(root), "")]  # (folder, its root-relative prefix)
    while stack:
        folder, prefix = stack.pop()
        try:
            with os.scandir(folder) as listing:
                entries = list(listing)
        except OSError:
            continue  # unreadable or vanished: os.walk skipped these too
        subfolders: list[tuple[str, str]] = []
        for entry in entries:
            try:
                is_dir = entry.is_dir()
            except OSError:
                is_dir = False
            if not is_dir:
                found[prefix + entry.name] = Path(entry.path)
            elif (entry.name not in _SKIP_DIRS and not entry.name.startswith(".")
                  and not entry.is_symlink()):
                subfolders.append((entry.path, prefix + entry.name + "/"))
        stack.extend(sorted(subfolders, reverse=True))
    return found


def read_bytes(
    origin: ModelOrigin, rel: str, *, limit: int | None = None, asset: bool = False
) -> bytes:
    """The bytes of root-relative file ``rel``, refusing escapes and oversized files.

    ``asset=True`` reads a data file the code names: the limit is ``MAX_ASSET_BYTES``
    and an oversized one is an ``AssetTooLargeError``. The size is checked before reading.
    """
    if limit is None:
        limit = MAX_ASSET_BYTES if asset else MAX_SOURCE_BYTES
    if rel.startswith("/") or ".." in rel.split("/"):
        raise UnsafePathError(
            f"{rel!r} points outside the model folder.",
            path=rel,
            fix="keep every file the code needs inside the model folder.",
        )
    full = origin.root / rel
    try:
        real = full.resolve()
    except (OSError, RuntimeError):  # a symlink loop (RuntimeError before Python 3.13)
        raise UnreadableFileError(
            f"{rel} is a symlink that loops.", path=str(full),
            fix="replace the link with the file it should point to.",
        ) from None
    if not real.is_relative_to(origin.fence):
        raise UnsafePathError(
            f"{rel} is a symlink to {real}, outside the model folder.",
            path=str(full),
            fix="replace the link with a copy of the file inside the model folder.",
        )
    try:
        info = real.stat()
    except OSError as exc:
        raise UnreadableFileError(
            f"{rel} cannot be read: {exc.strerror or exc}"
            + (" (a broken symlink)." if full.is_symlink() else "."),
            path=str(full), fix="replace it with the real file (download the model again).",
        ) from None
    if not stat.S_ISREG(info.st_mode):  # a pipe or a device would block or never end
        raise UnreadableFileError(
            f"{rel} is not a regular file.", path=str(full),
            fix="replace it with the real file (download the model again).",
        )
    size = info.st_size
    if size > limit and asset:
        raise AssetTooLargeError(
            f"{rel} is {size / 2**20:.1f} MiB, above the limit of {limit / 2**20:.0f} MiB for "
            "a data file the model code names.",
            path=str(full), size=size, limit=limit,
            fix="check that this is the right file; if the code really reads it, ship it "
            "outside the model folder (it is then not part of the verified code).",
        )
    if size > limit:
        raise SourceTooLargeError(
            f"{rel} is {size / 2**20:.1f} MiB; no model source file is that large "
            f"(the limit is {limit / 2**20:.0f} MiB).",
            path=str(full),
            fix="check that this is the right file; a generated or data file does not belong in code.",
        )
    try:
        return real.read_bytes()
    except OSError as exc:
        raise UnreadableFileError(
            f"{rel} cannot be read: {exc.strerror or exc}.", path=str(full),
            fix="check the file's permissions, or download the model again.",
        ) from None
