"""The lists docs/ARCHITECTURE.md gives that the module tables' tests (tests/test_architecture.py) do not hold:
each invariant names the tests that hold it, and those tests exist, so the list cannot drift from the suite."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAMED = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")


def invariants(text: str) -> list[str]:
    """The bullets of the "Invariants" section, each joined into one string."""
    section = text.split("\n## Invariants\n", 1)[1].split("\n## ", 1)[0]
    return [b.strip() for b in re.split(r"\n(?=- )", section) if b.strip().startswith("- ")]


def missing(bullet: str) -> list[str]:
    """The tests a bullet names that are not in the suite (``path::name`` with no ``def name(`` in that file)."""
    out = []
    for path, name in NAMED.findall(bullet):
        f = ROOT / path
        if not f.is_file() or not re.search(rf"^def {name}\(", f.read_text(), re.M):
            out.append(f"{path}::{name}")
    return out


def test_every_invariant_names_tests_that_exist():
    bullets = invariants((ROOT / "docs" / "ARCHITECTURE.md").read_text())
    assert len(bullets) >= 7
    for b in bullets:
        assert NAMED.search(b), f"an invariant that names no test: {b[:100]}"
        assert not missing(b), f"{missing(b)} named by: {b[:100]}"


def test_the_check_sees_a_named_test_that_is_gone(tmp_path):
    text = "x\n## Invariants\n- one (`tests/test_docs_lists.py::test_no_such_test`).\n- two.\n## Next\n"
    one, two = invariants(text)
    assert missing(one) == ["tests/test_docs_lists.py::test_no_such_test"]
    assert not NAMED.search(two)
