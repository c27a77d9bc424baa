"""The demo and the fast test tier on a machine whose cores others use: each run idle and beside busy loops (one
busy Python loop per core by default, what a neighbour's job looks like), the wall time of each, the CPU time the
run itself took (its processes' user + system) and the load average seen while it ran, as a user on a shared node
meets them (docs/PERFORMANCE.md, "Shared cores"). On a machine others use too, the wall time follows their load as
much as the busy loops: the CPU time says what the run cost, and its share of the wall time what it was given.

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
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
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
        argv = [sys.executable, "-m", "hsstore", "demo", "--out", str(workdir / "demo")]  # its log as a user gets it
        if variant == "before":
            argv += ["--cpu-threads", str(cores)]
            env["OMP_WAIT_POLICY"] = "ACTIVE"
        return argv, env
    if what == "fast":
        return [sys.executable, "-m", "pytest", "-q", "-m", "fast", "-p", "no:cacheprovider"], env
    raise ValueError(f"unknown run {what!r} (demo, fast)")


class LoadSampler:
    """The 1-minute load average every ``every`` seconds while a run lasts: its mean is the load the run met."""

    def __init__(self, every: float = 5.0) -> None:
        self.every, self.samples, self._stop = every, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> "LoadSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def mean(self) -> float:
        return round(sum(self.samples) / len(self.samples), 1) if self.samples else round(os.getloadavg()[0], 1)


def children_cpu() -> float:
    """CPU seconds (user + system) of this script's finished children so far."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_once(what: str, variant: str, busy: int, timeout: float) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix=f"bench-shared-{what}-"))
    argv, env = command(what, variant, workdir)
    procs = start_busy(busy)
    try:
        time.sleep(2.0 if busy else 0.0)  # the loops running before the clock starts
        cpu0 = children_cpu()
        with LoadSampler() as sampled:
            t0 = time.perf_counter()
            r = subprocess.run(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               timeout=timeout)
            seconds = time.perf_counter() - t0
        cpu = children_cpu() - cpu0  # the run's own (the busy loops are still running: not yet counted)
    finally:
        stop_busy(procs)
        shutil.rmtree(workdir, ignore_errors=True)
    tail = r.stdout.strip().splitlines()[-1:] if r.stdout.strip() else []
    return {"what": what, "variant": variant, "busy_loops": busy, "seconds": round(seconds, 1),
            "cpu_seconds": round(cpu, 1), "cpu_share": round(cpu / seconds, 2), "rc": r.returncode,
            "load_mean": sampled.mean, "carriage_returns": r.stdout.count("\r"),
            "last_line": tail[0][:200] if tail else ""}


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
                print(f"{what:>5} {variant:>8} beside {busy} busy loop(s): {r['seconds']:7.1f} s wall, "
                      f"{r['cpu_seconds']:7.1f} s CPU (exit {r['rc']}; load {r['load_mean']} on average)", flush=True)
    for what in args.what.split(","):
        for variant in args.variants.split(","):
            pair = [r for r in results if r["what"] == what and r["variant"] == variant]
            if len(pair) == 2:
                idle, busy = pair
                print(f"{what} ({variant}): beside {busy['busy_loops']} busy loops "
                      f"{busy['seconds'] / idle['seconds']:.2f}x its idle wall time, "
                      f"{busy['cpu_seconds'] / idle['cpu_seconds']:.2f}x its CPU time")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
