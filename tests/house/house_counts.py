"""The house's shape in numbers, read from the tree (``python tests/house/house_counts.py``).

Each count has its limit beside it; ``test_house_counts.py`` fails when one is over. They
are the figures a reader feels when opening the executor: how many modules share a folder,
how many kinds of request a worker answers, how untyped its seam is, how long the
signatures are that a change must thread through, whether the words name what exists, and
how much documentation there is to read.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SRC = ROOT / "src" / "codeferry"
sys.path[:0] = [str(HERE), str(HERE.parent)]  # test_words, and the _helpers it imports

#: (what, limit): a count above its limit fails ``test_house_counts``.
LIMITS = {
    "modules in the largest _exec folder": 10,
    "request kinds a worker generates for": 1,
    "Any-typed engines in the worker seam": 0,
    "parameters of _commands/run.run": 11,
    "parameters of the longest internal constructor": 11,
    "docstrings naming a missing module or telling history": 0,
    "KB of docs/": 119.9,
}

#: The public constructors whose keywords stay as users know them, and the values that hold
#: such a list of keywords once so that nothing else repeats it (``WorkerOptions``: the
#: executor's; ``SamplingParams``: vLLM's, and ``Resolved``, the same decided).
PUBLIC = {"_exec/executor.py:Executor", "_exec/options.py:WorkerOptions",
          "_exec/generate/params.py:SamplingParams", "_exec/generate/params.py:Resolved"}


def exec_folders() -> dict[str, int]:
    """Modules (not ``__init__``) per folder of ``_exec``."""
    return {str(folder.relative_to(SRC)): sum(1 for p in folder.glob("*.py")
                                              if p.name != "__init__.py")
            for folder in [SRC / "_exec", *(p for p in (SRC / "_exec").iterdir() if p.is_dir()
                                            and (p / "__init__.py").exists())]}


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def generating_requests() -> list[str]:
    """The kinds of ``Work`` whose answer is generated text: the ``Engine`` methods that
    return ``GenerateResult`` values."""
    module = _tree(SRC / "_exec" / "engines" / "base.py")
    engine = next(n for n in module.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    return [f.name for f in engine.body if isinstance(f, ast.FunctionDef)
            and f.returns is not None and "GenerateResult" in ast.unparse(f.returns)]


def untyped_engines() -> list[str]:
    """Parameters named ``engine`` or ``worker`` annotated ``Any`` in the worker and engine
    floors (the seam between a worker and its engine)."""
    found = []
    for path in sorted((SRC / "_exec").rglob("*.py")):
        if path.parent.name not in ("workers", "engines", "generate"):
            continue
        for node in ast.walk(_tree(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for arg in [*node.args.args, *node.args.kwonlyargs]:
                    if arg.arg in ("engine", "worker") and arg.annotation is not None \
                            and ast.unparse(arg.annotation) == "Any":
                        found.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name}")
    return found


def _parameters(function: ast.FunctionDef) -> int:
    args = function.args
    names = [a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]]
    return len([n for n in names if n not in ("self", "cls")]) + bool(args.vararg) + bool(args.kwarg)


def run_parameters() -> int:
    module = _tree(SRC / "_commands" / "run.py")
    return next(_parameters(f) for f in module.body
                if isinstance(f, ast.FunctionDef) and f.name == "run")


def constructors() -> dict[str, int]:
    """Parameters of every class's constructor in ``_exec`` and ``_commands``: its
    ``__init__``, or a dataclass's fields; the public ``Executor`` aside."""
    found = {}
    for path in sorted([*(SRC / "_exec").rglob("*.py"), *(SRC / "_commands").rglob("*.py")]):
        for node in ast.walk(_tree(path)):
            if not isinstance(node, ast.ClassDef):
                continue
            name = f"{path.relative_to(SRC)}:{node.name}"
            if name in PUBLIC:
                continue
            init = next((f for f in node.body if isinstance(f, ast.FunctionDef)
                         and f.name == "__init__"), None)
            dataclass = any("dataclass" in ast.unparse(d) for d in node.decorator_list)
            if init is not None:
                found[name] = _parameters(init)
            elif dataclass:
                found[name] = sum(1 for s in node.body if isinstance(s, ast.AnnAssign)
                                  and "ClassVar" not in ast.unparse(s.annotation))
    return found


def word_offenders() -> list[str]:
    from test_words import offenders

    return offenders(SRC)


def docs_kb() -> float:
    """The whole ``docs/`` folder, every file (pages and anything else), in KB."""
    return sum(p.stat().st_size for p in (ROOT / "docs").rglob("*") if p.is_file()) / 1000


def counts() -> dict[str, float]:
    longest = constructors()
    return {
        "modules in the largest _exec folder": max(exec_folders().values()),
        "request kinds a worker generates for": len(generating_requests()),
        "Any-typed engines in the worker seam": len(untyped_engines()),
        "parameters of _commands/run.run": run_parameters(),
        "parameters of the longest internal constructor": max(longest.values()),
        "docstrings naming a missing module or telling history": len(word_offenders()),
        "KB of docs/": round(docs_kb(), 1),
    }


def main() -> int:
    over = 0
    for what, value in counts().items():
        limit = LIMITS[what]
        mark = "ok" if value <= limit else "OVER"
        over += value > limit
        print(f"{what:<56} {value:>7} (limit {limit}) {mark}")
    folders = exec_folders()
    print("_exec folders:", ", ".join(f"{k} {v}" for k, v in sorted(folders.items())))
    longest = sorted(constructors().items(), key=lambda kv: -kv[1])[:3]
    print("longest constructors:", ", ".join(f"{k} {v}" for k, v in longest))
    print("generating requests:", ", ".join(generating_requests()))
    return 1 if over else 0


if __name__ == "__main__":
    raise SystemExit(main())
