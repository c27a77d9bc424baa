"""Speculative decoding paired with its baseline in one run: ``hsstore eval --model`` on a demo folder (the shipped
tiny target, its store and the demo's trained drafter, its held-out prompts), the target's cache brought back
after a rejected suffix two ways, alternating for ``--rounds`` rounds after a warm-up:

  states     the Gated DeltaNet states kept from the verification (``train.block_states``: no second forward)
  recompute  a copy of the cache before each verification, restored and advanced over the accepted tokens by a
             second forward (the general path, and what eval did before)

Each row is a whole ``evaluate_target`` (the target alone, then speculative, per prompt), so the target-alone
column is the run's own control. Outputs must be identical (or named ties) in both rows.

    python -m hsstore demo --out /tmp/demo --device cpu      # once: the folder (about 2 minutes on 2 cores)
    python -m tools.bench_eval /tmp/demo --device cuda --samples 8 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from hsstore.extract.demo import EVAL_MAX_NEW_TOKENS
from hsstore.train.speculative import evaluate_target

MODES = {"states": True, "recompute": False}


def run(demo: Path, device: str | None, samples: int, rounds: int, warmup: int, max_new: int) -> list[dict]:
    """One row per (round, mode), the modes' order swapped every round."""
    paths = dict(store_url=str(demo / "store"), drafter_dir=str(demo / "run"), model_dir=str(demo / "target"),
                 inputs=[str(demo / "data" / "heldout.jsonl")])
    if warmup:  # the kernels' first use (compiling, autotuning) in neither row
        evaluate_target(**paths, device=device, num_samples=warmup, max_new_tokens=max_new)
    rows = []
    for r in range(rounds):
        for mode in (list(MODES) if r % 2 else list(MODES)[::-1]):
            t0 = time.perf_counter()
            rep = evaluate_target(**paths, device=device, num_samples=samples, max_new_tokens=max_new,
                                  keep_states=MODES[mode])
            rows.append({"round": r + 1, "mode": mode, "seconds": time.perf_counter() - t0,
                         "tau_per_prompt": rep.tau_per_prompt, "tau_pooled": rep.tau_pooled,
                         "target_tokens_per_s": rep.target_tps, "spec_tokens_per_s": rep.spec_tps,
                         "speedup": rep.spec_tps / rep.target_tps, "identical": rep.identical, "ties": rep.ties,
                         "samples": rep.samples, "spec_forwards": rep.spec_forwards, "reruns": rep.spec_reruns})
    return rows


def table(rows: list[dict]) -> str:
    head = (f"{'round':>5} {'mode':>9} {'target tok/s':>12} {'spec tok/s':>10} {'spec/target':>11} "
            f"{'tau/prompt':>10} {'tau pooled':>10} {'identical':>9} {'forwards':>8} {'reruns':>6} {'seconds':>7}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['round']:>5} {r['mode']:>9} {r['target_tokens_per_s']:>12.1f} "
                     f"{r['spec_tokens_per_s']:>10.1f} {r['speedup']:>11.2f} {r['tau_per_prompt']:>10.2f} "
                     f"{r['tau_pooled']:>10.2f} "
                     f"{r['identical']:>4}/{r['samples']:<2}"
                     f"{'+' + str(r['ties']) + 't' if r['ties'] else '':>3} {r['spec_forwards']:>8} "
                     f"{r['reruns']:>6} {r['seconds']:>7.1f}")
    by = {m: [r["spec_tokens_per_s"] for r in rows if r["mode"] == m] for m in MODES}
    if all(by.values()):
        lines.append(f"states / recompute, speculative tokens/s: "
                     f"{sum(by['states']) / len(by['states']) / (sum(by['recompute']) / len(by['recompute'])):.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("demo", type=Path, help="an `hsstore demo --out` folder (target, store, run, data)")
    ap.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: the GPU when there is one)")
    ap.add_argument("--samples", type=int, default=8, help="held-out prompts per row")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of both modes, alternating their order")
    ap.add_argument("--warmup", type=int, default=2, help="prompts decoded once before the first row (0: none)")
    ap.add_argument("--max-new-tokens", type=int, default=EVAL_MAX_NEW_TOKENS)
    ap.add_argument("--json", action="store_true", help="the rows as JSON instead of a table")
    a = ap.parse_args(argv)
    rows = run(a.demo, a.device, a.samples, a.rounds, a.warmup, a.max_new_tokens)
    print(json.dumps(rows, indent=1) if a.json else table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
