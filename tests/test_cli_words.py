"""Every command takes ``-q/--quiet`` and its usage is what a word it does not take gets: a mistyped or unknown
flag (long or short) or an argument too many is one line naming the command, the near flag and the command's own
usage, never the top-level usage with "unrecognized arguments"."""

from __future__ import annotations

import argparse

import pytest

from hsstore.app.cli import build_parser, main


def _commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


@pytest.mark.parametrize("name", sorted(_commands()))
def test_every_command_takes_quiet(name):
    flags = {o for a in _commands()[name]._actions for o in a.option_strings}
    assert {"-q", "--quiet"} <= flags, name


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("argv,command,what,usage", [
    (["info", "STORE", "-x"], "info", "unknown flag -x", "usage: hsstore info [options] URL"),
    (["info", "STORE", "extra"], "info", "unexpected argument 'extra'", "usage: hsstore info [options] URL"),
    (["train", "--store", "s", "--out", "o", "-x"], "train", "unknown flag -x",
     "usage: hsstore train --store URL --out OUT [options]"),
    (["subset", "a", "b", "c"], "subset", "unexpected argument 'c'", "usage: hsstore subset [options] SRC DST"),
    (["export-drafter", "ckpt", "out", "--bset"], "export-drafter", "unknown flag --bset (did you mean --best?)",
     "usage: hsstore export-drafter [options] CKPT OUT"),
    (["verify", "STORE", "--jsno"], "verify", "unknown flag --jsno (did you mean --json?)", "hsstore verify"),
    (["train", "--store", "s"], "train", "the following arguments are required: --out",
     "usage: hsstore train --store URL --out OUT [options]"),
])
def test_a_word_a_command_does_not_take_is_one_line_with_its_usage(capsys, argv, command, what, usage):
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own refusals (a required flag missing) exit from the parser
        rc = e.code
    assert rc == 2
    line = one_line(capsys)
    assert line.startswith(f"hsstore {command}: error: {what}"), line
    assert usage in line and f"`hsstore {command} --help` lists the flags" in line, line
    assert "unrecognized arguments" not in line


def test_quiet_is_taken_where_it_was_refused(tmp_path, new_manifest, new_samples, write, capsys):
    """`info STORE -q` (and show, report, index) printed the top-level usage; now they run."""
    url = str(tmp_path / "s")
    write(url, new_manifest(), new_samples(3))
    assert main(["info", url, "-q"]) == 0
    assert main(["index", url, "-q"]) == 0
    assert main(["report", url, "--out", str(tmp_path / "r.html"), "-q"]) == 0
    assert "error" not in capsys.readouterr().err
