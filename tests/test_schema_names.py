"""One name per setting, from flag to field to config key, for every command; no class name meaning two things."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import typing
from pathlib import Path

import pytest

from hsstore.app import config
from hsstore.app.cli import build_parser
from hsstore.app.schema import SCHEMA_KEY, settings_of

ROOT = Path(__file__).resolve().parents[1]
# flags every command family adds by their helpers, outside the schemas (each spelled as its dest too)
SHARED = {"storage_option", "allow_location", "quiet", "json", "shard_mb", "config"}


def commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def names(parser: argparse.ArgumentParser) -> list[tuple[str, str, str, str]]:
    """(field, section.field of the schema, flag, config key) for every setting of a command that has a flag: the
    listing the test below checks (``python tests/test_schema_names.py`` prints it)."""
    schema = parser._defaults[SCHEMA_KEY]
    by_dest = {a.dest: a for a in parser._actions if a.help != argparse.SUPPRESS}
    keys = {key for actions in config.sections(parser).values() for key in actions}
    rows = []
    for s in settings_of(schema):
        if not s.how.cli:
            continue
        action = by_dest.get(s.name)
        flag = "(none)" if action is None else (
            "(positional)" if not action.option_strings else next(o for o in action.option_strings if o.startswith("--")))
        key = s.name if s.name in keys else "(none)"
        rows.append((s.name, f"{schema.__name__}.{s.section}.{s.name}", flag, key))
    return rows


@pytest.mark.parametrize("name", sorted(commands()))
def test_every_setting_has_one_name_from_flag_to_field_to_config_key(name):
    parser = commands()[name]
    assert SCHEMA_KEY in parser._defaults, f"hsstore {name}: its flags come from no schema (schema.add_arguments)"
    for field, where, flag, key in names(parser):
        assert flag in ("(positional)", "--" + field.replace("_", "-")), f"hsstore {name}: {where} has flag {flag}"
        assert key == field, f"hsstore {name}: {where} has no config key of its name"
    schema_names = {s.name for s in settings_of(parser._defaults[SCHEMA_KEY])}
    for action in parser._actions:  # every flag is a setting of the schema or a shared flag, named as its dest
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        assert action.dest in schema_names | SHARED, f"hsstore {name}: {action.dest} is in no schema"
        if action.option_strings:
            assert "--" + action.dest.replace("_", "-") in action.option_strings, (name, action.option_strings)


def test_a_renamed_flag_and_key_still_work_and_warn(tmp_path, caplog):
    """bench --batch-tokens is --token-budget; subset --min-tokens is --min-length; train's old keys load."""
    parser = build_parser()
    with caplog.at_level("WARNING"):
        args = parser.parse_args(["bench", "/x", "--batch-tokens", "700"])
    assert args.token_budget == 700 and "--batch-tokens is deprecated, use --token-budget" in caplog.text
    assert parser.parse_args(["subset", "a", "b", "--min-tokens", "5"]).min_length == 5
    train = commands()["train"]
    f = tmp_path / "old.yaml"
    f.write_text("run: {store: [/s], out: /o}\noutput: {no_resume: true}\ndrafter: {non_causal_sliding: true}\n"
                 "data: {checkpoint_layers: full, gpu_memory_gib: 40, allow_unhealthy: true}\n")
    caplog.clear()
    with caplog.at_level("WARNING"):
        values = config.load(f, train)
    assert values == {"store": ["/s"], "out": "/o", "resume": False, "sliding_causal": False,
                      "checkpoint_layers": "full", "gpu_memory_gib": 40.0, "allow_unhealthy": True}
    assert "data.checkpoint_layers is now memory.checkpoint_layers" in caplog.text
    assert "output.no_resume is the old name of resume (read inverted" in caplog.text


def _schema_classes() -> dict[str, set[type]]:
    out: dict[str, set[type]] = {}
    for parser in commands().values():
        schema = parser._defaults[SCHEMA_KEY]
        out.setdefault(schema.__name__, set()).add(schema)
        for sec in dataclasses.fields(schema):
            cls = typing.get_type_hints(schema)[sec.name]
            for c in cls.__mro__[:-1]:
                out.setdefault(c.__name__, set()).add(c)
    return out


def test_no_two_schema_classes_share_a_name():
    assert {n: cs for n, cs in _schema_classes().items() if len(cs) > 1} == {}


def test_no_class_name_means_two_things_across_the_packages():
    where: dict[str, list[str]] = {}
    for folder in ("hsstore", "extract", "train"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    where.setdefault(node.name, []).append(str(path.relative_to(ROOT)))
    twice = {n: w for n, w in where.items() if len(w) > 1}
    # left as they are: two private handlers of tests' servers
    assert set(twice) <= {"_Handler"}, twice


if __name__ == "__main__":
    for cmd, parser in sorted(commands().items()):
        for row in names(parser):
            print(f"{cmd:15} " + "  ".join(row))
