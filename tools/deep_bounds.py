"""The audit's and the compile check's bounds at the seeds' depth: how far a correct store drifts from the target's
recomputation per tap, and how far each planted fault lands, under the bounds ``extract/compare.py`` holds.

Builds a random-weight Qwen3.5-architecture target in this process (default: the 27B shape, 64 layers, hidden
5120, taps 1,16,31,46,61; a 64-layer folder would not fit the GPU machine's disk), synthetic samples, and:

1. an eager store and a compiled store, extracted as ``hsstore extract`` does (token-budget batches, right padding,
   ``extract_batches`` into a ``StoreWriter``; compiled: ``speed.compile_forward(mixers=True)``), each audited with
   the product's own ``audit.audit_model`` against the batch-1 eager recomputation: both must pass;
2. the eager forward's own spread per tap: a sample alone vs in its batch (worst token, whole feature);
3. extraction's compile check (``compile_check.check_first_batch``) on ``--first-batches`` different first batches:
   each must pass;
4. five planted faults per tap, judged by the audit's own rule (``audit.judge``, ``audit.diagnose``): the store
   holds a neighbouring layer (tap l + 1's features extracted under tap l's name), another target's weights (every
   matrix drawn again with another seed), the tokens shifted by one, one feature zeroed, one feature scaled by 2.
   Each must be caught.

Prints a table per tap and writes every figure as JSON (``--json``); ``--from-json`` re-judges saved figures under
the bounds the code holds now (no model). The slope of ``1 - cosine`` over depth it prints is what
``compare.AUDIT_DRIFT`` and ``COMPILE_DRIFT`` are derived from (docs/ARCHITECTURE.md, "Bounds that follow the
rounding"; figures in docs/PERFORMANCE.md).

    python -m tools.deep_bounds --json /tmp/deep.json                           # GPU: the seeds' shape (~5 min)
    python -m tools.deep_bounds --device cpu --hidden 256 --ffn 768 --heads 4 --kv-heads 2 --head-dim 64 \\
        --linear-k-heads 2 --linear-v-heads 4 --vocab 4096 --samples 6 --min-len 384 --max-len 512 \\
        --token-budget 1024 --first-batches 3 --json /tmp/deep-cpu.json        # CPU: 64 layers, narrow
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import tempfile
import time
from pathlib import Path

import torch

from tools.bench_extract import add_model_args, build_model, synthetic

FAULTS = ("neighbour layer", "other target", "shifted tokens", "zeroed", "scaled x2")


def fit(points: list[tuple[int, float]]) -> float:
    """The least-squares slope through the origin of ``1 - cosine`` over depth: the drift per layer."""
    num = sum(d * g for d, g in points)
    den = sum(d * d for d, _ in points)
    return num / den if den else float("nan")


def extract_store(model, layers, batches, url: str, manifest, device) -> None:
    from hsstore import StoreWriter
    from hsstore.extract.forward import extract_batches

    with StoreWriter(url, manifest, writer_tag="deep-bounds", check_finite=True) as w:
        extract_batches(model, layers, batches, lambda s, f, v: w.add(s.sample_id, s.input_ids, s.loss_mask, f,
                                                                      feature_stats=v), 0, device)


def per_sample(model, layers, batches, device) -> dict[str, torch.Tensor]:
    """Each sample's packed features ``[T, taps, H]`` on the host, extracted in its batch (extraction's forward)."""
    from hsstore.extract.forward import packed_features

    out = {}
    with torch.inference_mode():
        for b in batches:
            feats = packed_features(model, layers, b, 0, device).cpu()
            at = 0
            for s in b:
                out[s.sample_id] = feats[at:at + s.num_tokens]
                at += s.num_tokens
    return out


def measure(args) -> dict:
    import hsstore
    from hsstore import Manifest, TargetIdentity, TokenizerIdentity
    from hsstore.extract import audit
    from hsstore.extract.compare import agreement
    from hsstore.extract.compile_check import CompileMismatch, check_first_batch, eager_modules
    from hsstore.extract.forward import token_budget_batches
    from hsstore.extract.speed import compile_forward
    from hsstore.format.taps import default_taps
    from hsstore.app.target import to_device

    device = torch.device(args.device if args.device != "cuda" else f"cuda:{torch.cuda.current_device()}")
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    model = to_device(build_model(args), device)
    n = args.layers_total
    layers = default_taps(n)
    samples = synthetic(args.samples, args.min_len, args.max_len, args.vocab, seed=args.seed)
    batches = token_budget_batches(samples, args.token_budget)
    manifest = Manifest(target=TargetIdentity(name="random-qwen3.5", num_layers=n, hidden_size=args.hidden,
                                              config_hash=f"deep-bounds-seed{args.seed}"),
                        tokenizer=TokenizerIdentity(name="synthetic", vocab_hash="synthetic"), layers=tuple(layers))
    res: dict = {"shape": {"layers": n, "hidden": args.hidden, "taps": layers, "samples": len(samples),
                           "tokens": sum(s.num_tokens for s in samples), "device": str(device),
                           "dtype": "bfloat16"}, "build_s": time.perf_counter() - t0}
    scratch = Path(tempfile.mkdtemp(prefix="deep-bounds-"))
    stores = {"eager": str(scratch / "eager"), "compiled": str(scratch / "compiled")}
    try:
        # 1. the eager store, its neighbour-layer twin and the eager spread
        extract_store(model, layers, batches, stores["eager"], manifest, device)
        neighbour = per_sample(model, [l + 1 for l in layers], batches, device)
        first = batches[0][0]
        with torch.inference_mode():
            from hsstore.extract.capture import run_tapped
            from hsstore.extract.forward import pad_right

            ids, _ = pad_right(batches[0], 0)
            in_batch = run_tapped(model, layers, ids[:, :].to(device), None)[0, :first.num_tokens].float()
            alone = run_tapped(model, layers, ids[:1, :first.num_tokens].to(device), None)[0].float()
        res["eager_spread"] = {}
        for j, l in enumerate(layers):
            a = agreement(alone[:, j], in_batch[:, j])
            res["eager_spread"][str(l)] = a.as_dict()
        del in_batch, alone

        # 2. the compile check on several first batches, then the compiled store
        t = time.perf_counter()
        compile_forward(model, mixers=True)
        res["compile_checks"] = []
        for k in range(args.first_batches):
            fb = token_budget_batches(synthetic(max(1, args.token_budget // args.max_len), args.max_len, args.max_len,
                                                args.vocab, seed=1000 + k), args.token_budget)[0]
            try:
                check = check_first_batch(model, layers, fb, 0, device)
                res["compile_checks"].append({"passed": True, "per_tap": check.per_tap})
            except CompileMismatch as e:
                res["compile_checks"].append({"passed": False, "error": str(e)})
        res["compile_s"] = time.perf_counter() - t
        extract_store(model, layers, batches, stores["compiled"], manifest, device)

        # 3. the audit of both stores, the product's own code (the reference forward eager)
        res["audit"] = {}
        with eager_modules(model):
            for kind, url in stores.items():
                store = hsstore.open(url)
                report = audit.audit_model(store, model, "random-qwen3.5 (in process)", range(len(store)),
                                           progress=False)
                res["audit"][kind] = {"ok": report.ok, "features": {str(k): v for k, v in report.verdicts().items()}}

            # 4. the planted faults, judged by the audit's rule against the same recomputation
            store = hsstore.open(stores["eager"])
            faulty: dict[str, dict[str, list]] = {f: {str(l): [] for l in layers} for f in FAULTS}
            refs = {}
            for i in range(min(args.fault_samples, len(store))):
                item = store.read(i)
                ref = audit.reference_features(model, item["input_ids"])
                refs[item["sample_id"]] = ref.cpu()
                for j, l in enumerate(layers):
                    stored = item["hidden_states"][:, j].to(ref.device)
                    planted = {"neighbour layer": neighbour[item["sample_id"]][:, j].to(ref.device),
                               "shifted tokens": torch.cat([stored[:1], stored[:-1]]),
                               "zeroed": torch.zeros_like(stored), "scaled x2": stored * 2}
                    for f, values in planted.items():
                        faulty[f][str(l)].append(judged(values, ref, l, store, audit))
                del ref

        # 5. another target: every matrix drawn again (the same config), its features against the first's
        g = torch.Generator(device=device).manual_seed(args.seed + 1)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.02, generator=g)
        with eager_modules(model):
            other = per_sample(model, layers, batches, device)
            for sid, ref in refs.items():
                ref = ref.to(device)
                for j, l in enumerate(layers):
                    faulty["other target"][str(l)].append(judged(other[sid][:, j].to(device), ref, l, store, audit))
        res["faults"] = faulty
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return res


def judged(values: torch.Tensor, ref: torch.Tensor, layer: int, store, audit) -> dict:
    """The audit's verdict on ``values`` stored as tap ``layer``: its figures, caught or not, the diagnosis."""
    report = audit.AuditReport("", "", store.manifest.encoding, store.manifest.dtype, store.manifest.target.num_layers,
                               0, [layer])
    from hsstore.extract.compare import agreement

    figures, ok = audit.judge(values, ref, layer, report.bound_at)
    diagnosis = None if ok else audit.diagnose(values, ref, layer, report.bound_at, False)[0]
    # the closest layer beside it (the audit's second rule), kept for --from-json
    beside = min(agreement(values, ref[:, c]).rel_err for c in (layer - 1, layer + 1) if 0 <= c < ref.shape[1])
    return {**figures.as_dict(), "caught": not ok, "beside_rel_err": beside, "diagnosis": diagnosis}


def table(res: dict) -> str:
    """The per-tap table: correct stores (worst sample), the eager spread, the compile checks (worst batch), the
    faults (caught / judged), under the bounds the code holds now."""
    from hsstore.extract.compare import bound_of, compile_bound, depth_of

    n, taps = res["shape"]["layers"], res["shape"]["taps"]
    lines = [f"{n} layers, hidden {res['shape']['hidden']}, {res['shape']['samples']} samples "
             f"({res['shape']['tokens']:,} tokens), {res['shape']['device']}",
             "| tap | audit bound cos / rel | eager store cos / rel | compiled store cos / rel | eager alone vs batch "
             "(token) | compile bound cos / rel | compile checks worst cos / rel (passed) | "
             + " | ".join(FAULTS) + " |",
             "|" + "---|" * (7 + len(FAULTS))]
    audit_points, compile_points = [], []
    for l in taps:
        key, depth = str(l), depth_of(l, n)
        b, cb = bound_of("bfloat16", "raw", depth), compile_bound(depth)
        e, c = res["audit"]["eager"]["features"][key], res["audit"]["compiled"]["features"][key]
        audit_points += [(depth, 1 - e["min_cosine"]), (depth, 1 - c["min_cosine"])]
        checks = [k for k in res["compile_checks"] if "per_tap" in k]
        worst_cos = min((k["per_tap"][key]["min_cos"] for k in checks), default=float("nan"))
        worst_rel = max((k["per_tap"][key]["max_rel"] for k in checks), default=float("nan"))
        compile_points.append((depth, 1 - worst_cos))
        passed = sum(1 for k in res["compile_checks"] if k["passed"])
        spread = res["eager_spread"][key]
        cells = []
        for f in FAULTS:
            js = res["faults"][f][key]
            caught = sum(1 for j in js if j["caught"])
            cells.append(f"{caught}/{len(js)} ({min(j['cosine'] for j in js):.4f} / {max(j['rel_err'] for j in js):.3f})")
        lines.append(f"| {l} | {b.cosine:.6f} / {b.rel_err:.4f} | {e['min_cosine']:.6f} / {e['max_rel_err']:.4f} "
                     f"({e['samples_ok']}/{e['samples']}) | {c['min_cosine']:.6f} / {c['max_rel_err']:.4f} "
                     f"({c['samples_ok']}/{c['samples']}) | {spread['min_token_cosine']:.6f} | {cb.cosine:.5f} / "
                     f"{cb.rel_err:.4f} | {worst_cos:.5f} / {worst_rel:.4f} ({passed}/{len(res['compile_checks'])}) | "
                     + " | ".join(cells) + " |")
    lines.append(f"drift per layer (1 - cosine over depth, through the origin): audit {fit(audit_points):.3g}, "
                 f"compile check worst token {fit(compile_points):.3g}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.set_defaults(samples=12, rounds=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--first-batches", type=int, default=10, help="different first batches the compile check runs on")
    p.add_argument("--fault-samples", type=int, default=4, help="samples each planted fault is judged on")
    p.add_argument("--json", default=None, help="write every figure here")
    p.add_argument("--from-json", default=None, help="re-judge the figures saved in this file (no model)")
    args = p.parse_args()
    if args.from_json:
        res = json.loads(Path(args.from_json).read_text())
        rejudge(res)
    else:
        res = measure(args)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=lambda v: None if isinstance(v, float) and
                                              not math.isfinite(v) else str(v)))
    print(table(res))


def rejudge(res: dict) -> None:
    """Saved figures judged again under the bounds the code holds now: correct features held to the bound at their
    depth, faults caught where the bound fails them or they were closer to another layer when measured."""
    from hsstore.extract.compare import bound_of, compile_bound, depth_of

    n = res["shape"]["layers"]
    for kind in ("eager", "compiled"):
        for name, v in res["audit"][kind]["features"].items():
            b = bound_of("bfloat16", "raw", depth_of(int(name), n))
            v["samples_ok"] = v["samples"] if (v["min_cosine"] >= b.cosine and v["max_rel_err"] <= b.rel_err) else 0
    for k in res["compile_checks"]:
        if "per_tap" in k:
            for tap, t in k["per_tap"].items():
                cb = compile_bound(depth_of(int(tap), n))
                t["bound_cos"], t["bound_rel"] = cb.cosine, cb.rel_err
            k["passed"] = all(t["min_cos"] >= t["bound_cos"] and t["max_rel"] <= t["bound_rel"]
                              for t in k["per_tap"].values())
    for js in res["faults"].values():
        for tap, found in js.items():
            b = bound_of("bfloat16", "raw", depth_of(int(tap), n))
            for j in found:
                within = j["cosine"] >= b.cosine and j["rel_err"] <= b.rel_err
                j["caught"] = not (within and j["rel_err"] < j["beside_rel_err"])


if __name__ == "__main__":
    main()
