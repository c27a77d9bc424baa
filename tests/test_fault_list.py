"""The fault list (tools/faults.py, tools/faults/*.yaml): every entry parses and still names code that is there,
the list's format is checked, and (slow) a scratch copy imports its own code. Running the faults themselves is
slow and done on demand (README, "The fault list"), never here."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tools import faults

ROOT = Path(__file__).resolve().parents[1]

GOOD = '''- id: a-guard
  file: pkg/mod.py
  find: |
    if n == 0:
  replace: |
    if False:
  tests: [tests/test_mod.py]
  user: "what a user meets"
'''


def test_every_fault_names_code_that_is_there():
    """A fault whose file is gone, whose text is no longer found exactly once, or whose test file is gone no longer
    switches its guard off: the list must follow the code (or the guard is gone)."""
    found = faults.load(ROOT)
    assert found and len({f.id for f in found}) == len(found)
    stale = {f.id: why for f in found if (why := faults.stale(f, ROOT))}
    assert not stale, f"stale fault list entries (python -m tools.faults --list): {stale}"


def plant(root: Path, name: str, text: str) -> None:
    (root / "tools" / "faults").mkdir(parents=True, exist_ok=True)
    (root / "tools" / "faults" / f"{name}.yaml").write_text(text)


def test_a_list_that_is_not_one_of_faults_is_refused_naming_file_and_entry(tmp_path):
    plant(tmp_path, "one", GOOD)
    assert [f.id for f in faults.load(tmp_path)] == ["a-guard"]
    for name, text, words in [
        ("missing", GOOD.replace('  user: "what a user meets"\n', ""), "missing.yaml: entry 1 ('a-guard'): needs "),
        ("noop", GOOD.replace("if False:", "if n == 0:"), "replace is the text it replaces"),
        ("notests", GOOD.replace("[tests/test_mod.py]", "[]"), "tests must be a non-empty list"),
        ("badid", GOOD.replace("a-guard", "A_Guard"), "short-kebab-case"),
        ("twice", GOOD, "fault id 'a-guard' is also in tools/faults/one.yaml"),
        ("notalist", "id: x\n", "a list of faults expected"),
    ]:
        plant(tmp_path, name, text)
        with pytest.raises(faults.FaultListError, match=re.escape(words)):
            faults.load(tmp_path, [name, "one"] if name == "twice" else [name])
    with pytest.raises(faults.FaultListError, match="no list nope"):
        faults.load(tmp_path, ["nope"])


def test_a_stale_entry_is_told_why(tmp_path):
    plant(tmp_path, "one", GOOD)
    (fault,) = faults.load(tmp_path, ["one"])
    assert faults.stale(fault, tmp_path) == "pkg/mod.py does not exist"
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text("def f(n):\n    if n == 0:\n        return 1\n    if n == 0:\n        return 2\n")
    assert faults.stale(fault, tmp_path).startswith("its find text occurs 2 times in pkg/mod.py, not once")
    (tmp_path / "pkg" / "mod.py").write_text("def f(n):\n    if n == 0:\n        return 1\n")
    assert faults.stale(fault, tmp_path) == "no test file tests/test_mod.py"
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_mod.py").write_text("")
    assert faults.stale(fault, tmp_path) is None
    # a multi-line find written with `|` lost its first line's indentation: told how to write it
    two = faults.Fault("x", "pkg/mod.py", "if n == 0:\n    return 1\n", "pass\n", ("tests/test_mod.py",), "", "")
    assert "indented 4 more spaces" in faults.stale(two, tmp_path) and "|2" in faults.stale(two, tmp_path)


def test_the_results_table_and_summary():
    f = faults.Fault("a-guard", "pkg/mod.py", "x", "y", ("tests/t.py",), "u", "tools/faults/one.yaml")
    res = [faults.verdict(f, 1, "FAILED tests/t.py::test_a - AssertionError\n", 3.0),
           faults.verdict(f, 0, "", 2.0), faults.verdict(f, 5, "", 1.0), faults.verdict(f, None, "", 9.0)]
    assert [(r.verdict, r.by) for r in res] == [("caught", "tests/t.py::test_a"), ("SURVIVED", "every test passed"),
                                                ("error", "no test was selected"), ("timeout", "past the time allowed")]
    assert faults.table(res).splitlines()[2] == "| a-guard | one | caught | tests/t.py::test_a | 3 |"
    assert faults.summary(res, 75, ["tools/faults/one.yaml"]) == (
        "fault list: 4 fault(s), 1 caught, 1 survived, 1 error, 1 timeout (tools/faults/one.yaml) in 1 min 15 s")


def test_the_scratch_copy_imports_its_own_code():
    """``--self-check``: a canary planted in hsstore, hsstore.extract and hsstore.train of a scratch copy is caught
    in process and in a child process (the editable install maps the two to another checkout's folders otherwise),
    and the same test without it passes."""
    r = subprocess.run([sys.executable, "-m", "tools.faults", "--self-check"], cwd=ROOT, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 8 and all(ln.startswith("ok  ") for ln in lines), r.stdout
