"""Write docs/CLI.md, the command reference, from the real argparse parsers (``hsstore.app.cli.build_parser``, with
the commands extract and train register into it) and the table of environment variables (``hsstore.env``), so
the reference cannot drift from ``--help`` nor from what the code reads.

The text is formatted here, not by argparse's help formatter, so it does not depend on the terminal's width:
the same parsers give the same file on every machine. ``tests/test_cli_docs.py`` fails when the file is stale.

    python -m tools.cli_docs            # rewrite docs/CLI.md
    python -m tools.cli_docs --check    # exit 1 when docs/CLI.md differs from what the parsers give
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hsstore import env
from hsstore.app.cli import build_parser

CLI_MD = Path(__file__).resolve().parents[1] / "docs" / "CLI.md"
HEADER = """# Command reference

Every `hsstore` command with every flag, in the groups `hsstore COMMAND --help` shows them. Generated from the
parsers by `python -m tools.cli_docs`; do not edit by hand (`tests/test_cli_docs.py` fails when it is stale).
In a `--config FILE.yaml` (train, extract) the groups are the sections (`gate_thresholds`, `drafter_shape`, ...;
ungrouped flags under `options`) and the keys are the flags' names with `_` for `-`.
"""


def subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line help, parser) of each sub-command, in the order ``--help`` lists them."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            listed = [a.dest for a in action._choices_actions]
            rest = [n for n in action.choices if n not in listed]
            return [(n, helps.get(n, ""), action.choices[n]) for n in listed + rest]
    return []


def expanded_help(action: argparse.Action, prog: str) -> str:
    """The flag's help with argparse's ``%(default)s``-style fields filled in, as ``--help`` shows it."""
    text = action.help or ""
    if "%" not in text:
        return text
    params = {k: v for k, v in vars(action).items() if v is not argparse.SUPPRESS}
    params["prog"] = prog
    if params.get("choices") is not None:
        params["choices"] = ", ".join(str(c) for c in params["choices"])
    return text % params


def flag_names(action: argparse.Action) -> str:
    """``--flag METAVAR, -f METAVAR`` as the usage line spells it (a positional: its name)."""
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    if action.nargs == 0:
        return ", ".join(f"`{s}`" for s in action.option_strings)
    metavar = action.metavar or (action.dest.upper() if action.choices is None else "{" + ",".join(
        str(c) for c in action.choices) + "}")
    if isinstance(metavar, tuple):
        metavar = " ".join(metavar)
    return ", ".join(f"`{s} {metavar}`" for s in action.option_strings)


def describe_action(action: argparse.Action, prog: str) -> str:
    """One bullet: the flag, its help, its default and its choices."""
    text = " ".join(expanded_help(action, prog).split())
    parts = [text + ("." if text and text[-1] not in ".)!?:" else "")]
    default = action.default
    if action.option_strings and default not in (None, False, [], "", argparse.SUPPRESS) and action.nargs != 0:
        parts.append(f"Default: `{default}`.")
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        parts.append("Choices: " + ", ".join(f"`{c}`" for c in action.choices) + ".")
    return f"- {flag_names(action)}: " + " ".join(p for p in parts if p)


def command_section(name: str, summary: str, parser: argparse.ArgumentParser) -> list[str]:
    """The Markdown of one command: its summary, description and each ``--help`` group's flags."""
    lines = [f"## `hsstore {name}`", "", summary.strip()]
    if parser.description and parser.description.strip() != summary.strip():
        lines += ["", " ".join(parser.description.split())]
    hidden = []
    for group in parser._action_groups:
        shown = [a for a in group._group_actions if not isinstance(a, argparse._HelpAction)]
        hidden += [a for a in shown if a.help == argparse.SUPPRESS]
        shown = [a for a in shown if a.help != argparse.SUPPRESS]
        if not shown:
            continue
        lines += ["", f"**{group.title}**", ""]
        lines += [describe_action(a, parser.prog) for a in shown]
    if hidden:
        names = ", ".join(f"`{s}`" + (f" (now `{a.new}`)" if getattr(a, "new", None) else "")
                          for a in hidden for s in a.option_strings)
        lines += ["", f"Not listed by `--help`, still accepted (old spellings; a warning names the new one): {names}."]
    return lines + [""]


def cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "/")


def environment_section() -> list[str]:
    """The Markdown of every environment variable hsstore reads: its own switches (``env.SWITCHES``), those it
    warns about as removed (``env.REMOVED``) and other programs' variables it reads on purpose (``env.OTHERS``)."""
    lines = ["## Environment variables", "",
             "Every `HSSTORE_*` variable hsstore reads, read in one module (`hsstore/env.py`). An unset or empty "
             "variable is its default; a value that does not parse is one line naming the variable (exit 2); a set "
             "`HSSTORE_*` name hsstore does not read is warned about. For: `user`, someone running hsstore; "
             "`tuning`, a deployment whose network or stores differ from the defaults' assumptions; `benchmark`, "
             "a paired measurement or a diagnosis; `test`, the test suite.", "",
             "| Variable | Takes | Default | For | What it does |", "|---|---|---|---|---|"]
    lines += [f"| `{s.name}` | {cell(s.type_text())} | {cell(s.default_text())} | {s.audience} | {cell(s.meaning)} |"
              for s in env.SWITCHES.values()]
    lines += ["", "Removed (a warning names them when set): "
              + "; ".join(f"`{name}` ({cell(why)})" for name, why in env.REMOVED.items()) + ".", "",
              "Other programs' variables hsstore reads on purpose:", "",
              "| Variable | Read in | Why |", "|---|---|---|"]
    lines += [f"| {cell(o.name)} | {cell(o.where)} | {cell(o.meaning)} |" for o in env.OTHERS]
    return lines + [""]


def render(parser: argparse.ArgumentParser | None = None) -> str:
    """The whole of docs/CLI.md for ``parser`` (default: ``hsstore``'s)."""
    parser = parser or build_parser()
    commands = subcommands(parser)
    lines = [HEADER, "| Command | What it does |", "|---|---|"]
    lines += [f"| [`{n}`](#hsstore-{n}) | {s.replace('|', '/')} |" for n, s, _ in commands]
    lines += ["", "Environment variables: [the table](#environment-variables) at the end."]
    lines += ["", "Global options (before the command): "
              + "; ".join(describe_action(a, parser.prog)[2:] for a in parser._actions
                          if a.option_strings and not isinstance(a, argparse._HelpAction)), ""]
    for name, summary, sub in commands:
        lines += command_section(name, summary, sub)
    lines += environment_section()
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.cli_docs", description=__doc__.split("\n\n")[0],
                                 allow_abbrev=False)
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/CLI.md is stale, writing nothing")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if not CLI_MD.exists() or CLI_MD.read_text() != text:
            print("docs/CLI.md is stale: run python -m tools.cli_docs", file=sys.stderr)
            return 1
        return 0
    CLI_MD.write_text(text)
    print(f"wrote {CLI_MD}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
