"""Reading ``auto_map``: which classes a model names, and in which module.

Pure code: it takes parsed JSON and the text it came from, and returns ``ClassRef``
values, or raises ``InvalidAutoMapError`` / ``UnsafePathError`` /
``ShadowingModuleError`` naming the file and line. Nothing here touches the disk.

Values take three shapes (transformers' ``get_class_from_dynamic_module``)::

    "AutoConfig": "configuration_x.XConfig"                      # module.Class
    "AutoTokenizer": ["tokenization_x.XTokenizer", null]         # a [slow, fast] pair
    "AutoModel": "org/other--modeling_y.YModel"                  # cross-repo reference
    "AutoImageProcessor": {"pil": "ip_x.XSlow", "torchvision": "ip_x.XFast"}  # per backend (5.x)

and they appear in ``config.json`` (also inside nested sub-configs such as
``llm_config``), ``tokenizer_config.json`` (where a bare list is the legacy form of
``AutoTokenizer``), ``processor_config.json``, ``preprocessor_config.json`` and
``video_preprocessor_config.json``.
"""

from __future__ import annotations

import re
import reprlib
import sys
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidAutoMapError, ShadowingModuleError, UnsafePathError

__all__ = ["AUTO_MAP_FILES", "ClassRef", "parse_auto_maps", "parse_reference", "line_of",
           "qualified"]

#: Files that may carry an ``auto_map``, in the order they are read.
AUTO_MAP_FILES: tuple[str, ...] = (
    "config.json",
    "tokenizer_config.json",
    "processor_config.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
)

_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxstring, _SHORT.maxother = 3, 4, 4, 80, 80


def _short(value: Any) -> str:
    """``repr`` for messages: one line, however long or deep the value."""
    return _SHORT.repr(value)


_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")

#: Top-level names a remote module may not take: it would shadow what the code imports.
_PROTECTED = frozenset(sys.stdlib_module_names) | {
    "transformers",
    "torch",
    "huggingface_hub",
    "tokenizers",
    "safetensors",
    "codeferry",
    "transformers_modules",
}


@dataclass(frozen=True, order=True)
class ClassRef:
    """One class named by an ``auto_map``.

    ``declared_in`` is where the entry was found (``config.json``, or
    ``config.json:llm_config`` for a nested sub-config); ``slot`` is the index inside a
    ``[slow, fast]`` pair, ``None`` for a plain entry; ``repo`` is the other repo of a
    cross-repo reference, ``None`` for the model's own code.
    """

    declared_in: str
    key: str
    slot: int | None
    repo: str | None
    module: str
    name: str

    @property
    def reference(self) -> str:
        """The entry as ``auto_map`` spells it."""
        return qualified(self.repo, f"{self.module}.{self.name}")


def qualified(repo: str | None, name: str) -> str:
    """``name`` (a module, a file, a class) of ``repo``'s code, as ``auto_map`` spells a
    cross-repo reference: ``org/repo--name``; of the model's own code (``None``): ``name``.
    Module names, file names in messages and locks, and references all read this way."""
    return f"{repo}--{name}" if repo else name


def line_of(text: str, needle: str, start_line: int = 1) -> int | None:
    """First line (1-based, at or after ``start_line``) whose text contains ``needle``."""
    for number, line in enumerate(text.splitlines(), start=1):
        if number >= start_line and needle in line:
            return number
    return None


def parse_reference(value: str, *, path: str, line: int | None) -> tuple[str | None, str, str]:
    """Split ``[org/repo--]module.Class`` into ``(repo, module, class)``, validating each part."""

    def fail(what: str, fix: str, cls: type[InvalidAutoMapError] = InvalidAutoMapError) -> Any:
        raise cls(f"auto_map entry {_short(value)} {what}.", path=path, line=line, fix=fix)

    repo: str | None = None
    rest = value
    if "--" in value:
        repo, rest = value.split("--", 1)
        if not _REPO_ID.match(repo) or ".." in repo:
            fail("names an invalid repo id", "write it as 'org/name--module.Class'.")
    if rest.startswith("/") or "\\" in rest or "/" in rest or rest.startswith(".."):
        raise UnsafePathError(
            f"auto_map entry {_short(value)} points outside the model folder.",
            path=path,
            line=line,
            fix="name a module inside the model folder, as 'module.Class' or 'pkg.module.Class'.",
        )
    if "." not in rest:
        fail("has no dot", "write it as 'module.Class', e.g. 'modeling_x.XModel'.")
    module, name = rest.rsplit(".", 1)
    parts = module.split(".")
    if not all(_IDENT.match(p) for p in parts) or not _IDENT.match(name):
        fail(
            "is not 'module.Class' made of Python identifiers",
            "rename the file so its name is a valid identifier (letters, digits, '_').",
        )
    if parts[0] in _PROTECTED:
        raise ShadowingModuleError(
            f"auto_map entry {_short(value)} names module {module!r}, which would shadow "
            f"the installed {parts[0]!r}.",
            path=path,
            line=line,
            fix=f"rename {module.replace('.', '/')}.py to a name of its own, e.g. 'custom_{parts[0]}.py'.",
        )
    return repo, module, name


def _entries(
    auto_map: Any, *, declared_in: str, path: str, text: str, anchor: int
) -> list[ClassRef]:
    """The ``ClassRef`` values of one ``auto_map`` object."""
    if isinstance(auto_map, list) and declared_in == "tokenizer_config.json":
        auto_map = {"AutoTokenizer": auto_map}  # legacy form, still read by transformers
    if not isinstance(auto_map, dict):
        raise InvalidAutoMapError(
            f"auto_map must be an object mapping Auto classes to 'module.Class', "
            f"not {type(auto_map).__name__}.",
            path=path,
            line=anchor,
            fix='write it as {"AutoConfig": "configuration_x.XConfig", ...}.',
        )
    refs: list[ClassRef] = []
    for key, value in auto_map.items():
        line = line_of(text, f'"{key}"', anchor) or anchor
        if isinstance(value, str):
            values: list[tuple[int | None, str | None]] = [(None, value)]
        elif isinstance(value, list) and value and all(v is None or isinstance(v, str) for v in value):
            values = list(enumerate(value))
        elif isinstance(value, dict) and value and all(
                v is None or isinstance(v, str) for v in value.values()):
            # transformers 5: an image/video processor per backend ({"pil": ..., "torchvision":
            # ...}); each is code of the model, in the slot of its order
            values = list(enumerate(value.values()))
        else:
            raise InvalidAutoMapError(
                f"auto_map[{_short(key)}] must be 'module.Class' or a [slow, fast] list, "
                f"not {_short(value)}.",
                path=path,
                line=line,
                fix=f'write it as "{key}": "module.Class" (or ["module.Slow", null] for a tokenizer).',
            )
        for slot, entry in values:
            if entry is None:
                continue
            repo, module, name = parse_reference(entry, path=path, line=line)
            refs.append(ClassRef(declared_in, key, slot, repo, module, name))
    return refs


def parse_auto_maps(data: Any, *, filename: str, path: str, text: str) -> list[ClassRef]:
    """Every ``ClassRef`` in one JSON document, nested sub-configs included.

    ``filename`` is the file's name inside the model (``config.json``), ``path`` what
    errors show, ``text`` the raw JSON (to find line numbers).
    """
    refs: list[ClassRef] = []
    if not isinstance(data, dict):
        return refs
    if "auto_map" in data:
        anchor = line_of(text, '"auto_map"') or 1
        refs += _entries(data["auto_map"], declared_in=filename, path=path, text=text, anchor=anchor)
    if filename == "config.json":
        # Multimodal configs nest whole configs (InternVL's llm_config, vision_config):
        # each may carry its own auto_map. Walk them, keeping the key path in declared_in.
        stack: list[tuple[str, Any]] = [(k, v) for k, v in data.items() if k != "auto_map"]
        while stack:
            key_path, value = stack.pop(0)
            if not isinstance(value, dict):
                continue
            if "auto_map" in value:
                anchor = line_of(text, f'"{key_path.rsplit(".", 1)[-1]}"') or 1
                anchor = line_of(text, '"auto_map"', anchor) or anchor
                refs += _entries(
                    value["auto_map"],
                    declared_in=f"{filename}:{key_path}",
                    path=path,
                    text=text,
                    anchor=anchor,
                )
            stack += [(f"{key_path}.{k}", v) for k, v in value.items() if k != "auto_map"]
    return refs
