"""Text for people: the ``inspect`` report as a readable tree, and the graph as DOT."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

from .._code.automap import qualified
from .._code.doors import find_doors, render_doors
from .._code.resolve import Bundle
from ..errors import RemoteTraceback

__all__ = ["inspected", "remote_tail", "render_report", "render_dot", "write_atomic", "write_graph"]


def _size(n: int) -> str:
    return f"{n} B" if n < 1024 else f"{n / 1024:.1f} KiB"


def render_report(bundle: Bundle) -> str:
    """The human form of ``codeferry inspect``."""
    out: list[str] = []
    src = bundle.origin
    out.append(f"model    {src.name}")
    if src.repo_id:
        out.append(f"folder   {src.root}")
    out.append(f"digest   {bundle.digest}")
    for repo, commit in sorted(bundle.pins.items()):
        out.append(f"pinned   {repo}@{commit}")

    out.append("classes")
    by_file: dict[str, dict[str, list[str | None]]] = defaultdict(dict)
    pairs: set[tuple[str, str]] = set()
    blocked: dict[tuple[str, str], list[str]] = defaultdict(list)
    for ref in bundle.classes:
        for problem in bundle.problems_for(ref):
            why = f"{type(problem).__name__} at {problem.location or ref.reference}"
            if why not in blocked[(ref.declared_in, ref.key)]:
                blocked[(ref.declared_in, ref.key)].append(why)
        slots = by_file[ref.declared_in].setdefault(ref.key, [])
        if ref.slot is None:
            slots.append(ref.reference)
        else:
            pairs.add((ref.declared_in, ref.key))
            slots.extend([None] * (ref.slot + 1 - len(slots)))
            slots[ref.slot] = ref.reference
    for declared_in, keys in by_file.items():
        out.append(f"  {declared_in}")
        width = max(len(k) for k in keys)
        rows = []
        for key, refs in keys.items():
            if (declared_in, key) in pairs:
                refs = refs + [None] * (2 - len(refs))
                shown = "[" + ", ".join("null" if r is None else r for r in refs) + "]"
            else:
                shown = str(refs[0])
            reasons = blocked.get((declared_in, key))
            rows.append((key, shown, "blocked: " + "; ".join(reasons) if reasons else "ok"))
        shown_width = max(len(shown) for _, shown, _ in rows)
        for key, shown, state in rows:
            out.append(f"    {key:<{width}}  {shown:<{shown_width}}  {state}")

    if bundle.doors:  # code transformers runs besides auto_map: the lock covers it too
        out.append("doors (code transformers also runs)")
        for door in bundle.doors:
            out.append(f"  {door.name}  {src.root / door.path}:{door.line}")

    total = sum(f.size for f in bundle.files)
    out.append(f"files ({len(bundle.files)}, {_size(total)})")
    width = max((len(f.path) + (len(f.repo) + 2 if f.repo else 0) for f in bundle.files), default=0)
    for f in bundle.files:
        name = qualified(f.repo, f.path)
        tag = "" if f.kind == "module" else f"  ({f.kind})"
        out.append(f"  {name:<{width}}  {_size(f.size):>9}  sha256:{f.sha256[:12]}{tag}")

    deps: dict[str, list[str]] = defaultdict(list)
    for importer, imported, deferred in bundle.edges:
        if importer.startswith(imported + "."):
            continue  # a submodule's own package: not an import statement
        deps[importer].append(imported + (" (in a function)" if deferred else ""))
    out.append("load order (dependencies first)")
    for index, name in enumerate(bundle.load_order, start=1):
        out.append(f"  {index:>2}. {name}")
        if deps[name]:
            out.append(f"      imports {', '.join(sorted(deps[name]))}")

    out.append("requirements")
    if not bundle.requirements:
        out.append("  none beyond the standard library")
    for req in bundle.requirements:
        state = f"{req.version or 'installed'}" if req.installed else "MISSING"
        guard = "  guarded" if req.guarded else ""
        out.append(f"  {req.name:<16} {state}{guard}")
        for use in req.uses:
            out.append(f"      {use}")

    out.append("problems")
    if not bundle.problems:
        out.append("  none")
    for problem in bundle.problems:
        level = "error" if problem.blocking else "note"
        out.append(f"  {level}: {problem}")
    return "\n".join(out) + "\n"


def inspected(bundle: Bundle) -> tuple[dict[str, Any], str]:
    """What ``codeferry inspect`` shows: ``--json``'s data and the text. One ``doors`` list:
    the code transformers also runs (the bundle's) and the places the model's JSON files open
    a door besides ``auto_map`` (``_code.doors``: Hub kernels, trust keys, nested loads)."""
    doors = find_doors(bundle.origin.root)
    data = bundle.to_json()
    data["doors"] += [d.to_json() for d in doors]
    return data, render_report(bundle) + render_doors(doors)


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_dot(bundle: Bundle) -> str:
    """The import graph: modules as boxes, ``auto_map`` modules bold, deferred edges dashed."""
    named = {qualified(c.repo, c.module) for c in bundle.classes}
    lines = ["digraph codeferry {", "  rankdir=LR;", "  node [shape=box, fontname=Helvetica];"]
    for module in bundle.modules:
        style = ', style=bold' if module.qualified in named else ""
        label = module.path or module.name + "/"
        lines.append(f"  {_quote(module.qualified)} [label={_quote(label)}{style}];")
    for importer, imported, deferred in bundle.edges:
        style = " [style=dashed]" if deferred else ""
        lines.append(f"  {_quote(importer)} -> {_quote(imported)}{style};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def remote_tail(exc: BaseException, frames: int = 3) -> str | None:
    """The last ``frames`` frames and the error line of a worker's traceback in ``exc``'s causes.

    A worker's error reaches the parent with the worker's traceback as a ``__cause__``
    (``RemoteTraceback``), which a one-line message would drop: its fix then says the cause
    is "above", and this prints it there.
    """
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen and not isinstance(cause, RemoteTraceback):
        seen.add(id(cause))
        cause = cause.__cause__
    if not isinstance(cause, RemoteTraceback):
        return None
    # A chained traceback prints the original error first: its last frames say where the
    # worker failed (the chain's later sections are codeferry re-raising it, typed).
    section = re.split(r"\n\n(?:The above exception was the direct cause of the following "
                       r"exception|During handling of the above exception, another exception "
                       r"occurred):\n\n", cause.tb)[0]
    lines = section.rstrip("\n").splitlines()
    starts = [i for i, text in enumerate(lines) if text.startswith('  File "')]
    if not starts:
        return None
    shown = lines[starts[max(0, len(starts) - frames)]:]
    first = "codeferry: the worker's traceback"
    first += f" (last {frames} of {len(starts)} frames):" if len(starts) > frames else ":"
    return "\n".join([first, *shown]) + "\n"


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all (temp file in the same folder, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_graph(path: Path, dot: str) -> None:
    """``inspect --graph``: the DOT text as is, or rendered to SVG/PNG by Graphviz's ``dot``.
    A name or a machine that cannot give the format is a ``ValueError`` (a usage error)."""
    fmt = path.suffix.lower().lstrip(".")
    if fmt in {"dot", "gv", ""}:
        write_atomic(path, dot.encode("utf-8"))
        return
    if fmt not in {"svg", "png"}:
        raise ValueError("use a .dot, .svg or .png file name")
    exe = shutil.which("dot")
    if exe is None:
        raise ValueError(f"rendering {fmt.upper()} needs Graphviz's `dot` "
                         "(apt-get install graphviz); or write .dot instead")
    rendered = subprocess.run(
        [exe, f"-T{fmt}"], input=dot.encode("utf-8"), capture_output=True, check=True
    ).stdout
    write_atomic(path, rendered)
