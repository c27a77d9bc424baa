"""What each feature encoding costs a DFlash drafter: bytes per token, feature error per tap, and the drafters trained
from each encoding's store with the same recipe and seeds, on the demo's trained target and its data.

Default mode (CPU, the demo's target ``extract/data/tiny_trained`` and its conversations):

1. one store per encoding (``hsstore extract --encoding E``) of the demo's conversations, and a bf16 store of the
   target's own greedy answers to the held-out prompts (teacher-forced eval: what a served drafter reads is the live
   target's bf16 features, so every drafter is evaluated on them);
2. bytes per token: the encoding's own (scales and padding of the last block included) and the store's (its feature
   files over its tokens: chunk padding included);
3. feature error per tap against the bf16 store, over every token: ``1 - cosine``, relative error
   ``||q - x|| / ||x||``, SNR ``10 log10(||x||^2 / ||q - x||^2)``;
4. lossless codecs on each encoding's stored bytes (chunks as the store holds them): ratio and one core's decode
   speed;
5. per encoding and seed, ``hsstore train`` with the demo's recipe (``extract/demo.py``: its flags and steps),
   then ``hsstore eval`` teacher-forced on the held-out store and speculative (``--model``) on the held-out prompts;
   mean and spread over the seeds, and each encoding's tau against bf16's.

Every run's result is kept under ``OUT/results``: a re-run continues where one stopped. ``--seeds-shape``: the feature
error at the seeds' shape instead (a random-weight Qwen3.5 target of 64 layers, 5,120 wide, taps 1,16,31,46,61, on
the GPU), with outlier channels planted (random weights have none; trained LLMs carry a few channels 100-1000x the
median magnitude): per tap over all channels and over the others, and each encoding's decode speed on the device.

    nice -n 10 python -m tools.encoding_evidence --out /tmp/enc                       # CPU, the demo's target
    python -m tools.encoding_evidence --seeds-shape --json /tmp/enc-seeds.json        # GPU: 64 layers x 5,120
    python -m tools.encoding_evidence --seeds-shape --device cpu --hidden 256 --ffn 512 --heads 4 --kv-heads 2 \\
        --head-dim 64 --linear-k-heads 2 --linear-v-heads 4 --vocab 4096 --samples 2 --min-len 256 --max-len 320
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from hsstore.format import encodings

ENCODINGS = encodings.NAMES  # bf16 (raw), fp8 and each encoding below it
SHOWN = {"raw": "bf16"}
LOSSLESS = {  # the codecs the store has (format/codec.py), and blosc's bit shuffle, which only 4-bit codes could use
    "zstd:1": ("zstd", 1, None), "zstd:3": ("zstd", 3, None), "blosc-zstd (byte shuffle)": ("blosc", 1, "shuffle"),
    "blosc-zstd (bit shuffle)": ("blosc", 1, "bitshuffle"), "lz4": ("lz4", 1, "shuffle")}


def shown(encoding: str) -> str:
    return SHOWN.get(encoding, encoding)


def hsstore(*argv: str, threads: int = 1, capture: bool = False) -> str:
    """``hsstore ARGV`` in a child process (its own memory and threads); its stdout when ``capture``."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    done = subprocess.run([sys.executable, "-m", "hsstore", *argv], env=env, text=True,
                          stdout=subprocess.PIPE if capture else None)
    if done.returncode:
        raise RuntimeError(f"hsstore {' '.join(argv)}: exit {done.returncode}")
    return done.stdout or ""


# -- the feature error --------------------------------------------------------------------------------------
def error_of(q: torch.Tensor, x: torch.Tensor) -> dict[str, float]:
    """``1 - cosine``, relative error and SNR (dB) of ``q`` against ``x`` over all their values, in float64."""
    q, x = q.double().reshape(-1), x.double().reshape(-1)
    d2, n2 = float((q - x).square().sum()), float(x.square().sum())
    cos = float(q @ x) / math.sqrt(max(float(q @ q) * n2, 1e-300))
    return {"1-cos": 1.0 - cos, "rel": math.sqrt(d2 / n2) if n2 else 0.0,
            "snr_db": 10 * math.log10(n2 / d2) if d2 else math.inf}


def store_error(store_url: str, bf16_url: str) -> dict[str, dict[str, float]]:
    """Per tap, the error of a store's decoded features against the bf16 store's, over every token (samples
    matched by id)."""
    import hsstore as hs

    a, b = hs.open(bf16_url), hs.open(store_url)
    index = {sid: i for i, sid in enumerate(a.sample_ids())}
    xs, qs = [], []
    for item in b:
        qs.append(item["hidden_states"].float())
        xs.append(a.read(index[item["sample_id"]])["hidden_states"].float())
    x, q = torch.cat(xs), torch.cat(qs)
    return {str(l): error_of(q[:, j], x[:, j]) for j, l in enumerate(b.layers)}


def bytes_per_token(store_url: str) -> dict[str, float]:
    """The encoding's stored feature bytes per token (all taps: scales and block padding included) and the store's
    (its feature and scale files over its tokens: chunk padding included too)."""
    import hsstore as hs
    from hsstore.format import codec

    s = hs.open(store_url)
    m = s.manifest
    tokens = sum(r.n_tokens for r in s.commits)
    files = sum(v["size"] for r in s.commits for k, v in r.files.items() if k.split("/")[2].startswith(("layer_",
                                                                                                          "scale_")))
    return {"encoding": codec.token_bytes(m.dtype, m.encoding, len(m.layers), m.hidden_size),
            "store": files / max(1, tokens), "bf16": codec.token_bytes(m.dtype, "raw", len(m.layers), m.hidden_size)}


# -- lossless codecs on top ----------------------------------------------------------------------------------
def stored_rows(store_url: str) -> np.ndarray:
    """Every feature row of a store as it holds them (storage bits, layer-major), chunks concatenated."""
    import hsstore as hs

    s = hs.open(store_url)
    out = []
    for j, rec in enumerate(s.commits):
        _, _, feats = s.read_range(rec.shard, 0, rec.n_tokens, s.layers, scales_out=s.new_scales(len(s.layers),
                                                                                                 rec.n_tokens))
        out.append(feats.reshape(len(s.layers) * rec.n_tokens, -1))
    return np.concatenate(out)


def codec_of(kind: str, level: int, shuffle: str | None, itemsize: int):
    import numcodecs

    if kind == "zstd":
        return numcodecs.Zstd(level=level)
    mode = {"shuffle": numcodecs.Blosc.SHUFFLE, "bitshuffle": numcodecs.Blosc.BITSHUFFLE}[shuffle]
    return numcodecs.Blosc(cname="zstd" if kind == "blosc" else "lz4", clevel=level, shuffle=mode,
                           typesize=max(2, itemsize) if shuffle == "shuffle" else 1, blocksize=0)


def lossless(rows: np.ndarray, chunk_bytes: int = 4 << 20) -> dict[str, dict[str, float]]:
    """Per codec: compressed size over raw (as chunks of ``chunk_bytes``) and one core's decode GB/s (of raw bytes)."""
    import numcodecs

    numcodecs.blosc.set_nthreads(1)
    flat = np.ascontiguousarray(rows).view(np.uint8).reshape(-1)
    chunks = [flat[i:i + chunk_bytes] for i in range(0, flat.size, chunk_bytes)]
    out = {}
    for name, (kind, level, shuffle) in LOSSLESS.items():
        c = codec_of(kind, level, shuffle, rows.dtype.itemsize)
        enc = [c.encode(ch) for ch in chunks]
        dest = np.empty(chunk_bytes, np.uint8)
        t0 = time.perf_counter()
        for e, ch in zip(enc, chunks):
            c.decode(e, out=dest[:ch.size])
        dt = time.perf_counter() - t0
        out[name] = {"ratio": flat.size / sum(len(e) for e in enc), "decode_gb_s": flat.size / dt / 1e9}
    return out


def cpu_decode_speed(store_url: str, rows: np.ndarray) -> float | None:
    """Stored GB a second decoded into bfloat16 by one CPU thread (the CPU trainer's path), over ``rows``."""
    import hsstore as hs

    m = hs.open(store_url).manifest
    enc = encodings.get(m.encoding)
    if not enc.quantised or enc.row_scale:  # raw: nothing to decode; fp8's scales live apart (its rows alone: none)
        return None
    values = torch.from_numpy(rows)
    return decode_speed(enc, values, None, m.hidden_size)


# -- the drafters ----------------------------------------------------------------------------------------------
def heldout_conversations(target: Path, heldout: Path, out: Path, max_new: int) -> Path:
    """The target's own greedy answers to the held-out prompts, as conversations extraction reads."""
    from transformers import Qwen3_5ForCausalLM

    from hsstore.extract.target import load_tokenizer
    from tools.tiny_corpus import Example
    from tools.train_tiny_target import answer, split_response

    if out.exists():
        return out
    tok = load_tokenizer(str(target))
    model = Qwen3_5ForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    rows = []
    for line in heldout.read_text().splitlines():
        row = json.loads(line)
        prompt = next(m["content"] for m in row["messages"] if m["role"] == "user")
        reasoning, ans, _ = split_response(tok.decode(answer(model, tok, Example("heldout", prompt, "", ""), max_new),
                                                      skip_special_tokens=False))
        rows.append({"id": row["id"], "source": row.get("source", ""),
                     "messages": Example("heldout", prompt, reasoning, ans).messages()})
    tmp = out.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.rename(out)
    return out


def last_metrics(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {k: rows[-1].get(k) for k in ("step", "loss", "acc", "tau")}


def train_and_eval(args, enc: str, seed: int, store: str, heldout_store: str, target: Path, prompts: Path) -> dict:
    """One drafter: trained from ``store`` with the demo's recipe and ``seed``, then evaluated teacher-forced on the
    held-out bf16 store and speculatively on the held-out prompts. Kept in OUT/results (a re-run reuses it)."""
    from hsstore.extract.demo import EVAL_FLAGS, EVAL_SAMPLES, TRAIN_FLAGS

    result = Path(args.out) / "results" / f"{enc}-s{seed}.json"
    if result.exists():
        return json.loads(result.read_text())
    run = Path(args.out) / "runs" / f"{enc}-s{seed}"
    if run.exists():
        shutil.rmtree(run)  # an interrupted run: trained again from the start, with the same seed
    t0 = time.perf_counter()
    hsstore("train", "--store", store, "--out", str(run), "--steps", str(args.steps), *TRAIN_FLAGS, "--seed",
            str(seed), "--device", args.device, "--cpu-threads", str(args.cpu_threads), "-q", threads=args.cpu_threads)
    t1 = time.perf_counter()
    tf = json.loads(hsstore("eval", "--store", heldout_store, "--drafter", str(run), "--device", args.device,
                            "--cpu-threads", str(args.cpu_threads), "--json", "-q", capture=True,
                            threads=args.cpu_threads))
    spec = json.loads(hsstore("eval", "--store", store, "--drafter", str(run), "--model", str(target), "--input",
                              str(prompts), "--num-samples", str(EVAL_SAMPLES), *EVAL_FLAGS, "--device", args.device,
                              "--cpu-threads", str(args.cpu_threads), "--json", "-q", capture=True,
                              threads=args.cpu_threads))
    out = {"encoding": enc, "seed": seed, "train": last_metrics(run), "train_s": round(t1 - t0, 1),
           "eval_s": round(time.perf_counter() - t1, 1), "tf_tau": tf["tau"],
           "spec_tau": spec.get("tau_per_prompt", spec.get("tau")),
           "identical": f"{spec['identical']}/{spec['samples']}",
           **{f"spec_{k}": v for k, v in spec.items()  # tau_pooled: the other convention (SGLang's server)
              if k.startswith("tau_") and k != "tau_per_prompt" and not isinstance(v, list)},
           **{f"tf_{k}": v for k, v in tf.items() if k.startswith("tau_") and not isinstance(v, list)}}
    result.parent.mkdir(parents=True, exist_ok=True)
    result.write_text(json.dumps(out, indent=1) + "\n")
    shutil.rmtree(run / "checkpoints", ignore_errors=True)  # the drafter is kept; the checkpoints only resume
    return out


def spread(xs: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(xs), "sd": statistics.stdev(xs) if len(xs) > 1 else 0.0, "min": min(xs),
            "max": max(xs), "n": len(xs)}


def verdict(summary: dict, base: str = "raw", key: str = "spec_tau") -> dict[str, dict]:
    """Per encoding: its mean tau over bf16's, and whether it is within the goal: 2% of bf16's mean, or bf16's
    seeds' own spread (their sd) where that is larger; and the paired view: per seed both share the data order,
    anchors and initial weights, so the differences of the seeds both ran (encoding - bf16) show a cost the seeds'
    spread hides (mean, sd and standard error of the differences)."""
    b = summary[base]["tau"][key]
    allowed = max(0.02 * b["mean"], b["sd"])
    by_seed = {r["seed"]: r[key] for r in summary[base]["runs"]}
    out = {}
    for e, s in summary.items():
        diffs = [r[key] - by_seed[r["seed"]] for r in s["runs"] if r["seed"] in by_seed]
        paired = spread(diffs) if diffs else None
        if paired:
            paired["se"] = paired["sd"] / math.sqrt(paired["n"])
        out[e] = {"ratio": s["tau"][key]["mean"] / b["mean"], "gap": b["mean"] - s["tau"][key]["mean"],
                  "allowed": allowed, "within": b["mean"] - s["tau"][key]["mean"] <= allowed, "paired": paired}
    return out


def demo_evidence(args) -> dict:
    from hsstore.extract.tiny import build_trained_target, trained_files

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target = out / "target"
    if not target.exists():
        build_trained_target(target)
    shipped = trained_files()
    convs, prompts = shipped / "conversations.jsonl", shipped / "heldout.jsonl"
    answers = heldout_conversations(target, prompts, out / "heldout_answers.jsonl", args.max_new_tokens)
    stores = {}
    for enc in ["raw", *[e for e in args.encodings if e != "raw"]]:
        url = str(out / "stores" / enc)
        if not (Path(url) / "commits").exists():
            shutil.rmtree(url, ignore_errors=True)
            hsstore("extract", "--model", str(target), "--input", str(convs), "--out", url, "--device", args.device,
                    "--encoding", enc, "-q", threads=args.cpu_threads)
        stores[enc] = url
    heldout_store = str(out / "stores" / "heldout-bf16")
    if not (Path(heldout_store) / "commits").exists():
        shutil.rmtree(heldout_store, ignore_errors=True)
        hsstore("extract", "--model", str(target), "--input", str(answers), "--out", heldout_store, "--device",
                args.device, "-q", threads=args.cpu_threads)
    res: dict = {"encodings": {}, "command": "python -m tools.encoding_evidence " + " ".join(sys.argv[1:])}
    for enc in args.encodings:
        e = res["encodings"][enc] = {"bytes_per_token": bytes_per_token(stores[enc])}
        e["error"] = store_error(stores[enc], stores["raw"]) if enc != "raw" else {}
        rows = stored_rows(stores[enc])
        e["lossless"] = lossless(rows)
        e["cpu_decode_gb_s"] = cpu_decode_speed(stores[enc], rows)
        print(f"{shown(enc)}: {json.dumps({k: e[k] for k in ('bytes_per_token', 'error')})}", flush=True)
    seeds = {enc: args.seeds_for.get(enc, args.seeds) for enc in args.encodings}
    # seed by seed, so that partial results stay comparable; --jobs runs at a time (each one thread, its own process)
    todo = [(enc, seed) for seed in sorted({x for v in seeds.values() for x in v}) for enc in args.encodings
            if seed in seeds[enc]]

    def one(job):
        enc, seed = job
        r = train_and_eval(args, enc, seed, stores[enc], heldout_store, target, prompts)
        print(f"{shown(enc)} seed {seed}: teacher-forced tau {r['tf_tau']:.3f}, speculative tau {r['spec_tau']:.3f} "
              f"(train {r['train_s']:.0f}s, eval {r['eval_s']:.0f}s)", flush=True)
        return r

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        done = list(pool.map(one, todo))
    runs: dict[str, list] = {enc: [r for r in done if r["encoding"] == enc] for enc in args.encodings}
    for enc, rs in runs.items():
        keys = [k for k in rs[0] if "tau" in k and all(isinstance(r.get(k), (int, float)) for r in rs)]
        res["encodings"][enc].update(runs=rs, tau={k: spread([r[k] for r in rs]) for k in keys})
    res["verdict"] = {k: verdict(res["encodings"], key=k) for k in res["encodings"]["raw"]["tau"]}
    return res


# -- the seeds' shape ----------------------------------------------------------------------------------------
def plant_outliers(x: torch.Tensor, channels: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """``x`` ``[T, H]`` with each of ``channels`` rescaled so its median magnitude is ``factor`` x the median
    magnitude of all values (its tokens' variation kept, as trained LLMs' massive activations vary little)."""
    med = x.float().abs().median()
    ch = x[:, channels].float()
    scale = factors.to(x.device) * med / ch.abs().median(dim=0).values.clamp_min(1e-12)
    out = x.clone()
    out[:, channels] = (ch * scale).to(x.dtype)
    return out


def decode_speed(enc, values, scales, hidden: int, repeat: int = 3) -> float:
    """Stored GB decoded per second into bfloat16 on the values' device (best of ``repeat``)."""
    best = math.inf
    for _ in range(repeat):
        if values.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        enc.decode(values, scales, hidden, torch.bfloat16)
        if values.is_cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    nbytes = values.numel() * values.element_size() + (0 if scales is None else scales.numel() * 4)
    return nbytes / best / 1e9


def seeds_shape(args) -> dict:
    from hsstore.format import microscaling
    from hsstore.format.taps import default_taps
    from tools.bench_extract import build_model, synthetic
    from tools.deep_bounds import per_sample

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    model = build_model(args)
    taps = default_taps(args.layers_total)
    samples = synthetic(args.samples, args.min_len, args.max_len, args.vocab, args.seed)
    feats = torch.cat(list(per_sample(model, taps, [[s] for s in samples], device).values())).to(device)  # [T, L, H]
    del model
    H = feats.shape[-1]
    g = torch.Generator().manual_seed(args.seed)
    channels = torch.randperm(H, generator=g)[:args.outliers].to(device)
    factors = torch.logspace(2, 3, args.outliers)
    keep = torch.ones(H, dtype=torch.bool, device=device)
    keep[channels] = False
    res: dict = {"command": "python -m tools.encoding_evidence " + " ".join(sys.argv[1:]),
                 "shape": {"layers": args.layers_total, "hidden": H, "taps": taps, "tokens": int(feats.shape[0])},
                 "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "the CPU",
                 "outliers": {"channels": channels.tolist(), "factors": factors.tolist()}, "encodings": {}}
    planted = [plant_outliers(feats[:, j], channels, factors) for j in range(len(taps))]
    for name in args.encodings:
        enc = encodings.get(name)
        e = res["encodings"][name] = {"bytes_per_token": len(taps) * enc.row_bytes(H, "bfloat16"),
                                      "bf16_bytes_per_token": len(taps) * 2 * H, "per_tap": {}}
        if not enc.quantised:  # bf16's own bits: what a codec gets from a raw store
            e["lossless"] = lossless(torch.cat(planted)[: 1 << 16].view(torch.int16).cpu().numpy().view(np.uint16))
            continue
        for j, l in enumerate(taps):
            x = planted[j]
            v = enc.encode(x)
            q = enc.decode(v.values, v.scales, H, torch.float32)
            e["per_tap"][str(l)] = {"all": error_of(q, x), "others": error_of(q[:, keep], x[:, keep]),
                                    "without_outliers": error_of(
                                        enc.decode(*enc.encode(feats[:, j]), H, torch.float32), feats[:, j])}
            if isinstance(enc, encodings.BlockScaled):  # the same rows without outlier slots: what the slots buy
                bare = dataclasses.replace(enc.fmt, outlier_every=0)
                q0 = microscaling.decode(microscaling.encode(x, bare), H, bare, torch.float32)
                e["per_tap"][str(l)]["others_no_slots"] = error_of(q0[:, keep], x[:, keep])
        v = enc.encode(torch.cat(planted))
        e["decode_gb_s"] = decode_speed(enc, v.values, v.scales, H)
        e["lossless"] = lossless(v.values.view(torch.uint8).cpu().numpy()[: 1 << 16])
        print(f"{name}: {json.dumps(e['per_tap'])}", flush=True)
    return res


# -- the table --------------------------------------------------------------------------------------------------
def table(res: dict) -> str:
    """The evidence as markdown: bytes, error, codecs and tau per encoding."""
    encs = res["encodings"]
    lines = ["| encoding | bytes/token (encoding; store) | vs bf16 | 1 - cos (taps) | rel. error | SNR dB "
             "| teacher-forced tau | speculative tau, per prompt | speculative tau, pooled | seeds |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, e in encs.items():
        b = e["bytes_per_token"]
        errs = list(e.get("error", {}).values())
        err = (f"{min(x['1-cos'] for x in errs):.1e}..{max(x['1-cos'] for x in errs):.1e}",
               f"{statistics.fmean(x['rel'] for x in errs):.4f}", f"{statistics.fmean(x['snr_db'] for x in errs):.1f}"
               ) if errs else ("0", "0", "inf")
        tau = e.get("tau", {})

        def show(k):
            t = tau.get(k)
            return f"{t['mean']:.3f} ± {t['sd']:.3f} ({t['min']:.2f}-{t['max']:.2f})" if t else "-"
        lines.append(f"| {shown(name)} | {b['encoding']:.0f}; {b['store']:.1f} | {b['bf16'] / b['encoding']:.2f}x | "
                     f"{err[0]} | {err[1]} | {err[2]} | {show('tf_tau')} | {show('spec_tau')} | "
                     f"{show('spec_tau_pooled')} | "
                     f"{tau.get('spec_tau', {}).get('n', 0)} |")
    lines += lossless_lines(encs, "cpu_decode_gb_s", "decode to bf16, 1 CPU thread")
    for key, v in res.get("verdict", {}).items():
        lines += ["", f"{key}: " + "; ".join(
            f"{shown(e)} {x['ratio']:.3f} of bf16 ({'within' if x['within'] else 'outside'} the allowed "
            f"{x['allowed']:.3f}; paired difference {x['paired']['mean']:+.3f} ± {x['paired']['se']:.3f} over "
            f"{x['paired']['n']} seeds)" for e, x in v.items() if e != "raw")]
    return "\n".join(lines)


def lossless_lines(encs: dict, decode_key: str, decode_what: str) -> list[str]:
    """The codecs' table: per encoding each codec's ratio and decode speed, and the encoding's own decode speed."""
    lines = ["", "| encoding | " + " | ".join(LOSSLESS) + f" | {decode_what} |", "|---|" + "---|" * (len(LOSSLESS) + 1)]
    for name, e in encs.items():
        speed = e.get(decode_key)
        lines.append(f"| {shown(name)} | " + " | ".join(f"{e['lossless'][c]['ratio']:.3f}x, "
                                                       f"{e['lossless'][c]['decode_gb_s']:.2f} GB/s"
                                                       for c in LOSSLESS)
                     + f" | {'-' if speed is None else f'{speed:.2f} GB/s'} |")
    return lines


def seeds_table(res: dict) -> str:
    taps = res["shape"]["taps"]
    lines = [f"| encoding | bytes/token | vs bf16 | " + " | ".join(
        f"tap {t}: 1-cos / rel (others; others without slots) / rel unplanted" for t in taps) + " | decode GB/s |",
             "|---|---|---|" + "---|" * (len(taps) + 1)]
    for name, e in res["encodings"].items():
        cells = []
        for t in taps:
            p = e["per_tap"].get(str(t))
            bare = f"; {p['others_no_slots']['rel']:.3f}" if p and "others_no_slots" in p else ""
            cells.append(f"{p['all']['1-cos']:.1e} / {p['all']['rel']:.4f} ({p['others']['rel']:.3f}{bare}) / "
                         f"{p['without_outliers']['rel']:.3f}" if p else "0")
        lines.append(f"| {shown(name)} | {e['bytes_per_token']:,} | {e['bf16_bytes_per_token'] / e['bytes_per_token']:.2f}x"
                     f" | " + " | ".join(cells) + f" | {e.get('decode_gb_s', float('nan')):.2f} |")
    return "\n".join(lines + lossless_lines(res["encodings"], "decode_gb_s", f"decode to bf16 on {res['device']}"))


def main(argv: list[str] | None = None) -> int:
    from tools.bench_extract import add_model_args

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--out", default="/tmp/encoding-evidence", help="stores, runs and results (a re-run continues)")
    p.add_argument("--encodings", nargs="+", default=list(ENCODINGS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="drafter seeds of each encoding")
    p.add_argument("--seeds-for", nargs="+", default=[], metavar="ENC=S,S",
                   help="other seeds for an encoding, e.g. raw=0,1,2,3,4 (bf16: raw)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the demo's)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="the held-out answers' length at most")
    p.add_argument("--cpu-threads", type=int, default=1)
    p.add_argument("--jobs", type=int, default=1, help="drafters trained and evaluated at a time")
    p.add_argument("--json", default=None, help="write every figure here")
    p.add_argument("--seeds-shape", action="store_true", help="the feature error at the seeds' shape (GPU) instead")
    p.add_argument("--outliers", type=int, default=6, help="--seeds-shape: planted outlier channels per tap")
    p.add_argument("--seed", type=int, default=0)
    add_model_args(p)
    p.set_defaults(device=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.cpu_threads)
    if args.seeds_shape:
        args.device = args.device or "cuda"
        res = seeds_shape(args)
        text = seeds_table(res)
    else:
        from hsstore.extract.demo import TRAIN_STEPS

        args.device = args.device or "cpu"
        args.steps = args.steps or TRAIN_STEPS
        args.seeds_for = {k: [int(x) for x in v.split(",")] for k, v in (a.split("=", 1) for a in args.seeds_for)}
        res = demo_evidence(args)
        text = table(res)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
