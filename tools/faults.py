"""The fault list: each guard switched off, one at a time, on a scratch copy of the repository, and the tests that
must catch it run there.

A guard that no test holds can be deleted without a test noticing. So every guard has an entry in a list under
``tools/faults/`` (one YAML file per change that added guards, any number of them), each entry a fault:

    - id: short-kebab-name               # unique over every list
      file: hsstore/format/admission.py  # relative to the repository's root
      find: |                            # exact text, found exactly once in the file
        if n_samples == 0:
      replace: |                         # what replaces it: the guard switched off or weakened
        if False:
      tests: [tests/test_admission.py]   # test files or node ids; at least one must FAIL with the fault applied
      user: "what a user would meet if this guard were gone, one sentence"

``find`` is matched as it is written, as text: YAML's ``|`` takes away the first line's indentation (a one-line
``find`` is then still found, inside its line) and ends the text with a newline. A ``find`` of several lines whose
indentation matters is written ``|2`` (each line indented by its own indentation plus four under an entry's key),
a part of a line ``|-`` (no newline at its end); a stale entry that only needs this is told so.

For each fault the tool applies the exact edit to a scratch copy (the repository's tracked files and the untracked
ones git does not ignore, as they are in the working tree now: the working tree itself is never written), runs its
tests there with pytest (``-x``: the first failure is the catch), restores the file, and says ``caught`` (a test
failed), ``SURVIVED`` (every test passed: the guard is held by nothing), ``stale`` (the file is gone or the text is
not found exactly once: the entry no longer describes the code), ``timeout`` or ``error`` (pytest could not run
the tests: a collection error, no test selected). Before the faults, each distinct set of tests runs once without
a fault (``--no-baseline`` skips it): a set that already fails cannot show a catch, and its faults are reported
``baseline fails``.

The scratch copy imports its own code: ``hsstore`` is installed in editable mode, and the editable finder maps
``hsstore.extract`` and ``hsstore.train`` to the folders ``extract/`` and ``train/`` of the checkout it was installed
from, whatever ``sys.path`` says. So each run's ``PYTHONPATH`` starts with a folder beside the copy whose
``sitecustomize`` puts a finder first on ``sys.meta_path`` that maps ``hsstore``, ``hsstore.extract`` and
``hsstore.train`` to the copy, in pytest's process and in every program a test starts. ``--self-check`` shows it:
a canary planted in each of the three packages is caught (in process and in a child process), and the same test
without the canary passes.

It is slow (each fault runs its tests from a fresh pytest), so it runs on demand, never in the test suite: before
closing a change that adds guards (``python -m tools.faults --file NAME``), its summary line goes in the note.

    python -m tools.faults                        # every fault of every list
    python -m tools.faults --file guards          # the faults of tools/faults/guards.yaml
    python -m tools.faults --only ID --only ID2   # these faults
    python -m tools.faults --list                 # what the lists hold, stale entries marked
    python -m tools.faults --jobs 2 --timeout 900 # two scratch copies at once; seconds per fault run
    python -m tools.faults --self-check           # the scratch copy imports its own code
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LISTS = Path("tools") / "faults"
KEYS = ("id", "file", "find", "replace", "tests", "user")
ID = re.compile(r"[a-z0-9]+(-[a-z0-9]+)*")
DEFAULT_TIMEOUT_S = 1200.0
# pytest's exit statuses: 0 every test passed, 1 some failed, 5 none was collected; others: it could not run them
PASSED, FAILED, NOTHING = 0, 1, 5
PACKAGES = {"hsstore": "hsstore", "hsstore.extract": "extract", "hsstore.train": "train"}

# the scratch copy's sitecustomize: a finder ahead of the editable install's that maps the three packages to the copy
SITECUSTOMIZE = '''"""Written by tools/faults.py beside a scratch copy: its packages are imported from the copy."""
import importlib.machinery
import importlib.util
import sys

ROOT = {root!r}
PACKAGES = {packages!r}


class ScratchFinder:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name not in PACKAGES:
            return None
        folder = ROOT + "/" + PACKAGES[name]
        return importlib.util.spec_from_file_location(name, folder + "/__init__.py",
                                                      submodule_search_locations=[folder])


sys.meta_path.insert(0, ScratchFinder)
'''


class FaultListError(ValueError):
    """A list that cannot be read as faults: the file and the entry named."""


@dataclass(frozen=True)
class Fault:
    """One guard switched off: ``find`` replaced by ``replace`` in ``file``; ``tests`` must fail."""

    id: str
    file: str
    find: str
    replace: str
    tests: tuple[str, ...]
    user: str
    source: str  # the list it comes from (tools/faults/NAME.yaml)


@dataclass
class Result:
    fault: Fault
    verdict: str  # caught, SURVIVED, stale, timeout, error, baseline fails
    seconds: float = 0.0
    by: str = ""  # the first failing test (caught), or why (the others)
    tail: str = ""  # the end of pytest's output, for an error


# -- the lists ------------------------------------------------------------------------------------------------
def list_files(root: Path, names: list[str] | None = None) -> list[Path]:
    """The lists under ``root/tools/faults`` (``names``: only these, by stem or file name), sorted."""
    folder = root / LISTS
    found = sorted(folder.glob("*.yaml"))
    if names:
        wanted = {Path(n).stem for n in names}
        missing = wanted - {p.stem for p in found}
        if missing:
            raise FaultListError(f"no list {', '.join(sorted(missing))} in {LISTS}/ (it holds: "
                                 f"{', '.join(p.stem for p in found) or 'none'})")
        found = [p for p in found if p.stem in wanted]
    return found


def parse_list(path: Path, root: Path) -> list[Fault]:
    """The faults of one YAML list, each entry checked for its keys and their types."""
    import yaml

    where = str(path.relative_to(root)) if path.is_relative_to(root) else str(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise FaultListError(f"{where}: not YAML ({str(e).splitlines()[0]})") from None
    if data is None:
        return []
    if not isinstance(data, list):
        raise FaultListError(f"{where}: a list of faults expected, found {type(data).__name__}")
    out = []
    for n, entry in enumerate(data, 1):
        what = f"{where}: entry {n}" + (f" ({entry.get('id')!r})" if isinstance(entry, dict) else "")
        if not isinstance(entry, dict) or set(entry) != set(KEYS):
            keys = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
            raise FaultListError(f"{what}: needs exactly the keys {', '.join(KEYS)}; has {keys}")
        if not all(isinstance(entry[k], str) and entry[k] for k in ("id", "file", "find", "user")) or not isinstance(
                entry["replace"], str):
            raise FaultListError(f"{what}: id, file, find and user must be non-empty text, replace text")
        if not ID.fullmatch(entry["id"]):
            raise FaultListError(f"{what}: the id must be short-kebab-case")
        tests = entry["tests"]
        if not isinstance(tests, list) or not tests or not all(isinstance(t, str) and t for t in tests):
            raise FaultListError(f"{what}: tests must be a non-empty list of test files or node ids")
        if entry["find"] == entry["replace"]:
            raise FaultListError(f"{what}: replace is the text it replaces: no fault")
        out.append(Fault(entry["id"], entry["file"], entry["find"], entry["replace"], tuple(tests), entry["user"],
                         where))
    return out


def load(root: Path = ROOT, names: list[str] | None = None) -> list[Fault]:
    """Every fault of the lists (``names``: of these lists only), ids unique over all of them."""
    faults: list[Fault] = []
    seen: dict[str, str] = {}
    for path in list_files(root, names):
        for f in parse_list(path, root):
            if f.id in seen:
                raise FaultListError(f"{f.source}: fault id {f.id!r} is also in {seen[f.id]}")
            seen[f.id] = f.source
            faults.append(f)
    return faults


def stale(fault: Fault, root: Path) -> str | None:
    """Why ``fault`` no longer applies to the code under ``root`` (None: it applies): its file gone, its text
    found other than exactly once, a test file it names gone."""
    path = root / fault.file
    if not path.is_file():
        return f"{fault.file} does not exist"
    text = path.read_text(encoding="utf-8")
    n = text.count(fault.find)
    if n != 1:
        return f"its find text occurs {n} times in {fault.file}, not once" + indent_hint(fault.find, text)
    gone = [t for t in fault.tests if not (root / t.split("::", 1)[0]).is_file()]
    if gone:
        return f"no test file {', '.join(gone)}"
    return None


def indent_hint(find: str, text: str) -> str:
    """What to write when a multi-line ``find`` is in ``text`` once, only indented further: YAML's ``|`` takes the
    first line's indentation away, ``|2`` keeps what lies past the key's indentation plus two."""
    lines = find.split("\n")
    for k in range(1, 41):
        pad = " " * k
        if len(lines) > 1 and text.count("\n".join(pad + ln if ln else ln for ln in lines)) == 1:
            return (f" (it occurs once indented {k} more spaces: a multi-line find keeps its indentation as "
                    "`find: |2` under an entry's key, each line indented by its own indentation plus four)")
    return ""


# -- the scratch copy -----------------------------------------------------------------------------------------
def repository_files(root: Path) -> list[str]:
    """The files of the working tree a scratch copy holds: tracked ones, and untracked ones git does not ignore
    (a change not committed yet is what is checked), each as it is now."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         capture_output=True, check=True).stdout.decode("utf-8", "surrogateescape")
    return sorted({p for p in out.split("\0") if p and os.path.lexists(root / p)})


class Scratch:
    """A copy of the repository's files in a temporary folder, with the ``sitecustomize`` that makes its Python
    import the copy's packages (module docstring); faults are applied to it one at a time and restored."""

    def __init__(self, root: Path, files: list[str]) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="hsstore-faults-"))
        self.root = self.base / "repo"
        for rel in files:
            dst = self.root / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / rel, dst, follow_symlinks=False)
        site = self.base / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE.format(root=str(self.root), packages=PACKAGES))
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = os.pathsep.join([str(site), str(self.root)])
        # a fault that lets a model folder's code run has transformers copy it here, not into the user's cache
        self.env["HF_MODULES_CACHE"] = str(self.base / "hf-modules")
        self.env.pop("PYTEST_ADDOPTS", None)

    def remove(self) -> None:
        shutil.rmtree(self.base, ignore_errors=True)

    def apply(self, fault: Fault) -> bytes:
        """Apply ``fault``'s edit; returns the file's bytes before it, for ``restore``."""
        path = self.root / fault.file
        before = path.read_bytes()
        text = before.decode("utf-8")
        if text.count(fault.find) != 1:
            raise FaultListError(f"{fault.id}: its find text occurs {text.count(fault.find)} times in {fault.file}")
        path.write_text(text.replace(fault.find, fault.replace), encoding="utf-8")
        return before

    def restore(self, fault: Fault, before: bytes) -> None:
        path = self.root / fault.file
        path.write_bytes(before)
        if path.read_bytes() != before:
            raise RuntimeError(f"{path}: not restored after fault {fault.id}")

    def pytest(self, tests: tuple[str, ...], timeout_s: float) -> tuple[int | None, str, float]:
        """(pytest's exit status, or None past ``timeout_s``; its output; seconds) of ``tests`` in the copy."""
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
        return run(cmd, self.root, self.env, timeout_s)

    def where_imported(self) -> dict[str, str]:
        """The file each of the three packages is imported from by the copy's Python (from another folder)."""
        code = ("import importlib\nfor name in {names!r}:\n    print(name, importlib.import_module(name).__file__)\n"
                ).format(names=list(PACKAGES))
        rc, out, _ = run([sys.executable, "-c", code], self.base, self.env, 300)
        if rc != 0:
            raise RuntimeError(f"the scratch copy's Python could not import hsstore:\n{out[-2000:]}")
        return dict(line.split(" ", 1) for line in out.splitlines() if line.split(" ", 1)[0] in PACKAGES)


def run(cmd: list[str], cwd: Path, env: dict[str, str], timeout_s: float) -> tuple[int | None, str, float]:
    """(exit status or None past ``timeout_s``, stdout and stderr, seconds) of ``cmd``; past its time the
    program and everything it started (its own process group) are ended."""
    t0 = time.monotonic()
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            if proc.poll() is None or rc is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        log.seek(0)
        return rc, log.read(), time.monotonic() - t0


def first_failure(output: str) -> str:
    """The first ``FAILED``/``ERROR`` node id of pytest's short summary."""
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" ", 1)[1].split(" - ", 1)[0].strip()
    return "a test failed"


def verdict(fault: Fault, rc: int | None, output: str, seconds: float) -> Result:
    if rc is None:
        return Result(fault, "timeout", seconds, "past the time allowed", output[-3000:])
    if rc == FAILED:
        return Result(fault, "caught", seconds, first_failure(output))
    if rc == PASSED:
        return Result(fault, "SURVIVED", seconds, "every test passed")
    why = "no test was selected" if rc == NOTHING else f"pytest could not run the tests (exit status {rc})"
    return Result(fault, "error", seconds, why, output[-3000:])


# -- the run --------------------------------------------------------------------------------------------------
class Runner:
    """Faults run on ``jobs`` scratch copies at once, each copy running one fault at a time."""

    def __init__(self, root: Path, jobs: int, timeout_s: float, say=print) -> None:
        self.root, self.jobs, self.timeout_s, self.say = root, max(1, jobs), timeout_s, say
        self._free: list[Scratch] = []
        self._lock = threading.Lock()

    def __enter__(self) -> "Runner":
        files = repository_files(self.root)
        self._all = [Scratch(self.root, files) for _ in range(self.jobs)]
        self._free = list(self._all)
        return self

    def __exit__(self, *exc) -> None:
        for s in self._all:
            s.remove()

    def _take(self) -> Scratch:
        with self._lock:
            return self._free.pop()

    def _give(self, s: Scratch) -> None:
        with self._lock:
            self._free.append(s)

    def check_imports(self) -> None:
        """Refuse to run when the copy's Python imports a package from anywhere but the copy."""
        s = self._all[0]
        where = s.where_imported()
        wrong = {k: v for k, v in where.items() if not Path(v).resolve().is_relative_to(s.root.resolve())}
        if wrong or set(where) != set(PACKAGES):
            raise RuntimeError(f"the scratch copy imports {wrong or where} from outside {s.root}")

    def baseline(self, faults: list[Fault]) -> dict[tuple[str, ...], Result]:
        """Each distinct set of tests once, without a fault: those that fail already."""
        sets = sorted({f.tests for f in faults})

        def one(tests: tuple[str, ...]) -> tuple[tuple[str, ...], Result]:
            s = self._take()
            try:
                rc, out, secs = s.pytest(tests, self.timeout_s)
            finally:
                self._give(s)
            res = verdict(Fault("baseline", "", "", "", tests, "", ""), rc, out, secs)
            self.say(f"baseline  {'passes' if res.verdict == 'SURVIVED' else 'FAILS'}  {' '.join(tests)} "
                     f"({secs:.0f} s)")
            return tests, res

        with ThreadPoolExecutor(self.jobs) as pool:
            return dict(pool.map(one, sets))

    def one(self, fault: Fault) -> Result:
        s = self._take()
        try:
            why = stale(fault, s.root)
            if why:
                return Result(fault, "stale", 0.0, why)
            before = s.apply(fault)
            try:
                rc, out, secs = s.pytest(fault.tests, self.timeout_s)
            finally:
                s.restore(fault, before)
            return verdict(fault, rc, out, secs)
        finally:
            self._give(s)

    def run(self, faults: list[Fault], baseline: bool = True) -> list[Result]:
        broken: dict[tuple[str, ...], Result] = {}
        if baseline:
            runnable = [f for f in faults if not stale(f, self.root)]
            broken = {t: r for t, r in self.baseline(runnable).items() if r.verdict != "SURVIVED"}
        todo = [f for f in faults if f.tests not in broken]
        results = {f.id: Result(f, "baseline fails", 0.0, f"without the fault: {broken[f.tests].by}",
                                broken[f.tests].tail) for f in faults if f.tests in broken}

        def go(f: Fault) -> Result:
            res = self.one(f)
            self.say(line(res))
            return res

        with ThreadPoolExecutor(self.jobs) as pool:
            for res in pool.map(go, todo):
                results[res.fault.id] = res
        return [results[f.id] for f in faults]


def line(r: Result) -> str:
    return f"{r.verdict:<9} {r.fault.id}  ({r.seconds:.0f} s; {r.by})"


def table(results: list[Result]) -> str:
    """The results as a Markdown table, in list order."""
    rows = ["| fault | list | result | by | s |", "|---|---|---|---|---|"]
    rows += [f"| {r.fault.id} | {Path(r.fault.source).stem} | {r.verdict} | {r.by.replace('|', '/')} | "
             f"{r.seconds:.0f} |" for r in results]
    return "\n".join(rows)


def summary(results: list[Result], seconds: float, lists: list[str]) -> str:
    counts = {v: sum(r.verdict == v for r in results) for v in
              ("caught", "SURVIVED", "stale", "error", "timeout", "baseline fails")}
    shown = ", ".join(f"{n} {v.lower() if v == 'SURVIVED' else v}" for v, n in counts.items() if n or v == "caught")
    return (f"fault list: {len(results)} fault(s), {shown} ({', '.join(lists)}) in {seconds / 60:.0f} min "
            f"{seconds % 60:.0f} s")


# -- the self-check -------------------------------------------------------------------------------------------
CANARY_TEST = "tests/test_zz_fault_canary.py"
CANARY_SOURCE = '''"""Written by tools/faults.py --self-check into its scratch copy only."""
import subprocess
import sys

import hsstore
import hsstore.extract
import hsstore.train

PROBE = ("import hsstore, hsstore.extract, hsstore.train; "
         "print(hsstore.CANARY, hsstore.extract.CANARY, hsstore.train.CANARY)")


def test_no_canary_in_process():
    assert (hsstore.CANARY, hsstore.extract.CANARY, hsstore.train.CANARY) == ("none", "none", "none")


def test_no_canary_in_a_child_process(tmp_path):
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["none", "none", "none"], out.stdout
'''


def self_check(root: Path, timeout_s: float, say=print) -> bool:
    """Canaries on a scratch copy: the three packages imported from the copy, a planted canary in each caught
    in process and in a child process, and the same test without a canary passing. True when all hold."""
    files = repository_files(root)
    s = Scratch(root, files)
    try:
        where = s.where_imported()
        ok = set(where) == set(PACKAGES) and all(Path(v).resolve().is_relative_to(s.root.resolve())
                                                 for v in where.values())
        say(f"{'ok' if ok else 'WRONG'}  imported from the copy: " + ", ".join(f"{k} {v}" for k, v in where.items()))
        (s.root / CANARY_TEST).write_text(CANARY_SOURCE)
        inits = {name: s.root / folder / "__init__.py" for name, folder in PACKAGES.items()}
        for path in inits.values():
            path.write_text(path.read_text() + '\nCANARY = "none"\n')
        for name, folder in PACKAGES.items():
            for test in ("test_no_canary_in_process", "test_no_canary_in_a_child_process"):
                planted = Fault(f"canary-{folder}", f"{folder}/__init__.py", 'CANARY = "none"\n',
                                'CANARY = "planted"\n', (f"{CANARY_TEST}::{test}",), "", "self-check")
                before = s.apply(planted)
                try:
                    res = verdict(planted, *s.pytest(planted.tests, timeout_s))
                finally:
                    s.restore(planted, before)
                good = res.verdict == "caught"
                ok &= good
                say(f"{'ok' if good else 'WRONG'}  a canary in {name} ({test}): {res.verdict}")
        res = verdict(Fault("canary-none", "", "", "", (CANARY_TEST,), "", ""), *s.pytest((CANARY_TEST,), timeout_s))
        good = res.verdict == "SURVIVED"
        ok &= good
        say(f"{'ok' if good else 'WRONG'}  no canary (a no-op fault): {res.verdict.lower()}")
        return ok
    finally:
        s.remove()


# -- the command ----------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.faults", allow_abbrev=False,
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--file", action="append", metavar="NAME",
                   help="only the faults of tools/faults/NAME.yaml (repeatable; default: every list)")
    p.add_argument("--only", action="append", metavar="ID", help="only this fault (repeatable)")
    p.add_argument("--list", action="store_true", help="print the faults (stale ones marked) and run nothing")
    p.add_argument("--jobs", type=int, default=1, help="scratch copies running faults at once (default 1)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"seconds one fault's tests may run (default {DEFAULT_TIMEOUT_S:.0f})")
    p.add_argument("--no-baseline", action="store_true", help="skip running each set of tests without a fault first")
    p.add_argument("--self-check", action="store_true",
                   help="check that a scratch copy imports its own code (canaries), and run nothing else")
    args = p.parse_args(argv)
    if args.self_check:
        return 0 if self_check(ROOT, args.timeout) else 1
    try:
        faults = load(ROOT, args.file)
    except FaultListError as e:
        print(f"tools.faults: {e}", file=sys.stderr)
        return 2
    if args.only:
        unknown = sorted(set(args.only) - {f.id for f in faults})
        if unknown:
            print(f"tools.faults: no fault {', '.join(unknown)} in the lists read", file=sys.stderr)
            return 2
        faults = [f for f in faults if f.id in args.only]
    lists = sorted({f.source for f in faults}) or [str(LISTS)]
    if args.list:
        for f in faults:
            why = stale(f, ROOT)
            print(f"{f.id}  [{Path(f.source).stem}] {f.file}{'  STALE: ' + why if why else ''}\n    tests: "
                  f"{' '.join(f.tests)}\n    user: {f.user}")
        return 0
    t0 = time.monotonic()
    with Runner(ROOT, args.jobs, args.timeout) as runner:
        runner.check_imports()
        results = runner.run(faults, baseline=not args.no_baseline)
    for r in results:
        if r.tail and r.verdict in ("error", "timeout", "baseline fails"):
            print(f"\n--- {r.fault.id}: {r.verdict} ({r.by}); the end of pytest's output:\n{r.tail[-1500:]}")
    print("\n" + table(results))
    print(summary(results, time.monotonic() - t0, lists))
    return 0 if all(r.verdict == "caught" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
