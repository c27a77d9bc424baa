"""How mixed an epoch is under ``partition="node"`` vs a global shuffle (metadata only, CPU, seconds).

A synthetic catalog shaped like the recipe's store (samples of ~2K tokens, 5 x 5120 bf16 taps, 256 MB read
units, 1 GiB shuffle pool per slot) is planned for N nodes x L ranks over E epochs with the loader's own
planner; for each mode it prints:

  units/batch     distinct read units in one rank's batch (B consecutive samples of its stream)
  shares/step     distinct node shares (``node_units`` for N nodes) the world's batches of one step draw from
  shares/batch    the same for one rank's batch
  node reads      share of the store one node reads over E epochs (what its local cache must hold)

    python tools/bench_mixing.py --nodes 8 --ranks 8 --epochs 6
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from hsstore.distributed import World
from hsstore.loader.plan import Catalog, Planner, node_units


def synthetic_catalog(samples: int, per_shard: int, mean_tokens: int, unit_tokens: int, seed: int = 0) -> Catalog:
    rng = np.random.default_rng(seed)
    length = np.clip(rng.normal(mean_tokens, mean_tokens / 2, samples), 64, 4 * mean_tokens).astype(np.int64)
    shard = (np.arange(samples) // per_shard).astype(np.int32)
    local = (np.arange(samples) % per_shard).astype(np.int32)
    ends = np.cumsum(length)
    first = np.r_[0, np.flatnonzero(np.diff(shard)) + 1]
    base = np.repeat(np.r_[0, ends[first[1:] - 1]], np.diff(np.r_[first, samples]))
    start = ends - length - base
    window = start // unit_tokens
    new = np.r_[True, (shard[1:] != shard[:-1]) | (window[1:] != window[:-1])]
    unit = np.cumsum(new) - 1
    return Catalog(np.zeros(samples, np.int32), shard, local, start, start + length, unit.astype(np.int64),
                   [(0, samples)])


def measure(cat: Catalog, planner: Planner, nodes: int, ranks: int, epochs: int, batch: int) -> dict[str, float]:
    world = nodes * ranks
    owner = node_units(cat, [1.0], 0, nodes)
    node_seen = [np.zeros(len(cat), bool) for _ in range(nodes)]
    units, shares_batch, shares_step = [], [], []
    for e in range(epochs):
        streams = [planner.slot_plan(e, None, 0, World.of_slot(r, world, 1, nodes)).rows for r in range(world)]
        for r, rows in enumerate(streams):
            node_seen[r // ranks][rows] = True
        steps = min(len(s) for s in streams) // batch
        for k in range(steps):
            step_shares = set()
            for rows in streams:
                b = rows[k * batch:(k + 1) * batch]
                units.append(len(np.unique(cat.unit[b])))
                sh = owner[cat.unit[b]]
                shares_batch.append(len(np.unique(sh)))
                step_shares.update(sh.tolist())
            shares_step.append(len(step_shares))
    return {"units/batch": float(np.mean(units)), "shares/step": float(np.mean(shares_step)),
            "shares/batch": float(np.mean(shares_batch)),
            "node reads": float(np.mean([s.mean() for s in node_seen]))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=8, help="ranks per node")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--samples", type=int, default=65536)
    ap.add_argument("--per-shard", type=int, default=64, help="samples per shard")
    ap.add_argument("--mean-tokens", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8, help="samples per rank batch (~16K tokens)")
    ap.add_argument("--token-bytes", type=int, default=5 * 5120 * 2)
    ap.add_argument("--unit-bytes", type=int, default=256 << 20)
    ap.add_argument("--shuffle-bytes", type=int, default=1 << 30)
    a = ap.parse_args()
    unit_tokens = max(64, a.unit_bytes // a.token_bytes // 64 * 64)
    cat = synthetic_catalog(a.samples, a.per_shard, a.mean_tokens, unit_tokens)
    print(f"{a.samples} samples, {cat.n_units} read units, {a.nodes} nodes x {a.ranks} ranks, {a.epochs} epochs, "
          f"{a.batch} samples per rank batch")
    cols = ["units/batch", "shares/step", "shares/batch", "node reads"]
    print(f"{'partition':<10}" + "".join(f"{c:>14}" for c in cols) + f"{'s':>7}")
    for part in ("global", "node"):
        t0 = time.perf_counter()
        planner = Planner(cat, [1.0], seed=0, shuffle=True, even=None, unit_tokens=unit_tokens,
                          token_bytes=a.token_bytes, shuffle_bytes=a.shuffle_bytes, partition=part)
        m = measure(cat, planner, a.nodes, a.ranks, a.epochs, a.batch)
        print(f"{part:<10}" + "".join(f"{m[c]:>14.3f}" for c in cols) + f"{time.perf_counter() - t0:>7.1f}")


if __name__ == "__main__":
    main()
