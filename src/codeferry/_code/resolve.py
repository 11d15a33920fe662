"""Resolve a model's remote code statically: classes, files, load order, digest, problems.

This is what ``codeferry inspect`` prints and what every loader starts from. It reads
bytes and parses them; it never imports or executes model code. The bytes it hashed
are kept in the result (``Bundle.contents``), so whoever executes the code later runs
exactly the bytes that were checked, not a file read again after the check.

Phases, in order:

1. locate the model (``hub``: on disk, ``source``, after downloading a repo id the
   cache lacks) and read every ``auto_map`` (``automap``);
2. from the ``auto_map`` modules, walk relative imports to every needed file, per
   *unit*: the model's own code, plus each repo a cross-repo reference names, pinned
   at the commit its revision resolves to;
3. order modules dependencies-first, find cycles, collect problems and requirements;
4. hash: one sha256 per file and one digest over (unit, path, sha256) of all files,
   so it is stable across machines, folder names and file times.

Phase 2 is ``walk.Walker``; the result's data model (``Bundle`` and its parts) is in
``bundle``. This module runs the phases and assembles the ``Bundle``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..errors import (
    CodeferryError,
    ConfigNotFoundError,
    ImportCycleError,
    InvalidConfigError,
    LFSPointerError,
    OptionalPackageMissing,
)
from . import graph as _graph
from . import hub as _hub
from .automap import AUTO_MAP_FILES, ClassRef, parse_auto_maps, qualified
from .bundle import Bundle, Door, FileEntry
from .digest import bundle_digest, file_sha256
from .doors import custom_pipeline_refs
from .requirements import check_transformers_names, collect_requirements, missing_packages
from .source import ModelOrigin, read_bytes
from .walk import LFS_HEADER, Walker

# ``Bundle`` is re-exported: most of codeferry imports it from here, with ``resolve``.
__all__ = ["Bundle", "read_class_refs", "resolve"]


def _load_json(path: Path) -> tuple[Any, str]:
    try:
        raw = path.read_bytes()
    except OSError:
        raw = b""
    if raw.startswith(LFS_HEADER):
        raise LFSPointerError(
            f"{path.name} is a Git LFS pointer, not JSON: the real file was never downloaded.",
            path=str(path), line=1,
            fix="fetch the real file (`git lfs pull` in the model's clone, or download the "
            "repo again with huggingface_hub).",
        )
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidConfigError(
            f"{path.name} is not UTF-8 ({exc.reason}).", path=str(path),
            fix=f"save {path.name} as UTF-8 JSON.",
        ) from None
    try:
        return json.loads(text), text
    except json.JSONDecodeError as exc:
        raise InvalidConfigError(
            f"{path.name} is not valid JSON: {exc.msg}.", path=str(path), line=exc.lineno,
            col=exc.colno, fix=f"correct {path.name} at that position (a JSON linter shows it).",
        ) from None
    except (ValueError, RecursionError) as exc:  # a number too long, nesting too deep
        why = "it nests arrays or objects too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise InvalidConfigError(
            f"{path.name} cannot be read as JSON: {why}.", path=str(path),
            fix=f"correct {path.name}; no model config needs such values.",
        ) from None


def read_class_refs(origin: ModelOrigin) -> list[ClassRef]:
    """Every ``auto_map`` entry of the model, file by file, and its ``custom_pipelines``."""
    config = origin.root / "config.json"
    if not config.is_file():
        raise ConfigNotFoundError(
            f"{origin.root} has no config.json, so it is not a model folder.",
            path=str(config),
            fix="pass the folder that holds config.json (for a hub snapshot, the snapshot folder).",
        )
    refs: list[ClassRef] = []
    for name in AUTO_MAP_FILES:
        path = origin.root / name
        if path.is_file():
            data, text = _load_json(path)
            refs += parse_auto_maps(data, filename=name, path=str(path), text=text)
            if name == "config.json":  # pipeline() executes these classes too
                refs += custom_pipeline_refs(data, path=str(path), text=text)
    return refs


def resolve(
    model: str | os.PathLike[str],
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    requirements: bool = True,
    token: str | bool | None = None,
    local_files_only: bool | None = None,
    fetch: _hub.Need = "code",
) -> Bundle:
    """Resolve ``model`` (a folder, or a repo id of the Hugging Face Hub) without executing it.

    A repo id the hub cache lacks is downloaded first, unless ``HF_HUB_OFFLINE`` is set or
    ``local_files_only=True``: ``fetch="code"`` takes every file but the weights,
    ``fetch="model"`` everything (what loaders need). ``token`` is sent to the Hub
    (default: ``HF_TOKEN``, or the saved login).

    ``requirements=False`` skips the third-party package report (installed versions come
    from scanning every installed distribution, a third of a second): loaders do not
    need it.

    Raises a ``codeferry.errors`` error for input that cannot be analysed at all;
    everything else is reported in ``Bundle.problems``.
    """
    origin, refs, walker, doors = _walk(model, revision, cache_dir, token, local_files_only, fetch)
    modules = [m for unit in walker.units.values() for m in unit.modules.values()]
    names = [m.qualified for m in modules]
    eager = [(a, b) for a, b, deferred in walker.edges if not deferred]
    cycle = _graph.find_cycle(names, eager)
    if cycle:
        by_name = {m.qualified: m for m in modules}
        paths = " -> ".join(by_name[n].path or n for n in cycle)
        walker.report(ImportCycleError(
            f"modules import each other at module level: {paths}.",
            cycle=tuple(cycle), path=str(origin.root / by_name[cycle[0]].path),
            fix="move one of these imports into the function that uses it.",
        ), *cycle)
    # Parent packages and deferred imports still order modules where they can (a
    # function-level import of a config module is happier when the config exists), but
    # never create a cycle: try the richest edge set first.
    parents = sorted(walker.parent_edges)
    candidates = [[(a, b) for a, b, _ in walker.edges] + parents, eager + parents, eager]
    order_edges = next((c for c in candidates if not _graph.find_cycle(names, c)), eager)
    order = _graph.load_order(names, order_edges)

    files: list[FileEntry] = []
    contents: dict[tuple[str | None, str], bytes] = {}
    for unit in walker.units.values():
        for rel, data in unit.contents.items():
            kind = "package" if rel.endswith("__init__.py") else "module"
            files.append(FileEntry(unit.repo, rel, file_sha256(data), len(data), kind))
            contents[(unit.repo, rel)] = data
        for rel in unit.assets:
            asset = unit.asset_data.get(rel)
            if asset is None:
                asset = read_bytes(unit.origin, rel, asset=True)
            files.append(FileEntry(unit.repo, rel, file_sha256(asset), len(asset), "asset"))
            contents[(unit.repo, rel)] = asset
    files.sort(key=lambda f: (f.repo or "", f.path))
    digest = bundle_digest(files)

    scans = [
        (qualified(unit.repo, unit.modules[name].path), scan)
        for unit in walker.units.values()
        for name, scan in unit.scans.items()
    ]
    found_requirements = collect_requirements(scans, skip=walker.siblings) if requirements else []
    located = [
        (str(unit.origin.root / unit.modules[name].path), scan)
        for unit in walker.units.values()
        for name, scan in unit.scans.items()
    ]
    module_at = {
        str(unit.origin.root / unit.modules[name].path): unit.modules[name].qualified
        for unit in walker.units.values()
        for name in unit.scans
    }
    closures = _closures(refs, walker.edges, walker.parent_edges, order)
    at_load = {name for closure in closures.values() for name in closure}
    for path, scan in located:
        for problem in missing_packages(path, scan, skip=walker.siblings):
            note: CodeferryError = problem
            if module_at[path] not in at_load:  # only ever imported inside a function
                note = OptionalPackageMissing(
                    f"{problem.message[:-1]}; nothing imports this module at load, so only "
                    "the code that imports it fails.", path=problem.path, line=problem.line,
                    col=problem.col, package=problem.package,
                    distribution=problem.distribution, fix=problem.fix,
                )
            walker.report(note, module_at[path])
    for found in check_transformers_names(located):
        walker.report(found, module_at.get(found.path or "", ""))
    problems = walker.problems
    return Bundle(
        origin=origin,
        classes=tuple(refs),
        files=tuple(files),
        modules=tuple(sorted(modules, key=lambda m: m.qualified)),
        load_order=tuple(order),
        edges=tuple(sorted(walker.edges)),
        requirements=tuple(found_requirements),
        problems=tuple(problems),
        digest=digest,
        pins=dict(walker.pins),
        contents=contents,
        closures=closures,
        scopes=tuple(walker.scopes),
        parents=tuple(parents),
        doors=tuple(Door(name, path, line) for name, path, line in doors),
    )


def _walk(
    model: str | os.PathLike[str], revision: str | None,
    cache_dir: str | os.PathLike[str] | None, token: str | bool | None,
    local_files_only: bool | None, fetch: _hub.Need,
) -> tuple[ModelOrigin, list[ClassRef], Walker, list[tuple[str, str, int]]]:
    """Phases 1 and 2. A hub snapshot whose code imports files it lacks (what plain
    transformers leaves when it fails on a sub-package) is completed once, then walked again;
    offline that is a ``ModelNotCachedError`` naming the files (``hub.complete``)."""
    folder = Path(model).expanduser().is_dir()  # read as it is, never fetched
    for last in (False, True):
        origin = _hub.locate(model, revision=revision, cache_dir=cache_dir, token=token,
                             local_files_only=local_files_only, need=fetch)
        refs = read_class_refs(origin)
        # Cross-repo code of a cached repo (also one given as its snapshot folder, as
        # workers get it) comes from the cache that holds it.
        cache = origin.fence.parent if cache_dir is None and origin.repo_id else cache_dir
        walker = Walker(origin, cache, token, local_files_only)
        for ref in refs:
            walker.add_class(ref)
        doors = walker.add_doors()
        gaps = [] if last else [(repo, where, files)
                                for repo, where, files in walker.snapshot_gaps()
                                if repo is not None or not folder]
        # another repo's unit is its code only, whatever the model needs
        fetched = [_hub.complete(where, files, token=token, local_files_only=local_files_only,
                                 need=fetch if repo is None else "code")
                   for repo, where, files in gaps]
        if not any(fetched):
            break
    return origin, refs, walker, doors


def _closures(
    refs: list[ClassRef],
    edges: set[tuple[str, str, bool]],
    parent_edges: set[tuple[str, str]],
    order: list[str],
) -> dict[ClassRef, tuple[str, ...]]:
    """Per class, what executes when it loads: module-level imports and parent packages.

    Deferred imports (inside a function) are not followed: plain transformers does not
    execute those at load either, and a helper that needs a missing package there must
    not take the class down.
    """
    follows: dict[str, set[str]] = {}
    for a, b, deferred in edges:
        if not deferred:
            follows.setdefault(a, set()).add(b)
    for child, parent in parent_edges:
        follows.setdefault(child, set()).add(parent)
    rank = {name: i for i, name in enumerate(order)}
    out: dict[ClassRef, tuple[str, ...]] = {}
    for ref in refs:
        start = qualified(ref.repo, ref.module)
        seen = {start}
        todo = [start]
        while todo:
            for nxt in follows.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        out[ref] = tuple(sorted(seen, key=lambda n: (rank.get(n, len(rank)), n)))
    return out
