"""What the box (``--sandbox``, ``_sandbox``) would do with what the audit finds, statically.

A user reads ``codeferry audit`` before running; each finding the box refuses says so, from
the box's own rules (``_sandbox.policy``: what it lets code read and write, which variables
it removes), never a copy of them. Where the answer depends on a value known only at run
time the note says what it depends on, and a file read whose target cannot be known
statically is not a finding at all.

Paths are folded from constants (``"/etc/" + name``, ``os.path.join``, ``Path(...) / "x"``,
f-strings) and from the home (``~`` with ``expanduser``, ``Path.home()``, ``$HOME``) into a
``Target``: ``("abs", "/etc/x")``, ``("home", "~/.ssh/id_rsa")`` or ``("rel", "vocab.txt")``
(relative to a working folder the audit cannot know).
"""

from __future__ import annotations

import ast
import posixpath
from collections.abc import Iterable

from ..._sandbox.policy import device_writes, is_credential, python_reads, system_reads
from .names import NameResolver, const_str

__all__ = [
    "Target",
    "ENVIRON",
    "fold",
    "shown",
    "refused_read",
    "allowed_write",
    "credential",
    "NETWORK",
    "READ_REFUSED",
    "WRITE_REFUSED",
    "WRITE_UNLESS",
    "RUN_REFUSED",
    "RUN_UNLESS",
    "SHELL_REFUSED",
    "SIGNAL_UNLESS",
    "ENV_REMOVED",
    "ENV_SCRUBBED",
]

Target = tuple[str, str]

#: What the box does, as ``codeferry audit`` words it after ``under --sandbox:``.
NETWORK = "refused unless a Unix socket or a TCP port in CODEFERRY_SANDBOX_PORTS"
READ_REFUSED = "refused: not a folder the box lets code read (CODEFERRY_SANDBOX_READ adds one)"
WRITE_REFUSED = "refused: the box writes only TMPDIR, /dev/shm and the store"
WRITE_UNLESS = "refused unless the target is in TMPDIR, /dev/shm or the store"
RUN_REFUSED = "refused: the box runs no program but the Python interpreter"
RUN_UNLESS = "refused unless it runs the Python interpreter"
SHELL_REFUSED = "refused: the box runs no shell"
SIGNAL_UNLESS = "refused unless the process is inside the box"
ENV_REMOVED = "refused: the box removes {name} from the environment"
ENV_SCRUBBED = "the box removes every credential from it first"

_PATHS = frozenset({"pathlib.Path", "pathlib.PurePath", "pathlib.PosixPath", "os.path.join",
                    "posixpath.join"})  # fmt: skip
_SAME = frozenset({"os.path.abspath", "os.path.realpath", "os.path.normpath", "os.fspath",
                   "builtins.str", "posixpath.normpath"})  # fmt: skip
_ENV_GET = frozenset({"os.getenv", "os.environ.get"})
ENVIRON = frozenset({"os.environ", "os.environb"})
#: Below the home, what a box may grant: the model's own hub cache entry, codeferry's store.
_HOME_GRANTED = (".cache/huggingface/hub", ".cache/codeferry")


def _target(text: str) -> Target:
    if text.startswith("/"):
        return ("abs", text)
    return ("rel", text)


def _join(parts: list[Target | None]) -> Target | None:
    """``os.path.join``/``Path(a, b)``: a part that is absolute (or the home) starts over."""
    start = max((i for i, p in enumerate(parts) if p and p[0] in {"abs", "home"}), default=0)
    known = [p for p in parts[start:] if p is not None]
    if not known or len(known) != len(parts) - start:
        return None
    text = known[0][1]
    for part in known[1:]:
        text = posixpath.join(text, part[1])
    return (known[0][0], text)


def _home(target: Target | None) -> Target | None:
    """``expanduser``: a path that starts with ``~`` is in the home."""
    if target and target[0] == "rel" and target[1].startswith("~"):
        return ("home", target[1])
    return target


def fold(resolver: NameResolver, node: ast.AST | None) -> Target | None:
    """Where the path ``node`` points, when static analysis can tell."""
    if node is None or id(node) in resolver.resolving:
        return None
    resolver.resolving.add(id(node))
    try:
        return _fold(resolver, node)
    except RecursionError:
        return None
    finally:
        resolver.resolving.discard(id(node))


def _fold(resolver: NameResolver, node: ast.AST) -> Target | None:
    text = const_str(node)
    if text is not None:
        return _target(text)
    if isinstance(node, ast.Name):
        return fold(resolver, resolver.single_value(node.id))
    if isinstance(node, ast.JoinedStr):
        pieces = [
            fold(resolver, v.value if isinstance(v, ast.FormattedValue) else v) for v in node.values
        ]
        known = [p for p in pieces if p is not None]
        if not known or len(known) != len(pieces):
            return None
        return (known[0][0], "".join(p[1] for p in known))
    if isinstance(node, ast.BinOp):
        left, right = fold(resolver, node.left), fold(resolver, node.right)
        if isinstance(node.op, ast.Add) and left and right:
            return (left[0], left[1] + right[1])
        if isinstance(node.op, ast.Div):
            return _join([left, right])
        return None
    if isinstance(node, ast.Subscript):
        return _environ_home(resolver, node.value, node.slice)
    if isinstance(node, ast.Attribute):
        base = fold(resolver, node.value) if node.attr == "parent" else None
        if base is None or base[1] == "~":
            return None
        return (base[0], posixpath.dirname(base[1].rstrip("/")) or ".")
    if (
        not isinstance(node, ast.Call)
        or node.keywords
        or any(isinstance(a, ast.Starred) for a in node.args)
    ):
        return None
    qual = resolver.qualify(node.func)
    args = node.args
    if qual == "pathlib.Path.home" or (qual in _ENV_GET and args):
        return (
            ("home", "~") if qual == "pathlib.Path.home" or const_str(args[0]) == "HOME" else None
        )
    if qual in _PATHS:
        return _join([fold(resolver, a) for a in args]) if args else ("rel", ".")
    if qual == "os.path.expanduser" and len(args) == 1:
        return _home(fold(resolver, args[0]))
    if qual in _SAME and len(args) == 1:
        return fold(resolver, args[0])
    if isinstance(node.func, ast.Attribute) and qual is None:
        base = fold(resolver, node.func.value)
        method = node.func.attr
        if method == "expanduser" and not args:
            return _home(base)
        if method in {"resolve", "absolute"} and not args:
            return base
        if method == "joinpath":
            return _join([base, *(fold(resolver, a) for a in args)])
    return None


def _environ_home(resolver: NameResolver, value: ast.expr, key: ast.expr) -> Target | None:
    """``os.environ["HOME"]``: the home."""
    if resolver.qualify(value) in ENVIRON and const_str(key) == "HOME":
        return ("home", "~")
    return None


def _under(path: str, folders: Iterable[str]) -> bool:
    return any(path == f or path.startswith(f.rstrip("/") + "/") for f in folders)


def shown(target: Target) -> str:
    """The path as a finding names it (``~/.ssh/id_rsa``, ``/etc/shadow``)."""
    return posixpath.normpath(target[1])


def refused_read(target: Target | None, roots: Iterable[str] = ()) -> str | None:
    """The path, where the box surely refuses reading it; ``roots``: the model's folders."""
    if target is None or target[0] == "rel":
        return None
    path = shown(target)
    if target[0] == "home":
        tail = path[1:].lstrip("/")
        return None if _under(tail, _HOME_GRANTED) else path
    python = [p for p in python_reads() if p.rstrip("/")]  # the box never grants all of /
    granted = [*system_reads("/proc/self"), *device_writes(), *python, *roots]
    return None if _under(path, granted) else path


def allowed_write(target: Target | None) -> bool | None:
    """Whether the box lets code write there: ``None`` when static analysis cannot tell."""
    if target is None or target[0] == "rel":
        return None
    if target[0] == "home":
        return _under(shown(target)[1:].lstrip("/"), _HOME_GRANTED[1:])
    return _under(shown(target), device_writes())


def credential(name: str) -> bool:
    """The box's own decision (``_sandbox.policy.is_credential``): it removes this variable."""
    return is_credential(name)
