"""codeferry's content-addressed store of code units, safe for many writers at once.

A *unit* is one repo's worth of needed files (the model's own code, or a cross-repo
unit), named by the sha256 of its file list. The store lets a process that only got
a digest (a class pickled by reference, a pool started before the parent loaded the
model) find the exact bytes, and gives module code a real ``__file__`` next to its
assets. Layout::

    $CODEFERRY_HOME            (default: $XDG_CACHE_HOME/codeferry, ~/.cache/codeferry)
      v1/units/<token>/        token: first 32 hex digits of the unit digest
        manifest.json          {"digest": "sha256:...", "files": {path: sha256}, "order": [...]}
        files/<path>           the exact bytes
      v1/locks/<token>.lock    one writer at a time per unit (filelock: freed if the writer dies)
      v1/tmp/                  writers build a unit here, then rename it into place

Why this shape (transformers #22506, #22555, TensorRT-LLM #7379): writers never write
in place. A unit appears by one ``rename`` of a complete folder, so a reader sees all
of it or none of it. Readers verify every file against the manifest and the manifest
against the digest before using it; an entry left broken by a killed writer, or
corrupted later, fails that check and is rebuilt under the lock by anyone who has the
bytes. And nothing is ever imported from these files: the loader executes the bytes
it verified in memory. The files exist for ``__file__`` and for readers that have
only a digest.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import uuid
from collections.abc import Mapping
from pathlib import Path

from filelock import FileLock

from .. import _settings
from .._code.digest import file_sha256, token_of, unit_digest_of
from .._code.unit import Unit
from ..errors import StorePermissionError, StoreUnavailableError

__all__ = ["Unit", "foreign_access", "read_unit", "store_root", "unsafe_place", "user_name",
           "write_unit"]

_DIR_MODE = 0o700
_FILE_MODE = 0o600
_SUBFOLDERS = ("units", "locks", "tmp")


def store_root() -> Path:
    """The store, from the environment as it is now: ``CODEFERRY_HOME`` or the XDG cache."""
    return _settings.codeferry_home() / "v1"


def _manifest(unit: Unit) -> dict[str, object]:
    return {
        "digest": unit.digest,
        "label": unit.label,
        "order": list(unit.order),
        "packages": sorted(unit.packages),
        "files": {p: file_sha256(b) for p, b in sorted(unit.files.items())},
    }


# -- permissions -------------------------------------------------------------------------


def user_name(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _group_is_ours(gid: int) -> bool:
    """Our own group with no other members: its write bit lets nobody else in."""
    if gid != os.getegid():
        return False
    try:
        import grp
        import pwd

        me = pwd.getpwuid(os.geteuid()).pw_name
        return set(grp.getgrgid(gid).gr_mem) <= {me}
    except (ImportError, KeyError):
        return False


def foreign_access(st: os.stat_result, *, sticky_ok: bool) -> str | None:
    """Why another user could write through ``st`` (``None``: nobody but us and root).

    ``sticky_ok``: a folder above the store may be shared if it has the sticky bit
    (``/tmp``), where nobody can rename or delete what another user put in it.
    """
    if st.st_uid not in (os.geteuid(), 0):
        return f"is owned by {user_name(st.st_uid)}"
    if stat.S_ISLNK(st.st_mode):
        return None  # a link's own mode bits mean nothing; its target is checked too
    if sticky_ok and st.st_mode & stat.S_ISVTX:
        return None
    if st.st_mode & stat.S_IWOTH:
        return "is writable by every user"
    if st.st_mode & stat.S_IWGRP and not _group_is_ours(st.st_gid):
        return f"is writable by group {st.st_gid}"
    return None


def _refuse(path: Path | str, st: os.stat_result, why: str, what: str,
            digest: str | None = None) -> StorePermissionError:
    if digest is not None:
        fix = (f"find out who changed it, then remove it (`rm -rf {path}`): the next load "
               "writes it again, private.")
    elif st.st_uid not in (os.geteuid(), 0):
        fix = ("set CODEFERRY_HOME to a folder only you own and can write (e.g. "
               "`export CODEFERRY_HOME=~/.cache/codeferry`); never a shared one.")
    else:
        fix = (f"remove the write permission of others (`chmod go-w {path}`), or set "
               "CODEFERRY_HOME to a folder only you can write.")
    return StorePermissionError(
        f"the codeferry store's {what} {path} {why}: another user could replace code "
        "that this process would run.",
        path=str(path), owner=st.st_uid, mode=stat.S_IMODE(st.st_mode), digest=digest, fix=fix,
    )


def _check_path(path: Path, what: str, digest: str | None = None) -> bool:
    """Refuse ``path`` (and a link's target) if another user owns or can write it.

    Returns whether it exists.
    """
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    why = foreign_access(st, sticky_ok=False)
    if why is None and stat.S_ISLNK(st.st_mode):
        try:
            st = os.stat(path)
        except OSError:
            return False  # dangling: reads fail and the entry counts as broken
        why = foreign_access(st, sticky_ok=False)
    if why is not None:
        raise _refuse(path, st, why, what, digest)
    return True


def unsafe_place(path: str | os.PathLike[str], *,
                 shared_ok: bool) -> tuple[str, os.stat_result, str] | None:
    """Why another user could swap what codeferry keeps in folder ``path``: the offending
    path, its ``lstat`` and why; ``None`` when nobody but us and root can.

    The one rule for the store's home and for the temporary folder of private copies:
    every part of the path, as written and through each link it holds, is looked at itself
    (``lstat``): a link must be ours or root's (whoever owns a link, in a sticky folder too,
    can point it elsewhere later) and its target is held to the same rule; a folder must be
    ours or root's and writable by nobody else, unless it has the sticky bit and is a folder
    above ``path`` (or ``path`` itself, with ``shared_ok``: the temporary folder may be
    ``/tmp``). A part that does not exist is left to whoever creates or reads it. The
    path with every link resolved is walked too.
    """
    pending = [(os.path.realpath(path), shared_ok), (os.path.abspath(path), shared_ok)]
    seen: set[str] = set()
    while pending:
        start, sticky_ok = pending.pop()
        folder = start
        while folder not in seen:
            seen.add(folder)
            try:
                st = os.lstat(folder)
            except OSError:
                st = None
            if st is not None:
                why = foreign_access(st, sticky_ok=sticky_ok)
                if why is not None:
                    return folder, st, ("is a link " + why.removeprefix("is ")
                                        if stat.S_ISLNK(st.st_mode) else why)
                if stat.S_ISLNK(st.st_mode):
                    try:
                        target = os.path.join(os.path.dirname(folder), os.readlink(folder))
                    except OSError:
                        target = None
                    if target is not None:
                        pending.append((os.path.abspath(target), sticky_ok))
            parent = os.path.dirname(folder)
            if parent == folder:
                break
            folder, sticky_ok = parent, True
    return None


def _check_home(root: Path) -> bool:
    """Check the home, every folder above it and the store's own subfolders.

    Returns whether the store (``root``) exists.
    """
    home = root.parent
    if not os.path.lexists(home):
        return False
    unsafe = unsafe_place(home, shared_ok=False)
    if unsafe is not None:
        path, st, why = unsafe
        what = "home" if path == os.path.abspath(home) else "parent folder"
        raise _refuse(path, st, why + " (without the sticky bit)" if "writable" in why
                      else why, what)
    if not _check_path(home, "home"):
        return False
    if not _check_path(root, "folder"):
        return False
    for sub in _SUBFOLDERS:
        _check_path(root / sub, "folder")
    return True


def _check_entry_files(base: Path, listed: Mapping[str, object], digest: str) -> None:
    seen: set[Path] = set()
    for rel in listed:
        path = base / "files"
        for part in Path(rel).parts:
            path = path / part
            if path not in seen:
                seen.add(path)
                _check_path(path, "entry", digest)


def _make_private(folder: Path) -> None:
    """Create ``folder`` and any missing parents 0700 (``mkdir -p`` would make them 0755)."""
    missing: list[Path] = []
    current = folder
    while not os.path.lexists(current) and current != current.parent:
        missing.append(current)
        current = current.parent
    for path in reversed(missing):
        try:
            path.mkdir(mode=_DIR_MODE)
        except FileExistsError:
            pass  # another writer made it first: checked below like any other


def read_unit(digest_or_token: str, root: Path | None = None) -> Unit | None:
    """The unit from the store, verified; ``None`` if absent or broken (callers repair).

    Raises ``StorePermissionError`` when another user owns or can write the store or
    the entry: its bytes could be anyone's.
    """
    root = root or store_root()
    if not _check_home(root):
        return None
    base = root / "units" / token_of(digest_or_token)
    entry_digest = (digest_or_token if digest_or_token.startswith("sha256:")
                    else f"sha256:{digest_or_token}...")
    if not _check_path(base, "entry", entry_digest):
        return None
    _check_path(base / "manifest.json", "entry", entry_digest)
    _check_path(base / "files", "entry", entry_digest)
    try:
        manifest = json.loads((base / "manifest.json").read_text(encoding="utf-8"))
        listed = manifest["files"]
        if not isinstance(listed, dict):
            return None
        _check_entry_files(base, listed, entry_digest)
        files = {path: (base / "files" / path).read_bytes() for path in listed}
        unit = Unit(
            manifest["digest"], files, tuple(manifest["order"]),
            frozenset(manifest["packages"]), manifest["label"],
        )
    except StorePermissionError:
        raise
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not unit.digest.removeprefix("sha256:").startswith(token_of(digest_or_token)):
        return None
    # Every file against the manifest (a manifest that lies about its files is broken
    # too, and gets rewritten), and the whole against the digest.
    hashes = {path: file_sha256(data) for path, data in files.items()}
    if hashes != listed or unit_digest_of(hashes) != unit.digest:
        return None
    return unit


def unit_path(unit: Unit, root: Path | None = None) -> Path:
    """Where the unit's files are (``__file__`` of its modules points here)."""
    return (root or store_root()) / "units" / unit.token / "files"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    """Remove a leftover folder, or a file or link where a folder should be; best effort."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except OSError:
            pass


def write_unit(unit: Unit, root: Path | None = None) -> Path:
    """Put ``unit`` in the store (verified first), unless a valid copy is there already.

    Returns the unit's files folder. Raises ``StoreUnavailableError`` when the store
    cannot be written (read-only, disk full), naming the digest and the fix.
    """
    unit.verify()
    root = root or store_root()
    final = root / "units" / unit.token
    if read_unit(unit.digest, root) is not None:
        return final / "files"
    staging: Path | None = None
    try:
        _make_private(root)
        for sub in _SUBFOLDERS:
            (root / sub).mkdir(mode=_DIR_MODE, exist_ok=True)
        _check_home(root)
        with FileLock(str(root / "locks" / f"{unit.token}.lock"), mode=_FILE_MODE):
            if read_unit(unit.digest, root) is not None:  # another writer finished first
                return final / "files"
            for stale in (root / "tmp").glob(f"{unit.token}.*"):
                _remove(stale)  # left by killed writers
            staging = root / "tmp" / f"{unit.token}.{os.getpid()}.{uuid.uuid4().hex}"
            for path, data in unit.files.items():
                target = staging / "files" / path
                _make_private(target.parent)
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                             _FILE_MODE)
                with open(fd, "wb") as handle:
                    handle.write(data)
                    handle.flush()
                    os.fsync(handle.fileno())
            fd = os.open(staging / "manifest.json",
                         os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, _FILE_MODE)
            with open(fd, "w", encoding="utf-8") as handle:
                json.dump(_manifest(unit), handle, indent=1, sort_keys=True)
                handle.flush()
                os.fsync(handle.fileno())
            if os.path.lexists(final):  # a folder, a file, or a dangling link
                # Left broken by a killed writer or corrupted since: move it aside whole
                # (readers holding its files keep them), then drop it.
                trash = root / "tmp" / f"{unit.token}.broken.{uuid.uuid4().hex}"
                os.replace(final, trash)
                _remove(trash)
            os.replace(staging, final)
            staging = None
            _fsync_dir(final.parent)
    except StorePermissionError:
        raise  # not a full disk: the fix is the one it names
    except OSError as exc:
        if staging is not None:
            _remove(staging)  # nothing half-written stays behind (disk full, read-only)
        raise StoreUnavailableError(
            f"cannot write the code of {unit.label} ({unit.digest}) to the codeferry store "
            f"at {root}: {exc.strerror or exc}.",
            digest=unit.digest, model=unit.label, path=str(root),
            fix="free disk space or make the folder writable, or set CODEFERRY_HOME to a "
            "writable folder that only you own (e.g. `export "
            "CODEFERRY_HOME=~/.cache/codeferry`), never a shared one.",
        ) from exc
    return final / "files"
