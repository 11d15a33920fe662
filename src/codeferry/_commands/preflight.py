"""What ``codeferry run`` checks before any worker starts, each failure one line with its fix.

The command line's flags (``checked_flags``, ``paths``: a usage error, exit 2), the chat
template chat inputs need (``check_chat_template``), and the lines answered by their error
without running (``refused``: a field not honoured, another model's name, a prompt over the
context). A worker that started and failed on any of these would say so only after its
start-up, under a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._exec.files import may_have_chat_template
from .._exec.generate.params import SamplingParams
from ..errors import (
    ChatTemplateMissingError,
    CodeferryError,
    HubDownloadError,
    ModelFilesMissingError,
    ModelNotFoundError,
    SamplingParamsError,
    WeightsUnreadableError,
)
from .command import UsageError, demo
from .drain import over_context
from .fields import same_model
from .flags import sampling_params
from .inputs import Id, InputItem, Task
from .keywords import too_small

__all__ = ["check_chat_template", "check_model_files", "checked_flags", "engine_options", "paths",
           "read_template", "refused", "unknown_model"]


def check_chat_template(root: Path, code: Path, items: Sequence[InputItem],
                        template: str | None, path: str | os.PathLike[str]) -> None:
    """Chat inputs need a chat template: the model's, or ``--chat-template``'s. A remote-code
    tokenizer may set one in its code (``code``: its folder): one whose Python files never
    name ``chat_template`` has none either."""
    if template is not None or not any(i.request and i.request.messages for i in items):
        return
    if may_have_chat_template(root) and not _code_has_none(root, code):
        return
    raise ChatTemplateMissingError(
        f"the input has chat messages, and the model's tokenizer has no chat template "
        f"(no chat_template.jinja, nor a chat_template in tokenizer_config.json in "
        f"{root}).", path=str(path),
        fix="pass --chat-template FILE (a Jinja template), or send prompts instead.")


def _code_has_none(root: Path, code: Path) -> bool:
    """Whether the only reason to expect a chat template is a remote-code tokenizer, and no
    Python file of the model names one."""
    if {"chat_template.jinja", "chat_template.json"} & {p.name for p in root.iterdir()} or \
            (root / "additional_chat_templates").is_dir() or \
            _json(root / "tokenizer_config.json").get("chat_template"):
        return False
    for folder in {root, code}:
        for source in folder.rglob("*.py"):
            with contextlib.suppress(OSError):
                if b"chat_template" in source.read_bytes():
                    return False
    return True


def read_template(chat_template: str | os.PathLike[str] | None) -> str | None:
    """The text of the ``--chat-template`` file."""
    if chat_template is None:
        return None
    try:
        return Path(chat_template).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ChatTemplateMissingError(
            f"cannot read the chat template {chat_template}: "
            f"{getattr(exc, 'strerror', None) or exc}.", path=str(chat_template),
            fix="pass a readable UTF-8 Jinja file to --chat-template.") from None


def refused(model: str | os.PathLike[str], served: set[str], items: Sequence[InputItem],
            path: str | os.PathLike[str], defaults: SamplingParams, context: int | None,
            task: Task) -> dict[Id, CodeferryError]:
    """The lines answered by their error, never run: a field not honoured, a content part
    that is not text (``InputItem.refused``), a ``model`` other than the one run (``model``
    as given, its last part, or one of ``served``: the weights' name, ``--served-model-name``),
    a prompt over the context (``over_context``)."""
    names = {str(model), str(model).rstrip("/"), Path(model).name, *served}
    answered: dict[Id, CodeferryError] = {}
    for item in items:
        asked = item.openai.model if item.openai else None
        error = item.refused or (same_model(asked, names, path=str(path), line=item.line)
                                 if asked is not None else None)
        if error is not None:
            answered[item.id] = error
    if task == "generate":
        answered.update(over_context([i for i in items if i.id not in answered], path,
                                     defaults, context))
    return answered


def checked_flags(args: argparse.Namespace) -> SamplingParams | None:
    """The sampling flags as ``SamplingParams``, once every flag is checked (``UsageError``:
    a flag its task does not take, a count below 1, a timeout not above 0)."""
    try:
        params = sampling_params(args)
    except SamplingParamsError as exc:
        raise UsageError(f"--{exc.field.replace('_', '-')}: {exc}") from None
    if (params is not None or args.chat_template) and args.task != "generate":
        raise UsageError("sampling flags and --chat-template apply to --task generate only")
    if args.pooling is not None and args.task != "embed":
        raise UsageError("--pooling applies to --task embed only")
    if args.max_new_tokens is not None and args.task != "generate":
        raise UsageError("--max-new-tokens applies to --task generate only")
    small = too_small(workers=args.workers, batch_size=args.batch_size,
                      max_new_tokens=args.max_new_tokens, max_model_len=args.max_model_len,
                      max_batch_tokens=args.max_batch_tokens)
    if small is not None:
        raise UsageError(f"--{small[0].replace('_', '-')} must be at least 1, got {small[1]}")
    if args.batch_timeout is not None and not args.batch_timeout > 0:
        raise UsageError(f"--batch-timeout must be more than 0 seconds, got {args.batch_timeout}")
    return params


def engine_options(given: Sequence[str] | None) -> dict[str, Any] | None:
    """``--engine-option KEY=VALUE`` flags as ``engine_options``: each VALUE read as JSON
    where it parses (``0.5``, ``false``, ``{"a": 1}``), else kept as the string."""
    if not given:
        return None
    options: dict[str, Any] = {}
    for flag in given:
        key, sep, value = flag.partition("=")
        if not sep or not key.strip() or not key.strip().isidentifier():
            raise UsageError(f"--engine-option {flag!r} is not KEY=VALUE (e.g. "
                             "--engine-option gpu_memory_utilization=0.5)")
        try:
            options[key.strip()] = json.loads(value)
        except ValueError:
            options[key.strip()] = value
    return options


def paths(args: argparse.Namespace) -> tuple[Path, str]:
    """``--input`` (the demo's prompts without a MODEL) and ``--output`` (``-``: stdout),
    checked: an output that is a folder, or the input itself, is refused."""
    if args.input is None and args.model is not None:
        raise UsageError("--input FILE is required with a MODEL (without MODEL, the bundled "
                         "demo runs on its own prompts)")
    if args.input is not None and args.model is None:  # not the demo's random weights on it
        raise UsageError(f"--input {args.input} needs a MODEL: codeferry run MODEL --input "
                         f"{args.input} (the bundled demo, random weights, runs on its own "
                         "prompts only, with no --input)")
    inputs = Path(args.input) if args.input else Path(demo()) / "prompts.txt"
    output = args.output or "-"
    if output != "-":
        target = Path(output)
        if target.is_dir():
            raise UsageError(f"--output {output} is a folder: name a file")
        if (target.exists() and args.input != "-" and inputs.exists()
                and os.path.samefile(target, inputs)):
            raise UsageError(f"--output {output} is the input file: name another file")
    return inputs, output


def check_model_files(root: Path) -> None:
    """The model folder's files that every worker would fail on, named before any starts:
    a safetensors file cut short or a shard its index names that is missing
    (``WeightsUnreadableError``); a remote-code model without the ``tokenizer_config.json``
    that names its tokenizer class (``ModelFilesMissingError``: transformers would look for
    a library tokenizer and ask for sentencepiece instead)."""
    for index in sorted(root.glob("*.safetensors.index.json")):
        shards = _json(index).get("weight_map")
        for shard in sorted(set(shards.values()) if isinstance(shards, dict) else ()):
            if isinstance(shard, str) and not (root / shard).is_file():
                raise WeightsUnreadableError(
                    f"{shard}, a shard {index.name} names, is not in the model folder.",
                    path=str(root / shard), fix="download or copy the missing shard into "
                    f"{root} (a download that stopped resumes when run again).")
    for weights in sorted(root.glob("*.safetensors")):
        problem = _safetensors_problem(weights)
        if problem is not None:
            raise WeightsUnreadableError(
                f"the weights file {weights.name} is unreadable: {problem}.", path=str(weights),
                fix="download or copy it again (a download that stopped resumes when run "
                "again); it was probably cut short.")
    config = _json(root / "config.json")
    auto_map = config.get("auto_map")
    if (not (root / "tokenizer_config.json").is_file() and not (root / "tokenizer.json").is_file()
            and isinstance(auto_map, dict) and "AutoTokenizer" not in auto_map
            and "tokenizer_class" not in config):
        raise ModelFilesMissingError(
            "the model folder has no tokenizer_config.json (nor tokenizer.json): nothing names "
            "the tokenizer class of this remote-code model, so no worker could build it.",
            path=str(root / "tokenizer_config.json"), missing=("tokenizer",),
            files=("tokenizer_config.json",), fix="copy the model's tokenizer_config.json into "
            f"{root} (`tokenizer.save_pretrained(folder)` writes it).")


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _safetensors_problem(path: Path) -> str | None:
    """Why ``path`` is not a whole safetensors file (its header, then the size the header
    promises), or ``None``; read without safetensors: 8 bytes of header length, the JSON
    header, then every tensor's bytes up to the largest ``data_offsets`` end."""
    try:
        size = path.stat().st_size
        with path.open("rb") as source:
            head = source.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else -1
            if length < 2 or 8 + length > size:
                return f"{size} bytes, shorter than its header"
            header = json.loads(source.read(length).decode("utf-8"))
    except OSError as exc:
        return exc.strerror or str(exc)
    except (ValueError, RecursionError):
        return "its header is not JSON"
    ends = [e["data_offsets"][1] for k, e in header.items() if k != "__metadata__"
            and isinstance(e, dict) and isinstance(e.get("data_offsets"), list)
            and len(e["data_offsets"]) == 2 and isinstance(e["data_offsets"][1], int)]
    wanted = 8 + length + max(ends, default=0)
    if size < wanted:
        return f"{size} of the {wanted} bytes its header describes"
    return None


def unknown_model(model: str | os.PathLike[str], cache_dir: object,
                  error: HubDownloadError) -> CodeferryError:
    """A failed download of a name that is no folder here and no repo in the hub cache: most
    likely a typo or a missing local folder, said so (with folders here of a close name)
    rather than as a connection problem. A repo id the cache holds keeps ``error``."""
    name = str(model)
    try:
        from huggingface_hub import scan_cache_dir

        cached = {repo.repo_id for repo in scan_cache_dir(cache_dir).repos}  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - no cache, or one it cannot read: nothing cached
        cached = set()
    if name in cached:
        return error
    here = [p.name for p in Path.cwd().iterdir() if p.is_dir()] if Path.cwd().is_dir() else []
    near = difflib.get_close_matches(Path(name).name, sorted(set(here) | cached), n=1,
                                     cutoff=0.75)
    hint = f" (did you mean {'./' if near and near[0] in here else ''}{near[0]}?)" if near else ""
    return ModelNotFoundError(
        f"{name!r} is neither a folder here nor a repo in the Hugging Face cache{hint}, and "
        "the Hub could not be reached to look it up.", path=name,
        fix="check the name: a local folder needs its path (./folder); a Hub repo id "
        "(org/name) is downloaded once the Hub can be reached.")
