"""What ``codeferry run`` checks before any worker starts, each failure one line with its fix.

The command line's flags (``checked_flags``, ``paths``: a usage error, exit 2), the chat
template chat inputs need (``check_chat_template``), and the lines answered by their error
without running (``refused``: a field not honoured, another model's name, a prompt over the
context). A worker that started and failed on any of these would say so only after its
start-up, under a traceback.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path

from .._exec.files import may_have_chat_template
from .._exec.generate.params import SamplingParams
from ..errors import ChatTemplateMissingError, CodeferryError, SamplingParamsError
from .command import UsageError, demo
from .drain import over_context
from .fields import same_model
from .flags import sampling_params
from .inputs import Id, InputItem, Task
from .keywords import too_small

__all__ = ["check_chat_template", "checked_flags", "paths", "read_template", "refused"]


def check_chat_template(root: Path, items: Sequence[InputItem], template: str | None,
                        path: str | os.PathLike[str]) -> None:
    """Chat inputs need a chat template: the model's, or ``--chat-template``'s."""
    if template is None and any(i.request and i.request.messages for i in items) \
            and not may_have_chat_template(root):
        raise ChatTemplateMissingError(
            f"the input has chat messages, and the model's tokenizer has no chat template "
            f"(no chat_template.jinja, nor a chat_template in tokenizer_config.json in "
            f"{root}).", path=str(path),
            fix="pass --chat-template FILE (a Jinja template), or send prompts instead.")


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


def refused(model: str | os.PathLike[str], served: str, items: Sequence[InputItem],
            path: str | os.PathLike[str], defaults: SamplingParams, context: int | None,
            task: Task) -> dict[Id, CodeferryError]:
    """The lines answered by their error, never run: a field not honoured, a content part
    that is not text (``InputItem.refused``), a ``model`` other than the one run (``model``
    as given, its last part, or ``served``, the weights' name), a prompt over the context
    (``over_context``)."""
    names = {str(model), str(model).rstrip("/"), Path(model).name, served}
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
                      max_new_tokens=args.max_new_tokens, max_model_len=args.max_model_len)
    if small is not None:
        raise UsageError(f"--{small[0].replace('_', '-')} must be at least 1, got {small[1]}")
    if args.batch_timeout is not None and not args.batch_timeout > 0:
        raise UsageError(f"--batch-timeout must be more than 0 seconds, got {args.batch_timeout}")
    return params


def paths(args: argparse.Namespace) -> tuple[Path, str]:
    """``--input`` (the demo's prompts without a MODEL) and ``--output`` (``-``: stdout),
    checked: an output that is a folder, or the input itself, is refused."""
    if args.input is None and args.model is not None:
        raise UsageError("--input FILE is required with a MODEL (without MODEL, the bundled "
                         "demo runs on its own prompts)")
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
