"""Comments and docstrings say why, in the present: a machine's name, an issue number or a date in them is a
measurement or a history that belongs in docs/PERFORMANCE.md or a commit message, where it stays true; a file
outside the repository is one a reader cannot open."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("hsstore", "extract", "train")
RULES = {
    "a machine's name (H200)": re.compile(r"\bH200s?\b"),
    "an issue reference": re.compile(r"(?<![\w&#])#\d+\b|\b[Ii]ssues? #?\d+\b"),
    "a date": re.compile(r"\b(19|20)\d\d-[01]\d-[0-3]\d\b"),
    "a file outside the repository": re.compile(r"\bBRIEF\b|(?<![\w.])/work/"),
}


def prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of a module's source."""
    found = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline)
             if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                found.append((node.body[0].lineno, doc))
    return found


def violations(source: str) -> list[str]:
    return [f"{line}: {what}: {m.group(0)!r}" for line, text in prose(source)
            for what, rule in RULES.items() for m in rule.finditer(text)]


def test_the_scan_finds_what_it_looks_for_and_leaves_code_alone():
    planted = '''"""Measured on an H200 on 2026-12-03 (BRIEF)."""
x = "#222"  # a colour in code, not a comment
# see #51 and issue 40
def f():
    """Fixed in issue #7."""
'''
    found = sorted(violations(planted))
    assert found == sorted(["1: a machine's name (H200): 'H200'", "1: a date: '2026-12-03'",
                            "1: a file outside the repository: 'BRIEF'",
                            "3: an issue reference: '#51'", "3: an issue reference: 'issue 40'",
                            "5: an issue reference: 'issue #7'"]), found


def test_package_comments_and_docstrings_carry_no_machine_issue_or_date():
    bad = [f"{p.relative_to(ROOT)}:{v}" for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))
           for v in violations(p.read_text())]
    assert not bad, "comments and docstrings say why, in the present (figures: docs/PERFORMANCE.md):\n" + "\n".join(bad)
