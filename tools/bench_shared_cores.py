"""The demo and the fast test tier on a machine whose cores others use: each run idle and beside busy loops (one
busy Python loop per core by default, what a neighbour's job looks like), the wall time of each and the load
average seen, as a user on a shared node meets them (docs/PERFORMANCE.md, "Shared cores").

    python -m tools.bench_shared_cores --what demo,fast --busy 2 --json out.json
    python -m tools.bench_shared_cores --what demo --variants default,before   # with the old thread choice

Variants: ``default`` (hsstore's choice: one CPU thread for the tiny models, OpenMP waiting passively) and
``before`` (what hsstore did before choosing: torch's default threads, every core, with OpenMP's active wait;
``--cpu-threads`` given the cores and ``OMP_WAIT_POLICY=ACTIVE``). The goal the figures are held to: beside the
busy loops each run takes at most twice its idle time. Each run is a fresh process; the busy loops are this
script's own children, ended by their ids. The fast tier's ``before`` is left out: the tests choose their threads
in tests/conftest.py, which ``before`` cannot reach.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUSY = "while True:\n    pass\n"


def load() -> list[float]:
    """The 1, 5 and 15 minute load averages (what ``uptime`` prints)."""
    return [round(x, 2) for x in os.getloadavg()]


def start_busy(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(n)]


def stop_busy(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()  # by its own id: this script's child
    for p in procs:
        p.wait()


def command(what: str, variant: str, workdir: Path) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of one run."""
    env = dict(os.environ)
    cores = len(os.sched_getaffinity(0))
    if what == "demo":
        argv = [sys.executable, "-m", "hsstore", "demo", "--out", str(workdir / "demo"), "-q"]
        if variant == "before":
            argv += ["--cpu-threads", str(cores)]
            env["OMP_WAIT_POLICY"] = "ACTIVE"
        return argv, env
    if what == "fast":
        return [sys.executable, "-m", "pytest", "-q", "-m", "fast", "-p", "no:cacheprovider", "-x"], env
    raise ValueError(f"unknown run {what!r} (demo, fast)")


def run_once(what: str, variant: str, busy: int, timeout: float) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix=f"bench-shared-{what}-"))
    argv, env = command(what, variant, workdir)
    procs = start_busy(busy)
    try:
        time.sleep(2.0 if busy else 0.0)  # the loops running before the clock starts
        before = load()
        t0 = time.perf_counter()
        r = subprocess.run(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=timeout)
        seconds = time.perf_counter() - t0
        after = load()
    finally:
        stop_busy(procs)
        shutil.rmtree(workdir, ignore_errors=True)
    tail = r.stdout.strip().splitlines()[-1:] if r.stdout.strip() else []
    return {"what": what, "variant": variant, "busy_loops": busy, "seconds": round(seconds, 1), "rc": r.returncode,
            "load_before": before, "load_after": after, "last_line": tail[0][:200] if tail else ""}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--what", default="demo,fast", help="runs: demo, fast (comma-separated)")
    p.add_argument("--variants", default="default", help="default, before (comma-separated; demo only for before)")
    p.add_argument("--busy", type=int, default=len(os.sched_getaffinity(0)),
                   help="busy loops beside the loaded runs (default: one per core)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds one run may take")
    p.add_argument("--json", metavar="FILE", help="write the results here as JSON too")
    args = p.parse_args(argv)
    results = []
    for what in args.what.split(","):
        for variant in args.variants.split(","):
            if what == "fast" and variant == "before":
                continue
            for busy in (0, args.busy):
                r = run_once(what, variant, busy, args.timeout)
                results.append(r)
                print(f"{what:>5} {variant:>8} beside {busy} busy loop(s): {r['seconds']:7.1f} s (exit {r['rc']}; "
                      f"load {r['load_before']} -> {r['load_after']})", flush=True)
    for what in args.what.split(","):
        for variant in args.variants.split(","):
            pair = [r for r in results if r["what"] == what and r["variant"] == variant]
            if len(pair) == 2:
                idle, busy = pair
                print(f"{what} ({variant}): beside {busy['busy_loops']} busy loops {busy['seconds'] / idle['seconds']:.2f}x "
                      "its idle time")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
