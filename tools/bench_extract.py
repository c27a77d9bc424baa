"""Extraction throughput vs forward-only throughput of the same model and batches (GPU benchmark).

Builds a random-weight Qwen3.5-architecture target (default: 27B scale, 64 layers, hidden 5120),
synthetic sequences, and times, on the same batches, alternating:
  forward_full   the whole decoder, no lm_head, no capture (the brief's "forward only");
  forward_taps   the decoder up to the last tapped layer, no capture, no copy;
  extract        the real pipeline: hooks, GPU pack, pinned copy, StoreWriter threads, local store;
  extract_process  the same with the writer in a child process fed through shared memory (ProcessWriter);
  extract_memory   the thread writer into ``memory://`` (no disk: separates storage from CPU contention);
  capture_only   hooks, GPU pack and pinned copy, no writer;
  extract_process_nostats  extract_process without the feature statistics (``record_stats=False``):
                 paired with extract_process, their cost.
  extract_process_torchconv  extract_process with the Gated DeltaNet short convolution on transformers' PyTorch
                 path instead of fla's Triton kernel (``hsstore/app/conv.py``; what ``HSSTORE_CONV=torch`` keeps):
                 paired with extract_process, the kernel's gain.
Prints JSON with tokens/s, ratios, MFU, and how long the forward waited on the writer (``slot_wait_s``)
and the writer on storage (``storage_wait_s``).

Under ``torchrun --nproc_per_node N`` every rank takes its share of the samples (sample i to rank i % world,
as extraction splits input rows, so ``--samples`` is the total) and all ranks run each mode at the same time, sharing disk and CPUs;
rank 0 prints per-rank and summed figures. ``--keep URL`` finally extracts once more into URL, with the
target's embedding, lm_head and config as store assets, so ``hsstore train`` can run on it: the assets are written
before the first shard, and the kept writer's session names every rank's writer tag and what it plans to write, so
``hsstore train --follow`` can start on the store while it is written and knows when it is finished
(``tools/bench_follow.py --target bench``; ``--modes ""`` keeps only that extraction).

    python -m tools.bench_extract --out /tmp/bench-store [--layers-total 64 --hidden 5120 ...]
    torchrun --nproc_per_node 2 -m tools.bench_extract --samples 96 --modes forward_full,extract_process
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

from hsstore.app.conv import restore_conv, torch_conv, use_fla_conv
from hsstore.extract.capture import run_tapped
from hsstore.app.target import base_model, decoder_layers
from hsstore.extract.forward import extract_batches, pad_right, token_budget_batches
from hsstore.extract.sample import TokenizedSample
from hsstore.io import storage
from hsstore import Manifest, ProcessWriter, StoreWriter, TargetIdentity, TokenizerIdentity
from hsstore.format import assets
from hsstore.distributed import rank_and_world
from hsstore.format.taps import default_taps
from tools.measure import timed

MODES = ("forward_full", "extract", "extract_process", "extract_memory", "forward_taps", "capture_only",
         "extract_process_nostats", "extract_process_torchconv")
TORCH_CONV = "_torchconv"  # mode suffix: the short convolution on PyTorch's path for that mode


def build_model(args):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    n = args.layers_total
    cfg = Qwen3_5TextConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=n,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
        linear_num_key_heads=args.linear_k_heads, linear_num_value_heads=args.linear_v_heads, linear_key_head_dim=128,
        linear_value_head_dim=128, layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                                for i in range(n)])
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(args.device):
        model = Qwen3_5ForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    return model.eval()


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The target's shape (default: Qwen3.5 at 27B scale) and the synthetic batches: shared by the GPU tools."""
    p.add_argument("--layers-total", type=int, default=64)
    p.add_argument("--hidden", type=int, default=5120)
    p.add_argument("--ffn", type=int, default=17408)
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--linear-v-heads", type=int, default=48)
    p.add_argument("--linear-k-heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=248320)
    p.add_argument("--samples", type=int, default=48)
    p.add_argument("--min-len", type=int, default=3072)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--token-budget", type=int, default=16384)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--device", default="cuda")


def synthetic(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[TokenizedSample]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        T = int(rng.integers(lo, hi + 1))
        ids = rng.integers(0, vocab, T).astype(np.int32)
        mask = np.zeros(T, np.uint8)
        mask[T // 4:] = 1
        out.append(TokenizedSample(f"b{i:05d}", ids, mask, source="bench"))
    return out


def bench_tag(rank: int) -> str:
    """The writer tag of rank ``rank``'s benchmark writers: its kept store's session expects every rank's."""
    return f"bench-rank{rank}"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@torch.inference_mode()
def forward_pass(model, batches, layers, full: bool) -> None:
    device = next(model.parameters()).device
    for b in batches:
        ids, attn = pad_right(b, 0)
        ids, attn = ids.to(device, non_blocking=True), attn.to(device, non_blocking=True)
        if full:
            base_model(model)(input_ids=ids, attention_mask=attn, use_cache=False)
        else:
            run_tapped(model, layers, ids, attn)
    sync()


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, )
    p.add_argument("--out", default="/tmp/bench-extract-store")
    add_model_args(p)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--keep", default=None, metavar="URL", help="finally extract into URL (with assets) and keep it")
    p.add_argument("--seed", type=int, default=0, help="model init seed (same on every rank)")
    p.add_argument("--shard-mb", type=float, default=0, help="the writer's shard size (0: its default); a tiny "
                   "dry-run store needs small shards to have more chunks than the loader has readers")
    p.add_argument("--no-emulate-casts", action="store_true", help="with --compile: let fused kernels keep fp32 "
                   "intermediates (inductor's default) instead of rounding to bf16 where eager kernels do")
    p.add_argument("--compile", action="store_true",
                   help="after the eager rounds: compile the decoder's dense parts (extract/speed.py), warm up on "
                        "every batch shape (compile time reported), run the modes again as MODE+compile and compare "
                        "the first batch's features with the eager ones (per-token cosine)")
    args = p.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        p.error(f"unknown modes {sorted(unknown)}")

    rank, world = rank_and_world()
    dist = None
    if world > 1:
        import torch.distributed as dist

        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    device = torch.device(args.device if args.device != "cuda" else f"cuda:{torch.cuda.current_device()}")
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    model = build_model(args)
    build_s = time.perf_counter() - t0
    conv_hooked = use_fla_conv(model, device)  # as load_target does for extraction (HSSTORE_CONV=torch: not)
    layers = default_taps(args.layers_total)
    samples = synthetic(args.samples, args.min_len, args.max_len, args.vocab)[rank::world]
    batches = token_budget_batches(samples, args.token_budget)
    tokens = sum(s.num_tokens for s in samples)
    manifest = Manifest(
        target=TargetIdentity(name="random-qwen3.5", num_layers=args.layers_total, hidden_size=args.hidden,
                              config_hash=f"bench-seed{args.seed}"),
        tokenizer=TokenizerIdentity(name="bench", vocab_hash="bench"), layers=tuple(layers))
    out = f"{args.out}-rank{rank}"
    waits: dict[str, dict[str, list[float]]] = {}
    close_s: dict[str, list[float]] = {}

    def open_writer(mode: str):
        url = f"memory://bench-extract-rank{rank}" if mode == "extract_memory" else args.keep if mode == "keep" else out
        if mode != "keep":
            _clear(url)
        process = mode.startswith("extract_process") or (mode == "keep" and device.type == "cuda")
        cls = ProcessWriter if process else StoreWriter
        extra = {"shard_bytes": int(args.shard_mb * 1e6)} if args.shard_mb else {}
        if mode == "keep":  # a follower waits for every rank's writer and estimates its schedule from the plan
            extra.update(expects=[bench_tag(r) for r in range(world)], planned_samples=len(samples),
                         planned_tokens=tokens)
        return cls(url, manifest, writer_tag=bench_tag(rank), check_finite=False,  # checked on the device
                   record_stats=not mode.endswith("_nostats"), **extra)

    def extract_into(w, mode: str) -> None:
        """Until every sample is handed to the writer (steady-state pipeline); the final flush of the
        last shards is timed separately (in a long run it is paid once), as is starting the writer."""
        proc = isinstance(w, ProcessWriter)

        def sink(s, f, values):
            w.add(s.sample_id, s.input_ids, s.loss_mask, f, feature_stats=values)

        stats = extract_batches(model, layers, batches, sink, 0, device, staging_tokens=args.token_budget,
                                on_batch=(lambda b: w.sync()) if proc else None,
                                host_alloc=w.staging if proc else None, record_stats=not mode.endswith("_nostats"))
        wt = waits.setdefault(mode, {"slot_wait_s": [], "storage_wait_s": []})
        wt["slot_wait_s"].append(stats.slot_wait_s)
        wt["storage_wait_s"].append(w.wait_s)

    def close_writer(w, mode: str) -> None:
        t = time.perf_counter()
        w.close()
        close_s.setdefault(mode, []).append(time.perf_counter() - t)
        if mode != "keep":
            _clear(w.url)

    def on_torch_conv(fn):
        """``fn()`` with the short convolution on transformers' PyTorch path (the fla hook undone meanwhile)."""
        undone = torch_conv(model)
        try:
            return fn()
        finally:
            restore_conv(undone)

    def run_mode(mode: str, w) -> None:
        if mode.endswith(TORCH_CONV):
            return on_torch_conv(lambda: run_base(mode, w))
        return run_base(mode, w)

    def run_base(mode: str, w) -> None:
        base = mode.removesuffix(TORCH_CONV)
        if base == "forward_full":
            forward_pass(model, batches, layers, full=True)
        elif base == "forward_taps":
            forward_pass(model, batches, layers, full=False)
        elif base == "capture_only":
            extract_batches(model, layers, batches, lambda s, f, v: None, 0, device, staging_tokens=args.token_budget)
        else:
            extract_into(w, mode)

    def barrier():
        if dist is not None:
            dist.barrier()

    forward_pass(model, batches[:1], layers, full=True)  # warm-up: kernels, autotuning
    forward_pass(model, batches[:1], layers, full=False)
    torch_modes = any(m.endswith(TORCH_CONV) for m in modes)
    if torch_modes:
        on_torch_conv(lambda: forward_pass(model, batches[:1], layers, full=False))
    best: dict[str, float] = {}

    def measure(suffix: str) -> None:
        for _ in range(args.rounds):
            for mode in modes:
                w = open_writer(mode) if mode.startswith("extract") else None
                barrier()  # every rank runs the same mode at the same time: they share disk and CPUs
                sec = timed(lambda: run_mode(mode, w), sync)
                best[mode + suffix] = min(best.get(mode + suffix, np.inf), sec)
                print(json.dumps({"rank": rank, "mode": mode + suffix, "seconds": sec, "tokens_per_s": tokens / sec}),
                      file=sys.stderr, flush=True)  # progress that survives a timeout
                if w is not None:
                    close_writer(w, mode)

    measure("")
    compiled: dict = {}
    if args.compile:
        from hsstore.extract.compile_check import compare_taps
        from hsstore.extract.speed import compile_forward

        ids, mask = pad_right(batches[0], 0)
        ids, mask = ids.to(device), mask.to(device)
        # the reference: the eager forward with transformers' own PyTorch convolution, whatever extraction runs
        ref = on_torch_conv(lambda: run_tapped(model, layers, ids, mask).float())
        n0 = batches[0][0].num_tokens  # the batch's first sample, alone: the eager forward at another shape
        alone = on_torch_conv(lambda: run_tapped(model, layers, ids[:1, :n0], mask[:1, :n0]).float())
        if conv_hooked:  # the eager forward on fla's convolution against the same reference
            eager_fla = run_tapped(model, layers, ids, mask).float()
            c = torch.nn.functional.cosine_similarity(ref[mask.bool()], eager_fla[mask.bool()], dim=-1)
            compiled["fla_conv_eager_vs_torch_eager"] = {
                str(l): {"min": float(c[:, j].min()), "mean": float(c[:, j].mean())} for j, l in enumerate(layers)}
            del eager_fla, c
        report = compile_forward(model, emulate_casts=not args.no_emulate_casts, mixers=True)
        t = time.perf_counter()
        forward_pass(model, batches, layers, full=True)  # every batch shape once: the compile time, up front
        forward_pass(model, batches, layers, full=False)
        if torch_modes:  # the mixers' graphs again for the other convolution (dynamo guards on the function)
            on_torch_conv(lambda: forward_pass(model, batches, layers, full=False))
        compiled["warm_up_s"] = time.perf_counter() - t
        compiled["modules"] = str(report)
        compiled["emulate_casts"] = not args.no_emulate_casts
        new = run_tapped(model, layers, ids, None).float()  # as extraction calls it: no padding mask
        keep = mask.bool()

        def cosines(a, b):  # per token and tap: [tokens, taps]
            return torch.nn.functional.cosine_similarity(a, b, dim=-1)

        c = cosines(ref[keep], new[keep])
        floor = cosines(ref[0, :n0], alone[0])
        worst = compare_taps(ref[keep], new[keep], [str(l) for l in layers], args.layers_total)  # what extraction's own check bounds
        compiled["cosine_min"], compiled["cosine_mean"] = float(c.min()), float(c.mean())
        compiled["per_tap"] = {str(l): {"compiled_vs_eager_min": float(c[:, j].min()),
                                        "compiled_vs_eager_mean": float(c[:, j].mean()),
                                        "eager_alone_vs_in_batch_min": float(floor[:, j].min()),
                                        "eager_alone_vs_in_batch_mean": float(floor[:, j].mean()),
                                        "compiled_vs_eager_max_rel": worst[str(l)]["max_rel"]}
                               for j, l in enumerate(layers)}
        compiled["max_abs_diff"] = float((ref[keep] - new[keep]).abs().max())
        compiled["batch_shapes"] = len({(len(b), max(s.num_tokens for s in b)) for b in batches})
        del ref, new, alone
        measure("+compile")
        for m in modes:
            compiled[f"speedup_{m}"] = best[m] / best[m + "+compile"]
    stack = decoder_layers(model)
    params_full = sum(p.numel() for p in stack.parameters())
    params_taps = sum(p.numel() for l in stack[: max(layers) + 1] for p in l.parameters())
    n_full_attn = sum(1 for i in range(args.layers_total) if (i + 1) % 4 == 0)
    mean_T = tokens / max(1, len(samples))
    attn_full = 2 * 2 * (mean_T / 2) * args.heads * args.head_dim * n_full_attn  # QK^T and PV, causal
    attn_taps = attn_full * (max(layers) + 1) / args.layers_total

    def tflops(mode):
        full = mode.startswith("forward_full")
        return tokens * (2 * (params_full if full else params_taps) + (attn_full if full else attn_taps)) / best[mode] / 1e12

    res = {
        "rank": rank, "device": torch.cuda.get_device_name() if device.type == "cuda" else str(device),
        "tokens": tokens, "samples": len(samples), "batches": len(batches),
        "layers_total": args.layers_total, "hidden": args.hidden, "taps": layers, "build_model_s": build_s,
        "fla": _fla_available(), "conv_on_fla": conv_hooked,
        "tokens_per_s": {m: tokens / v for m, v in best.items()},
        "tflops": {m: tflops(m) for m in best},
        "compile": compiled,
        "final_flush_s": {m: min(v) for m, v in close_s.items()},
        "waits_s": {m: {k: min(v) for k, v in w.items()} for m, w in waits.items()},
        "store_bytes_per_pass": tokens * len(layers) * args.hidden * 2,
    }
    res["mfu_vs_989"] = {m: v / 989 for m, v in res["tflops"].items()}
    for base in ("forward_full", "forward_taps"):
        for m in modes:
            if base in best and m.startswith(("extract", "capture")):
                res[f"ratio_{m}_vs_{base}"] = best[base] / best[m]
    for suffix in ("", "+compile"):  # the pair of convolutions, same batches, alternating
        fla_s, torch_s = best.get("extract_process" + suffix), best.get("extract_process" + TORCH_CONV + suffix)
        if fla_s and torch_s:
            res["fla_conv_speedup" + suffix] = torch_s / fla_s
    if args.compile and "extract_process+compile" in best:
        res["extract_process+compile_vs_eager_forward_full"] = best.get("forward_full", np.nan) / best[
            "extract_process+compile"]
    if args.keep:
        w = open_writer("keep")
        if rank == 0:  # before the first shard: a trainer following the store builds its drafter from them
            fs, root = storage.resolve(args.keep, {})
            assets.write_assets(fs, root, {
                assets.EMBED: assets.tensors_bytes({"weight": model.get_input_embeddings().weight}),
                assets.LM_HEAD: assets.tensors_bytes({"weight": model.get_output_embeddings().weight}),
                assets.CONFIG: model.config.to_json_string().encode()})
        barrier()
        t = time.perf_counter()
        extract_into(w, "keep")
        close_writer(w, "keep")
        res["keep_tokens_per_s"] = tokens / (time.perf_counter() - t)
        res["kept"] = args.keep
    if dist is not None:
        gathered = [None] * world
        dist.all_gather_object(gathered, res)
        if rank == 0:
            total = {m: sum(r["tokens"] for r in gathered) / max(r["tokens"] / r["tokens_per_s"][m] for r in gathered)
                     for m in modes}
            print(json.dumps({"world_size": world, "per_rank": gathered, "tokens_per_s_all_ranks": total,
                              "tokens_per_s_per_gpu": {m: v / world for m, v in total.items()}}, indent=2))
        dist.destroy_process_group()
    else:
        print(json.dumps(res, indent=2))


def _clear(url: str) -> None:
    fs, root = storage.resolve(url, {})
    if fs.exists(root):
        fs.rm(root, recursive=True)


def _fla_available() -> bool:
    try:
        import fla  # noqa: F401

        return True
    except Exception:
        return False


if __name__ == "__main__":
    main()
