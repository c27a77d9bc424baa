"""Speculative decoding paired with its baselines in one run: ``hsstore eval --model`` on a demo folder (the shipped
tiny target, its store and the demo's trained drafter, its held-out prompts), in modes alternating for ``--rounds``
rounds after a warm-up:

  graphs     eval's default on a GPU: the drafter's step replayed as one CUDA graph (``train.graphs.StaticDraft``),
             the verified block through the Gated DeltaNet's token-by-token delta rule in one call
             (``block_states.RECURRENT_BLOCKS``: one kernel per layer), its states kept (``train.block_states``)
  chunk      the same with the block through the chunked delta rule (several kernels per layer)
  eager      eval's path before: the drafter's step launched op by op (``DraftContext``), the chunked delta rule,
             the states kept
  recompute  eager, and a copy of the cache before each verification, restored and advanced over the accepted
             tokens by a second forward (the general path)

Each row is a whole ``evaluate_target`` (the target alone, then speculative, per prompt), so the target-alone
column is the run's own control. Outputs must be identical (or named ties) in every row.

Beside the rows, what bounds the speed-up, measured on the same models (``costs``, each part timed alone over
``--reps`` calls with the device synchronised): the target's one-token forward (``target_ms``: the baseline's cost
per token), the drafter's step (``draft_ms_MODE``), and the verification of a block with its cache brought back
after a rejection (``verify_ms_MODE``). ``ceiling`` = tau / (1 + draft / target), the speed-up if verifying a block
cost what one token costs; ``bound`` = tau x target / (draft + verify), what these parts allow (tau pooled: every
verify step's tokens over the steps, what the speed follows).

    python -m hsstore demo --out /tmp/demo --device cpu      # once: the folder (about 2 minutes on 2 cores)
    python -m tools.bench_eval /tmp/demo --device cuda --samples 8 --rounds 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch

from hsstore.extract.demo import EVAL_MAX_NEW_TOKENS
from hsstore.train import block_states
from hsstore.train.speculative import TargetCache, drafter_proposer, evaluate_target

MODES = {"graphs": dict(keep_states=True, graphs=True, recurrent=True),
         "chunk": dict(keep_states=True, graphs=True, recurrent=False),
         "eager": dict(keep_states=True, graphs=False, recurrent=False),
         "recompute": dict(keep_states=False, graphs=False, recurrent=False)}


@contextlib.contextmanager
def verified_blocks(mode: str):
    """A mode's form of the delta rule for verified blocks (``block_states.RECURRENT_BLOCKS``), restored after."""
    before = block_states.RECURRENT_BLOCKS
    block_states.RECURRENT_BLOCKS = before if MODES[mode]["recurrent"] else ()
    try:
        yield
    finally:
        block_states.RECURRENT_BLOCKS = before


def evaluate(demo: Path, mode: str, **kw):
    """``evaluate_target`` on the demo folder in ``mode``."""
    m = MODES[mode]
    with verified_blocks(mode):
        return evaluate_target(**paths(demo), keep_states=m["keep_states"], graphs=m["graphs"], **kw)


def paths(demo: Path) -> dict:
    return dict(store_url=str(demo / "store"), drafter_dir=str(demo / "run"), model_dir=str(demo / "target"),
                inputs=[str(demo / "data" / "heldout.jsonl")])


def run(demo: Path, device: str | None, samples: int, rounds: int, warmup: int, max_new: int,
        modes: list[str] | None = None) -> list[dict]:
    """One row per (round, mode), the modes' order reversed every other round."""
    modes = modes or ["graphs", "chunk", "eager"]
    if warmup:  # the kernels' first use (compiling, autotuning) in neither row
        for mode in modes:
            evaluate(demo, mode, device=device, num_samples=warmup, max_new_tokens=max_new)
    rows = []
    for r in range(rounds):
        for mode in (modes if r % 2 else modes[::-1]):
            t0 = time.perf_counter()
            rep = evaluate(demo, mode, device=device, num_samples=samples, max_new_tokens=max_new)
            rows.append({"round": r + 1, "mode": mode, "seconds": time.perf_counter() - t0,
                         "tau_per_prompt": rep.tau_per_prompt, "tau_pooled": rep.tau_pooled,
                         "target_tokens_per_s": rep.target_tps, "spec_tokens_per_s": rep.spec_tps,
                         "speedup": rep.spec_tps / rep.target_tps, "identical": rep.identical, "ties": rep.ties,
                         "samples": rep.samples, "spec_forwards": rep.spec_forwards, "reruns": rep.spec_reruns})
    return rows


def load(demo: Path, device: str | None):
    """(target, drafter, taps, a held-out prompt) as ``evaluate_target`` loads them."""
    from transformers import AutoTokenizer

    from hsstore import open as open_store
    from hsstore.app.devices import resolve_device
    from hsstore.app.target import load_target
    from hsstore.train.build import load_frozen
    from hsstore.train.checkpoint import load_drafter
    from hsstore.train.speculative import load_prompts

    p = paths(demo)
    dev = resolve_device(device)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    _, embed, head = load_frozen(open_store(p["store_url"]))
    drafter = load_drafter(p["drafter_dir"], embed.to(dev, dt), head.to(dev, dt), attn_impl="sdpa")
    drafter = drafter.to(device=dev, dtype=dt).eval()
    tok = AutoTokenizer.from_pretrained(p["model_dir"], local_files_only=True)
    prompt = load_prompts(p["inputs"], tok, limit=1)[0][1]
    return load_target(p["model_dir"], dt, dev, progress=False), drafter, drafter.config.target_layers, prompt


def timed(fn, reps: int, device: torch.device) -> float:
    """Milliseconds per call of ``fn`` (after one untimed call), the device synchronised around the loop."""
    fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / reps * 1e3


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def costs(demo: Path, device: str | None, reps: int, modes: list[str]) -> dict:
    """The parts of a speculative step and of the baseline's token, each timed alone (module doc)."""
    model, drafter, taps, prompt = load(demo, device)
    dev = drafter.lm_head.device
    S = drafter.config.block_size
    target = TargetCache(model)
    logits, feats = target.forward(prompt, keep=1, taps=taps)
    nxt = int(logits[-1].argmax())
    out = {"target_ms": timed(lambda: target.forward([nxt], keep=1), reps, dev)}
    block = [nxt] * S

    def verify():  # a block verified, its drafts rejected, the cache brought back (the kept states' path)
        target.verify(block, taps=taps)
        target.accept(1)

    for mode in modes:  # the drafter's step, the context one position longer each call (as decoding grows it)
        with verified_blocks(mode):
            out[f"verify_ms_{mode}"] = timed(verify, reps, dev)
        propose = drafter_proposer(drafter, MODES[mode]["graphs"])
        ctx = torch.cat([feats, feats[-1:].expand(reps + 2, *feats.shape[1:])])
        seq = torch.tensor(prompt + [nxt] * (reps + 3))
        at = iter(range(len(prompt), len(prompt) + reps + 2))

        def step():
            p = next(at)
            return propose(ctx[:p], seq[:p + 1])

        out[f"draft_ms_{mode}"] = timed(step, reps, dev)
    return out


def ceilings(rows: list[dict], parts: dict) -> dict:
    """Per mode: the measured speed-up beside the ceiling and the bound its parts allow (module doc)."""
    out = {}
    for mode in {r["mode"] for r in rows}:
        mine = [r for r in rows if r["mode"] == mode]
        tau = statistics.mean(r["tau_pooled"] for r in mine)  # tokens per verify step: what the speed follows
        draft, verify = parts.get(f"draft_ms_{mode}"), parts.get(f"verify_ms_{mode}")
        if draft is None or verify is None:
            continue
        out[mode] = {"tau": tau, "speedup": statistics.mean(r["speedup"] for r in mine),
                     "ceiling": tau / (1 + draft / parts["target_ms"]),
                     "bound": tau * parts["target_ms"] / (draft + verify)}
    return out


def table(rows: list[dict], parts: dict | None = None) -> str:
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
    for a, b in (("graphs", "eager"), ("graphs", "chunk"), ("chunk", "eager"), ("eager", "recompute")):
        if by[a] and by[b]:
            lines.append(f"{a} / {b}, speculative tokens/s: {statistics.mean(by[a]) / statistics.mean(by[b]):.2f}x")
    if parts:
        lines.append("parts (ms): " + ", ".join(f"{k.removesuffix('_ms')} {v:.2f}" for k, v in parts.items()))
        for mode, c in ceilings(rows, parts).items():
            lines.append(f"{mode}: speed-up {c['speedup']:.2f}x, ceiling tau / (1 + draft / target) "
                         f"{c['ceiling']:.2f}x, bound tau x target / (draft + verify) {c['bound']:.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("demo", type=Path, help="an `hsstore demo --out` folder (target, store, run, data)")
    ap.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: the GPU when there is one)")
    ap.add_argument("--samples", type=int, default=8, help="held-out prompts per row")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of every mode, alternating their order")
    ap.add_argument("--warmup", type=int, default=2, help="prompts decoded once per mode before the first row (0: none)")
    ap.add_argument("--max-new-tokens", type=int, default=EVAL_MAX_NEW_TOKENS)
    ap.add_argument("--modes", default="graphs,chunk,eager", help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--reps", type=int, default=50, help="calls per part timed alone (0: no parts)")
    ap.add_argument("--json", action="store_true", help="the rows and parts as JSON instead of a table")
    a = ap.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"--modes: {unknown} not among {list(MODES)}")
    rows = run(a.demo, a.device, a.samples, a.rounds, a.warmup, a.max_new_tokens, modes)
    parts = costs(a.demo, a.device, a.reps, modes) if a.reps else None
    if a.json:
        print(json.dumps({"rows": rows, "parts": parts, "ceilings": ceilings(rows, parts) if parts else None},
                         indent=1))
    else:
        print(table(rows, parts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
