"""Train while extracting (``hsstore train --follow``) against extract-then-train, on one machine: the demo's
extraction (the tiny trained target, its conversations) and the demo's drafter training, each way, one after the
other in one run.

  sequential  ``hsstore extract`` to the end, then ``hsstore train`` on the finished store
  follow      ``hsstore extract`` and ``hsstore train --follow`` started together on the same device

Per mode: seconds from the start to the trainer's first step (its first metrics.jsonl row, ``--log-every 1``), to
the extraction's end and to the trainer's end, and the steps trained. Both extract with the same small shards
(``--shard-mb``, zstd: the tiny target's chunks are mostly padding) so the follower has shards to take. A warm-up
extraction of a few conversations runs first (fla's Triton kernels compile on their first use: ~60 s on a fresh
GPU machine).

    python -m tools.bench_follow --dir /tmp/bf --device cuda               # the H200 row (docs/PERFORMANCE.md)
    python -m tools.bench_follow --dir /tmp/bf --device cpu --conversations 40 --epochs 1     # a CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import hsstore
from hsstore.extract.demo import TRAIN_FLAGS
from hsstore.extract.tiny import trained_files, trained_target_dir


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "hsstore", *args]


def watch(metrics: Path, procs: dict[str, subprocess.Popen], t0: float, times: dict[str, float]) -> None:
    """Until every process of ``procs`` exits: seconds after ``t0`` of ``metrics``'s first row (``first_step``)
    and of each process's exit (``<name>_done``), polled every 20 ms."""
    while True:
        now = time.perf_counter() - t0
        if "first_step" not in times and metrics.exists() and metrics.stat().st_size:
            times["first_step"] = now
        for name, p in procs.items():
            if f"{name}_done" not in times and p.poll() is not None:
                times[f"{name}_done"] = now
        if all(p.poll() is not None for p in procs.values()):
            return
        time.sleep(0.02)


def run_mode(mode: str, d: Path, extract: list[str], train: list[str], env: dict) -> dict:
    store, run = d / mode / "store", d / mode / "run"
    shutil.rmtree(d / mode, ignore_errors=True)
    (d / mode).mkdir(parents=True)
    logs = {k: (d / mode / f"{k}.log").open("w") for k in ("extract", "train")}
    argv = {"extract": [*extract, "--out", str(store)], "train": [*train, "--store", str(store), "--out", str(run)]}

    def start(name: str, *extra: str) -> subprocess.Popen:
        return subprocess.Popen(cli(*argv[name], *extra), stdout=logs[name], stderr=subprocess.STDOUT, env=env)

    times: dict[str, float] = {}
    t0 = time.perf_counter()
    if mode == "sequential":
        procs = {"extract": start("extract")}
        watch(run / "metrics.jsonl", procs, t0, times)
        procs["train"] = start("train")
    else:
        procs = {"extract": start("extract"), "train": start("train", "--follow")}
    watch(run / "metrics.jsonl", procs, t0, times)
    bad = {k: p.returncode for k, p in procs.items() if p.returncode}
    if bad:
        raise SystemExit(f"{mode}: {bad} exited non-zero; see {d / mode}/*.log")
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {"mode": mode, "first_step_s": round(times["first_step"], 2),
            "extract_done_s": round(times["extract_done"], 2), "total_s": round(max(times.values()), 2),
            "steps": rows[-1]["step"], "samples": len(hsstore.open(str(store)))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="scratch folder (each mode's store, run and logs)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: the GPU when there is one)")
    ap.add_argument("--conversations", type=int, default=None, help="the first N of the demo's (default: all)")
    ap.add_argument("--epochs", type=int, default=6, help="training epochs (the recipe's 6)")
    ap.add_argument("--shard-mb", type=float, default=1.0, help="extraction's shard size, both modes")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args(argv)

    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    rows_in = trained_files() / "conversations.jsonl"
    lines = rows_in.read_text().splitlines()
    if args.conversations:
        lines = lines[:args.conversations]
    data = d / "conversations.jsonl"
    data.write_text("\n".join(lines) + "\n")
    warm = d / "warm.jsonl"
    warm.write_text("\n".join(lines[:8]) + "\n")
    target = str(trained_target_dir())
    device = ["--device", args.device] if args.device else []
    extract = ["extract", "--model", target, "--input", str(data), "--shard-mb", str(args.shard_mb),
               "--codec", "zstd", "-q", *device]
    flags = list(TRAIN_FLAGS)  # the demo's drafter, logging every step (the first row is the first step)
    del flags[flags.index("--log-every"):flags.index("--log-every") + 2]
    train = ["train", "--epochs", str(args.epochs), *flags, "--log-every", "1", "-q", *device]
    env = {**os.environ, "HSSTORE_FOLLOW_POLL_S": os.environ.get("HSSTORE_FOLLOW_POLL_S", "2")}

    shutil.rmtree(d / "warm-store", ignore_errors=True)
    subprocess.run(cli("extract", "--model", target, "--input", str(warm), "--out", str(d / "warm-store"), "-q",
                           *device), check=True, env=env, capture_output=True)
    rows = [run_mode(m, d, extract, train, env) for m in ("sequential", "follow")]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    seq = rows[0]
    print(f"{'mode':<11} {'first step s':>12} {'extract done s':>14} {'total s':>8} {'steps':>6} {'samples':>8}")
    for r in rows:
        print(f"{r['mode']:<11} {r['first_step_s']:>12.2f} {r['extract_done_s']:>14.2f} {r['total_s']:>8.2f} "
              f"{r['steps']:>6} {r['samples']:>8}")
    fol = rows[1]
    print(f"follow / sequential: first step {fol['first_step_s'] / seq['first_step_s']:.2f}x, total "
          f"{fol['total_s'] / seq['total_s']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
