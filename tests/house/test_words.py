"""The words match the code: every module a docstring or comment names exists, and none of
them tells history (git holds it) or points at an issue number.

Where the words are: comments (``#`` and ``#:``) and bare string statements (module, class
and function docstrings, and the strings documenting an attribute) of every ``.py`` file
under ``src/codeferry`` except ``demo/`` (the bundled model's code, written as a model).

**Names.** A reference is a backticked span (````x```` or ```x```) that is a name or a
path: letters, digits, ``_``, ``.`` and ``/``, with an optional trailing ``()`` or ``/``.
It is taken for one of ours, and checked, when:

- its first part starts with one ``_`` (``_generation``, ``_exec/decode.py``,
  ``_resolve.RepoScan``; dunders such as ``__init__`` are Python's), or
- its first part is ``codeferry``, or
- it has two parts or more and its first part is the last name of a package of the tree
  (``workers.transport``), of a module in the file's own package (``stream.choose`` in
  ``_exec/generate/``), or of a module of the tree the file imports under that name
  (``from .._code import hub``: ``hub.complete``); not one of ``SHADOWED``, or
- it ends in ``.py`` and its first part is one of the above.

A path (``/``) becomes a dotted name (``.py`` and ``__init__`` dropped). A checked
reference resolves when some leading parts of it name a module or package of the tree
(``src/codeferry``, ``demo/`` included) whose dotted name (below ``codeferry``) is those
parts or ends in ``.`` and those parts (so a short name may match any module with that last
name, and ``workers.transport`` matches ``_exec.workers.transport``), and the rest is defined
in that module: a top-level name (``def``, ``class``, assignment or import), then a member
of that class (a method, a class attribute, a ``self.x`` assignment; a member found on no
class of that module may be one any class of the tree defines: inherited). A single ``_name``
that is no module also resolves as a name defined in the same file or anywhere in the tree
(``_CUSTOM_GENERATE``, ``_refused``). ``EXTERNAL`` lists the few ``_names`` that are other
libraries' (transformers' private attributes our words name).

**Issue numbers.** ``issue 20``, ``issues 3 and 4``, ``PR 7``, ``gh-5`` and a bare ``#45``
are ours; ``#N`` right after another project's name (``transformers #38476``, ``vllm #572,
#6607``) is that project's tracker and allowed.

**History.** ``HISTORY`` is the list of phrases that read as a change rather than as the
code: ``used to`` (not ``is/are/be used to``, which is what a thing serves for), ``no
longer``, ``previously``, ``formerly``, ``before this change`` (commit, fix, patch),
``was/were/has been renamed`` (moved, split, replaced, removed), ``now`` opening a sentence
or after ``they``/``we``/``these``/``which`` (``They now call``; ``from now on`` and ``End
it now`` are the code's own time, not history). ``ALLOWED`` lists the
sentences where such a phrase is about the user's world (transformers' history), not ours.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

from _helpers import SRC

#: ``_names`` our words name that are not ours: other libraries' private names, a pattern.
EXTERNAL = frozenset({
    "_attn_implementation_internal", "_experts_implementation_internal",  # transformers' config
    "_LazyModule.__dir__", "_can_set_attn_implementation",  # transformers'
    "_supports_attention_backend",  # vLLM's
    "_inheriting",  # multiprocessing's
    "_cmd_NAME",  # the pattern of the CLI's command functions
})
#: Last names of our modules that our words also use for something else, so that ``x.y`` is
#: not taken for one of ours: vLLM (``_install/vllm.py`` names ``vllm.general_plugins``),
#: ``transformers.generation``, and the usual names of a ``ModelSpec`` and a ``ModelOptions``
#: value (``spec.seed``, ``options.lock``).
SHADOWED = frozenset({"vllm", "generation", "spec", "options"})
#: Phrases of ``HISTORY`` that are no history of ours: ``(file, words around the phrase)``.
#: Another project's past, or a state that the code itself changes at run time.
ALLOWED = frozenset({
    ("doors.py", "transformers releases before the fix"),  # transformers' history
    ("vllm_engine.py", "the class no longer builds outside vLLM"),  # after vLLM patched it
})

_SPAN = re.compile(r"``([^`\s]+)``|(?<![`\w])`([^`\s]+)`(?![`\w])")
_NAME = re.compile(r"[A-Za-z_][\w.]*(?:/[\w.]+)*/?(?:\(\))?")
_ISSUE = re.compile(r"\b(?:issues?|PR|pull request)\s*#?\d+(?:\s*(?:,|and)\s*#?\d+)*|\bgh-\d+",
                    re.IGNORECASE)
_HASH = re.compile(r"(?<![\w&/])#\d+\b")
#: ``<project> #N`` and the ``, #M`` that follow it: another tracker.
_FOREIGN = re.compile(r"\b([A-Za-z][\w.-]*)\s+#\d+(?:\s*,\s*#\d+)*")
_NOT_PROJECTS = frozenset({"issue", "issues", "pr", "see", "fixes", "closes", "bug", "ticket"})
HISTORY = re.compile(
    r"(?<!\bis )(?<!\bare )(?<!\bbe )(?<!\bbeen )(?<!\bbeing )\bused to\b"
    r"|\bno longer\b|\bpreviously\b|\bformerly\b"
    r"|\bbefore (?:this|the) (?:change|commit|fix|patch|refactor\w*)\b"
    r"|\b(?:was|were|has been|have been) (?:renamed|moved|split|replaced|removed)\b"
    r"|(?:\A\s*|[.!?]\s+)now\b|\b(?:they|we|these|which) now\b",
    re.IGNORECASE)


@dataclass
class Tree:
    """The modules of a source tree and the names each defines."""

    root: Path
    modules: dict[str, Path] = field(default_factory=dict)  # dotted (below the root) -> file
    top: dict[str, set[str]] = field(default_factory=dict)  # module -> top-level names
    members: dict[str, dict[str, set[str]]] = field(default_factory=dict)  # module -> class ->
    nested: dict[str, set[str]] = field(default_factory=dict)  # module -> every def/class
    anywhere: set[str] = field(default_factory=set)  # every name defined (not imported)

    @classmethod
    def of(cls, root: Path) -> Tree:
        tree = cls(root)
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root).with_suffix("").parts
            if rel[-1] == "__init__":
                rel = rel[:-1]
            name = ".".join(rel)
            tree.modules[name] = path
            for parent in range(1, len(rel)):  # a folder without __init__ is a package too
                tree.modules.setdefault(".".join(rel[:parent]), path.parent)
            top, members = _definitions(ast.parse(path.read_text(encoding="utf-8")))
            tree.top[name], tree.members[name] = top, members
            tree.nested[name] = members.pop("")
            tree.anywhere |= top - members.pop("<imported>") | tree.nested[name]
            for names in members.values():
                tree.anywhere |= names
        return tree

    def prefixes(self, path: Path) -> set[str]:
        """The first parts of a dotted ``x.y`` that ``path``'s words mean as one of ours: a
        package of the tree, a module beside ``path`` (its own package), or a module of the
        tree that ``path`` imports under its own last name (less ``SHADOWED``)."""
        packages = {name.rsplit(".", 1)[-1] for name, file in self.modules.items()
                    if name and (file.is_dir() or file.name == "__init__.py")}
        rel = path.relative_to(self.root).with_suffix("").parts
        package = ".".join(rel[:-1])  # a module's package; an __init__'s own
        siblings = {name.rsplit(".", 1)[-1] for name in self.modules
                    if name and name.rpartition(".")[0] == package}
        last = {name.rsplit(".", 1)[-1] for name in self.modules if name}
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith(
                    self.root.name)):
                imported |= {a.name for a in node.names if a.asname is None} & last
        return (packages | siblings | imported) - SHADOWED

    def resolves(self, parts: list[str]) -> bool:
        for k in range(len(parts), 0, -1):
            prefix = ".".join(parts[:k])
            for module in self.modules:
                if (module == prefix or module.endswith("." + prefix)) and self._defines(
                        module, parts[k:]):
                    return True
        return False

    def _defines(self, module: str, rest: list[str]) -> bool:
        if not rest:
            return True
        if rest[0] not in self.top.get(module, ()):
            return len(rest) == 1 and rest[0] in self.nested.get(module, ())
        if len(rest) == 1:
            return True
        owner = self.members.get(module, {}).get(rest[0])
        if owner is None:  # an instance or a value, not a class: its attributes are its own
            return True
        return rest[1] in owner or rest[1] in self.anywhere


def _definitions(module: ast.Module) -> tuple[set[str], dict[str, set[str]]]:
    """The top-level names of ``module`` (under ``if``/``try``/``with`` too), and the members
    of each class (``""``: every function and class defined anywhere in it, nested ones too;
    ``"<imported>"``: the top-level names an import binds)."""
    top: set[str] = set()
    members: dict[str, set[str]] = {"": set(), "<imported>": set()}

    def bound(target: ast.AST) -> set[str]:
        return {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                top.add(node.name)
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    top.update(bound(target))
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                top.update(bound(node.target))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = {(a.asname or a.name).split(".")[0] for a in node.names}
                top.update(names)
                members["<imported>"].update(names)
            for inner in ("body", "orelse", "finalbody", "handlers"):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    visit([n for n in getattr(node, inner, []) if isinstance(n, ast.stmt)]
                          + [s for h in getattr(node, inner, []) if isinstance(h, ast.excepthandler)
                             for s in h.body])

    visit(module.body)
    for node in ast.walk(module):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            members[""].add(node.name)
        if isinstance(node, ast.ClassDef):
            own = members.setdefault(node.name, set())
            for item in ast.walk(node):
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    own.add(item.name)
                elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                    for target in (item.targets if isinstance(item, ast.Assign)
                                   else [item.target]):
                        own |= bound(target)
                        own |= {a.attr for a in ast.walk(target)
                                if isinstance(a, ast.Attribute)}  # self.x = ...
    return top, members


def texts(source: str) -> list[tuple[int, str]]:
    """``(first line, text)`` of every comment and bare string statement of ``source``."""
    found: list[tuple[int, str]] = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            found.append((token.start[0], token.string.lstrip("#:")))
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            found.append((node.value.lineno, node.value.value))
    return sorted(found)


def _ours(raw: str, prefixes: set[str]) -> bool:
    """Whether the reference ``raw`` looks like one of ours (the rule above)."""
    name = raw.removesuffix("()").rstrip("/")
    pieces = re.split(r"[./]", name)
    first = pieces[0]
    if (first.startswith("_") and not first.startswith("__")) or first in ("codeferry", "src"):
        return True
    if "/" in name or name.endswith(".py"):
        return False
    return len(pieces) > 1 and first in prefixes


def _parts(raw: str) -> list[str]:
    name = raw.removesuffix("()").rstrip("/")
    if "/" in name or name.endswith(".py"):
        name = name.removesuffix(".py").replace("/", ".")
    parts = [p for p in name.split(".") if p]
    if parts and parts[-1] == "__init__":
        parts = parts[:-1]
    if parts[:2] == ["src", "codeferry"]:
        parts = parts[2:]
    if parts[:1] == ["codeferry"]:
        parts = parts[1:]
    return parts


def check(tree: Tree, path: Path, shown: str) -> list[str]:
    """``path:line: what`` for every offender in one file."""
    source = path.read_text(encoding="utf-8")
    prefixes = tree.prefixes(path)
    out: list[str] = []
    for line, text in texts(source):
        def at(offset: int, line: int = line, text: str = text) -> int:
            return line + text.count("\n", 0, offset)

        for match in _SPAN.finditer(text):
            raw = match.group(1) or match.group(2)
            if not _NAME.fullmatch(raw) or raw in EXTERNAL or not _ours(raw, prefixes):
                continue
            parts = _parts(raw)
            if not parts or tree.resolves(parts):
                continue  # (no parts: the package itself)
            if len(parts) == 1 and parts[0] in tree.anywhere:
                continue
            out.append(f"{shown}:{at(match.start())}: {raw}")
        for match in _ISSUE.finditer(text):
            out.append(f"{shown}:{at(match.start())}: {match.group(0)}")
        foreign = {m.start(): m.end() for m in _FOREIGN.finditer(text)
                   if m.group(1).lower() not in _NOT_PROJECTS}
        for match in _HASH.finditer(text):
            if not any(s <= match.start() < e for s, e in foreign.items()):
                out.append(f"{shown}:{at(match.start())}: {match.group(0)}")
        for match in HISTORY.finditer(text):
            sentence = text[max(0, match.start() - 80): match.end() + 80]
            if any(file == path.name and allowed in sentence for file, allowed in ALLOWED):
                continue
            out.append(f"{shown}:{at(match.start())}: {match.group(0).strip(' .!?:;')!r}")
    return out


def offenders(root: Path, skip: tuple[str, ...] = ("demo",)) -> list[str]:
    tree = Tree.of(root)
    out: list[str] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in skip:
            continue
        out += check(tree, path, f"{root.name}/{rel.as_posix()}")
    return out


def test_words_name_what_exists_and_tell_no_history() -> None:
    found = offenders(SRC)
    print("\n".join(found))
    assert found == []


def test_the_checker_flags_a_missing_module_and_an_issue_number(tmp_path: Path) -> None:
    root = tmp_path / "pkg"
    (root / "_exec" / "generate").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "_exec" / "__init__.py").write_text("")
    (root / "_exec" / "generate" / "__init__.py").write_text("")
    (root / "_exec" / "generate" / "stream.py").write_text(
        "class Stream:\n    def choose(self):\n        self.last = 1\n\n\ndef choose(): ...\n")
    (root / "_exec" / "executor.py").write_text(
        '"""Runs ``stream.choose`` and ``generate.stream.Stream.last``, through\n'
        '``_exec/generate/stream.py`` and ``codeferry._exec.executor.run``; not\n'
        '``_generation`` nor ``_exec/decode.py`` nor ``stream.pick``."""\n\n\n'
        "from .generate import stream\n\n\n"
        "def run():\n"
        "    x = 1  # see transformers #38476, #1 (vllm #572): theirs; ours: (issue 20), #45\n"
        '    """``_helper`` is here; it used to be elsewhere, and is used to run."""\n'
        "    return x\n\n\n"
        "def _helper(): ...\n")
    assert offenders(root) == [
        "pkg/_exec/executor.py:3: _generation",
        "pkg/_exec/executor.py:3: _exec/decode.py",
        "pkg/_exec/executor.py:3: stream.pick",
        "pkg/_exec/executor.py:10: issue 20",
        "pkg/_exec/executor.py:10: #45",
        "pkg/_exec/executor.py:11: 'used to'",
    ]
