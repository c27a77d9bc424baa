"""bf16 vs fp8 stores of the same data: bytes per token, fp8's error against bf16, and the drafter trained
on each (same seed, same steps): final loss, accuracy, teacher-forced and speculative acceptance length.

Extracts the input twice with one target (``--encoding raw`` in bf16, then ``--encoding fp8``), reads both
stores side by side for the error distribution (per element ``|q - x| / |x|`` over non-zero ``x``,
sampled; per token and layer ``||q - x|| / ||x||``, all rows; ``q`` dequantised in float32, so the number
is the encoding's error alone), trains a drafter on each, and runs ``hsstore eval`` with each drafter
against the live target.

    python -m tools.compare_fp8 --out /tmp/cmp                       # tiny demo target + bundled data, CPU
    python -m tools.compare_fp8 --out /scratch/cmp --model /models/t --input data.jsonl --device cuda \\
        --steps 2000 --draft-layers 5 --token-budget 16384 --anchors 512 --json

The tiny demo target has random weights: its drafter barely learns and speculative tau stays near 1 for
both stores; there the loss/accuracy difference is the signal. Run it on a real target for tau.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import time
from pathlib import Path

import numpy as np
import torch

import hsstore
from hsstore.extract.job import ExtractSettings, run_extract
from hsstore.extract.tiny import build_tiny_target, demo_conversations_path
from hsstore.format import fp8
from hsstore.app.cli import main as hsstore_main
from hsstore.ops.info import summarize
from hsstore.app.schema import build
from hsstore.train.trainer import TrainSettings, train

ELEMENT_PCTS = (50, 90, 99, 99.9, 100)
ROW_PCTS = (50, 90, 99, 100)


def relative_errors(bf16_url: str, fp8_url: str, per_sample: int = 1 << 16, seed: int = 0,
                    ) -> dict[str, dict[str, float]]:
    """Percentiles of fp8's relative error against bf16, matching samples by id."""
    a, b = hsstore.open(bf16_url), hsstore.open(fp8_url)
    index = {sid: i for i, sid in enumerate(a.sample_ids())}
    rng = np.random.default_rng(seed)
    elems, rows = [], []
    flushed = nonzero = 0
    for i, sid in enumerate(b.sample_ids()):
        x = a.read(index[sid])["hidden_states"].float()  # [T, L, H]
        raw = b.read(i, dequantise=False)
        q = fp8.dequantise(raw["hidden_states"], raw["hidden_scales"], torch.float32)
        diff = q - x
        norms = x.norm(dim=-1)
        ok = norms > 0
        rows.append((diff.norm(dim=-1)[ok] / norms[ok]).numpy())
        nz = x != 0
        rel = (diff.abs()[nz] / x.abs()[nz]).numpy()
        nonzero += rel.size
        flushed += int((q[nz] == 0).sum())  # below half e4m3's smallest subnormal of the row: error 1
        if rel.size > per_sample:
            rel = rng.choice(rel, per_sample, replace=False)
        elems.append(rel)
    e, r = np.concatenate(elems), np.concatenate(rows)
    return {"element": {f"p{p:g}": float(np.percentile(e, p)) for p in ELEMENT_PCTS} | {"n": int(e.size)},
            "flushed_to_zero": flushed / max(1, nonzero),
            "token_layer": {f"p{p:g}": float(np.percentile(r, p)) for p in ROW_PCTS} | {"n": int(r.size)}}


def eval_tau(store: str, drafter: str, model: str, inputs: list[str], n: int, max_new: int, device: str) -> dict:
    """``hsstore eval --json`` with one drafter: tau and whether speculative output equals the target's."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = hsstore_main(["eval", "--store", store, "--drafter", drafter, "--model", model, "--input", *inputs,
                           "--num-samples", str(n), "--max-new-tokens", str(max_new), "--device", device, "--json"])
    if rc:
        raise RuntimeError(f"hsstore eval failed ({rc}): {buf.getvalue()[-2000:]}")
    report = json.loads(buf.getvalue())
    return {"tau_per_prompt": report["tau_per_prompt"], "tau_pooled": report["tau_pooled"],
            "identical": report["identical"], "samples": report["samples"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--out", required=True, help="working folder (replaced)")
    p.add_argument("--model", default=None, help="target directory (default: build the tiny demo target)")
    p.add_argument("--input", nargs="+", default=None, help="conversations (default: the bundled demo data)")
    p.add_argument("--layers", default=None, help="tapped layer ids (default: DFlash spacing)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--token-budget", type=int, default=None)
    p.add_argument("--force", action="store_true", help="extract even when the quality gate fails")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--draft-layers", type=int, default=1)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--anchors", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--eval-samples", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--reuse", action="store_true", help="keep OUT: extraction and training resume (finished ones "
                   "are skipped), so an interrupted comparison continues")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.reuse:
        raise SystemExit(f"{out} exists and is not empty: give a new folder, or --reuse to continue in it "
                         "(nothing is deleted)")
    out.mkdir(parents=True, exist_ok=True)
    model = args.model or (str(out / "target") if (out / "target").exists() and args.reuse
                           else str(build_tiny_target(out / "target")))
    inputs = args.input or [str(demo_conversations_path())]
    layers = [int(x) for x in args.layers.split(",")] if args.layers else None
    result: dict = {"model": model, "inputs": inputs, "steps": args.steps, "seed": args.seed, "stores": {}}
    urls = {}
    for enc in ("raw", "fp8"):
        url = urls[enc] = str(out / f"store-{enc}")
        t0 = time.perf_counter()
        run_extract(build(ExtractSettings, model=model, inputs=inputs, out=url, layers=layers, device=args.device,
                          token_budget=args.token_budget, encoding=enc, force=args.force, progress=False))
        s = summarize(hsstore.open(url))
        result["stores"][enc] = {"url": url, "extract_s": time.perf_counter() - t0, "tokens": s["tokens"],
                                 "bytes_per_token": s["bytes_per_token"], "stored_bytes": s["stored_bytes"],
                                 "bf16_bytes_per_token": s["dtype_bytes_per_token"]}
    result["relative_error"] = relative_errors(urls["raw"], urls["fp8"], seed=args.seed)
    for enc, url in urls.items():
        run = out / f"run-{enc}"
        t0 = time.perf_counter()
        train(build(TrainSettings, store=[url], out=str(run), steps=args.steps, seed=args.seed, device=args.device,
                    draft_layers=args.draft_layers, block_size=args.block_size, anchors=args.anchors,
                    token_budget=args.max_tokens, lr=args.lr, log_every=max(1, args.steps // 20),
                    save_every=args.steps, progress=False))
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        last, tail = rows[-1], rows[-max(1, len(rows) // 5):]  # the last fifth of the logged steps: less noise
        st = result["stores"][enc]
        st.update({"train_s": time.perf_counter() - t0, "final_loss": last["loss"], "final_acc": last["acc"],
                   "tail_loss": float(np.mean([x["loss"] for x in tail])),
                   "tail_acc": float(np.mean([x["acc"] for x in tail])),
                   "teacher_forced_tau": last.get("tau")})
        st.update(eval_tau(url, str(run), model, inputs, args.eval_samples, args.max_new_tokens, args.device))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_text(result))
    (out / "compare_fp8.json").write_text(json.dumps(result, indent=2))
    return 0


def format_text(r: dict) -> str:
    a, b = r["stores"]["raw"], r["stores"]["fp8"]
    e, t = r["relative_error"]["element"], r["relative_error"]["token_layer"]
    lines = [f"target {r['model']}; {a['tokens']:,} tokens; {r['steps']} steps, seed {r['seed']}",
             f"{'':24}{'bf16':>12}{'fp8':>12}",
             f"{'bytes/token':24}{a['bytes_per_token']:>12,.1f}{b['bytes_per_token']:>12,.1f}"
             f"   ({a['bytes_per_token'] / b['bytes_per_token']:.2f}x)"]
    for k in ("final_loss", "tail_loss", "final_acc", "tail_acc", "teacher_forced_tau", "tau_per_prompt",
              "tau_pooled"):
        lines.append(f"{k:24}{a[k]:>12.4f}{b[k]:>12.4f}   (fp8 - bf16 {b[k] - a[k]:+.2e})")
    lines.append(f"{'eval output == target':24}{a['identical']:>9}/{a['samples']}{b['identical']:>9}/{b['samples']}")
    lines.append("fp8 vs bf16, per element |q-x|/|x| (sampled, x != 0): "
                 + "  ".join(f"{k}={v:.4f}" for k, v in e.items() if k != "n") + f"  (n={e['n']:,}); non-zero "
                 f"elements stored as 0: {100 * r['relative_error']['flushed_to_zero']:.2g}%")
    lines.append("fp8 vs bf16, per token+layer ||q-x||/||x||:          "
                 + "  ".join(f"{k}={v:.4f}" for k, v in t.items() if k != "n") + f"  (n={t['n']:,})")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
