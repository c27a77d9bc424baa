"""What one fuzz case runs and checks, shared by the store fuzzer (``tools/fuzz_store.py``) and the families beyond
a store's files (``tools/fuzz_boundaries.py``), below both so neither imports the other: a command run under its
alarm with its output captured and the oracles it broke, the digest of a tree that must never change, and the
random setting of a JSON document's member a mutator makes."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

COMMAND_S = 30  # seconds a command may take on a tiny store (they take well under 2)
MEMORY_MB = 512  # growth of the driver's peak resident set a case may cause


# values a forger puts where a store's JSON holds one: wrong types, extremes, escapes, paths
HOSTILE = [True, False, None, -1, 0, 2 ** 31, 10 ** 30, 1e308, "x" * 5000, "", "\x1b[2J\x07\n", [], {}, [1, 2],
           {"a": 1}, "../../etc/passwd", "/etc/passwd", "a/../../b", 1.5]


def digest(ids, mask, feats) -> str:
    """SHA-256 over a sample's token ids, loss mask and feature bits: what a served sample is compared by."""
    h = hashlib.sha256()
    for a in (ids, mask, feats):
        h.update(bytes(memoryview(a.contiguous().view(-1).view(__import__("torch").uint8).numpy())))
    return h.hexdigest()


def item_digest(item: dict) -> str:
    return digest(item["input_ids"].to(__import__("torch").int64), item["loss_mask"].to(__import__("torch").uint8),
                  item["hidden_states"])


def tree_digest(root: Path) -> str:
    """Every file's name, mode, size, mtime and bytes under ``root`` (links as their target; of a file over 64 MiB,
    a sparse one a mutator made, its first and last MiB): what must never change."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_symlink():
            h.update(os.readlink(p).encode())
        elif p.is_file():
            st = p.stat()
            h.update(f"{st.st_mode:o} {st.st_size} {st.st_mtime_ns}".encode())
            with open(p, "rb") as f:
                if st.st_size <= 64 << 20:
                    h.update(f.read())
                else:
                    h.update(f.read(1 << 20))
                    f.seek(st.st_size - (1 << 20))
                    h.update(f.read())
    return h.hexdigest()


def set_random(rng: random.Random, doc: Any, value: Any) -> str:
    """Set a random leaf or member of ``doc`` (a parsed JSON object) to ``value``; the path changed."""
    path, node = [], doc
    while isinstance(node, (dict, list)) and node and (not path or rng.random() < 0.7):
        key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
        path.append(key)
        if not isinstance(node[key], (dict, list)) or not node[key]:
            break
        node = node[key]
    if not path:
        return "(nothing)"
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    parent[path[-1]] = copy.deepcopy(value)
    return "/".join(map(str, path))


class _Alarm(BaseException):
    """A command past its time. Not an ``Exception``: a command's own ``except Exception`` must not turn it into a
    refusal (and, were it caught anyway, ``_FIRED`` still says the time ran out)."""


_FIRED = [False]


def _alarm(signum, frame):
    _FIRED[0] = True
    raise _Alarm()


def _captured(fn) -> tuple[Any, str, str]:
    """(result or exception, stdout, stderr) of ``fn()`` with descriptors 1 and 2 captured (logging included)."""
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    saved = os.dup(1), os.dup(2)
    sys.stdout.flush(), sys.stderr.flush()
    os.dup2(out.fileno(), 1), os.dup2(err.fileno(), 2)
    try:
        try:
            result = fn()
        except BaseException as e:  # noqa: BLE001 (what escapes is what is counted)
            result = e
        sys.stdout.flush(), sys.stderr.flush()
    finally:
        os.dup2(saved[0], 1), os.dup2(saved[1], 2)
        os.close(saved[0]), os.close(saved[1])
    out.seek(0), err.seek(0)
    return result, out.read().decode(errors="replace"), err.read().decode(errors="replace")


def _is_refusal(e: BaseException) -> bool:
    from hsstore.errors import StoreError

    return isinstance(e, (StoreError, ValueError, OSError))


def run_command(name: str, fn: Callable[[], Any], refusals_raise: bool = False,
                log_dir: Path | None = None, keep: list[str] | None = None) -> tuple[dict, list[str], Any]:
    """Run one command (``fn``: ``main(argv)``, or a loader epoch when ``refusals_raise``) under the alarm with its
    output captured: what it gave (``rc``, seconds, memory growth ``mb`` and absolute peak ``peak_mb``), the
    oracles it broke (a traceback, a hang, a refusal of more than one line, memory, a raw escape sequence) and what
    ``fn`` returned (or raised). ``keep``: its stdout and stderr appended, for the caller's own oracles."""
    from tools.measure import peak_rss_mb, reset_peak_rss

    base = reset_peak_rss()
    _FIRED[0] = False
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(COMMAND_S)
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        got, out, err = _captured(fn)
    finally:
        signal.alarm(0)
    if _FIRED[0] and not isinstance(got, _Alarm):  # the alarm was swallowed by the command: still past its time
        got = _Alarm()
    peak = peak_rss_mb()
    if keep is not None:
        keep += [out, err]
    r = {"s": round(time.perf_counter() - t0, 2), "cpu_s": round(time.process_time() - c0, 2),
         "mb": round(peak - base, 1), "peak_mb": round(peak, 1)}
    failures = []
    if isinstance(got, _Alarm):
        failures.append(f"{name}: hang (over {COMMAND_S} s)")
    elif refusals_raise:
        if isinstance(got, BaseException) and not _is_refusal(got):
            failures.append(f"{name}: traceback {type(got).__name__}: {str(got)[:200]}")
        r["rc"] = "refused" if isinstance(got, BaseException) else 0
    elif isinstance(got, BaseException) and not (isinstance(got, SystemExit) and got.code == 2):
        failures.append(f"{name}: traceback {type(got).__name__}: {str(got)[:200]}")
    else:  # (argparse and --config's refusals end in SystemExit(2), as a user sees them: exit 2)
        got = 2 if isinstance(got, SystemExit) else got
        r["rc"] = got
        lines = [ln for ln in err.splitlines() if ln.strip() and "%|" not in ln
                 and not ln.startswith(("WARNING", "INFO", "DEBUG"))]
        if got == 2 and len(lines) != 1:
            failures.append(f"{name}: error of {len(lines)} lines: {err[-300:]!r}")
        if "Traceback" in err:
            failures.append(f"{name}: traceback printed")
    if r["mb"] > MEMORY_MB:
        failures.append(f"{name}: memory +{r['mb']:.0f} MB")
    printed = "" if isinstance(got, BaseException) and not isinstance(got, SystemExit) else out + err
    if "\x1b" in printed or "\x07" in printed:
        failures.append(f"{name}: a store's escape sequence printed raw")
    if failures and log_dir is not None and log_dir.is_dir():  # what it printed, kept with the case
        (log_dir / f"{name}.output").write_text(f"{got!r}\n-- stdout --\n{out}\n-- stderr --\n{err}")
    return r, failures, got


# -- what both fuzzers' families share: the commands' fast settings, deadlines, forging steps --------------------
DEADLINES = {"HSSTORE_REQUEST_S": "2", "HSSTORE_HEAD_S": "5"}
FAST = ["--token-budget", "1024", "--draft-layers", "1", "--block-size", "8", "--anchors", "32", "--log-every", "1",
        "--device", "cpu", "-q"]
HOSTILE_JSON = [True, None, -1, 0, 2 ** 31, 10 ** 30, 1e308, "x" * 5000, "", "\x1b[2J\x07\n", [], {}, [1, 2],
                {"a": 1}, "../../etc/passwd", "/etc/passwd", 1.5, 2_000_000]


def read_since(atimes: dict[str, int]) -> list[str]:
    """Sentinel files read since ``age_atimes``."""
    return [p for p, t in atimes.items() if os.path.exists(p) and os.stat(p).st_atime_ns != t]


def replace_path(p: Path, make: Callable[[Path], None]) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    elif p.exists() or p.is_symlink():
        p.unlink()
    p.parent.mkdir(parents=True, exist_ok=True)
    make(p)


PASSWD = b"root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534::/nonexistent:/usr/sbin/nologin\n"


def link_or_odd(rng: random.Random, p: Path, sentinel: Path) -> str:
    """``p`` made a link (to the sentinel's secret or victim folder, /dev/zero, the sentinel's stand-in for
    /etc/passwd: never the machine's own, which a command's bug or the forger's would change for real), a FIFO, or
    sparse and huge."""
    kind = rng.choice(["secret", "victim", "zero", "passwd", "fifo", "huge"])
    if kind == "huge":
        if p.is_file():
            os.truncate(p, rng.choice([3 << 30, 1 << 40]))
            return f"huge {p.name}"
        kind = "fifo"
    target = {"secret": sentinel / "secret", "victim": sentinel / "victim", "zero": Path("/dev/zero"),
              "passwd": sentinel / "passwd"}.get(kind)
    replace_path(p, os.mkfifo if kind == "fifo" else (lambda q: os.symlink(target, q)))
    return f"{kind} at {p.name}"


def guard_forging(work: Path) -> None:
    """From now on in this process (the one that forges cases), a file under ``work`` is never opened for writing
    nor truncated through a link: a later mutation of a case writing where an earlier one planted a link (to the
    sentinel, or to a system file) raises ``PermissionError``, which the forge names, instead of writing through
    it (an end record planted through a link an earlier mutation had made overwrote /etc/passwd). The drivers,
    which run hsstore's commands, have no such guard: what they write through a link is what the sentinels catch."""
    root = os.path.realpath(work)
    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and bool(flags & writes))
        elif event == "os.truncate":
            path, writing = args[0], True
        else:
            return
        if not writing or not isinstance(path, (str, os.PathLike)):
            return
        p = os.path.abspath(os.fspath(path))
        if not p.startswith(root + os.sep):
            return
        cur = root
        for part in p[len(root) + 1:].split(os.sep):
            cur = os.path.join(cur, part)
            if os.path.islink(cur):
                raise PermissionError(f"{p}: not written through the link {cur} (an earlier mutation)")

    sys.addaudithook(hook)


def plain_file(p: Path) -> bool:
    """A regular file of a size a mutator may read (not a FIFO, a link or a sparse giant an earlier one made)."""
    return p.is_file() and not p.is_symlink() and p.stat().st_size < 16 << 20


def json_edit(rng: random.Random, p: Path) -> str:
    if not plain_file(p):
        return f"json {p.name}: not a plain file now"
    if rng.random() < 0.25:
        body = rng.choice([b"[" * 200_000 + b"]" * 200_000, b'{"a": ' + b"7" * 20000 + b"}", b"\xff\xfe",
                           b"{", b"", os.urandom(64), b'{"a": NaN}'])
        p.write_bytes(body)
        return f"odd json {p.name}"
    try:
        doc = json.loads(p.read_text())
    except (ValueError, RecursionError):  # an earlier mutation made it not JSON
        return f"json {p.name}: not JSON now"
    where = set_random(rng, doc, rng.choice(HOSTILE_JSON))
    p.write_text(json.dumps(doc))
    return f"json {p.name}:{where}"


def sentinel_failures(case: dict, d: Path) -> list[str]:
    """What a case did to the files it must never touch: the sentinel's files read since the case began, or its
    tree changed."""
    out = []
    read = read_since(case["atimes"])
    if read:
        out.append(f"read outside: {read[:2]}")
    if tree_digest(d / "sentinel") != case["sentinel"]:
        out.append("sentinel tree changed")
    return out
