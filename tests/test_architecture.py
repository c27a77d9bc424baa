"""The package's shape, read from its source: ``hsstore/`` modules import each other without a cycle (at
module level or inside functions: a function-level import hides a cycle, it does not remove it), never
import transformers, and every shard layout implements the layout protocol."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from hsstore import layout

PACKAGE = Path(__file__).resolve().parents[1] / "hsstore"


def _type_checking_only(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imported_modules(tree: ast.Module, package: str, modules: set[str]) -> set[str]:
    """Top-level names imported anywhere in ``tree`` (functions included; ``if TYPE_CHECKING:`` blocks, which
    never run, excluded): sibling modules of ``package`` as their names, anything else as its first part."""
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking_only(child):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.ImportFrom):
                parts = (child.module or "").split(".") if child.module else []
                if child.level == 1 or (child.level == 0 and parts[:1] == [package]):
                    inner = parts if child.level == 1 else parts[1:]
                    if inner:  # from .x import y / from hsstore.x import y
                        out.add(inner[0])
                    else:  # from . import x, y / from hsstore import x, y
                        out.update(a.name for a in child.names if a.name in modules)
                elif child.level == 0:
                    out.add(parts[0])
            elif isinstance(child, ast.Import):
                for a in child.names:
                    parts = a.name.split(".")
                    out.add(parts[1] if parts[0] == package and len(parts) > 1 else parts[0])
            visit(child)

    visit(tree)
    return out


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module -> the sibling modules it imports."""
    modules = {p.stem for p in package_dir.glob("*.py")}
    graph = {}
    for m in sorted(modules):
        tree = ast.parse((package_dir / f"{m}.py").read_text(), filename=f"{m}.py")
        graph[m] = (imported_modules(tree, package_dir.name, modules) & modules) - {m}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_find_cycle_sees_function_level_imports(tmp_path):
    """The checker itself: a cycle closed only by an import inside a function is found; a TYPE_CHECKING one
    is not a cycle."""
    pkg = tmp_path / "hsstore"
    pkg.mkdir()
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x\n")
    assert find_cycle(import_graph(pkg)) is None
    (pkg / "b.py").write_text("def f():\n    from hsstore.a import x\n    return x\n")
    assert find_cycle(import_graph(pkg)) == ["a", "b", "a"]


def test_hsstore_has_no_import_cycle():
    graph = import_graph(PACKAGE)
    assert {"layout", "reader", "verify", "wds"} <= set(graph)  # the package was found
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle in hsstore/: {' -> '.join(cycle)}"


def test_hsstore_never_imports_transformers():
    """hsstore/ is the library extract/ and train/ share; the target's framework is theirs alone."""
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    bad = sorted(p.name for p in PACKAGE.glob("*.py")
                 if "transformers" in imported_modules(ast.parse(p.read_text()), PACKAGE.name, modules))
    assert not bad, f"hsstore/ modules importing transformers: {bad}"


@pytest.mark.parametrize("name", sorted(layout.LAYOUTS))
def test_layouts_implement_the_protocol(name):
    """Every registered layout has each function of :class:`hsstore.layout.Layout`, with its parameters."""
    impl = layout.get(name)
    for attr, spec in vars(layout.Layout).items():
        if attr.startswith("_") or not callable(spec):
            continue
        fn = getattr(impl, attr, None)
        assert callable(fn), f"layout {name!r} lacks {attr}"
        want = list(inspect.signature(spec).parameters)[1:]  # without self
        assert list(inspect.signature(fn).parameters) == want, f"layout {name!r}: {attr} parameters"
    with pytest.raises(ValueError, match="unknown shard layout 'tar'"):
        layout.get("tar")


def test_train_has_no_import_cycle():
    """train/ split by concept: its modules import each other without a cycle (evaluate.py and trainer.py
    once imported each other, through a function-level import of ``load_frozen``)."""
    graph = import_graph(PACKAGE.parent / "train")
    assert {"trainer", "evaluate", "build", "config", "masks", "metrics"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle in train/: {' -> '.join(cycle)}"
