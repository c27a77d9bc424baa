"""hsstore.app.schema: flags, config sections and resume keys generated from one grouped dataclass schema."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass

import pytest
import yaml

from hsstore.app import config
from hsstore.app.schema import (add_arguments, build, flat, from_args, option, replace, resume_keys, section,
                            settings_of)


@dataclass
class Run:
    store: list[str] = option(None, required=True, metavar="URL", was="stores", help="store URL (repeatable)")
    steps: int | None = option(None, exclusive="length", help="optimizer steps")
    epochs: int | None = option(None, exclusive="length", help="passes")
    resume: bool = option(True, old_negated="--fresh", help="go on (--no-resume: start over)")


@dataclass
class Shape:
    token_budget: int | None = option(None, old="--max-tokens", resume=True, help="padded tokens per batch")
    window: int | None = option(2048, convert=lambda v: v or None, resume=True, help="0: full attention")
    attn: str = option("auto", choices=["auto", "sdpa"], help="kernel")
    lr: float = option(6e-4, help="peak learning rate")
    fast: bool = option(False, help="go fast")


@dataclass
class Settings:
    run: Run = section(Run, "run")
    shape: Shape = section(Shape, "drafter shape (the published rule)")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="t")
    add_arguments(p, Settings)
    config.add_config_option(p)
    return p


def test_defaults_flags_and_conversion():
    cfg = from_args(Settings, parser().parse_args(["--store", "a", "--store", "b", "--window", "0", "--fast",
                                                    "--no-resume", "--lr", "1e-3"]))
    assert cfg.run.store == ["a", "b"] and cfg.run.resume is False and cfg.run.steps is None
    assert cfg.shape.window is None and cfg.shape.fast is True and cfg.shape.lr == 1e-3
    assert cfg.shape.attn == "auto" and cfg.shape.token_budget is None
    assert flat(cfg)["window"] is None and list(flat(cfg))[:2] == ["store", "steps"]
    assert resume_keys(Settings) == ("token_budget", "window")


def test_help_groups_choices_and_refusals(capsys):
    p = parser()
    titles = [g.title for g in p._action_groups]
    assert "run" in titles and "drafter shape (the published rule)" in titles
    with pytest.raises(SystemExit):
        p.parse_args(["--store", "a", "--steps", "2", "--epochs", "3"])
    assert "argument --epochs: not allowed with argument --steps" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        p.parse_args(["--store", "a", "--attn", "flex"])
    assert "invalid choice: 'flex'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        p.parse_args([])
    assert "the following arguments are required: --store" in capsys.readouterr().err
    help_text = p.format_help()
    assert "--token-budget" in help_text and "--max-tokens" not in help_text  # old spelling hidden


def test_old_spelling_stores_into_the_new_dest(caplog):
    with caplog.at_level(logging.WARNING):
        args = parser().parse_args(["--store", "a", "--max-tokens", "77"])
    assert from_args(Settings, args).shape.token_budget == 77
    assert "--max-tokens is deprecated, use --token-budget" in caplog.text


def test_config_file_sections_come_from_the_schema(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"run": {"store": ["s3://b/x"], "steps": 5},
                                 "drafter_shape": {"token_budget": 123, "attn": "sdpa"}}))
    p = parser()
    known = config.sections(p)
    assert set(known["drafter_shape"]) == {"token_budget", "window", "attn", "lr", "fast"}
    assert set(known["run"]) == {"store", "steps", "epochs", "resume"}
    values = config.load(f, p)
    assert values == {"store": ["s3://b/x"], "steps": 5, "token_budget": 123, "attn": "sdpa"}


def test_overrides_and_bad_schemas():
    cfg = from_args(Settings, parser().parse_args(["--store", "a"]), lr=0.5)
    assert cfg.shape.lr == 0.5
    with pytest.raises(TypeError, match="no settings named"):
        from_args(Settings, parser().parse_args(["--store", "a"]), nope=1)

    @dataclass
    class Twice:
        a: Run = section(Run, "a")
        b: Run = section(Run, "b")

    with pytest.raises(TypeError, match="is used by"):
        settings_of(Twice)



@dataclass
class Out:
    cache: bool = option(True, old_negated="--no-cache-at-all", help="cache (--no-cache: none)")
    steps: int = option(3, help="steps")


@dataclass
class Negated:
    out: Out = section(Out, "output")


def test_a_true_default_is_a_flag_pair_and_an_old_negated_flag_warns(tmp_path, caplog):
    """A bool defaulting to True is ``--cache/--no-cache`` with key ``cache``; an old flag that meant its opposite
    stores False and says the new spelling, and its config key is read inverted; ``build`` by field name gives the
    schema's defaults for the rest."""
    p = argparse.ArgumentParser(prog="t")
    config.add_config_option(p)
    groups = add_arguments(p, Negated)
    assert set(groups) == {"out"} and groups["out"].title == "output"
    assert from_args(Negated, p.parse_args([])).out.cache is True
    args = p.parse_args(["--no-cache"])
    assert args.cache is False and from_args(Negated, args).out.cache is False
    with caplog.at_level(logging.WARNING):
        assert p.parse_args(["--no-cache-at-all"]).cache is False
    assert "--no-cache-at-all is deprecated, use --no-cache" in caplog.text
    f = tmp_path / "c.yaml"
    f.write_text("output: {no_cache_at_all: true}\n")
    assert config.load(f, p) == {"cache": False}
    assert build(Negated) == build(Negated, cache=True, steps=3) == from_args(Negated, p.parse_args([]))
    assert flat(from_args(Negated, args)) == {"cache": False, "steps": 3}


def test_an_old_field_name_still_builds_and_warns():
    with pytest.warns(DeprecationWarning, match="stores is now store"):
        assert build(Settings, stores=["a"]).run.store == ["a"]
    with pytest.raises(TypeError, match="the same setting"), pytest.warns(DeprecationWarning):
        build(Settings, stores=["a"], store=["b"])


@dataclass
class Taps:
    layers: list[int] | None = option(None, type=str, convert=lambda v: [int(x) for x in v.split(",")] if v else None,
                                      help="ids, e.g. 1,3")
    compile: bool | None = option(None, help="compile (unset: decided later)")


@dataclass
class Limits:
    small: int = option(32, help="a limit")


@dataclass
class Grouped:
    taps: Taps = section(Taps, "capture", about="what the forward keeps")
    limits: Limits = section(Limits, "limits")


def test_flag_type_tristate_bool_group_description_and_whole_sections():
    p = argparse.ArgumentParser(prog="t")
    add_arguments(p, Grouped)
    group = next(g for g in p._action_groups if g.title == "capture")
    assert group.description == "what the forward keeps"
    args = p.parse_args(["--layers", "1,16,31", "--no-compile"])
    assert args.layers == "1,16,31"  # the flag reads a string; the setting is the list
    cfg = from_args(Grouped, args)
    assert cfg.taps.layers == [1, 16, 31] and cfg.taps.compile is False
    unset = from_args(Grouped, p.parse_args([]))
    assert unset.taps.layers is None and unset.taps.compile is None
    assert from_args(Grouped, p.parse_args(["--compile"])).taps.compile is True

    # a whole section by its name; replace changes settings by name, each in its section
    whole = build(Grouped, layers=[1], limits=Limits(small=1))
    assert whole.limits.small == 1 and whole.taps.layers == [1]
    changed = replace(cfg, small=5, compile=True)
    assert changed.limits == Limits(small=5) and changed.taps.compile is True and cfg.limits.small == 32
    with pytest.raises(TypeError, match="no settings named"):
        replace(cfg, smal=5)
