"""The files every worker will need, checked in the parent before any worker starts.

A worker builds the model from the folder's weights and ``AutoTokenizer`` from its tokenizer
files. A folder without them would fail only once every worker had started (seconds
each), with transformers' traceback from each worker: ``check_model_files`` refuses it
first, with ``ModelFilesMissingError``.

The check refuses only what cannot load: a folder with no weights at all (a file of
``WEIGHT_SUFFIXES``, or a sharded checkpoint's ``*.index.json``), or with none of the files
its tokenizer reads. Which files those are follows ``AutoTokenizer``: ``tokenizer.json``;
else the class that ``tokenizer_config.json`` names (its ``auto_map``: the remote class's
``vocab_files_names``, read from its source without running it; or ``tokenizer_class``: a
class of transformers'), or ``config.json``'s ``tokenizer_class``, or the class transformers
maps the ``model_type`` to. Any one of a class's files, or of the files that carry a
vocabulary (``tokenizer.model``, ``vocab.json``, ...), is taken as enough; where the class
cannot be told, the folder passes, and transformers has the last word in the workers.

A class of transformers' with none of its files is refused even where transformers 5 would
build it: it builds an empty vocabulary (``GPT2Tokenizer`` without ``vocab.json`` and
``merges.txt`` turns every text into no tokens), which ``run`` would feed to the model.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._code.source import WEIGHT_SUFFIXES
from ..errors import ModelFilesMissingError

__all__ = ["MODEL_TASKS", "check_model_files", "has_weights", "may_have_chat_template", "written_for",
           "missing_tokenizer", "model_context"]

#: The tasks whose workers build a model from the weights.
MODEL_TASKS = frozenset({"generate", "embed", "score"})
#: Files that are a tokenizer, or carry its vocabulary: with any of them the folder passes.
TOKENIZER_FILES = frozenset({"tokenizer.json", "tokenizer.model", "spiece.model",
                             "sentencepiece.bpe.model", "vocab.json", "vocab.txt", "merges.txt",
                             "tekken.json"})
TOKENIZER_SUFFIXES = (".tiktoken", ".model")
#: What ``AutoTokenizer`` reads when nothing names a tokenizer class: ``TokenizersBackend``'s.
_ANY_TOKENIZER = ("tokenizer.json", "tokenizer.model")


def _files(folder: Path) -> set[str]:
    try:
        return {entry.name for entry in folder.iterdir() if entry.is_file()}
    except OSError:
        return set()


def _json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def has_weights(names: set[str]) -> bool:
    """Whether ``names`` (a folder's files) hold weights, whole or sharded (an index)."""
    return any(name.endswith(WEIGHT_SUFFIXES)
               or name.removesuffix(".index.json").endswith(WEIGHT_SUFFIXES) for name in names)


def _remote_vocab_files(ref: str, roots: Sequence[Path]) -> tuple[str, ...] | None:
    """The ``vocab_files_names`` of the remote class ``ref`` (``module.Class``), read from
    its source; ``None`` when it cannot be told (another repo's code, a computed value)."""
    if "--" in ref or "." not in ref:
        return None
    module, _, name = ref.rpartition(".")
    source = next((root / (module.replace(".", "/") + ".py") for root in roots
                   if (root / (module.replace(".", "/") + ".py")).is_file()), None)
    if source is None:
        return None
    try:
        tree = ast.parse(source.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None

    def value(node: ast.expr | None) -> tuple[str, ...] | None:
        if isinstance(node, ast.Name):  # ``vocab_files_names = VOCAB_FILES_NAMES``
            node = next((s.value for s in tree.body if isinstance(s, ast.Assign)
                         and any(isinstance(t, ast.Name) and t.id == node.id for t in s.targets)),
                        None)
        try:
            names = ast.literal_eval(node) if node is not None else None
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None
        if not isinstance(names, dict):
            return None
        return tuple(v for v in names.values() if isinstance(v, str))

    for cls in tree.body:
        if isinstance(cls, ast.ClassDef) and cls.name == name:
            for stmt in cls.body:
                targets: list[ast.expr]
                assigned: ast.expr | None
                if isinstance(stmt, ast.Assign):
                    targets, assigned = stmt.targets, stmt.value
                elif isinstance(stmt, ast.AnnAssign):
                    targets, assigned = [stmt.target], stmt.value
                else:
                    continue
                if any(isinstance(t, ast.Name) and t.id == "vocab_files_names" for t in targets):
                    return value(assigned)
    return None


def _library_vocab_files(name: str) -> tuple[str, ...] | None:
    """The ``vocab_files_names`` of transformers' tokenizer class ``name``."""
    try:
        from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

        cls = tokenizer_class_from_name(name) or tokenizer_class_from_name(
            name.removesuffix("Fast") if name.endswith("Fast") else name + "Fast")
        names = getattr(cls, "vocab_files_names", None)
    except Exception:  # noqa: BLE001 - a class that needs a missing package: cannot tell
        return None
    if not isinstance(names, dict):
        return None
    return tuple(v for v in names.values() if isinstance(v, str))


def _mapped(model_type: object) -> str | None:
    """The tokenizer class transformers maps ``model_type`` to, or ``None``."""
    if not isinstance(model_type, str) or not model_type:
        return None
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    found: Any = TOKENIZER_MAPPING_NAMES.get(model_type)
    if isinstance(found, (tuple, list)):
        found = next((f for f in reversed(found) if f), None)
    return found if isinstance(found, str) else None


def missing_tokenizer(folder: Path, code: Path | None = None) -> tuple[str, ...] | None:
    """``None`` when ``folder`` has what ``AutoTokenizer`` reads (or that cannot be told);
    else the files any one of which it would need. ``code``: where the remote code is, when
    not in ``folder``."""
    names = _files(folder)
    if names & TOKENIZER_FILES or any(n.endswith(TOKENIZER_SUFFIXES) for n in names):
        return None
    tokenizer_config = _json(folder / "tokenizer_config.json")
    config = _json(folder / "config.json") or {}
    wanted: tuple[str, ...] | None = None
    if tokenizer_config is not None:
        auto = tokenizer_config.get("auto_map")
        ref = auto.get("AutoTokenizer") if isinstance(auto, dict) else auto
        refs = [ref] if isinstance(ref, str) else [r for r in ref or () if isinstance(r, str)]
        if refs:  # transformers takes the fast class (the second) when there is one
            roots = [folder] if code is None else [code, folder]
            wanted = _remote_vocab_files(refs[-1], roots)
        elif isinstance(tokenizer_config.get("tokenizer_class"), str):
            wanted = _library_vocab_files(tokenizer_config["tokenizer_class"])
    elif isinstance(config.get("tokenizer_class"), str):
        wanted = _library_vocab_files(config["tokenizer_class"])
    else:
        name = _mapped(config.get("model_type"))
        if name is None:  # nothing names a tokenizer: AutoTokenizer has nothing to load
            return _ANY_TOKENIZER
        wanted = _library_vocab_files(name)
    if wanted is None or not wanted or names & set(wanted):
        return None  # cannot tell, needs no file (ByT5), or has one
    return wanted


def check_model_files(folder: Path, tasks: Sequence[str], code: Path | None = None) -> None:
    """Raise ``ModelFilesMissingError`` when workers running ``tasks`` on ``folder`` would
    all fail for want of weights or tokenizer files."""
    names = _files(folder)
    missing: list[str] = []
    files: list[str] = []
    what: list[str] = []
    fixes: list[str] = []
    if MODEL_TASKS & set(tasks) and not has_weights(names):
        missing.append("weights")
        files += [f"*{suffix}" for suffix in WEIGHT_SUFFIXES]
        what.append(f"no weights (a file ending in {', '.join(WEIGHT_SUFFIXES)}, or a sharded "
                    "checkpoint's *.index.json)")
        fixes.append("put the model's weights in it (`model.save_pretrained(folder)` writes "
                     "them), or name the folder or repo id that has them")
    tokenizer = missing_tokenizer(folder, code)
    if tokenizer is not None:
        missing.append("tokenizer")
        files += tokenizer
        what.append(f"no tokenizer files (AutoTokenizer needs {' or '.join(tokenizer)})")
        fixes.append("save the model's tokenizer into it (`tokenizer.save_pretrained(folder)`), "
                     "or copy its files there")
    if missing:
        raise ModelFilesMissingError(
            f"the model folder has {' and '.join(what)}: every worker would fail to build "
            f"the model; no worker was started.",
            path=str(folder), missing=tuple(missing), files=tuple(files),
            fix="; ".join(fixes) + ".")


def may_have_chat_template(folder: Path) -> bool:
    """Whether the tokenizer of ``folder`` can have a chat template: one of the files
    transformers reads it from (``chat_template.jinja``, ``chat_template.json``, a
    ``chat_template`` in ``tokenizer_config.json``), or a remote-code tokenizer (its class may
    set one in code: the worker has the last word)."""
    names = _files(folder)
    if names & {"chat_template.jinja", "chat_template.json"} or (folder / "additional_chat_templates").is_dir():
        return True
    config = _json(folder / "tokenizer_config.json") or {}
    auto_map = config.get("auto_map")
    return bool(config.get("chat_template")) or (
        isinstance(auto_map, dict) and "AutoTokenizer" in auto_map)


#: The keys of a text config that bound its sequences, as vLLM reads them (the least wins).
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length",
                "max_seq_len")


def written_for(folder: Path) -> str | None:
    """The transformers release the model's ``config.json`` says it was saved with, if any."""
    version = (_json(folder / "config.json") or {}).get("transformers_version")
    return version if isinstance(version, str) else None


def model_context(folder: Path) -> int | None:
    """The most tokens (prompt and completion) the model in ``folder`` takes, read from its
    ``config.json`` as vLLM derives ``max_model_len``, without running its code: the least of
    ``CONTEXT_KEYS`` in its text config (``text_config`` when it has one), times a RoPE
    scaling ``factor`` that extends it; ``None`` when the config says none."""
    config = _json(folder / "config.json") or {}
    text = config.get("text_config")
    for part in ([text] if isinstance(text, dict) else []) + [config]:
        found = [v for k in CONTEXT_KEYS if isinstance(v := part.get(k), int)
                 and not isinstance(v, bool) and v > 0]
        if not found:
            continue
        rope = part.get("rope_scaling") or part.get("rope_parameters") or {}
        kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
        factor = rope.get("factor") if isinstance(rope, dict) else None
        if kind in ("su", "longrope", "llama3", "default", "mrope", None) or not isinstance(
                factor, (int, float)) or factor < 1:
            return min(found)
        original = rope.get("original_max_position_embeddings")
        base = original if kind == "yarn" and isinstance(original, int) else min(found)
        return int(base * factor)
    return None
