"""Private copies: each process's own read-only copy of the verified bytes of a unit.

``__file__`` of every module ``loader`` executes points into one, and so do the files
transformers reads for a loaded model (a tokenizer's ``vocab.json``): whatever reads "the
file" after the check reads the checked bytes. Layout::

    $TMPDIR/codeferry-private-<pid>-<random>/   this process's folder (mkdtemp, 0700)
      .alive                                    flock held while the process (or a fork) lives
      <unit token>/...                          a unit's files (0400), folders 0500

The temporary folder is held to the store's permission rule (``store.unsafe_place``, the
one ``CODEFERRY_HOME`` passes): it, every folder above it and every link on the way must be
ours or root's, and writable by nobody else unless it has the sticky bit (``/tmp``). In a folder that others can write without the sticky
bit, another user could rename our folder away and put one of theirs, with other bytes,
under its name: then what the code reads would not be what was checked. Such a folder
is refused (``StorePermissionError``, naming ``TMPDIR``), before anything is written.

Removing a copy (at exit, or the sweep of copies left by killed processes) never follows
what someone may have put in place of it: the folder is opened with ``O_NOFOLLOW``, must
be ours (and, at exit, the very folder this process made: same device and inode), and
everything inside is removed relative to that descriptor.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
import warnings
from pathlib import Path

from ..errors import StorePermissionError, StoreUnavailableError
from .store import Unit, unsafe_place, user_name

__all__ = ["verified_dir"]

_PRIVATE_PREFIX = "codeferry-private-"
_ALIVE = ".alive"
_DIR_FLAGS = (os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
              | getattr(os, "O_CLOEXEC", 0))
#: Folders can be opened and worked in by descriptor (not on Windows).
_BY_FD = os.open in os.supports_dir_fd and os.scandir in os.supports_fd

_lock = threading.RLock()
_private: dict[str, Path] = {}  # unit token -> its folder, in the process that made it
#: (pid, root, (st_dev, st_ino) of root) of this process's copies.
_private_owner: tuple[int, Path, tuple[int, int]] | None = None
_alive_fds: list[int] = []  # kept open for the process's life: the lock dies with it


def _check_temp(base: str) -> None:
    """Refuse ``base`` (and the folders above it) if another user could swap what is in it.

    The store's rule (``store.unsafe_place``, as for ``CODEFERRY_HOME``): ours or root's,
    and writable by nobody else unless sticky; a link in the path, ours or root's too.
    """
    unsafe = unsafe_place(base, shared_ok=True)
    if unsafe is not None:
        folder, st, why = unsafe
        if "writable" in why:
            why += " without the sticky bit"
        fix = ("point TMPDIR at a folder only you can write (e.g. `mkdir -m 700 ~/tmp && "
               "export TMPDIR=~/tmp`), or unset it to use the system's /tmp")
        if st.st_uid not in (os.geteuid(), 0):
            fix += f", or run as {user_name(st.st_uid)}"
        raise StorePermissionError(
            f"the temporary folder {base} that codeferry keeps this process's private copy "
            f"of the checked code in is not safe: {folder} {why}, so another user could "
            "rename the copy away and put other files under its name, which this process "
            "would then read as the checked ones.",
            path=folder, owner=st.st_uid, mode=st.st_mode & 0o7777, fix=fix + ".",
        )


def _private_root() -> Path:
    """This process's folder for private copies: a fresh ``mkdtemp`` (0700), one per pid.

    A forked child keeps the modules its parent executed (and their ``__file__``, in
    the parent's folder); it makes its own folder for units it imports itself.
    """
    global _private_owner
    pid = os.getpid()
    if _private_owner is None or _private_owner[0] != pid:
        if _private_owner is not None:
            _private.clear()  # the parent's copies: the parent removes them
        base = tempfile.gettempdir()
        _check_temp(base)
        _sweep_private(base)
        root = Path(tempfile.mkdtemp(prefix=f"{_PRIVATE_PREFIX}{pid}-", dir=base))
        st = os.lstat(root)
        ident = (st.st_dev, st.st_ino)
        _hold_alive(root)
        _private_owner = (pid, root, ident)
        atexit.register(_remove_private, pid, root, ident)
    return _private_owner[1]


def _same_folder(root: Path, ident: tuple[int, int]) -> bool:
    try:
        st = os.lstat(root)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == ident


def _empty_at(fd: int) -> None:
    """Remove everything inside the open folder ``fd``, best effort, never leaving it.

    Folders get their write bit back first (copies are read-only). Paths are relative
    to ``fd``, whose folder is ours and private: nobody else can swap anything below it.
    Its own stack, not ``os.walk``/``shutil.rmtree``, which recurse in Python 3.11 (a
    unit may be deeper than the recursion limit) and hold a descriptor per level.
    """
    folders: list[str] = []
    stack = [""]
    while stack:
        rel = stack.pop()
        try:
            sub = os.open(rel, _DIR_FLAGS, dir_fd=fd) if rel else fd
        except OSError:
            continue
        try:
            os.fchmod(sub, 0o700)
            with os.scandir(sub) as listing:
                entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in listing]
        except OSError:
            continue
        finally:
            if sub != fd:
                os.close(sub)
        if rel:
            folders.append(rel)
        for name, is_dir in entries:
            path = f"{rel}/{name}" if rel else name
            if is_dir:
                stack.append(path)
            else:
                try:
                    os.unlink(path, dir_fd=fd)
                except OSError:
                    pass
    for rel in reversed(folders):  # children were listed after their parents
        try:
            os.rmdir(rel, dir_fd=fd)
        except OSError:
            pass


def _remove_tree(root: Path, ident: tuple[int, int] | None = None) -> None:
    """Remove a private copy at ``root``, best effort, if it is ours (and ``ident``).

    Opened without following a link; a folder of another user, or (``ident``) another
    folder than the one this process made, is left alone.
    """
    if not _BY_FD:  # Windows: no other user reaches a folder of the user's own profile
        shutil.rmtree(root, ignore_errors=True)
        return
    try:
        fd = os.open(root, _DIR_FLAGS)
    except OSError:
        return
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or (ident is not None and (st.st_dev, st.st_ino) != ident):
            return
        _empty_at(fd)
        if _same_folder(root, (st.st_dev, st.st_ino)):
            try:
                os.rmdir(root)
            except OSError:
                pass
    finally:
        os.close(fd)


def _remove_private(pid: int, root: Path, ident: tuple[int, int]) -> None:
    if os.getpid() == pid:  # never a forked child's exit: the folder is its parent's
        _remove_tree(root, ident)


def _hold_alive(root: Path) -> None:
    """Hold an exclusive ``flock`` on ``root/.alive`` until this process (and its forks) end.

    A lock, not a pid: it is released by the kernel however the process dies, and a pid
    can be reused or belong to another PID namespace sharing this temporary folder.
    """
    try:
        import fcntl
    except ImportError:  # no flock (Windows): copies of killed processes stay behind
        warnings.warn(
            f"codeferry: no fcntl.flock on this platform: the private copy {root} of this "
            "process's code cannot be marked alive, so copies left by killed processes are "
            f"not removed ({tempfile.gettempdir()}/{_PRIVATE_PREFIX}*; delete them when no "
            "codeferry process runs).", RuntimeWarning, stacklevel=2)
        return
    # Locked before it has its name: a sweeper that found ``.alive`` unlocked between its
    # creation and our flock would take the lock itself and remove a live copy.
    pending = root / f"{_ALIVE}.{os.getpid()}"
    fd = os.open(pending, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.rename(pending, root / _ALIVE)
    _alive_fds.append(fd)


def _sweep_private(base: str | None = None) -> None:
    """Remove copies left by processes that were killed: those whose lock nobody holds."""
    try:
        import fcntl
    except ImportError:
        return
    base = base or tempfile.gettempdir()
    try:
        with os.scandir(base) as listing:
            names = [e.name for e in listing if e.name.startswith(_PRIVATE_PREFIX)]
    except OSError:
        return
    uid = os.geteuid()
    for name in names:
        path = os.path.join(base, name)
        try:
            fd = os.open(path, _DIR_FLAGS)  # a link, or no folder: not ours to look into
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if st.st_uid != uid:
                continue
            try:
                alive = os.open(_ALIVE, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0), dir_fd=fd)
            except OSError:
                continue  # being created right now (no lock file yet)
            try:
                fcntl.flock(alive, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # its process (or a fork of it) is alive
            finally:
                os.close(alive)
        finally:
            os.close(fd)
        _remove_tree(Path(path), (st.st_dev, st.st_ino))


def verified_dir(unit: Unit) -> Path:
    """The folder of this process's private, read-only copy of ``unit``'s verified bytes.

    Written from the bytes in memory (which ``register`` verified), read back and
    compared, then made read-only; refused with ``StoreUnavailableError`` when the
    temporary folder cannot be written (set ``TMPDIR`` to one that can), and with
    ``StorePermissionError`` when another user could swap what is in it.
    """
    with _lock:
        root = _private_root()
        found = _private.get(unit.token)
        if found is not None:
            return found
        assert _private_owner is not None
        if not _same_folder(root, _private_owner[2]):
            raise StorePermissionError(
                f"this process's private copy {root} of the checked code was replaced by "
                "another folder since it was made.", path=str(root),
                fix="find out who replaced it; keep TMPDIR in a folder only you can write.")
        folder = root / unit.token
        try:
            folder.mkdir(mode=0o700)
            subfolders: set[Path] = set()  # made one level at a time: mkdir(parents) recurses
            for rel in unit.files:
                for parent in reversed(Path(rel).parents):
                    if parent != Path(".") and parent not in subfolders:
                        (folder / parent).mkdir(mode=0o700)
                        subfolders.add(parent)
            for rel, data in unit.files.items():
                target = folder / rel
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with open(fd, "wb") as handle:
                    handle.write(data)
            for rel, data in unit.files.items():
                target = folder / rel
                with open(target, "rb") as handle:
                    if handle.read() != data:
                        raise OSError(f"{target} does not read back as written")
                os.chmod(target, 0o400)
            for sub in subfolders:
                os.chmod(folder / sub, 0o500)
            os.chmod(folder, 0o500)
        except OSError as exc:
            _remove_tree(folder)
            raise StoreUnavailableError(
                f"cannot write this process's private copy of the code of {unit.label} "
                f"({unit.digest}) under {root}: {exc.strerror or exc}.",
                digest=unit.digest, model=unit.label, path=str(root),
                fix="free space in the temporary folder, or point TMPDIR at a writable one.",
            ) from exc
        _private[unit.token] = folder
        return folder
