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

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from .errors import StoreCorruptError, StoreUnavailableError

__all__ = ["UnitData", "store_root", "unit_digest", "token_of", "read_unit", "write_unit"]

TOKEN_LENGTH = 32


def store_root() -> Path:
    """The store, from the environment as it is now: ``CODEFERRY_HOME`` or the XDG cache."""
    if os.environ.get("CODEFERRY_HOME"):
        return Path(os.environ["CODEFERRY_HOME"]).expanduser() / "v1"
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "codeferry" / "v1"


def unit_digest(files: Mapping[str, bytes]) -> str:
    """``sha256:<hex>`` over the sorted (path, sha256) list: stable across machines."""
    return _digest_of_hashes({path: hashlib.sha256(b).hexdigest() for path, b in files.items()})


def _digest_of_hashes(hashes: Mapping[str, str]) -> str:
    lines = "".join(f"{path}\0{hashes[path]}\n" for path in sorted(hashes))
    return "sha256:" + hashlib.sha256(lines.encode("utf-8")).hexdigest()


def token_of(digest: str) -> str:
    return digest.removeprefix("sha256:")[:TOKEN_LENGTH]


@dataclass(frozen=True)
class UnitData:
    """The verified bytes of a unit, and what the loader needs to execute them.

    ``order`` lists dotted module names dependencies first; ``packages`` those that are
    packages (``__init__.py`` or namespace folders); ``label`` is what messages call it.
    """

    digest: str
    files: Mapping[str, bytes]
    order: tuple[str, ...]
    packages: frozenset[str]
    label: str

    @property
    def token(self) -> str:
        return token_of(self.digest)

    def verify(self) -> None:
        actual = unit_digest(self.files)
        if actual != self.digest:
            raise StoreCorruptError(
                f"the code of {self.label} does not match its digest: expected "
                f"{self.digest}, got {actual}.",
                digest=self.digest, model=self.label,
                fix="the bytes were changed after they were hashed; load the model again from its source.",
            )


def _manifest(unit: UnitData) -> dict[str, object]:
    return {
        "digest": unit.digest,
        "label": unit.label,
        "order": list(unit.order),
        "packages": sorted(unit.packages),
        "files": {p: hashlib.sha256(b).hexdigest() for p, b in sorted(unit.files.items())},
    }


def read_unit(digest_or_token: str, root: Path | None = None) -> UnitData | None:
    """The unit from the store, verified; ``None`` if absent or broken (callers repair)."""
    base = (root or store_root()) / "units" / token_of(digest_or_token)
    try:
        manifest = json.loads((base / "manifest.json").read_text(encoding="utf-8"))
        listed = manifest["files"]
        if not isinstance(listed, dict):
            return None
        files = {path: (base / "files" / path).read_bytes() for path in listed}
        unit = UnitData(
            manifest["digest"], files, tuple(manifest["order"]),
            frozenset(manifest["packages"]), manifest["label"],
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not unit.digest.removeprefix("sha256:").startswith(token_of(digest_or_token)):
        return None
    # Every file against the manifest (a manifest that lies about its files is broken
    # too, and gets rewritten), and the whole against the digest.
    hashes = {path: hashlib.sha256(data).hexdigest() for path, data in files.items()}
    if hashes != listed or _digest_of_hashes(hashes) != unit.digest:
        return None
    return unit


def unit_path(unit: UnitData, root: Path | None = None) -> Path:
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


def write_unit(unit: UnitData, root: Path | None = None) -> Path:
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
        for sub in ("units", "locks", "tmp"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        with FileLock(str(root / "locks" / f"{unit.token}.lock")):
            if read_unit(unit.digest, root) is not None:  # another writer finished first
                return final / "files"
            for stale in (root / "tmp").glob(f"{unit.token}.*"):
                _remove(stale)  # left by killed writers
            staging = root / "tmp" / f"{unit.token}.{os.getpid()}.{uuid.uuid4().hex}"
            for path, data in unit.files.items():
                target = staging / "files" / path
                target.parent.mkdir(parents=True, exist_ok=True)
                with open(target, "wb") as handle:
                    handle.write(data)
                    handle.flush()
                    os.fsync(handle.fileno())
            with open(staging / "manifest.json", "w", encoding="utf-8") as handle:
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
    except OSError as exc:
        if staging is not None:
            _remove(staging)  # nothing half-written stays behind (disk full, read-only)
        raise StoreUnavailableError(
            f"cannot write the code of {unit.label} ({unit.digest}) to the codeferry store "
            f"at {root}: {exc.strerror or exc}.",
            digest=unit.digest, model=unit.label, path=str(root),
            fix="free disk space or make the folder writable, or set CODEFERRY_HOME to a "
            "writable folder (e.g. `export CODEFERRY_HOME=/tmp/codeferry`).",
        ) from exc
    return final / "files"
