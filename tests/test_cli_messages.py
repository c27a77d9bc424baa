"""Errors that say where (#38): a bad flag is named with what is wrong with it, before anything is loaded; a
mistyped path is told apart from a folder that is not a store."""

from __future__ import annotations

import json
import shutil

import pytest

from hsstore.cli import main


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def config_only(tiny_dir, tmp_path):
    """The tiny target's folder with its config.json and nothing else: a command that reaches the tokenizer,
    the input or the weights fails on their absence, so only one that checks the flags first says the flag."""
    d = tmp_path / "config-only"
    d.mkdir()
    shutil.copy(tiny_dir / "config.json", d / "config.json")
    return d


@pytest.mark.parametrize("command", ["extract", "check"])
def test_layers_that_are_not_numbers_name_the_flag(capsys, config_only, tmp_path, command):
    extra = ["--out", str(tmp_path / "s")] if command == "extract" else []
    code, _, err = run(capsys, command, "--model", str(config_only), "--input", str(tmp_path / "none.jsonl"),
                       "--layers", "1,two", *extra)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--layers '1,two': 'two' is not a layer id" in err, err


@pytest.mark.parametrize("command", ["extract", "check"])
def test_layers_out_of_range_refused_before_anything_loads(capsys, config_only, tmp_path, command):
    """`--layers 1,99` on an 8-layer target: refused from config.json alone (no tokenizer, input or weights
    there to load), where it used to be refused after the gate and the model load."""
    extra = ["--out", str(tmp_path / "s")] if command == "extract" else []
    code, _, err = run(capsys, command, "--model", str(config_only), "--input", str(tmp_path / "none.jsonl"),
                       "--layers", "1,99", *extra)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--layers 1,99: layer ids [99] out of range: the target has 8 decoder layers" in err, err
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("command", ["info", "verify", "index", "report"])
def test_a_mistyped_store_path_says_it_does_not_exist(capsys, tmp_path, command):
    from conftest import make_manifest, make_samples, write_samples

    store = tmp_path / "stores" / "run1"
    write_samples(str(store), make_manifest(), make_samples(2))
    extra = ["--out", str(tmp_path / "r.html")] if command == "report" else []
    code, _, err = run(capsys, command, str(tmp_path / "stores" / "rnu1"), *extra)
    assert code == 2
    assert "does not exist" in err and f"the nearest folder that exists is {tmp_path / 'stores'}" in err, err
    assert "manifest.json" not in err
    (tmp_path / "plain").mkdir()  # a folder that exists and is not a store still says so
    code, _, err = run(capsys, command, str(tmp_path / "plain"), *extra)
    assert code == 2 and "is not an hsstore store: no manifest.json there" in err


def test_show_of_a_path_that_does_not_exist(capsys, tmp_path):
    code, _, err = run(capsys, "show", str(tmp_path / "nowhere.jsonl"), "0")
    assert code == 2 and "does not exist (neither a store nor an input file)" in err, err
