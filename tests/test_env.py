"""Environment variables: one table (``hsstore.env``), read in one module, every name in docs/CLI.md; a bad value
is one line; a flag never writes into the environment."""

from __future__ import annotations

import ast
import logging
import os
import re
from pathlib import Path

import pytest

import hsstore
from hsstore import env
from hsstore.app.cli import main
from hsstore.testing.stores import make_manifest, make_samples, write_store

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("hsstore", "extract", "train")
ENV_MODULE = ROOT / "hsstore" / "env.py"
NAME = re.compile(r"HSSTORE_[A-Z0-9_]*")


def env_reads(path: Path) -> list[str]:
    """``line: what`` for each place ``path`` names an ``HSSTORE_*`` variable as a value (a string that is such a
    name, or the prefix alone) or reads ``os.environ``/``os.getenv`` with such a name: outside ``hsstore/env.py``
    each is a switch read around the table."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if NAME.fullmatch(node.value.strip()):
                found.append(f"{node.lineno}: {node.value!r}")
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str) and node.args[0].value.startswith("HSSTORE_"):
            f = ast.unparse(node.func)
            if f.startswith(("os.environ", "os.getenv", "environ.", "getenv")):
                found.append(f"{node.lineno}: {f}({node.args[0].value!r})")
    return found


def package_files() -> list[Path]:
    return sorted(p for d in SCANNED for p in (ROOT / d).rglob("*.py") if p != ENV_MODULE)


def test_the_scanner_finds_the_reads_it_looks_for(tmp_path):
    planted = tmp_path / "m.py"
    planted.write_text('import os\nNAME = "HSSTORE_SOMETHING"\nx = os.environ.get("HSSTORE_OTHER", "")\n'
                       'y = os.getenv("HSSTORE_Y")\nz = [k for k in os.environ if k.startswith("HSSTORE_")]\n'
                       'def f():\n    """HSSTORE_IN_A_DOCSTRING is a mention, not a read."""\n')
    found = env_reads(planted)
    assert {int(f.split(":")[0]) for f in found} == {2, 3, 4, 5} and not any("DOCSTRING" in f for f in found), found
    assert env_reads(ENV_MODULE)  # the table itself is found: the scan reads what it should


def test_only_the_env_module_reads_hsstore_variables():
    bad = {str(p.relative_to(ROOT)): r for p in package_files() for r in [env_reads(p)] if r}
    assert not bad, f"HSSTORE_* read outside hsstore/env.py (add a Switch there, read it with .get()): {bad}"


def test_every_variable_is_in_the_cli_reference_and_every_mention_is_in_the_table():
    cli_md = (ROOT / "docs" / "CLI.md").read_text()
    for name in [*env.SWITCHES, *env.REMOVED]:
        assert f"`{name}`" in cli_md, f"{name} is not in docs/CLI.md (python -m tools.cli_docs)"
    known = {*env.SWITCHES, *env.REMOVED}
    texts = [*package_files(), *(ROOT / "tools").glob("*.py"), *(ROOT / "tools").glob("*.sh"),
             *(ROOT / "docs").glob("*.md"), ROOT / "README.md"]
    unknown = {(str(p.relative_to(ROOT)), m) for p in texts for m in NAME.findall(p.read_text())
               if m not in known and m != env.PREFIX}
    assert not unknown, f"HSSTORE_* names that hsstore/env.py does not list: {sorted(unknown)}"


def test_a_switch_is_its_default_unset_or_empty_and_refuses_a_bad_value(monkeypatch):
    monkeypatch.delenv(env.METADATA_CONCURRENCY.name, raising=False)
    assert env.METADATA_CONCURRENCY.get() == 64
    monkeypatch.setenv(env.METADATA_CONCURRENCY.name, "  ")
    assert env.METADATA_CONCURRENCY.get() == 64
    monkeypatch.setenv(env.METADATA_CONCURRENCY.name, "12")
    assert env.METADATA_CONCURRENCY.get() == 12
    monkeypatch.setenv(env.WRITER_HEARTBEAT_S.name, "0.5")
    assert env.WRITER_HEARTBEAT_S.get() == 0.5
    monkeypatch.setenv(env.ALLOW_LOCATIONS.name, " /a, ,s3://b/c ")
    assert env.ALLOW_LOCATIONS.get() == ("/a", "s3://b/c")
    for switch, raw in [(env.METADATA_CONCURRENCY, "0"), (env.METADATA_CONCURRENCY, "many"),
                        (env.REQUEST_S, "-1"), (env.MIN_RATE, "nan"), (env.CONV, "triton")]:
        monkeypatch.setenv(switch.name, raw)
        with pytest.raises(hsstore.StoreError, match=rf"^{switch.name}='{re.escape(raw)}': expected "):
            switch.get()


NON_FINITE = ("nan", "inf", "-inf", "+inf", "NaN", "Infinity", "-Infinity", "INF", "1e999")
NUMERIC = [s for s in env.SWITCHES.values() if s.kind in ("count", "seconds", "rate")]


@pytest.mark.parametrize("switch", NUMERIC, ids=lambda s: s.name)
def test_every_numeric_switch_refuses_every_non_finite_value(switch, monkeypatch):
    """``HSSTORE_REQUEST_S=inf`` would be no deadline at all, ``HSSTORE_MIN_RATE=inf`` cuts every answer: a number
    that is not finite is no setting (``1e999`` is one too, once parsed)."""
    assert {"HSSTORE_REQUEST_S", "HSSTORE_MIN_RATE", "HSSTORE_HEAD_S"} <= {s.name for s in NUMERIC}
    for raw in NON_FINITE:
        monkeypatch.setenv(switch.name, raw)
        with pytest.raises(env.SwitchError, match=rf"^{switch.name}='{re.escape(raw)}': expected a positive "):
            switch.get()
    monkeypatch.setenv(switch.name, "2")
    assert switch.get() == 2  # a finite value of the same switch is taken


def test_a_non_finite_deadline_is_one_line_exit_2(monkeypatch, tmp_path, capsys):
    url = write_store(str(tmp_path / "s"), make_samples(2), manifest=make_manifest())
    monkeypatch.setenv(env.REQUEST_S.name, "inf")
    assert main(["info", url]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["hsstore info: error: HSSTORE_REQUEST_S='inf': expected a positive number (seconds) (unset: 10)"]


def test_a_bad_value_is_one_line_and_a_removed_switch_is_named(monkeypatch, tmp_path, capsys, caplog):
    url = write_store(str(tmp_path / "s"), make_samples(3), manifest=make_manifest())
    monkeypatch.setenv("HSSTORE_READ_BLOCK", "0")  # removed: warned about, never silently ignored
    with caplog.at_level(logging.WARNING, logger="hsstore.env"):
        assert main(["info", url]) == 0
    assert any("HSSTORE_READ_BLOCK is set, but hsstore does not read it (removed:" in r.getMessage()
               for r in caplog.records)
    capsys.readouterr()
    monkeypatch.setenv(env.HEAD_S.name, "soon")
    assert main(["info", url]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["hsstore info: error: HSSTORE_HEAD_S='soon': expected a positive number (seconds) (unset: 60)"], err


def test_allow_location_reaches_the_store_and_leaves_the_environment_alone(tmp_path, monkeypatch, capsys):
    """A store merged by reference reads its shards from the prefix ``--allow-location`` names, and the flag
    writes nothing into ``os.environ`` (a later command, or a library call, is not allowed by it)."""
    from hsstore.ops.merge import merge

    monkeypatch.delenv(env.ALLOW_LOCATIONS.name, raising=False)
    a = write_store(str(tmp_path / "a"), make_samples(4), manifest=make_manifest())
    ref = str(tmp_path / "ref")
    merge(ref, [a], by="reference")
    before = dict(os.environ)
    assert main(["verify", ref, "-q"]) != 0  # not allowed: refused
    assert main(["verify", ref, "-q", "--allow-location", str(tmp_path / "a")]) == 0
    assert dict(os.environ) == before
    assert main(["verify", ref, "-q"]) != 0  # the flag was this command's only
    store = hsstore.open(ref, allow_locations=[str(tmp_path / "a")])
    assert store.allow_locations == [str(tmp_path / "a")] and len(store.sample_ids()) == 4
