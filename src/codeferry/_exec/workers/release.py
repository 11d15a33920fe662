"""Release environments: the transformers release a model's code needs, for its workers.

Remote code is written for the transformers of its day. Where a later release removed a name
that code imports and no shim has one obvious meaning (``HybridCache``...), the code runs
only on a release that still has it. The parent process stays on the installed transformers:
it reads the code statically, and ``_code.removed.release_for`` names the release line. The
workers are other processes, so they can import another transformers: a zygote started with
the release's folder first on its path forks them (``zygote``), and each worker then loads
and verifies the code as any worker does. A Ray actor is a fresh process on a node that does
not share this disk: it makes or finds its node's own release and puts it first on its path
before it imports transformers (``enter``).

A release is made once per line and Python: ``pip install --target`` (``uv`` where it is
installed) of the newest ``transformers==<line>.*`` with the dependencies that release asks
for, into a temporary folder renamed into place under a file lock, so two executors making it
at once make it once and a half-made one is never used. torch is no dependency of
transformers: the user's torch serves both. Once made, it needs no network; ``codeferry
release`` makes it ahead of time for a machine that will run offline.

The user's other packages stay visible behind the release, and one of them may need what the
release replaced (``kernels`` needs huggingface_hub 1.x, the release of 4.53 brings 0.36, and
4.53 imports ``kernels`` when it can find it): ``hide_conflicts`` hides such packages from
the release's processes, as if they were not installed, which is what that release expects.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ... import _settings
from ...errors import ReleaseUnavailableError

__all__ = ["ensure", "enter", "folder", "for_workers", "hide_conflicts", "made"]

_LINE = re.compile(r"\d+\.\d+")
_MARKER = "codeferry-release.json"


def folder(line: str) -> Path:
    """Where the release ``line`` (``"4.57"``) is, made or not, for this Python."""
    if not _LINE.fullmatch(line):
        raise ValueError(f"a transformers release line is major.minor, like 4.57: not {line!r}")
    tag = f"py{sys.version_info.major}{sys.version_info.minor}"  # wheels are per Python
    return _settings.releases_home() / f"transformers-{line}-{tag}"


def made(line: str) -> str | None:
    """The exact transformers release made for ``line`` (``"4.57.6"``), or ``None``."""
    try:
        data = json.loads((folder(line) / _MARKER).read_text())
    except (OSError, ValueError):
        return None
    version = data.get("transformers") if isinstance(data, dict) else None
    return version if isinstance(version, str) else None


def _installer(target: Path, line: str) -> list[str]:
    spec = f"transformers=={line}.*"
    uv = shutil.which("uv")
    if uv:
        return [uv, "pip", "install", "--quiet", "--python", sys.executable,
                "--target", str(target), spec]
    return [sys.executable, "-m", "pip", "install", "--quiet", "--no-compile", "--no-input",
            "--disable-pip-version-check", "--retries", "2", "--target", str(target), spec]


def _version_in(target: Path) -> str | None:
    for info in target.glob("transformers-*.dist-info"):
        return info.name[len("transformers-"):-len(".dist-info")]
    return None


def ensure(line: str, *, say: bool = True) -> Path:
    """The folder of release ``line``, made first if it is not (``ReleaseUnavailableError``
    when it cannot be: the installer's last lines say why). ``say``: a line on stderr while a
    release is made (seconds from a warm package cache, a minute or more from the network)."""
    from filelock import FileLock

    where = folder(line)
    if made(line):
        return where
    where.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(where.parent / f".{where.name}.lock")):
        if made(line):
            return where  # another process made it while we waited
        if say:
            print(f"codeferry: making transformers {line} for code that needs it, once, in "
                  f"{where}", file=sys.stderr, flush=True)
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=f".{where.name}-", dir=where.parent) as scratch:
            target = Path(scratch) / "release"
            command = _installer(target, line)
            try:
                done = subprocess.run(command, capture_output=True, text=True, check=False,
                                      timeout=1800)
                failure = ((done.stderr.strip() or done.stdout.strip()) if done.returncode
                           else "")
            except (OSError, subprocess.TimeoutExpired) as exc:
                failure = str(exc)
            version = None if failure else _version_in(target)
            if version is None:
                tail = "\n".join((failure or "no transformers was installed").splitlines()[-8:])
                raise ReleaseUnavailableError(
                    f"transformers {line}, which this model's code needs, is not made in "
                    f"{where} and could not be made: `{' '.join(command)}` said:\n{tail}",
                    fix=(f"on a machine with access to the package index run `codeferry "
                         f"release {line}` (with the same CODEFERRY_RELEASES and Python), or "
                         f"install transformers <= {line} in this environment."))
            (target / _MARKER).write_text(json.dumps({
                "transformers": version, "line": line, "python": sys.version.split()[0],
                "seconds": round(time.monotonic() - started, 1)}) + "\n")
            if where.exists():  # a half-made folder from a killed run: never used, replaced
                shutil.rmtree(where)
            target.rename(where)
    return where


def for_workers(line: str | None, backend: str) -> str | None:
    """The release line an executor's workers run the code on (``None``: the installed
    transformers). Local workers' release is made here, now, once; a Ray actor makes or
    finds its node's own when it starts (``enter``): nodes do not share this disk."""
    if line is not None and backend == "local":
        ensure(line)
    return line


def enter(line: str) -> str:
    """Put the release ``line`` (made on this machine if it is not) first on this process's
    path, its conflicting packages hidden, before anything imports transformers: a Ray
    actor's start. A process that already imported another transformers cannot change it
    (``ReleaseUnavailableError``). Returns the folder."""
    imported = sys.modules.get("transformers")
    if imported is not None:
        version = str(getattr(imported, "__version__", "?"))
        if not version.startswith(f"{line}."):
            raise ReleaseUnavailableError(
                f"this model's code needs transformers {line}, and this process (pid "
                f"{os.getpid()}) imported transformers {version} before its worker started.",
                fix="start the worker in a fresh process: with Ray, an actor of its own "
                    "(nothing in the actor's process may import transformers first).")
    where = str(ensure(line))
    if imported is not None:
        return where
    if where not in sys.path:
        sys.path.insert(0, where)
    hide_conflicts(where)
    importlib.invalidate_caches()
    return where


def _top_names(dist: Any) -> set[str]:
    """The top-level import names a distribution installs."""
    listed = dist.read_text("top_level.txt")
    if listed:
        return {line.strip() for line in listed.splitlines() if line.strip()}
    names = set()
    for file in dist.files or ():
        top = file.parts[0] if file.parts else ""
        if top.endswith((".dist-info", ".egg-info", ".data")) or top in ("..", "__pycache__"):
            continue
        names.add(top[:-3] if top.endswith(".py") else top)
    return {n for n in names if n.isidentifier()}


def conflicts(release: str) -> set[str]:
    """Top-level names of packages outside ``release`` that require a distribution the release
    brings, at a version it does not bring (their own names excepted)."""
    from importlib import metadata

    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name

    ours = {canonicalize_name(d.metadata["Name"] or ""): d.version
            for d in metadata.distributions(path=[release])}
    provided = set().union(*(_top_names(d) for d in metadata.distributions(path=[release])))
    others = [p for p in sys.path if p and p != release]
    hidden: set[str] = set()
    for dist in metadata.distributions(path=others):
        if canonicalize_name(dist.metadata["Name"] or "") in ours:
            continue  # shadowed by the release's own
        for text in dist.requires or ():
            try:
                need = Requirement(text)
            except InvalidRequirement:
                continue
            have = ours.get(canonicalize_name(need.name))
            if have is None or (need.marker is not None
                                and not need.marker.evaluate({"extra": ""})):
                continue
            if not need.specifier.contains(have, prereleases=True):
                hidden |= _top_names(dist)
                break
    return hidden - provided


class _Hiding:
    """A path entry's finder that finds nothing for the hidden names, the rest as before."""

    def __init__(self, inner: Any, hidden: set[str]) -> None:
        self._inner, self._hidden = inner, hidden

    def find_spec(self, fullname: str, target: Any = None) -> Any:
        if fullname.partition(".")[0] in self._hidden:
            return None
        return self._inner.find_spec(fullname, target)

    def invalidate_caches(self) -> None:
        self._inner.invalidate_caches()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def hide_conflicts(release: str) -> set[str]:
    """Hide from this process (a release zygote, before it imports transformers) the packages
    ``conflicts`` names: every other path entry's finder finds nothing for them. Returns
    them."""
    import importlib.machinery

    hidden = conflicts(release)
    if hidden:
        for entry in sys.path:
            if not entry or entry == release or not Path(entry).is_dir():
                continue
            finder = importlib.machinery.PathFinder._path_importer_cache(entry)  # type: ignore[attr-defined]
            if finder is not None and not isinstance(finder, _Hiding):
                sys.path_importer_cache[entry] = _Hiding(finder, hidden)
    return hidden
