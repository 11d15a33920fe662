"""A factory of tiny ``trust_remote_code`` models, for tests, benchmarks and docs.

Real remote-code repositories break loaders in many small ways: helper modules in sub-packages,
``from . import x``, imports inside functions or ``try`` blocks, star imports, data files read at
import time, nested remote configs, code living in another repository, generic module names that
two models share... Each :class:`ModelSpec` switch reproduces one of those shapes in a model small
enough (a few hundred KB at most) to be written in milliseconds once torch is imported, so that
every test can build exactly the repository it needs instead of downloading one.

Everything written is deterministic: the same spec gives byte-identical files (JSON with a fixed
key order, weights drawn from a private generator seeded with ``spec.seed``), so hub commits
derived from the bytes are stable and results can be compared across processes and machines.

Run ``python -m codeferry.testing._factory --write-demo src/codeferry/demo`` to regenerate the
bundled demo model, and ``--check-demo`` to verify the committed copy is up to date.

This module writes the files: a plain folder, a hub cache snapshot, the demo. What a model
looks like is :mod:`codeferry.testing._spec`; the bytes of its files come from
:mod:`codeferry.testing._contents`.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from codeferry.testing._contents import cross_repo_files, model_files
from codeferry.testing._spec import DEMO_SPEC, ModelSpec

__all__ = [
    "demo_model_path",
    "write_demo_model",
    "write_hub_model",
    "write_model",
]

_REPO_ID_RE = re.compile(r"([\w.-]+/)?[\w.-]+\Z")
#: The default of ``write_model`` and ``write_hub_model`` (frozen, so one instance serves all).
_DEFAULT_SPEC = ModelSpec()

DEMO_PROMPTS = (
    "Hello, world",
    "The quick brown fox",
    "Once upon a time",
    "def main():",
    "1 + 1 =",
    "Remote code, every process.",
    "To be or not to be",
    "codeferry ships code",
)


def _write_files(root: Path, files: Mapping[str, bytes]) -> None:
    for relative, data in files.items():
        target = root.joinpath(*relative.split("/"))
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)


def _commit_for(repo_id: str, files: Mapping[str, bytes]) -> str:
    """A fake but stable commit sha: sha1 of the repo id and every (path, bytes) pair."""
    digest = hashlib.sha1(repo_id.encode("utf-8"))
    for relative in sorted(files):
        digest.update(b"\0" + relative.encode("utf-8") + b"\0" + files[relative])
    return digest.hexdigest()


#: Files huggingface_hub stores through Git LFS, whose blobs are named by their sha256.
_LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx")


def _blob_name(relative: str, data: bytes) -> str:
    """The blob name huggingface_hub gives a file: sha256 for LFS files, git's sha1 else."""
    if relative.endswith(_LFS_SUFFIXES):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _write_snapshot(repo_dir: Path, commit: str, files: Mapping[str, bytes]) -> Path:
    """Blobs in ``blobs/``, and ``snapshots/<commit>/<path>`` relative symlinks to them.

    Exactly huggingface_hub's layout: a file ``a/b.py`` of the snapshot links to
    ``../../../blobs/<sha>`` (one ``../`` per folder below ``snapshots``).
    """
    blobs = repo_dir / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot = repo_dir / "snapshots" / commit
    for relative, data in files.items():
        blob = _blob_name(relative, data)
        if not (blobs / blob).is_file():
            (blobs / blob).write_bytes(data)
        parts = relative.split("/")
        link = snapshot.joinpath(*parts)
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to("../" * (len(parts) + 1) + "blobs/" + blob)
    return snapshot


def _write_hub_repo(
    cache_dir: Path, repo_id: str, files: Mapping[str, bytes], commit: str | None
) -> Path:
    if not _REPO_ID_RE.match(repo_id) or "--" in repo_id:
        raise ValueError(f"repo_id must look like 'org/name' or 'name', got {repo_id!r}")
    commit = commit if commit is not None else _commit_for(repo_id, files)
    if not re.fullmatch(r"[0-9a-f]{40}", commit):
        raise ValueError(f"commit must be 40 lowercase hex digits, got {commit!r}")
    repo_dir = cache_dir / ("models--" + repo_id.replace("/", "--"))
    snapshot = _write_snapshot(repo_dir, commit, files)
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / "main").write_text(commit, encoding="utf-8")
    return snapshot


def write_model(dest: str | os.PathLike[str], spec: ModelSpec = _DEFAULT_SPEC) -> Path:
    """Write a plain local model folder at ``dest`` (created if needed) and return its path.

    Any folder name works, including dots, hyphens and spaces, since loaders must cope with them.
    With ``spec.cross_repo`` the ``auto_map`` still references the other repository, whose code
    then lives only in a hub cache: write it there with :func:`write_hub_model`.
    """
    root = Path(dest)
    root.mkdir(parents=True, exist_ok=True)
    _write_files(root, model_files(spec))
    return root


def write_hub_model(
    cache_dir: str | os.PathLike[str],
    repo_id: str,
    spec: ModelSpec = _DEFAULT_SPEC,
    *,
    commit: str | None = None,
) -> Path:
    """Write ``repo_id`` into a Hugging Face hub cache (``HF_HUB_CACHE``) and return its snapshot.

    The layout is huggingface_hub's: ``models--{org}--{name}/blobs/{sha}`` files (sha256 of an
    LFS file such as the weights, git's blob sha1 of any other), ``snapshots/{commit}/{path}``
    relative symlinks to them (``../../blobs/{sha}``, one more ``../`` per folder of ``path``)
    and ``refs/main``. Change a file by writing a new blob and relinking, as a download would:
    writing through a link changes the blob every snapshot sharing it sees. huggingface_hub and
    transformers load it offline
    (``HF_HUB_OFFLINE=1``) given ``cache_dir=`` or ``HF_HUB_CACHE``. The default commit is derived
    from the repo id and the file bytes. ``spec.cross_repo`` is written into the same cache too.
    """
    cache = Path(cache_dir)
    if spec.cross_repo:
        _write_hub_repo(cache, spec.cross_repo, cross_repo_files(spec), None)
    return _write_hub_repo(cache, repo_id, model_files(spec), commit)


def _demo_files() -> dict[str, bytes]:
    files = model_files(DEMO_SPEC, package=f"{DEMO_SPEC.name}_ops")
    files["prompts.txt"] = ("\n".join(DEMO_PROMPTS) + "\n").encode("utf-8")
    return files


def write_demo_model(dest: str | os.PathLike[str]) -> Path:
    """Write the bundled ``charlm`` demo model (see :data:`DEMO_SPEC`) and its ``prompts.txt``."""
    root = Path(dest)
    root.mkdir(parents=True, exist_ok=True)
    _write_files(root, _demo_files())
    return root


def demo_model_path() -> Path:
    """The demo model folder shipped inside the ``codeferry`` package (``codeferry/demo``)."""
    return Path(__file__).resolve().parent.parent / "demo"


def _check_demo(folder: Path) -> list[str]:
    """Paths whose committed bytes differ from what the factory writes now."""
    expected = _demo_files()
    found = {
        path.relative_to(folder).as_posix()
        for path in folder.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }
    stale = [
        rel
        for rel, data in expected.items()
        if not (folder / rel).is_file() or (folder / rel).read_bytes() != data
    ]
    return sorted(stale + sorted(found - set(expected)))


def main(argv: Sequence[str] | None = None) -> int:
    """``--write-demo DIR`` regenerates the demo model; ``--check-demo DIR`` verifies it."""
    parser = argparse.ArgumentParser(
        prog="python -m codeferry.testing._factory", description=main.__doc__
    )
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write-demo", metavar="DIR", type=Path)
    group.add_argument("--check-demo", metavar="DIR", type=Path)
    args = parser.parse_args(argv)
    if args.write_demo is not None:
        print(write_demo_model(args.write_demo))
        return 0
    stale = _check_demo(args.check_demo)
    for rel in stale:
        print(f"out of date: {rel}", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
