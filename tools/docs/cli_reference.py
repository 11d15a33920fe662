"""Write docs/cli.md, the command-line reference, from codeferry's argparse parser.

    python tools/docs/cli_reference.py           # check: exit 1 (and say how to fix) when stale
    python tools/docs/cli_reference.py --write   # regenerate docs/cli.md

The page is made from the parser alone (``codeferry.cli``'s parser-building function), so
it says what ``codeferry COMMAND --help`` says, each argument once: the options every model
command takes stand as ``[model options]`` in the usage lines and have one table at the end,
and an argument several commands share with the same help has one row in the shared table.
Usage lines are wrapped at a fixed width and the program is always ``codeferry``, so the
page is the same on every machine.
``tests/house/test_cli_doc.py`` and ``tools/docs/check.py`` fail while the page is stale.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parents[2] / "docs" / "cli.md"  # from tools/docs/
WIDTH = 100
REGENERATE = "python tools/docs/cli_reference.py --write"


def build_parser() -> argparse.ArgumentParser:
    """The parser ``codeferry`` runs with: ``codeferry.cli.parser()`` or ``_parser()`` (a
    parser object of either name is taken as it is)."""
    cli = importlib.import_module("codeferry.cli")
    for name in ("parser", "_parser", "build_parser"):
        found = getattr(cli, name, None)
        if isinstance(found, argparse.ArgumentParser):
            return found
        if callable(found):
            parser = found()
            if isinstance(parser, argparse.ArgumentParser):
                return parser
    raise SystemExit("codeferry.cli has no parser(), _parser() or build_parser() returning an "
                     "argparse.ArgumentParser: update build_parser() in tools/docs/cli_reference.py")


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """``(name, one-line help, parser)`` of each subcommand, in the parser's order."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, sub in action.choices.items():
                found.append((name, helps.get(name, ""), sub))
    return found


MODEL_OPTIONS = "[model options]"


def _usage(parser: argparse.ArgumentParser, common_keys: set[tuple[str, str]] = frozenset()) -> str:
    """The usage line, the options of every model command as one ``[model options]``."""
    actions = [a for a in parser._actions if _key(a) not in common_keys]
    if len(actions) < len(parser._actions):
        actions.append(argparse.Action([MODEL_OPTIONS], dest="model_options", nargs=0))
    formatter = argparse.HelpFormatter(parser.prog, width=WIDTH)
    formatter.add_usage(parser.usage, actions, parser._mutually_exclusive_groups)
    return formatter.format_help().strip().replace(f"[{MODEL_OPTIONS}]", MODEL_OPTIONS)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _help(action: argparse.Action) -> str:
    text = action.help or ""
    if "%" in text:
        values = dict(vars(action), prog="codeferry")
        for name in list(values):
            if hasattr(values[name], "__name__"):
                values[name] = values[name].__name__
        text = text % values
    default = action.default
    if (action.option_strings and default not in (None, False, [], argparse.SUPPRESS)
            and "default" not in text and action.nargs != 0):
        text += f" (default: `{default}`)"
    if action.required and action.option_strings:
        text = "required; " + text
    return _cell(text)


def _name(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{(action.metavar or action.dest).upper() if action.metavar is None else action.metavar}`"
    if action.nargs == 0:
        return ", ".join(f"`{o}`" for o in action.option_strings)
    metavar = action.metavar or (
        "{" + ",".join(map(str, action.choices)) + "}" if action.choices else action.dest.upper())
    return ", ".join(f"`{o} {metavar}`" for o in action.option_strings)


def _key(action: argparse.Action) -> tuple[str, str]:
    return (" ".join(action.option_strings) or action.dest, _help(action))


def _shown(action: argparse.Action) -> bool:
    return (action.help is not argparse.SUPPRESS and not isinstance(action, argparse._HelpAction)
            and not isinstance(action, argparse._SubParsersAction))


def _table(actions: list[argparse.Action]) -> list[str]:
    lines = ["| argument | what |", "|---|---|"]
    lines += [f"| {_name(a)} | {_help(a)} |" for a in actions]
    return lines


def _common(commands: list[tuple[str, str, argparse.ArgumentParser]]) -> list[argparse.Action]:
    """The options every command that takes a MODEL has, with the same help."""
    with_model = [sub for _, _, sub in commands
                  if any(not a.option_strings and a.dest == "model" for a in sub._actions)]
    if len(with_model) < 2:
        return []
    shared = [a for a in with_model[0]._actions if a.option_strings and _shown(a)]
    keys = set.intersection(*({_key(a) for a in sub._actions} for sub in with_model[1:]))
    return [a for a in shared if _key(a) in keys]


def _shared(commands: list[tuple[str, str, argparse.ArgumentParser]],
            common_keys: set[tuple[str, str]]) -> dict[tuple[str, str], tuple[argparse.Action, list[str]]]:
    """The arguments (not of every model command) that two or more commands take with the same
    help: each with the commands that take it, in the parser's order."""
    seen: dict[tuple[str, str], tuple[argparse.Action, list[str]]] = {}
    for name, _, sub in commands:
        for action in sub._actions:
            if _shown(action) and _key(action) not in common_keys:
                seen.setdefault(_key(action), (action, []))[1].append(name)
    return {key: found for key, found in seen.items() if len(found[1]) > 1}


def render() -> str:
    parser = build_parser()
    commands = _subcommands(parser)
    common = _common(commands)
    common_keys = {_key(a) for a in common}
    shared = _shared(commands, common_keys)
    out = [
        "# Command-line reference",
        "",
        "<!-- Generated from codeferry's argparse parser by tools/docs/cli_reference.py; do not edit.",
        f"     Regenerate: {REGENERATE} -->",
        "",
        "Every command and option, as `codeferry COMMAND --help` prints them (every command"
        " also takes `-h`, `--help`), each once: an argument several commands share is in"
        " [Shared arguments](#shared-arguments), and `[model options]` in a usage line stands"
        " for the [options of every model command](#options-of-every-model-command).",
        "",
        "```text",
        _usage(parser),
        "```",
        "",
    ]
    if parser.description:
        out += [_cell(parser.description), ""]
    out += [*_table([a for a in parser._actions if _shown(a)]), ""]
    out += ["| command | what |", "|---|---|"]
    out += [f"| [`{name}`](#codeferry-{name}) | {_cell(summary)} |" for name, summary, _ in commands]
    out.append("")
    for name, _summary, sub in commands:
        # the summary is in the table of commands above
        out += [f"## codeferry {name}", "", "```text", _usage(sub, common_keys), "```", ""]
        if sub.description:
            out += [_cell(sub.description), ""]
        # argparse's own two groups make one table; a titled group of the command, its own
        untitled = ("positional arguments", "options", "optional arguments")
        groups = [[a for g in sub._action_groups if g.title in untitled for a in g._group_actions]]
        groups += [g for g in sub._action_groups if g.title not in untitled]
        for group in groups:
            members = group if isinstance(group, list) else group._group_actions
            actions = [a for a in members if _shown(a) and _key(a) not in common_keys
                       and _key(a) not in shared]
            if not actions:
                continue
            if not isinstance(group, list):
                out += [f"{group.title[0].upper()}{group.title[1:]}:", ""]
            out += [*_table(actions), ""]
        also = [f"`{a.option_strings[0] if a.option_strings else a.dest.upper()}`"
                for a in sub._actions if _key(a) in shared]
        more = (["[shared](#shared-arguments) " + ", ".join(also)] if also else []) + (
            ["the [model options](#options-of-every-model-command)"]
            if any(_key(a) in common_keys for a in sub._actions) else [])
        if more:
            out += ["Also: " + "; ".join(more) + ".", ""]
    if shared:
        out += ["## Shared arguments", "", "| argument | commands | what |", "|---|---|---|"]
        out += [f"| {_name(a)} | {', '.join(f'`{n}`' for n in names)} | {_help(a)} |"
                for a, names in shared.values()]
        out.append("")
    if common:
        out += ["## Options of every model command", "",
                "Every command that takes a MODEL (" + ", ".join(
                    f"`{name}`" for name, _, sub in commands
                    if any(_key(a) in common_keys for a in sub._actions)) + ") takes these:", ""]
        out += [*_table(common), ""]
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    args = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    args.add_argument("--write", action="store_true", help="regenerate docs/cli.md")
    options = args.parse_args(argv)
    text = render()
    if options.write:
        PAGE.write_text(text, encoding="utf-8")
        print(f"wrote {PAGE}")
        return 0
    if not PAGE.is_file() or PAGE.read_text(encoding="utf-8") != text:
        print(f"docs/cli.md differs from the command-line parser; regenerate it: {REGENERATE}",
              file=sys.stderr)
        return 1
    print("docs/cli.md matches the parser")
    return 0


if __name__ == "__main__":
    sys.exit(main())
