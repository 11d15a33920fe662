"""The other doors: what a model's own files can make transformers fetch or execute besides
``auto_map`` code. Pure: it reads parsed JSON (and its text, for line numbers); nothing is
imported, downloaded or executed.

transformers executes a model repo's Python through ``auto_map`` (``automap``), and through
these doors too, each named in the model's JSON files:

* ``custom-pipeline``: ``config.json``'s ``custom_pipelines`` (``{"task": {"impl":
  "module.Class", "pt": [...]}}``), which ``pipeline(task, model, trust_remote_code=True)``
  loads with ``get_class_from_dynamic_module``. Its ``impl`` is code of the model like an
  ``auto_map`` entry: ``custom_pipeline_refs`` turns it into a ``ClassRef`` so that the
  module and the files it imports enter the bundle (digest, ``inspect``, ``audit``, lock).
* ``hub-kernel``: a config field whose value is a Hub kernel repo (``org/repo``,
  ``org/repo@rev``, ``org/repo:function``), which transformers fetches and imports with the
  ``kernels`` package: ``attn_implementation`` / ``experts_implementation`` and their
  private forms ``_attn_implementation_internal`` / ``_experts_implementation_internal``
  (CVE-2026-4372: transformers releases before the fix copied the private form from the
  file without ``trust_remote_code``), in the config or any sub-config; ``use_kernels`` /
  ``kernel_config`` written into a file.
* ``nested-load``: ``audio_tokenizer_name_or_path`` (``processor_config.json``'s
  ``audio_tokenizer``, or ``audio_tokenizer_config.json``): transformers 5 loads another
  model from the path or repo the file names, with a class the file names.
* ``trust-in-file``: a ``trust_remote_code`` key in any of the model's JSON files
  (CVE-2026-5241: a nested load that takes trust from a file). codeferry never takes trust
  from a file (``_trust.decide``); the key is listed so a reviewer sees it.

``find_doors`` lists every such place with file and line; ``kernel_repos`` the kernel repos a
model's config names (what the runtime gate refuses under a lock).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InvalidAutoMapError
from .automap import AUTO_MAP_FILES, ClassRef, line_of, parse_reference

__all__ = ["DOOR_FILES", "KERNEL_FIELDS", "Door", "custom_pipeline_refs", "find_doors",
           "is_kernel_repo", "kernel_references", "kernel_repo", "kernel_repos", "render_doors"]

#: The JSON files a door can be named in: those that carry an ``auto_map``, and the
#: generation config (``from_pretrained`` reads it with the model's own keywords).
DOOR_FILES: tuple[str, ...] = (*AUTO_MAP_FILES, "generation_config.json",
                               "audio_tokenizer_config.json")

#: Config fields whose value transformers reads as an attention or experts implementation:
#: a Hub kernel repo when it reads ``org/repo``.
KERNEL_FIELDS: tuple[str, ...] = (
    "attn_implementation",
    "_attn_implementation",
    "_attn_implementation_internal",
    "experts_implementation",
    "_experts_implementation",
    "_experts_implementation_internal",
)

#: transformers' own pattern of a Hub kernel (``integrations.hub_kernels.is_kernel``; 4.53's
#: inline pattern is narrower). Its classes let ``|`` through: ``"x|org/repo"`` matches.
_KERNEL = re.compile(r"^[^/:]+/[^/:]+(?:@[^/:]+)?(?::[^/:]+)?$")


def kernel_references(value: Any) -> tuple[str, ...]:
    """Every Hub kernel reference transformers may read out of ``value``, at any release:
    the whole value (4.53 passes its repo part, prefix and all, to ``get_kernel``; 5.x checks
    it with ``is_kernel`` first), what follows the first ``|`` (5.x's
    ``load_and_register_attn_kernel``: ``split("|")[1]``, whatever the prefix) and what
    follows the last (the MSA kernel's loader), each also after ``paged|`` is removed
    (``modeling_utils``). A reading transformers would reject is listed too: refusing it
    costs nothing, missing one fetches code."""
    if not isinstance(value, str):
        return ()
    found: list[str] = []
    for text in (value, value.strip(), value.removeprefix("paged|")):
        parts = text.split("|")
        for part in (text, parts[1] if len(parts) > 1 else text, parts[-1]):
            for candidate in (part, part.strip()):
                if _KERNEL.match(candidate) and candidate not in found:
                    found.append(candidate)
    return tuple(found)


def is_kernel_repo(value: Any) -> bool:
    """Whether transformers may read ``value`` as a Hub kernel (``kernel_references``)."""
    return bool(kernel_references(value))


def kernel_repo(value: str) -> str:
    """The repo id of a kernel reference (``x|org/repo@rev:func`` -> ``org/repo``): what
    follows the last ``|``, so that 4.53's whole-value reading names the same repo."""
    value = value.strip().rsplit("|", 1)[-1]
    return value.split(":", 1)[0].split("@", 1)[0].strip()


@dataclass(frozen=True)
class Door:
    """One place in a model's files that opens a door: ``file`` inside the model, its line,
    the door's kind, the JSON key path, the value as written, and why it matters."""

    file: str
    line: int
    kind: str
    key: str
    value: str
    reason: str
    repos: tuple[str, ...] = ()  # a hub-kernel door: the kernel repos it names

    @property
    def location(self) -> str:
        return f"{self.file}:{self.line}"

    def to_json(self) -> dict[str, Any]:
        # the shape of ``Bundle.to_json``'s code doors (door, path, line), with the JSON key
        # that opens it, its value and why it matters: one ``doors`` list in ``inspect --json``
        return {"door": self.kind, "path": self.file, "line": self.line, "key": self.key,
                "value": self.value, "reason": self.reason}


def custom_pipeline_refs(data: Any, *, path: str, text: str) -> list[ClassRef]:
    """The ``custom_pipelines`` entries of a parsed ``config.json`` as ``ClassRef`` values.

    Each comes as ``declared_in="config.json:custom_pipelines"`` and the task as its key, so
    ``load`` keys it ``"custom_pipelines:<task>"``. An entry without a string ``impl`` is an
    ``InvalidAutoMapError`` naming the line (transformers would fail on it too).
    """
    pipelines = data.get("custom_pipelines") if isinstance(data, dict) else None
    if pipelines is None:
        return []
    anchor = line_of(text, '"custom_pipelines"') or 1
    if not isinstance(pipelines, dict):
        raise InvalidAutoMapError(
            f"custom_pipelines must be an object mapping tasks to {{\"impl\": ...}}, not "
            f"{type(pipelines).__name__}.", path=path, line=anchor,
            fix='write it as {"my-task": {"impl": "pipeline_x.XPipeline", "pt": ["AutoModel"]}}.')
    refs: list[ClassRef] = []
    for task, entry in pipelines.items():
        line = line_of(text, f'"{task}"', anchor) or anchor
        impl = entry.get("impl") if isinstance(entry, dict) else None
        if not isinstance(impl, str):
            raise InvalidAutoMapError(
                f"custom_pipelines[{task!r}] has no \"impl\" naming its class.", path=path,
                line=line, fix=f'write it as "{task}": {{"impl": "pipeline_x.XPipeline"}}.')
        impl_line = line_of(text, '"impl"', line) or line
        repo, module, name = parse_reference(impl, path=path, line=impl_line)
        refs.append(ClassRef("config.json:custom_pipelines", str(task), None, repo, module, name))
    return refs


def _walk(value: Any, key_path: str) -> list[tuple[str, str, Any]]:
    """Every ``(key path, key, value)`` of a JSON document, parents before children."""
    out: list[tuple[str, str, Any]] = []
    stack: list[tuple[str, Any]] = [(key_path, value)]
    while stack:
        where, node = stack.pop(0)
        if isinstance(node, dict):
            for key, child in node.items():
                path = f"{where}.{key}" if where else str(key)
                out.append((path, str(key), child))
                stack.append((path, child))
        elif isinstance(node, list):
            stack += [(f"{where}[{i}]", child) for i, child in enumerate(node)]
    return out


def _line(text: str, key_path: str, key: str) -> int:
    """The line of ``key`` inside the object ``key_path`` names (its parents first)."""
    line = 1
    for part in key_path.split(".")[:-1]:
        line = line_of(text, f'"{part.split("[", 1)[0]}"', line) or line
    return line_of(text, f'"{key}"', line) or line


def _short(value: Any) -> str:
    shown = json.dumps(value, ensure_ascii=False, default=str)
    return shown if len(shown) <= 80 else shown[:77] + "..."


def doors_of(data: Any, *, filename: str, text: str) -> list[Door]:
    """The doors one parsed JSON file opens (``filename``: its name inside the model)."""
    found: list[Door] = []
    for key_path, key, value in _walk(data, ""):
        line = _line(text, key_path, key)
        if key == "trust_remote_code":
            found.append(Door(filename, line, "trust-in-file", key_path, _short(value),
                              "a file that asks for trust: transformers' nested loads may pass "
                              "it on (CVE-2026-5241); codeferry takes trust only from the caller"))
        elif key in KERNEL_FIELDS and _kernels_in(value):
            found.append(Door(filename, line, "hub-kernel", key_path, _short(value),
                              "a Hub kernel repo that transformers downloads and imports with "
                              "the kernels package (CVE-2026-4372 for the private field)",
                              _kernels_in(value)))
        elif key in ("use_kernels", "kernel_config") and value not in (None, False, {}, []):
            found.append(Door(filename, line, "hub-kernel", key_path, _short(value),
                              "asks transformers to replace layers with Hub kernels"))
        elif key == "audio_tokenizer_name_or_path" and isinstance(value, str):
            found.append(Door(filename, line, "nested-load", key_path, _short(value),
                              "a processor loads another model from this path or repo "
                              "(its weights, with a class the file names)"))
        elif key == "custom_pipelines" and filename == "config.json" and isinstance(value, dict):
            for task, entry in value.items():
                impl = entry.get("impl") if isinstance(entry, dict) else entry
                found.append(Door(filename, line_of(text, f'"{task}"', line) or line,
                                  "custom-pipeline", f"{key_path}.{task}", _short(impl),
                                  "pipeline() executes this class of the model's code "
                                  "(with trust_remote_code); codeferry locks its files"))
    return found


def _kernels_in(value: Any) -> tuple[str, ...]:
    """The kernel repos a field's value names: a string, or a per-sub-config mapping."""
    values = value.values() if isinstance(value, dict) else [value]
    return tuple(sorted({kernel_repo(r) for v in values for r in kernel_references(v)}))


def _read(path: Path) -> tuple[Any, str] | None:
    try:
        text = path.read_text(encoding="utf-8")
        return json.loads(text), text
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None  # resolve reports a config it cannot read; a door needs a readable one


def find_doors(root: str | Path) -> tuple[Door, ...]:
    """Every door the JSON files of the model folder ``root`` open, file by file."""
    found: list[Door] = []
    for name in DOOR_FILES:
        read = _read(Path(root) / name)
        if read is not None:
            found += doors_of(read[0], filename=name, text=read[1])
    return tuple(found)


def kernel_repos(root: str | Path) -> dict[str, Door]:
    """The Hub kernel repos the model folder ``root`` names (repo id -> where)."""
    out: dict[str, Door] = {}
    for door in find_doors(root):
        for repo in door.repos:
            out.setdefault(repo, door)
    return out


def render_doors(doors: tuple[Door, ...]) -> str:
    """The ``doors`` section of ``codeferry inspect`` (nothing when there is none)."""
    if not doors:
        return ""
    out = ["doors"]
    for door in doors:
        out.append(f"  {door.location}: {door.kind} {door.key} = {door.value}")
        out.append(f"      {door.reason}")
    return "\n".join(out) + "\n"
