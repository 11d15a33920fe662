"""The groups of flags that several commands share, each added by one function.

Every command with a MODEL takes ``add_common_flags`` (where the model is, last in its
``--help``); a command that runs the model's code takes ``add_trust_flags``, one that
starts workers ``add_worker_flags``. ``codeferry run``'s sampling flags
(``add_sampling_flags``) are the defaults of every input that sets none: one flag per
``SamplingParams`` field, named as vLLM's (``--temperature``, ``--top-p``...);
``--max-new-tokens`` (also ``--max-tokens``) is ``max_tokens``.
"""

from __future__ import annotations

import argparse
from typing import Any

from .._exec.generate.params import SamplingParams

__all__ = ["MODEL_HELP", "add_common_flags", "add_sampling_flags", "add_trust_flags",
           "add_worker_flags", "sampling_params"]

#: Every subcommand's MODEL: optional, the bundled demo when omitted (one rule for all).
MODEL_HELP = ("a model folder, or a repo id of the Hugging Face Hub, downloaded unless "
              "cached or HF_HUB_OFFLINE=1 (default: the bundled demo model")


def add_trust_flags(command: argparse.ArgumentParser | argparse._MutuallyExclusiveGroup) -> None:
    """What the trust decision is made from, for a command that runs the model's code."""
    command.add_argument("--trust-remote-code", action="store_true",
                         help="allow the model's code to run here and in the workers")
    command.add_argument("--lock", metavar="FILE",
                         help="allow exactly the code this lock file lists")


def add_worker_flags(command: argparse.ArgumentParser, *, workers: int | None = None,
                     workers_help: str | None = None) -> None:
    """How many workers, started how, where: for a command that starts workers."""
    command.add_argument("--workers", type=int, default=workers, metavar="N", help=workers_help)
    command.add_argument("--start-method", choices=["spawn", "forkserver", "fork"],
                         default="spawn")
    command.add_argument("--backend", choices=["local", "ray"], default="local",
                         help="local worker processes, or Ray actors across a cluster "
                         "(needs `pip install 'codeferry[ray]'`)")
    command.add_argument("--address", metavar="ADDR",
                         help="the Ray cluster (--backend ray; default: RAY_ADDRESS, else a "
                         "local cluster)")


def add_sandbox_flag(command: argparse.ArgumentParser) -> None:
    """``--sandbox``: the command's workers run in the box (unset: ``CODEFERRY_SANDBOX``)."""
    command.add_argument("--sandbox", action="store_const", const=True, default=None,
                         help="run every worker in the box: no home, no network, no "
                         "credentials, no other programs (docs/security.md; default: "
                         "$CODEFERRY_SANDBOX)")


def add_common_flags(command: argparse.ArgumentParser) -> None:
    """Options every subcommand with a MODEL takes, after its own (last in its ``--help``).
    ``--debug`` is also accepted before the command."""
    command.add_argument("--revision", help="branch, tag or commit of a repo (default: main)")
    command.add_argument("--code-revision", metavar="REVISION",
                         help="the revision whose code runs, as transformers' code_revision: "
                         "config and weights still come from --revision (default: --revision)")
    command.add_argument("--cache-dir", metavar="DIR",
                         help="the Hugging Face hub cache that holds MODEL (default: $HF_HUB_CACHE, "
                         "else $HF_HOME/hub, else $XDG_CACHE_HOME or ~/.cache, /huggingface/hub)")
    command.add_argument("--token", metavar="TOKEN",
                         help="Hugging Face token for a gated or private MODEL (default: $HF_TOKEN, "
                         "else the saved login)")
    command.add_argument("--local-files-only", action="store_true",
                         help="never download: MODEL must be in the hub cache already")
    command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                         help="show tracebacks")

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
