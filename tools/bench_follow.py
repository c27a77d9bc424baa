"""Train while extracting (``hsstore train --follow``) against extract-then-train, on one machine, each way, one
after the other in one run.

  sequential  the extraction to the end, then ``hsstore train`` on the finished store
  follow      the extraction and ``hsstore train --follow`` started together on the same device

Two targets (``--target``):

  demo   (default) ``hsstore extract`` of the demo's tiny trained target over its conversations, and the demo's
         drafter training. Both extract with the same small shards (``--shard-mb``, zstd: the tiny target's chunks
         are mostly padding) so the follower has shards to take.
  bench  the random-weight Qwen3.5 target at 27B shape built on the device (``tools.bench_extract --modes ""
         --keep STORE``: 64 layers, hidden 5,120, taps 1,16,31,46,61), synthetic samples: a size where the
         extraction takes minutes. Flags this script does not know go to ``tools.bench_extract`` (the target's
         shape, ``--samples``, ``--min-len``, ``--max-len``, ``--token-budget``); the default 100 samples of
         3,072-4,096 tokens are about 364K tokens, 18.7 GB of features (51,200 bytes a token), about a minute
         of the eager forward on one GPU, in 256 MB shards. The drafter is one draft layer of the target's
         shape, 8,192-token batches, 128 anchors, one epoch (``BENCH_TRAIN_FLAGS``, both modes) with
         ``--gpu-memory-gib 20``: train plans its step from the card's whole memory, and in follow mode the
         extraction holds about 55 GiB of it (the target's bf16 weights and its forward), so the trainer is
         planned for, and held to, what is left. Each mode's store and run folder are removed once its row is
         taken (two stores and their checkpoints would not fit a 64 GB disk); the logs and metrics.jsonl stay.

Per mode: seconds from the start to the trainer's first step (its first metrics.jsonl row, ``--log-every 1``), to
the extraction's end and to the trainer's end, the first step as a share of the extraction's time (the goal: a
follower's first step before a quarter of the extraction is done), the steps trained, the samples and the GB the
store holds (its shards, not its assets). A warm-up runs first, so neither mode pays a first use's compilation
(fla's Triton kernels: ~60 s on a fresh GPU machine): the demo's, an extraction of a few conversations; bench's,
an extraction of 2 samples by an 8-layer target of the same width and one training step on it (the trainer's
compiled pointwise kernels too; none on a CPU). A follower believes the writers' end two heartbeats after it
(``HSSTORE_WRITER_HEARTBEAT_S``, 30 s unless the environment says otherwise): the follow mode's total includes
that wait, its first step does not where a batch fills before the end.

    python -m tools.bench_follow --dir /tmp/bf --device cuda               # the demo's row (docs/PERFORMANCE.md)
    python -m tools.bench_follow --dir /tmp/bf --device cpu --conversations 40 --epochs 1     # a CPU smoke test
    python -m tools.bench_follow --dir /tmp/bf27 --device cuda --target bench --epochs 1      # the 27B-shaped row
    python -m tools.bench_follow --dir /tmp/bfw --device cpu --target bench --epochs 1 --shard-mb 0.05 \
        --layers-total 8 --hidden 64 --ffn 128 --heads 4 --kv-heads 2 --head-dim 16 --linear-v-heads 4 \
        --linear-k-heads 2 --vocab 512 --samples 8 --min-len 64 --max-len 96           # bench's CPU dry run
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

import torch

import hsstore
from hsstore.extract.demo import TRAIN_FLAGS
from hsstore.extract.tiny import trained_files, trained_target_dir
from hsstore.ops.info import summarize

TARGETS = ("demo", "bench")
# bench's drafter: one draft layer of the 27B shape, planned for what the extraction leaves of an 80 GB card
BENCH_TRAIN_FLAGS = ("--draft-layers", "1", "--token-budget", "8192", "--anchors", "128", "--gpu-memory-gib", "20",
                     "--mask-token-id", "0", "--log-every", "1", "--save-every", "1000000")
BENCH_SAMPLES = ("--samples", "100")  # before the flags passed through: a --samples given wins
BENCH_WARM = ("--layers-total", "8", "--samples", "2")  # the warm-up's target: the width of the measured one
SHARD_MB = {"demo": 1.0, "bench": 256.0}


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


def run_mode(mode: str, d: Path, extract: list[str], train: list[str], env: dict, out_flag: str = "--out",
             drop: bool = False) -> dict:
    """One mode's row: ``follow`` starts the extraction and ``train --follow`` together, any other mode trains
    once the extraction has exited. ``extract``/``train``: command lines, the store given to the extraction as
    ``out_flag STORE``; ``drop``: the store and the run folder are removed once the row is taken."""
    store, run = d / mode / "store", d / mode / "run"
    shutil.rmtree(d / mode, ignore_errors=True)
    (d / mode).mkdir(parents=True)
    logs = {k: (d / mode / f"{k}.log").open("w") for k in ("extract", "train")}
    argv = {"extract": [*extract, out_flag, str(store)], "train": [*train, "--store", str(store), "--out", str(run)]}

    def start(name: str, *extra: str) -> subprocess.Popen:
        return subprocess.Popen([*argv[name], *extra], stdout=logs[name], stderr=subprocess.STDOUT, env=env)

    times: dict[str, float] = {}
    t0 = time.perf_counter()
    if mode != "follow":
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
    held = hsstore.open(str(store))
    row = {"mode": mode, "first_step_s": round(times["first_step"], 2),
           "extract_done_s": round(times["extract_done"], 2), "total_s": round(max(times.values()), 2),
           "first_step_share": round(times["first_step"] / times["extract_done"], 3),
           "steps": rows[-1]["step"], "samples": len(held), "store_gb": round(summarize(held)["stored_bytes"] / 1e9, 3)}
    if drop:
        shutil.copy(run / "metrics.jsonl", d / mode / "metrics.jsonl")
        shutil.rmtree(store)
        shutil.rmtree(run)
    return row


def demo_commands(args, d: Path, env: dict) -> tuple[list[str], list[str]]:
    """The demo's extraction and training command lines, after its warm-up extraction."""
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
    extract = cli("extract", "--model", target, "--input", str(data), "--shard-mb", str(args.shard_mb),
                  "--codec", "zstd", "-q", *device)
    flags = list(TRAIN_FLAGS)  # the demo's drafter, logging every step (the first row is the first step)
    del flags[flags.index("--log-every"):flags.index("--log-every") + 2]
    train = cli("train", "--epochs", str(args.epochs), *flags, "--log-every", "1", "-q", *device)
    shutil.rmtree(d / "warm-store", ignore_errors=True)
    subprocess.run(cli("extract", "--model", target, "--input", str(warm), "--out", str(d / "warm-store"), "-q",
                       *device), check=True, env=env, capture_output=True)
    return extract, train


def bench_commands(args, passed: list[str], d: Path, env: dict) -> tuple[list[str], list[str]]:
    """The 27B-shaped extraction (``passed``: flags for ``tools.bench_extract``) and its drafter's training command
    lines, after their warm-up on a GPU (an 8-layer target of the same width, 2 samples, one step)."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    extract = [sys.executable, "-m", "tools.bench_extract", "--modes", "", "--device", device, *BENCH_SAMPLES,
               "--shard-mb", str(args.shard_mb), *passed]
    train = cli("train", *BENCH_TRAIN_FLAGS, "-q", "--device", device)
    if device != "cpu":  # on a CPU nothing compiles on first use
        run_mode("warm-up", d, [*extract, *BENCH_WARM], [*train, "--steps", "1"], env, "--keep", drop=True)
    return extract, [*train, "--epochs", str(args.epochs)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                 epilog="--target bench: other flags go to tools.bench_extract (the target's shape, "
                                        "--samples, --min-len, --max-len, --token-budget)")
    ap.add_argument("--dir", required=True, help="scratch folder (each mode's store, run and logs)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: the GPU when there is one)")
    ap.add_argument("--target", choices=TARGETS, default="demo",
                    help="demo: the demo's tiny target and drafter; bench: the 27B-shaped random target (module doc)")
    ap.add_argument("--conversations", type=int, default=None, help="demo: the first N of its (default: all)")
    ap.add_argument("--epochs", type=int, default=6, help="training epochs (the recipe's 6)")
    ap.add_argument("--shard-mb", type=float, default=None, help="extraction's shard size, both modes (default: "
                    + ", ".join(f"{t} {mb:g}" for t, mb in SHARD_MB.items()) + ")")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args, passed = ap.parse_known_args(argv)
    if passed and args.target != "bench":
        ap.error(f"unrecognized arguments: {' '.join(passed)}")
    args.shard_mb = args.shard_mb or SHARD_MB[args.target]

    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HSSTORE_FOLLOW_POLL_S": os.environ.get("HSSTORE_FOLLOW_POLL_S", "2")}
    bench = args.target == "bench"
    extract, train = bench_commands(args, passed, d, env) if bench else demo_commands(args, d, env)
    rows = [run_mode(m, d, extract, train, env, "--keep" if bench else "--out", drop=bench)
            for m in ("sequential", "follow")]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    seq = rows[0]
    print(f"{'mode':<11} {'first step s':>12} {'extract done s':>14} {'first/extract':>13} {'total s':>8} "
          f"{'steps':>6} {'samples':>8} {'store GB':>8}")
    for r in rows:
        print(f"{r['mode']:<11} {r['first_step_s']:>12.2f} {r['extract_done_s']:>14.2f} "
              f"{r['first_step_share']:>13.3f} {r['total_s']:>8.2f} {r['steps']:>6} {r['samples']:>8} "
              f"{r['store_gb']:>8.3f}")
    fol = rows[1]
    print(f"follow / sequential: first step {fol['first_step_s'] / seq['first_step_s']:.2f}x, total "
          f"{fol['total_s'] / seq['total_s']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
