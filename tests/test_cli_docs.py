"""docs/CLI.md is what ``python -m tools.cli_docs`` makes of the real parsers, and names every flag of every
command: the parsers are walked here on their own, not through the generator's walk."""

from __future__ import annotations

import argparse
import re

import pytest

from hsstore.app.cli import build_parser
from tools import cli_docs


def sections(text: str) -> dict[str, str]:
    """Command name -> its section of docs/CLI.md."""
    parts = re.split(r"^## `hsstore ([\w-]+)`$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def every_command(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command path, parser) of every sub-command at any depth."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield path + (name,), sub
                yield from every_command(sub, path + (name,))


def test_cli_md_is_current():
    on_disk = cli_docs.CLI_MD.read_text() if cli_docs.CLI_MD.exists() else ""
    if on_disk != cli_docs.render():
        pytest.fail("docs/CLI.md is stale: run python -m tools.cli_docs", pytrace=False)


def test_every_flag_of_every_command_is_named_in_its_section():
    text = cli_docs.CLI_MD.read_text()
    found = sections(text)
    commands = list(every_command(build_parser()))
    assert len(commands) >= 20
    for path, parser in commands:
        name = " ".join(path)
        assert name in found, f"docs/CLI.md has no section for hsstore {name}"
        for action in parser._actions:
            for flag in action.option_strings:
                if flag in ("-h", "--help"):
                    continue
                assert re.search(rf"`{re.escape(flag)}[` ]", found[name]), f"hsstore {name}: {flag} not in docs/CLI.md"
            if not action.option_strings and not isinstance(action, argparse._SubParsersAction):
                assert f"`{action.metavar or action.dest}`" in found[name], f"hsstore {name}: {action.dest} missing"


def test_a_flag_shows_its_help_default_choices_and_group():
    parser = argparse.ArgumentParser(prog="hsstore")
    sub = parser.add_subparsers(dest="command")
    q = sub.add_parser("probe", help="a probe command", description="What the probe does, at length.")
    group = q.add_argument_group("tuning")
    group.add_argument("--mode", choices=("fast", "safe"), default="safe", help="how it runs (%(choices)s)")
    text = cli_docs.render(parser)
    probe = sections(text)["probe"]
    assert "a probe command" in probe and "What the probe does, at length." in probe
    line = next(x for x in probe.splitlines() if "--mode" in x)
    assert "how it runs (fast, safe)" in line and "Default: `safe`" in line and "Choices: `fast`, `safe`" in line
    assert probe.index("**tuning**") < probe.index("--mode")
    assert "[`probe`](#hsstore-probe)" in text


def test_check_fails_on_a_stale_file_and_passes_on_a_fresh_one(tmp_path, monkeypatch, capsys):
    target = tmp_path / "CLI.md"
    monkeypatch.setattr(cli_docs, "CLI_MD", target)
    target.write_text("old\n")
    assert cli_docs.main(["--check"]) == 1
    assert "docs/CLI.md is stale: run python -m tools.cli_docs" in capsys.readouterr().err
    assert target.read_text() == "old\n"
    assert cli_docs.main([]) == 0
    assert cli_docs.main(["--check"]) == 0
