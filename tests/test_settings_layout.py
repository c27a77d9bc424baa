"""Where settings live: every command's schema in its family's ``settings.py``; the settings the families share
declared once (``hsstore.app.sections``); every command registered through ``hsstore.app.commands``; the old
module names still serving their names, with a DeprecationWarning."""

from __future__ import annotations

import argparse
import ast
import importlib
import re
import warnings
from pathlib import Path

import pytest

from hsstore.app import sections
from hsstore.app.cli import build_parser
from hsstore.app.schema import SCHEMA_KEY, settings_of

ROOT = Path(__file__).resolve().parents[1]
SETTINGS_MODULES = {"hsstore.app.settings", "hsstore.extract.settings", "hsstore.train.settings"}
CLI_FILES = [ROOT / "hsstore" / "app" / "cli.py", ROOT / "extract" / "cli.py", ROOT / "train" / "cli.py"]
# old name -> (module it moved to, a name read through it)
MOVED = {
    "hsstore.app.store_settings": ("hsstore.app.settings", "SubsetSettings"),
    "hsstore.train.config": ("hsstore.train.settings", "TrainSettings"),
    "hsstore.extract.settings": ("hsstore.app.commands", "shared_overrides"),
    "hsstore.app.cli": ("hsstore.app.commands", "add_quiet_option"),
}


def schemas() -> dict[str, type]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name: parser._defaults[SCHEMA_KEY] for name, parser in sub.choices.items()}


def test_every_commands_schema_lives_in_its_familys_settings_module():
    wrong = {name: s.__module__ for name, s in schemas().items() if s.__module__ not in SETTINGS_MODULES}
    assert not wrong, f"schemas outside a family's settings.py: {wrong}"


def test_shared_settings_are_declared_once():
    """A setting with a shared name is the one ``sections.py`` declares, in every command that has it (its
    default and help may be the command's own, through the declaration's parameters)."""
    seen: set[str] = set()
    wrong = []
    for name, schema in schemas().items():
        for s in settings_of(schema):
            if s.name in sections.SHARED_NAMES:
                seen.add(s.name)
                if s.field.metadata.get(sections.SHARED_KEY) != s.name:
                    wrong.append(f"hsstore {name}: {schema.__name__}.{s.section}.{s.name}")
    assert not wrong, f"shared settings declared again instead of through hsstore.app.sections: {wrong}"
    assert seen == set(sections.SHARED_NAMES), "sections.SHARED_NAMES names a setting no command has"


def test_commands_are_registered_only_through_the_one_helper():
    """No family makes a command's parser by hand: ``add_parser`` is called in ``hsstore/app/commands.py``
    alone, so every command gets its flags, shared flags, ``--config`` and handler the same way."""
    found = []
    for path in CLI_FILES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_parser":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, f"parsers made outside hsstore.app.commands: {found}"


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_names_still_work_and_warn(old):
    new, name = MOVED[old]
    module = importlib.import_module(old)
    with pytest.warns(DeprecationWarning, match=rf"{re.escape(old)}\.{name} is now {re.escape(new)}\.{name}"):
        value = getattr(module, name)
    assert value is getattr(importlib.import_module(new), name)
    with pytest.raises(AttributeError):
        getattr(module, "no_such_name")


def test_the_new_names_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for new, name in MOVED.values():
            getattr(importlib.import_module(new), name)


def test_architecture_names_the_shared_settings():
    """docs/ARCHITECTURE.md's list of the shared settings is sections.SHARED_NAMES."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    m = re.search(r"Shared settings \(`app/sections.py`\): ([^.]*)\.", text)
    assert m, "docs/ARCHITECTURE.md no longer lists the shared settings"
    assert re.findall(r"`(\w+)`", m.group(1)) == list(sections.SHARED_NAMES)
