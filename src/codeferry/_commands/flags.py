"""The sampling flags of ``codeferry run``: the defaults of every input that sets none.

One flag per ``SamplingParams`` field, named as vLLM's (``--temperature``, ``--top-p``...);
``--max-new-tokens`` (also ``--max-tokens``) is ``max_tokens``. Kept out of ``cli.py`` so
the command line stays one screen per command.
"""

from __future__ import annotations

import argparse
from typing import Any

from .._exec.generate.params import SamplingParams

__all__ = ["add_sampling_flags", "sampling_params"]

#: flag -> (SamplingParams field, type, help)
_FLAGS: dict[str, tuple[str, Any, str]] = {
    "--temperature": ("temperature", float, "0: greedy; above 0: sample (default: the "
                      "model's generation_config; greedy when it says nothing)"),
    "--top-p": ("top_p", float, "nucleus sampling: keep the most likely tokens up to this mass"),
    "--top-k": ("top_k", int, "sample among the K most likely tokens (0 or -1: all)"),
    "--min-p": ("min_p", float, "drop tokens less likely than this times the most likely"),
    "--seed": ("seed", int, "seed of each sampled input: its text is the same in any batch"),
    "--min-tokens": ("min_tokens", int, "generate at least this many tokens"),
    "--n": ("n", int, "completions per input"),
    "--presence-penalty": ("presence_penalty", float, "OpenAI's, -2 to 2"),
    "--frequency-penalty": ("frequency_penalty", float, "OpenAI's, -2 to 2"),
    "--repetition-penalty": ("repetition_penalty", float, "transformers' (1: off)"),
    "--logprobs": ("logprobs", int, "write each chosen token's logprob and this many "
                   "alternatives (0: the chosen only)"),
}


def add_sampling_flags(command: argparse.ArgumentParser) -> None:
    group = command.add_argument_group(
        "sampling (--task generate; the defaults of inputs that do not set their own)")
    for flag, (dest, kind, text) in _FLAGS.items():
        group.add_argument(flag, dest=dest, type=kind, metavar="X", help=text)
    group.add_argument("--stop", action="append", metavar="TEXT",
                       help="end a completion before this text (repeatable)")
    group.add_argument("--stop-token-id", dest="stop_token_ids", action="append", type=int,
                       metavar="ID", help="end a completion at this token (counted, not shown; repeatable)")
    group.add_argument("--chat-template", metavar="FILE",
                       help="Jinja chat template for inputs with messages (default: the model's)")


def sampling_params(args: argparse.Namespace) -> SamplingParams | None:
    """The flags given, as ``SamplingParams`` (``None``: none given); ``SamplingParamsError``
    names a bad one."""
    values = {dest: getattr(args, dest) for dest, _, _ in _FLAGS.values()}
    values["stop"] = tuple(args.stop) if args.stop else None
    values["stop_token_ids"] = tuple(args.stop_token_ids) if args.stop_token_ids else None
    given = {k: v for k, v in values.items() if v is not None}
    return SamplingParams(**given) if given else None
