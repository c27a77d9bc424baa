"""The packages' shape, read from their source: hsstore/, extract/, train/ and tools/ import their own modules without
a cycle (at module level, inside functions or for type checkers alone: each hides a cycle, none removes it);
each subpackage of hsstore/ imports only what the ``Imports:`` line of its doc allows; hsstore/ never imports
transformers; extract/ and train/ never import each other; every shard layout implements the protocol; the loader's
dataset knows its epochs' source, not follow mode; the lists docs/ARCHITECTURE.md gives are the code's."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from hsstore.layouts import base as layout

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"hsstore": ("hsstore", ROOT / "hsstore"), "extract": ("hsstore.extract", ROOT / "extract"),
            "train": ("hsstore.train", ROOT / "train")}
CYCLE_FREE = {**PACKAGES, "tools": ("tools", ROOT / "tools")}  # the benchmarks and fuzzers too: one room each
CORE = "core"  # hsstore's top-level modules, which every subpackage may use
TOP = {"__init__", "__main__"}  # the package and `python -m hsstore`, above everything
APP = "app"  # the applications' floor: above the library, below extract/ and train/


def _type_checking_only(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def modules_of(package_dir: Path) -> dict[str, Path]:
    """Dotted name inside the package -> file: ``reader`` for a top-level module, ``store.reader`` in a
    subpackage, ``store`` for its ``__init__``, ``__init__`` for the package's own."""
    out = {}
    for p in sorted(package_dir.rglob("*.py")):
        parts = list(p.relative_to(package_dir).with_suffix("").parts)
        if "__pycache__" in parts or any(not s.isidentifier() for s in parts):
            continue
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def imported(tree: ast.Module, name: str, is_init: bool, absolute: str, modules: set[str], typing: bool = False
             ) -> tuple[set, set]:
    """(modules of this package that ``tree`` imports, first parts of everything else it imports), anywhere
    in the file but ``if TYPE_CHECKING:`` (there too with ``typing``). ``name`` is the module's dotted name inside
    its package."""
    inner: set[str] = set()
    outer: set[str] = set()
    package = name.split(".") if is_init and name != "__init__" else name.split(".")[:-1]

    def resolve(target: list[str], names: list[str]) -> None:
        for n in names or [None]:
            full = ".".join(target + ([n] if n else []))
            while full and full not in modules:
                full = full.rpartition(".")[0]
            inner.add(full or "__init__")

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking_only(child) and not typing:
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.ImportFrom):
                mod = (child.module or "").split(".") if child.module else []
                if child.level:
                    base = package[:len(package) - (child.level - 1)] if child.level > 1 else package
                    resolve(base + mod, [a.name for a in child.names])
                elif (child.module or "").startswith(absolute + ".") or child.module == absolute:
                    resolve(mod[len(absolute.split(".")):], [a.name for a in child.names])
                else:
                    outer.add(".".join(mod[:2]) if mod[0] == "hsstore" else mod[0])
            elif isinstance(child, ast.Import):
                for a in child.names:
                    if a.name.startswith(absolute + "."):
                        resolve(a.name.split(".")[len(absolute.split(".")):], [])
                    else:
                        parts = a.name.split(".")
                        outer.add(".".join(parts[:2]) if parts[0] == "hsstore" else parts[0])
            visit(child)

    visit(tree)
    return inner - {name}, outer


def import_graph(package_dir: Path, absolute: str, typing: bool = False) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (``typing``: for type checkers too)."""
    files = modules_of(package_dir)
    return {m: imported(ast.parse(p.read_text(), filename=str(p)), m, p.name == "__init__.py", absolute,
                        set(files), typing)[0] for m, p in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or None. A package's ``__init__`` that re-exports its modules
    is not part of a cycle through them (importing ``pkg.mod`` runs ``pkg`` first, not the other way)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if n.startswith(m + ".") or (m == "__init__"):  # a package importing its own modules
                continue
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


def group_of(module: str, subpackages: set[str]) -> str:
    head = module.split(".")[0]
    return head if head in subpackages else ("top" if module in TOP else CORE)


def allowed_imports(doc: str | None) -> set[str]:
    """The groups named on the ``Imports:`` line of a subpackage's doc (``hsstore core`` -> ``core``)."""
    for line in (doc or "").splitlines():
        if line.startswith("Imports:"):
            names = [w.strip(" .") for w in line[len("Imports:"):].split(",")]
            return {CORE if n == "hsstore core" else n for n in names if n}
    return set()


def test_find_cycle_sees_function_level_imports(tmp_path):
    """The checker itself: a cycle closed only by an import inside a function is found, through a
    subpackage too; one closed for type checkers alone is found where they are counted."""
    pkg = tmp_path / "hsstore"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import x\n")
    assert find_cycle(import_graph(pkg, "hsstore")) is None
    assert find_cycle(import_graph(pkg, "hsstore", typing=True)) == ["a", "sub.b", "a"]
    (pkg / "sub" / "b.py").write_text("def f():\n    from hsstore.a import x\n    return x\n")
    assert find_cycle(import_graph(pkg, "hsstore")) == ["a", "sub.b", "a"]
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import a\n")
    assert find_cycle(import_graph(pkg, "hsstore")) == ["a", "sub.b", "a"]


@pytest.mark.parametrize("package", sorted(CYCLE_FREE))
def test_no_import_cycle(package):
    """Type checkers' imports count: two modules that name each other's types are one room, whichever import runs."""
    absolute, path = CYCLE_FREE[package]
    graph = import_graph(path, absolute, typing=True)
    assert len(graph) > 5  # the package was found
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle in {package}/: {' -> '.join(cycle)}"


def test_subpackages_import_only_what_their_doc_allows():
    absolute, path = PACKAGES["hsstore"]
    files = modules_of(path)
    subpackages = {m for m, p in files.items() if p.name == "__init__.py" and m != "__init__"}
    assert {"io", "format", "layouts", "store", "loader", "ops", APP} <= subpackages
    allowed = {s: allowed_imports(ast.get_docstring(ast.parse(files[s].read_text()))) | {s} for s in subpackages}
    allowed[CORE] = {CORE}
    bad = []
    for m, p in files.items():
        g = group_of(m, subpackages)
        if g == "top":
            continue
        assert g == CORE or len(allowed[g]) > 1, f"hsstore/{g}/__init__.py has no 'Imports:' line"
        deps = imported(ast.parse(p.read_text()), m, p.name == "__init__.py", absolute, set(files))[0]
        bad += [f"{m} -> {d}" for d in sorted(deps) if group_of(d, subpackages) not in allowed[g]]
    assert not bad, f"imports their package's doc does not allow: {bad}"


def test_the_library_never_imports_the_app_floor_nor_transformers():
    """hsstore/ but its app floor is the library; the app floor (settings, devices, the target loader, the command
    line) is what the applications share above it: no library package lists it on its ``Imports:`` line, no
    library module imports it (``hsstore.testing`` runs commands as a user does, and ``__main__`` is the command),
    and transformers is imported only in the app floor, extract/ and train/."""
    absolute, path = PACKAGES["hsstore"]
    files = modules_of(path)
    subpackages = {m for m, p in files.items() if p.name == "__init__.py" and m != "__init__"}
    library = {m: p for m, p in files.items() if group_of(m, subpackages) not in (APP, "testing", "top")}
    up = sorted(f"{m} -> {d}" for m, p in library.items()
                for d in imported(ast.parse(p.read_text()), m, p.name == "__init__.py", absolute, set(files))[0]
                if group_of(d, subpackages) == APP)
    assert not up, f"library modules importing the app floor: {up}"
    listed = sorted(s for s in subpackages - {APP, "testing"}
                    if APP in allowed_imports(ast.get_docstring(ast.parse(files[s].read_text()))))
    assert not listed, f"library packages allowing the app floor: {listed}"
    bad = sorted(m for m, p in library.items()
                 if "transformers" in imported(ast.parse(p.read_text()), m, p.name == "__init__.py", absolute,
                                               set(files))[1])
    assert not bad, f"library modules importing transformers: {bad}"


def test_hsstore_top_holds_at_most_15_modules():
    """The package's top floor stays small enough to read at a glance: I/O lives in ``io``, what the applications
    share in ``app``."""
    top = sorted(p.name for p in (ROOT / "hsstore").glob("*.py"))
    assert len(top) <= 15, top


@pytest.mark.parametrize("package,other", [("extract", "train"), ("train", "extract")])
def test_extract_and_train_never_import_each_other(package, other):
    absolute, path = PACKAGES[package]
    files = modules_of(path)
    bad = sorted(m for m, p in files.items()
                 if f"hsstore.{other}" in imported(ast.parse(p.read_text()), m, p.name == "__init__.py", absolute,
                                                   set(files))[1])
    assert not bad, f"{package}/ modules importing hsstore.{other}: {bad}"


def private_reaches(tree: ast.Module) -> list[str]:
    """Where ``tree`` reaches a private name (``x._name``, not a dunder) of anything but ``self`` or ``cls``."""
    return sorted((f"line {n.lineno}: {ast.unparse(n)}" for n in ast.walk(tree)
                   if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")
                   and ast.unparse(n.value) not in ("self", "cls")), key=lambda x: int(x.split()[1][:-1]))


def test_private_reaches_are_found():
    src = "def f(ds, view):\n    ds._pool()\n    self._x = view.__dict__\n    return copy(ds)._attach_cache\n"
    assert private_reaches(ast.parse(src)) == ["line 2: ds._pool", "line 4: copy(ds)._attach_cache"]


def test_the_dataset_knows_its_epochs_source_not_follow_mode():
    """loader/dataset.py plans and reads its epochs through ``loader.epochs`` and never imports loader/follow.py
    (not for type checkers either); follow.py never imports the dataset and reaches no private name of another
    object (no dataset copied and its buffers or caches taken from inside)."""
    absolute, path = PACKAGES["hsstore"]
    files = modules_of(path)

    def deps(m: str) -> set[str]:
        return imported(ast.parse(files[m].read_text()), m, False, absolute, set(files), typing=True)[0]

    assert "loader.epochs" in deps("loader.dataset") and "loader.epochs" in deps("loader.follow")
    assert "loader.follow" not in deps("loader.dataset"), "loader/dataset.py imports follow mode"
    assert "loader.dataset" not in deps("loader.follow"), "loader/follow.py imports the dataset"
    reached = private_reaches(ast.parse(files["loader.follow"].read_text()))
    assert not reached, f"loader/follow.py reaches private names: {reached}"


@pytest.mark.parametrize("name", sorted(layout.names()))
def test_layouts_implement_the_protocol(name):
    """Every registered layout has each function of :class:`hsstore.layouts.base.Layout`, with its parameters."""
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


def test_layout_names_come_from_the_registry():
    """Only the registry (format/layout_spec.py) and the layouts' own modules name a layout: the manifest's rules,
    the CLI's choices, convert's codec and extract's --layout ask ``layout_spec``, so a layout registered from
    outside the package is a choice and a rule everywhere at once."""
    from hsstore.format import layout_spec

    names = set(layout_spec.names())
    assert {"zarr", "wds"} <= names
    for rel in ("hsstore/format/manifest.py", "hsstore/app/cli.py", "hsstore/ops/convert.py", "extract/settings.py",
                "hsstore/loader/dataset.py"):
        tree = ast.parse((ROOT / rel).read_text())
        named = [f"line {n.lineno}: {n.value!r}" for n in ast.walk(tree)
                 if isinstance(n, ast.Constant) and n.value in names]
        assert not named, f"{rel} names a layout itself: {named}"
    with pytest.raises(ValueError, match="registered already"):
        layout_spec.register(dataclasses.replace(layout_spec.get("wds"), chunk_cache=True))


def test_public_names_resolve_to_their_modules():
    """``import hsstore`` exposes every name of ``__all__``, each the object defined in its module."""
    import importlib

    import hsstore

    assert {"open", "Store", "StoreWriter", "HiddenStateDataset", "Manifest", "StoreError", "World"} <= set(
        hsstore.__all__)
    for name in hsstore.__all__:
        assert getattr(hsstore, name) is not None, name
    assert hsstore.Store is importlib.import_module("hsstore.store.reader").Store
    assert hsstore.open is importlib.import_module("hsstore.store.reader").open
    assert hsstore.HiddenStateDataset is importlib.import_module("hsstore.loader.dataset").HiddenStateDataset
    assert not hasattr(importlib.import_module("hsstore.store.reader"), "open_store")  # one name per function
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        hsstore.nope  # noqa: B018


def type_checking_names(tree: ast.Module) -> dict[str, str]:
    """Name -> defining module (relative to the package) of the ``from .x import name`` lines inside the
    module's ``if TYPE_CHECKING:`` blocks."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.If) and _type_checking_only(node):
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.level == 1, ast.unparse(imp)
                out.update({a.asname or a.name: imp.module for a in imp.names})
    return out


def test_namespace_static_tools_see_is_the_one_resolved_at_run_time():
    """hsstore/__init__.py lists its public names twice, of necessity: real imports under TYPE_CHECKING (what
    type checkers and IDEs read) and the lazy table that keeps `import hsstore` free of torch and zarr. The two
    are one list: same names, same modules, each name defined (not re-exported) by its module."""
    import importlib

    import hsstore

    static = type_checking_names(ast.parse((ROOT / "hsstore" / "__init__.py").read_text()))
    assert static == hsstore._PUBLIC
    assert set(hsstore.__all__) == set(static) | {"__version__"}
    for name, module in static.items():
        value = getattr(importlib.import_module(f"hsstore.{module}"), name)
        if hasattr(value, "__module__") and not isinstance(value, (int, str)):
            assert value.__module__ == f"hsstore.{module}", f"{name} is defined in {value.__module__}, not {module}"


def test_import_hsstore_installs_no_meta_path_finder():
    """No module path is aliased: importing the package leaves ``sys.meta_path`` as it was, and no source file
    of the package touches it."""
    import importlib
    import subprocess
    import sys

    code = ("import sys\nbefore = list(sys.meta_path)\nimport hsstore, hsstore.app.cli\n"
            "print(len(sys.meta_path) - len(before))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "0", out.stderr
    bad = [str(p.relative_to(ROOT)) for d in ("hsstore", "extract", "train") for p in sorted((ROOT / d).rglob("*.py"))
           if "meta_path" in p.read_text()]
    assert not bad, f"files touching sys.meta_path: {bad}"
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("hsstore.reader")  # the flat paths of the first layout are gone


def facade_imports(tree: ast.Module, package_dir: Path, absolute: str, name: str, is_init: bool) -> list[str]:
    """Imports in ``tree`` that go through ``hsstore/__init__.py`` for a name it re-exports: ``import hsstore``
    (then ``hsstore.X``) or ``from hsstore import X`` / ``from .. import X`` where X is not a module. Imports
    of modules (``from hsstore import storage``) are direct."""
    hs = ROOT / "hsstore"
    package = name.split(".") if is_init and name != "__init__" else name.split(".")[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [f"line {node.lineno}: import hsstore" for a in node.names if a.name == "hsstore"]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module == "hsstore":
                names = [a.name for a in node.names]
            elif node.level and absolute == "hsstore" and not node.module and node.level == len(package) + 1:
                names = [a.name for a in node.names]
            else:
                continue
            out += [f"line {node.lineno}: from hsstore import {n}" for n in names
                    if not ((hs / f"{n}.py").exists() or (hs / n / "__init__.py").exists())]
    return out


def test_internal_code_imports_from_defining_modules():
    """hsstore/, extract/ and train/ import each name from the module that defines it, never through the
    package's public namespace (which would hide the edge from the import checks above)."""
    bad = []
    for package, (absolute, path) in PACKAGES.items():
        for m, p in modules_of(path).items():
            if package == "hsstore" and m == "__init__":
                continue
            found = facade_imports(ast.parse(p.read_text()), path, absolute, m, p.name == "__init__.py")
            bad += [f"{package}/{p.relative_to(path)} {f}" for f in found]
    assert not bad, "imports through hsstore/__init__.py:\n" + "\n".join(bad)


def defined_names(path: Path) -> set[str]:
    """Names a module defines at its top level (functions, classes, assignments, in ``if``/``try`` too), not
    the names it imports."""
    out: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        for sub in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node]:
            if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(sub.name)
            elif isinstance(sub, (ast.Assign, ast.AnnAssign)):
                for target in sub.targets if isinstance(sub, ast.Assign) else [sub.target]:
                    out |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return out


def test_names_are_imported_from_their_defining_module():
    """``from M import name`` inside hsstore/, extract/ and train/ names the module that defines ``name`` (or a
    submodule of M): no module serves as another's re-export, so every import edge is the real one."""
    files = {}
    for absolute, path in PACKAGES.values():
        files.update({(f"{absolute}.{m}" if m != "__init__" else absolute): p for m, p in modules_of(path).items()})
    bad = []
    for mod, p in files.items():
        package = mod.split(".") if p.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(p.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = package[:len(package) - node.level + 1] if node.level else []
            source = ".".join(base + ([node.module] if node.module else []))
            if source not in files or source == "hsstore":  # outside packages; the facade: the test above
                continue
            defined = defined_names(files[source])
            bad += [f"{p.relative_to(ROOT)}:{node.lineno}: from {source} import {a.name}" for a in node.names
                    if a.name not in defined and f"{source}.{a.name}" not in files]
    assert not bad, "names imported from a module that does not define them:\n" + "\n".join(bad)


def test_tools_never_import_tests_nor_edit_sys_path():
    """tools/ share helpers with tests through the package (``hsstore.testing``) or tools/ itself: a tool that
    imports tests/ or edits ``sys.path`` runs only from a checkout laid out as the author's."""
    bad = []
    for p in sorted((ROOT / "tools").rglob("*.py")):
        tree = ast.parse(p.read_text())
        for node in ast.walk(tree):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            bad += [f"{p.name}:{node.lineno}: imports {m}" for m in mods
                    if m.split(".")[0] in {"tests", "conftest", "faultproxy", "layout_contract", "engine_server"}]
            if isinstance(node, ast.Attribute) and ast.unparse(node) == "sys.path":
                bad.append(f"{p.name}:{node.lineno}: sys.path")
    assert not bad, "\n".join(bad)


# -- the one door: no module but hsstore/io/door.py and the storage modules under it reads a store object
DOOR = {"hsstore/io/door.py", "hsstore/io/storage.py", "hsstore/io/listing.py", "hsstore/io/transfer.py",
        "hsstore/io/receive.py"}
# raw baselines that must bypass the door to measure it (they read only stores the bench itself wrote)
RAW_BASELINES = {"hsstore/ops/bench.py"}
FS_READS = {"cat_file", "_cat_file", "cat_ranges", "cat", "open", "read_block", "get_file", "cat_many",
            "cat_verified", "cat_into"}


def store_reads(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, call) of every call in ``tree`` that reads a file or an object by itself: a filesystem's read
    methods (``x.fs.cat_file``, ``fs.open``, ``transfer.cat_many`` ...), builtin ``open`` without a writing mode,
    and ``os.open`` without ``O_WRONLY``."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and ast.unparse(f) == "os.open":
            if "O_WRONLY" not in ast.unparse(node.args[1] if len(node.args) > 1 else node):
                out.append((node.lineno, "os.open"))
        elif isinstance(f, ast.Attribute) and f.attr in FS_READS:
            owner = ast.unparse(f.value)
            if owner in ("storage", "transfer") or owner.endswith("fs") or owner.endswith(".fs"):
                out.append((node.lineno, ast.unparse(f)))
        elif isinstance(f, ast.Name) and f.id == "open":
            mode = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "mode"),
                                                                None)
            if not (isinstance(mode, ast.Constant) and isinstance(mode.value, str) and set(mode.value) & set("wax")):
                out.append((node.lineno, "open"))
    return sorted(out)


def test_scanner_finds_the_reads_it_looks_for():
    src = ("a = fs.cat_file(p)\nb = store.fs.open(p)\nc = transfer.cat_many(fs, ps)\nd = open(p, 'rb')\n"
           "e = open(p, 'wb')\nf = os.open(p, os.O_RDONLY)\ng = os.open(p, os.O_WRONLY | os.O_CREAT)\nh = x.cat(1)\n")
    assert [c for _, c in store_reads(ast.parse(src))] == ["fs.cat_file", "store.fs.open", "transfer.cat_many",
                                                            "open", "os.open"]


def test_every_store_read_goes_through_the_door():
    """Readers, copiers, verify, the loader and the cache read a store's bytes only through ``hsstore.io.door``
    (which opens each object one guarded way): none calls a filesystem's read or ``open`` on a store path."""
    bad = []
    for package in ("hsstore/store", "hsstore/layouts", "hsstore/loader", "hsstore/format", "hsstore/ops"):
        for p in sorted((ROOT / package).rglob("*.py")):
            rel = str(p.relative_to(ROOT))
            if rel in DOOR | RAW_BASELINES:
                continue
            bad += [f"{rel}:{line}: {call}" for line, call in store_reads(ast.parse(p.read_text()))]
    for rel in ("hsstore/io/destination.py", "extract/show.py", "extract/export.py", "train/build.py",
                "train/evaluate.py", "train/speculative.py", "train/data.py",
                # folders from elsewhere: drafters, checkpoints, run folders, peers' files
                "train/checkpoint.py", "train/drafter_format.py", "train/metrics.py", "train/rundir.py",
                *(f"extract/peers/{p.name}" for p in sorted((ROOT / "extract" / "peers").glob("*.py")))):
        bad += [f"{rel}:{line}: {call}" for line, call in store_reads(ast.parse((ROOT / rel).read_text()))]
    assert not bad, "reads that bypass hsstore.io.door:\n" + "\n".join(bad)


# -- storage kinds: told apart only by the backends (hsstore/io/backends/); every other module asks the backend
BACKENDS = ROOT / "hsstore" / "io" / "backends"
KIND_CHECKS = {"is_local", "is_s3", "is_http"}  # the checks the backends replaced
FS_CLASSES = {"S3FileSystem", "HTTPFileSystem", "LocalFileSystem", "AbstractFileSystem.protocol"}
SCHEMES = {"s3://", "s3a://", "http://", "https://", "file://"}


def storage_kind_checks(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, what) of every place ``tree`` tells storage kinds apart itself: a call or definition of
    ``is_local``/``is_s3``/``is_http``, a filesystem's ``protocol`` read, a filesystem class named (in code or
    as a string), ``hasattr(fs, "_call_s3")``, a URL tested for a scheme (``url.startswith("s3://")``)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in KIND_CHECKS:
            out.append((node.lineno, f"def {node.name}"))
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            consts = {c.value for a in node.args for c in ast.walk(a) if isinstance(c, ast.Constant)}
            if name in KIND_CHECKS:
                out.append((node.lineno, ast.unparse(f)))
            elif name == "hasattr" and "_call_s3" in consts:
                out.append((node.lineno, ast.unparse(node)))
            elif name in ("startswith", "partition", "split") and consts & SCHEMES:
                out.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Attribute) and node.attr == "protocol" and isinstance(node.ctx, ast.Load):
            out.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, (ast.Name, ast.Attribute)) and (node.id if isinstance(node, ast.Name)
                                                              else node.attr) in FS_CLASSES:
            out.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Constant) and node.value in FS_CLASSES:
            out.append((node.lineno, repr(node.value)))
    return sorted(set(out))


def test_the_storage_kind_scanner_finds_the_checks_it_looks_for():
    src = ("a = storage.is_local(fs)\nb = receive.is_s3(fs)\ndef is_http(fs): pass\nc = fs.protocol\n"
           "d = type(fs).__name__ == 'S3FileSystem'\ne = isinstance(fs, HTTPFileSystem)\nf = hasattr(fs, '_call_s3')\n"
           "g = url.startswith(('s3://', 's3a://'))\nh = backend_for(fs).local_paths\ni = url.partition('://')\n")
    assert [line for line, _ in storage_kind_checks(ast.parse(src))] == [1, 2, 3, 4, 5, 6, 7, 8]


def test_storage_kinds_are_told_apart_only_by_the_backends():
    """Local disk, S3 and HTTP are told apart once, by their backend (``io/backends``); the door, transfers,
    listings, destinations, names, layouts, the loader, the commands, extract and train ask the backend what
    it can do, so a new backend is one module and one line in the registry."""
    bad = []
    for package in ("hsstore", "extract", "train"):
        for p in sorted((ROOT / package).rglob("*.py")):
            if p.is_relative_to(BACKENDS) or p.is_relative_to(ROOT / "hsstore" / "testing"):
                continue
            rel = p.relative_to(ROOT)
            bad += [f"{rel}:{line}: {what}" for line, what in storage_kind_checks(ast.parse(p.read_text()))]
    assert not bad, "storage kinds told apart outside hsstore/io/backends/ (ask the backend):\n" + "\n".join(bad)


# --- settings: written types, one per command -------------------------------------------------------------

GENERATORS = {"make_dataclass", "flat_class"}  # what once built settings classes at import time


def test_no_settings_class_is_generated_at_import():
    """Settings are read where they are written: no ``dataclasses.make_dataclass`` (or the schema's old
    ``flat_class``) anywhere in hsstore/, extract/ or train/, so go-to-definition and type checkers reach a line."""
    bad = []
    for absolute, path in PACKAGES.values():
        for m, p in modules_of(path).items():
            for node in ast.walk(ast.parse(p.read_text())):
                name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else (
                    node.name if isinstance(node, (ast.FunctionDef, ast.alias)) else None)
                if name in GENERATORS:
                    bad.append(f"{absolute}.{m}:{getattr(node, 'lineno', '?')} {name}")
    assert not bad, f"settings classes generated instead of written: {bad}"


def command_schemas() -> dict[str, type]:
    """{command: the schema class its flags come from} of every command of the ``hsstore`` parser (each family
    registers its commands through ``hsstore.app.commands``)."""
    import argparse

    from hsstore.app.cli import build_parser
    from hsstore.app.schema import SCHEMA_KEY

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name: parser._defaults[SCHEMA_KEY] for name, parser in sub.choices.items()}


def test_each_commands_settings_type_is_a_class_statement():
    """Every command's schema, and each of its sections, is a ``class`` statement at the top of the module it
    names as its home (not a class built by a call), and eval's flags come from one too."""
    import typing

    schemas = command_schemas()
    names = {cls.__name__ for cls in schemas.values()}
    assert {"TrainSettings", "EvalSettings", "ExtractSettings", "RegenerateSettings", "CheckSettings"} <= names
    bad = []
    for cls in {*schemas.values(), *(t for s in schemas.values() for t in typing.get_type_hints(s).values())}:
        source = Path(inspect.getsourcefile(inspect.getmodule(cls)))
        written = {n.name for n in ast.parse(source.read_text()).body if isinstance(n, ast.ClassDef)}
        if cls.__name__ not in written:
            bad.append(f"{cls.__module__}.{cls.__name__}")
    assert not bad, f"settings types without a class statement: {sorted(bad)}"


def test_the_token_budget_rule_is_written_once():
    """"sequences x longest <= token_budget" lives in hsstore.loader.batching.TokenBudget; extraction's batcher
    uses it (no second copy of the comparison in extract/forward.py)."""
    from hsstore.extract import forward
    from hsstore.loader import batching

    src = inspect.getsource(forward.token_budget_batches)
    assert "TokenBudget(" in src and "* longest" not in src and forward.TokenBudget is batching.TokenBudget


MAX_FUNCTION_LINES, MAX_PARAMETERS = 80, 16  # a newcomer reads a function on one screen; options travel grouped


def oversized_functions(source: str, where: str) -> list[str]:
    """Functions of ``source`` longer than MAX_FUNCTION_LINES or with more than MAX_PARAMETERS parameters."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            params = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES or params > MAX_PARAMETERS:
                out.append(f"{where}:{node.lineno} {node.name}: {lines} lines, {params} parameters")
    return out


def test_oversized_functions_are_found():
    body = "\n".join(f"    x{i} = {i}" for i in range(80))
    assert oversized_functions(f"def long():\n{body}\n", "m.py") == ["m.py:1 long: 81 lines, 0 parameters"]
    params = ", ".join(f"p{i}" for i in range(16))
    assert oversized_functions(f"def f({params}, *, q, **kw):\n    pass\n", "m.py") == [
        "m.py:1 f: 2 lines, 18 parameters"]
    assert oversized_functions(f"def f({params}):\n    pass\n", "m.py") == []


def test_no_function_over_80_lines_or_16_parameters():
    found = []
    for package in ("hsstore", "extract", "train"):
        for path in sorted((ROOT / package).rglob("*.py")):
            found += oversized_functions(path.read_text(), str(path.relative_to(ROOT)))
    assert not found, "split these (or group their options in a dataclass):\n" + "\n".join(found)


FORK_UNSAFE = {"Lock", "RLock"}
# locks no forked DataLoader worker inherits: the writer's (a writing process never forks loaders), the
# lock type itself, and test helpers (servers of the test process)
PLAIN_LOCKS_ALLOWED = {"locks", "store.writer"}


def test_locks_a_forked_loader_inherits_are_process_locks():
    """A thread lock copied by a fork while a parent thread holds it stays held in the child for good; every
    lock hsstore/ shares between threads is a ``locks.ProcessLock`` (see tests/test_locks.py)."""
    bad = []
    for m, p in modules_of(PACKAGES["hsstore"][1]).items():
        if m in PLAIN_LOCKS_ALLOWED or m.startswith("testing"):
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            f = node.func if isinstance(node, ast.Call) else None
            if isinstance(f, ast.Attribute) and f.attr in FORK_UNSAFE and getattr(f.value, "id", "") == "threading":
                bad.append(f"{m}:{node.lineno}")
    assert not bad, f"plain thread locks a forked worker may inherit held: {bad}"


# -- docs/ARCHITECTURE.md's lists are the code's: the modules of each floor, the modules' tables, the protocol
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
NUMBERS = {w: i for i, w in enumerate("zero one two three four five six seven eight nine ten eleven twelve".split())}


def floor_modules(text: str) -> dict[str, set[str]]:
    """Folder of hsstore/ -> the modules the "by floor" block of ARCHITECTURE.md names there (``hsstore/``: its
    top floor); a name's parenthesis (``dataset (HiddenStateDataset)``) is its gloss."""
    block = text.split("## hsstore/ — by floor", 1)[1].split("```", 2)[1]
    lists: dict[str, str] = {}
    folder = None
    for line in block.splitlines():
        if line.startswith("hsstore/"):
            folder, _, line = line.partition(" ")
            line = line.split(":", 1)[1]
        if folder is not None:
            lists[folder] = lists.get(folder, "") + " " + line
    return {f: {n.strip() for n in re.sub(r"\([^)]*\)", "", names).split(",") if n.strip()}
            for f, names in lists.items()}


def code_floors() -> dict[str, set[str]]:
    """Folder of hsstore/ -> its modules (``hsstore/``: the top floor's, without the package and its ``__main__``;
    a package inside a subpackage, ``hsstore/io/backends/``, is a folder of its own)."""
    hs = ROOT / "hsstore"
    out = {"hsstore/": {p.stem for p in hs.glob("*.py")} - TOP}
    for init in sorted(hs.rglob("*/__init__.py")):  # a subpackage's own packages too (io/backends/)
        d = init.parent
        out[f"hsstore/{d.relative_to(hs).as_posix()}/"] = {p.stem for p in d.glob("*.py")} - {"__init__"}
    return out


def table_files(text: str, heading: str) -> list[str]:
    """The files the first column of the module table under ``heading`` names, as paths from the folder the table
    is about: ``loader/dataset.py``, ``options.py`` in one row is loader/dataset.py and loader/options.py."""
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    out = []
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        folder = ""
        for name in re.findall(r"`([\w/]+\.py)`", line.split("|")[1]):
            folder = name.rpartition("/")[0] + "/" if "/" in name else folder
            out.append(name if "/" in name else folder + name)
    return out


def protocol_sentence(text: str) -> tuple[int, list[str]]:
    """(how many functions ARCHITECTURE says the layout protocol has, the functions it names)."""
    m = re.search(r"The `Layout` protocol \(`layouts/base.py`\) is (\w+) functions:(.*?)\.\s", text, re.S)
    assert m, "ARCHITECTURE.md no longer says what the layout protocol is"
    return NUMBERS[m.group(1)], re.findall(r"`(\w+)`", re.sub(r"\([^)]*\)", "", m.group(2)))


def test_the_doc_list_readers_are_found():
    text = ("## hsstore/ — by floor\n```\nhsstore/     core: errors, distributed (World), version\n"
            "hsstore/io/  bytes: storage, door (the one\n              way), sinks,\n              memory\n```\n"
            "| `io/door.py`, `receive.py` | x |\n| `env.py` | y |\n## next\n"
            "The `Layout` protocol (`layouts/base.py`) is two functions: `a` (tokens `x:y` read), and `b`. More.\n")
    assert floor_modules(text) == {"hsstore/": {"errors", "distributed", "version"},
                                   "hsstore/io/": {"storage", "door", "sinks", "memory"}}
    assert table_files(text, "```\n") == ["io/door.py", "io/receive.py", "env.py"]
    assert protocol_sentence(text) == (2, ["a", "b"])


def test_architecture_names_each_floors_modules():
    """The "by floor" block names every module of each subpackage of hsstore/, and only those."""
    named, code = floor_modules(ARCHITECTURE.read_text()), code_floors()
    wrong = [f"{d}: missing {sorted(code.get(d, set()) - named.get(d, set()))}, gone "
             f"{sorted(named.get(d, set()) - code.get(d, set()))}" for d in sorted(set(named) | set(code))
             if named.get(d) != code.get(d)]
    assert not wrong, "docs/ARCHITECTURE.md's floors are not the code's:\n" + "\n".join(wrong)


@pytest.mark.parametrize("heading,folder", [("## hsstore/ — by floor", "hsstore"),
                                            ("## extract/ — input to store", "extract"),
                                            ("## train/ — store to drafter", "train")])
def test_architecture_module_tables_name_modules_that_exist(heading, folder):
    """Every file a module table names exists; extract's and train's tables name each of their modules."""
    named = table_files(ARCHITECTURE.read_text(), heading)
    gone = sorted(n for n in named if not (ROOT / folder / n).is_file())
    assert not gone, f"docs/ARCHITECTURE.md names {folder}/ files that do not exist: {gone}"
    if folder != "hsstore":  # hsstore/'s table groups its modules by job; its floors are held above
        missing = sorted({p.relative_to(ROOT / folder).as_posix() for p in (ROOT / folder).rglob("*.py")
                          if "__pycache__" not in p.parts} - {"__init__.py"} - set(named))
        assert not missing, f"docs/ARCHITECTURE.md's {folder}/ table lacks {missing}"


def test_architecture_states_the_layout_protocol_as_the_code_has_it():
    count, names = protocol_sentence(ARCHITECTURE.read_text())
    code = [a for a, v in vars(layout.Layout).items() if not a.startswith("_") and callable(v)]
    assert (count, names) == (len(code), code), (
        f"docs/ARCHITECTURE.md says the layout protocol is {count} functions {names}; layouts/base.py has "
        f"{len(code)}: {code}")


def backend_protocol_sentence(text: str) -> list[str]:
    """The names ARCHITECTURE's sentence on the storage backend protocol gives, properties then functions."""
    m = re.search(r"The `Backend` protocol \(`io/backends/base.py`\) is (.*?)\.\s", text, re.S)
    assert m, "ARCHITECTURE.md no longer says what the storage backend protocol is"
    return re.findall(r"`(\w+)`", re.sub(r"\([^)]*\)", "", m.group(1)))


def test_architecture_states_the_backend_protocol_as_the_code_has_it():
    from hsstore.io.backends.base import Backend

    named = backend_protocol_sentence(ARCHITECTURE.read_text())
    props = [a for a, v in vars(Backend).items() if not a.startswith("_") and not callable(v)]
    funcs = [a for a, v in vars(Backend).items() if not a.startswith("_") and callable(v)]
    assert named == props + funcs, (f"docs/ARCHITECTURE.md says the backend protocol is {named}; "
                                    f"io/backends/base.py has {props + funcs}")


def test_package_doc_names_the_floors_as_they_are():
    """hsstore/__init__'s doc, where readers start, names every subpackage and the core's modules, and only those."""
    import hsstore

    doc = hsstore.__doc__
    core = re.search(r"the core \(([^)]*)\)", doc)
    assert core, "hsstore/__init__'s doc no longer names the core"
    floors = code_floors()
    assert set(re.findall(r"``(\w+)``", core.group(1))) == floors["hsstore/"]
    assert set(re.findall(r"``(\w+)``", doc[core.end():])) == {f.split("/")[1] for f in floors if f != "hsstore/"}


# -- the peers: chosen through their registry, never by comparing a name --------------------------------------
PEER_MODULES = {"extract/peers/specforge.py", "extract/peers/speculators.py", "extract/peers/dflash.py"}


def peer_name_uses(tree: ast.Module, peer_names: set[str]) -> list[str]:
    """Where ``tree`` chooses by a peer's name: a comparison with one (``fmt == "specforge"``, ``fmt in
    ("specforge", ...)``) or a dict literal keyed by one (``{"specforge": 0, ...}[fmt]``)."""
    def named(node: ast.AST) -> bool:
        items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
        return any(isinstance(x, ast.Constant) and x.value in peer_names for x in items)

    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(named(x) for x in [node.left, *node.comparators]):
            out.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Dict) and any(k is not None and named(k) for k in node.keys):
            out.append(f"line {node.lineno}: a dict keyed by a peer's name")
    return out


def test_the_peer_name_scanner_finds_the_choices_it_looks_for():
    src = ('a = fmt == "specforge"\nb = fmt in ("x", "speculators")\nc = {"specforge": 0}[fmt]\n'
           'd = get("specforge")\ne = layout == "eagle3"\n')
    assert [u.split(":")[0] for u in peer_name_uses(ast.parse(src), {"specforge", "speculators"})] == \
        ["line 1", "line 2", "line 3"]


def test_peer_code_paths_are_chosen_through_the_registry():
    """No module of hsstore/, extract/ or train/ but a peer's own compares a name to a peer's to choose a code
    path: the registry (``extract/peers``) gives the peer's module, and adding a peer touches no other file."""
    from hsstore.extract import peers

    bad = []
    for folder in ("hsstore", "extract", "train"):
        for p in sorted((ROOT / folder).rglob("*.py")):
            rel = p.relative_to(ROOT).as_posix()
            if rel not in PEER_MODULES:
                bad += [f"{rel} {u}" for u in peer_name_uses(ast.parse(p.read_text()), set(peers.names()))]
    assert not bad, "peer code paths chosen by name, not through extract/peers' registry:\n" + "\n".join(bad)
    assert {f"extract/peers/{m.rpartition('.')[2]}.py" for m in (d.module for d in peers.PEERS.values())} == \
        PEER_MODULES


def test_architecture_states_the_peer_protocol_and_registry_as_the_code_has_them():
    """ARCHITECTURE's sentences on the peers name the protocol's members and the registered peers with what each
    offers, as extract/peers has them."""
    from hsstore.extract import peers
    from hsstore.extract.peers import base

    text = ARCHITECTURE.read_text()
    m = re.search(r"The `Peer` protocol\s+\(`extract/peers/base.py`\) is (.*?)\.\s+What all", text, re.S)
    assert m, "ARCHITECTURE.md no longer says what the peer protocol is"
    said = re.findall(r"`(\w+)` \(|`(\w+)`(?:,| and|$)", re.sub(r"\([^()]*(\([^()]*\)[^()]*)*\)", "(", m.group(1)))
    members = [a for a in [*base.Peer.__annotations__, *vars(base.Peer)] if not a.startswith("_")]
    assert [a or b for a, b in said] == list(dict.fromkeys(members)), (said, members)
    d = re.search(r"declares each peer as data.*?: (.*?)\. `get", text, re.S)
    assert d, "ARCHITECTURE.md no longer lists the registered peers"
    listed = dict(re.findall(r"`(\w+)` \((export, import|export|import|neither)", d.group(1)))
    want = {n: ", ".join(w for w in peers.OFFERS if decl.offers(w)) or "neither" for n, decl in peers.PEERS.items()}
    assert listed == want
