"""Speed, peak memory and MFU of one DFlash training step with random weights (no target, no data needed),
for each attention implementation x lm_head/cross-entropy implementation side by side in one run.

    python -m tools.bench_attention --published --seq 16384 32768 --anchors 512 \
        --impl sdpa blocks --ce full fused                                           # the 27B drafter, H200
    python -m tools.bench_attention --tiny --impl sdpa blocks --ce full fused      # CPU smoke test
    python -m tools.bench_attention --check --impl blocks flex                      # == sdpa on this device
    python -m tools.bench_attention --published --seq 4096 --batch 4 --anchors 512 --impl blocks \
        --ckpt off mlp full                                 # 4 x 4096 tokens, 2,048 anchors: no, MLP-half and
                                                            # whole-layer recompute of the draft layers

``--published``: the Qwen3.6-27B drafter (5 layers: 4 sliding-window 2048 + 1 full; hidden 5120, FFN 17408,
32 heads x 128, 8 KV heads, 5 taps, vocab 248320). ``--batch`` sequences (default 1) of ``--seq`` tokens, every
position a response token, ``--anchors`` anchors each; ``--ckpt mlp``/``full`` recomputes each draft layer's MLP half / the whole layer in backward
(``hsstore train --checkpoint-layers``), and every row prints ``train``'s GPU estimate beside the measured peak. ``--ce``: how the lm_head + cross entropy run (objective.CE_IMPLS:
full = all logits at once, the unchunked reference; checkpoint = ``--ce-chunk`` rows at a time, recomputed
in backward; fused = ``--ce-chunk`` rows at a time, gradient taken in forward, each chunk's softmax, gradient, CE
and argmax one compiled pass under ``--pointwise fused``). Prints ms/step, tokens/s
(context tokens), peak memory over the timed steps (CUDA: ``torch.cuda.max_memory_allocated`` after a reset,
weights included; CPU: each case runs in its own process with glibc returning large blocks to the system
at once, and reports its peak RSS since a reset of the high-water mark, and that peak less the RSS at the
reset, i.e. the step's own memory), the activations kept for backward after the forward (exact, counted by
``saved_bytes``, on both devices) and MFU = model FLOPs / time / ``--peak-tflops`` (989: H200 dense bf16). Model FLOPs:
the matmuls (fc, q/k/v/o, SwiGLU, the lm_head rows that carry loss weight) and the attention over the keys
the mask allows (4 * heads * head_dim per visible query-key pair); backward counted as 2x forward for the
trained layers and 1x for fc and the frozen lm_head (one of the two gradients), recomputation not counted.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import time

import torch

from hsstore.train import masks as masks_mod
from hsstore.train import pointwise as pointwise_mod
from hsstore.train.budget import step_bytes, saved_activation_bytes
from hsstore.train.masks import own_block_visible
from hsstore.train.model import ATTN_IMPLS, CHECKPOINT_POLICIES, DFlashDrafter, DrafterConfig
from hsstore.train.optim import build_optimizer, clip_grad
from hsstore.train.objective import CE_IMPLS, batch_anchors, block_targets, dflash_loss
from tools.bench_train import add_drafter_size_args, sync
from tools.measure import device_profile, ops_by_shape, peak_rss_mb, reset_peak_rss

TINY = dict(hidden=64, ffn=128, heads=4, kv_heads=2, head_dim=16, vocab=1000, taps=3, seq=[1024], anchors=64,
            steps=3, warmup=1)


def windows(args) -> list[int | None] | None:
    if args.published:
        return [2048] * 4 + [None]
    if args.window:
        return [args.window] * (args.layers - 1) + [None] if args.full_last else [args.window] * args.layers
    return None


def make(impl, args, seq, device, dtype):
    ws = windows(args)
    cfg = DrafterConfig(hidden_size=args.hidden, intermediate_size=args.ffn, vocab_size=args.vocab,
                        target_layers=list(range(args.taps)), mask_token_id=args.vocab - 1,
                        num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                        num_layers=len(ws) if ws else args.layers, block_size=args.block, attn_impl=impl,
                        sliding_window=ws, max_position=max(40960, seq + args.block))
    torch.manual_seed(0)
    embed = torch.randn(args.vocab, args.hidden, device=device, dtype=dtype) * 0.02
    head = torch.randn(args.vocab, args.hidden, device=device, dtype=dtype) * 0.02
    return DFlashDrafter(cfg, embed, head).to(device=device, dtype=dtype)


def make_batch(args, seq, device, dtype, B=1):
    g = torch.Generator().manual_seed(1)
    loss_mask = torch.ones(B, seq, dtype=torch.bool)
    return dict(
        input_ids=torch.randint(0, args.vocab - 1, (B, seq), generator=g).to(device),
        loss_mask=loss_mask.to(device),
        hidden_states=torch.randn(B, seq, args.taps, args.hidden, generator=g).to(device, dtype),
        anchors=batch_anchors(loss_mask, args.anchors, torch.Generator().manual_seed(2)).to(device),
    )


def step_flops(cfg: DrafterConfig, batch) -> float:
    """Model FLOPs of one training step on ``batch`` (see the module doc)."""
    anchors = batch["anchors"].cpu()
    B, T = batch["input_ids"].shape
    S, Hd, F = cfg.block_size, cfg.hidden_size, cfg.intermediate_size
    q_w, kv_w = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    real = anchors >= 0
    N = int(real.sum()) * S  # block rows of real anchors (padding anchors are not model work)
    _, w = block_targets(batch["input_ids"].cpu(), batch["loss_mask"].cpu(), anchors, S, 7.0)
    p = anchors[real].double()[:, None]
    i = torch.arange(S, dtype=torch.float64)
    fwd = 0.0
    for layer in range(cfg.num_layers):
        W = cfg.window(layer)
        lo = torch.zeros_like(p + i) if W is None else (p + i - (W - 1)).clamp(min=0)
        pairs = float((p - lo).clamp(min=0).sum()) + int(real.sum()) * int(
            own_block_visible(S, W, cfg.sliding_causal).sum())
        fwd += 2 * N * Hd * (2 * q_w) + 2 * (N + B * T) * Hd * 2 * kv_w + 3 * 2 * N * Hd * F + 4 * q_w * pairs
    fc = 2 * B * T * cfg.num_taps * Hd * Hd
    head = 2 * int((w > 0).sum()) * Hd * cfg.vocab_size
    return 3 * fwd + 2 * (fc + head)


# operators of one drafter step by class, first match wins (``--profile``; eager code launches generic kernels, so
# the time is given to the operator that launched them)
OP_CLASSES = (
    ("attention", r"attention|flash|fmha|sdpa|flex"),
    ("gemm", r"aten::(mm|addmm|bmm|baddbmm|matmul|linear)$"),
    ("cross entropy", r"softmax|aten::exp_?$|scatter|argmax|nll_loss"),
    ("gather, copy, cast", r"copy|index|gather|aten::cat$|pad|clone|repeat|masked_fill|fill_|zero_|where|embedding"),
    ("elementwise", r"aten::(mul|add|sub|div|rsqrt|pow|mean|silu|neg|sum|sigmoid|rsub|sqrt|reciprocal)"),
    ("optimizer", r"foreach|adam"),
)
COPY_OPS = {"aten::copy_", "aten::cat", "aten::index", "aten::_index_put_impl_", "aten::index_select", "aten::gather",
            "aten::clone", "aten::fill_", "aten::zero_", "aten::constant_pad_nd", "aten::where"}  # by shape, --profile


def phases_ms(model, batch, ce, ce_chunk) -> dict:
    """Forward (the loss) and backward of one step, timed apart (the device synchronised between them)."""
    device = next(model.parameters()).device
    sync(device)
    t0 = time.perf_counter()
    loss, _ = dflash_loss(model, batch, ce_impl=ce, ce_chunk=ce_chunk)
    sync(device)
    t1 = time.perf_counter()
    loss.backward()
    sync(device)
    t2 = time.perf_counter()
    model.zero_grad(set_to_none=True)
    return {"forward": round((t1 - t0) * 1e3, 1), "backward": round((t2 - t1) * 1e3, 1)}


def step(model, batch, ce="fused", ce_chunk=1024):
    loss, _ = dflash_loss(model, batch, ce_impl=ce, ce_chunk=ce_chunk)
    loss.backward()
    return loss


def saved_bytes(model, batch, ce="fused", ce_chunk=1024) -> int:
    """Activation bytes kept for backward by one forward of the loss (weights and frozen buffers not counted)."""
    n, _ = saved_activation_bytes(lambda: dflash_loss(model, batch, ce_impl=ce, ce_chunk=ce_chunk),
                                  exclude=[*model.parameters(), *model.buffers()])
    return n


def bench_one(impl, seq, args, ce="fused", ckpt="off", pointwise="fused") -> dict:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    res = {"impl": impl, "ce": ce, "seq": seq, "anchors": args.anchors, "batch": args.batch, "ckpt": ckpt,
           "pointwise": pointwise}
    pointwise_mod.FUSE = pointwise == "fused"
    if args.chunk_rows:  # set here: a spawned process imports the model afresh
        masks_mod.ATTN_CHUNK_ROWS = args.chunk_rows
    if args.full_groups:
        masks_mod.FULL_LAYER_GROUPS = args.full_groups
    try:
        model = make(impl, args, seq, device, dtype)
        model.checkpoint_layers = ckpt
        batch = make_batch(args, seq, device, dtype, B=args.batch)
        frozen = model.embed_tokens.numel() + model.lm_head.numel()
        res["estimate_gib"] = step_bytes(model.config, seq * args.batch, args.anchors,
                                             model.num_trainable_parameters(), frozen, sequences=args.batch,
                                             ce_chunk=args.ce_chunk, checkpoint_layers=ckpt) / 2**30
        res["tflop_per_step"] = step_flops(model.config, batch) / 1e12
        res["saved_gib"] = saved_bytes(model, batch, ce, args.ce_chunk) / 2**30
        gc.collect()  # nothing of that measurement's graph may count in the timed steps' peak
        for _ in range(args.warmup):
            step(model, batch, ce, args.ce_chunk)
            model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            base = reset_peak_rss() * 2**20
        t = time.perf_counter()
        for _ in range(args.steps):
            step(model, batch, ce, args.ce_chunk)
            model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = (time.perf_counter() - t) / args.steps
        peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else peak_rss_mb() * 2**20
        if args.profile:
            res["phases_ms"] = phases_ms(model, batch, ce, args.ce_chunk)

            def one():
                step(model, batch, ce, args.ce_chunk)
                model.zero_grad(set_to_none=True)
            res["profile"] = device_profile(one, OP_CLASSES, by="op", top=args.profile)
            res["profile"]["copies"] = ops_by_shape(one, COPY_OPS, top=args.profile)
    except torch.OutOfMemoryError as e:
        res["error"] = f"out of memory: {str(e).splitlines()[0]}"
        return res
    res.update(ms_per_step=dt * 1e3, tokens_per_s=seq * args.batch / dt,
               mfu=res["tflop_per_step"] / dt / args.peak_tflops)
    if device.type == "cuda":
        res["peak_gib"] = peak / 2**30
    else:
        res.update(peak_rss_gib=peak / 2**30, step_rss_gib=(peak - base) / 2**30)
    return res


def optimizer_steps(args) -> dict:
    """The trainer's update alone (clip to 1.0, then AdamW) on the drafter's fp32 master weights with random
    gradients: PyTorch's default (foreach) vs ``fused=True``, alternating for ``--steps`` rounds; ms each (best)."""
    device = torch.device(args.device)
    model = make("blocks", args, args.seq[0], device, torch.float32)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    kinds = {"foreach": {"fused": False, "foreach": True}, "fused": {"fused": True}} if device.type == "cuda" \
        else {"foreach": {}}
    opts = {k: build_optimizer(model, **kw) for k, kw in kinds.items()}
    best = {k: float("inf") for k in opts}
    for _ in range(args.warmup + args.steps):
        for k, opt in opts.items():
            sync(device)
            t = time.perf_counter()
            clip_grad(params, 1.0)
            opt.step()
            sync(device)
            best[k] = min(best[k], time.perf_counter() - t)
    return {"params": sum(p.numel() for p in params), **{f"{k}_ms": round(v * 1e3, 1) for k, v in best.items()}}


def _child(impl, seq, args, ce, ckpt, pointwise, queue):
    try:
        queue.put(bench_one(impl, seq, args, ce, ckpt, pointwise))
    except Exception as e:  # noqa: BLE001 -- reported in the parent's table
        queue.put({"impl": impl, "ce": ce, "seq": seq, "anchors": args.anchors, "ckpt": ckpt, "pointwise": pointwise,
                   "error": f"{type(e).__name__}: {e}"})


def bench(impl, seq, args, ce="fused", ckpt="off", pointwise="fused") -> dict:
    """In a fresh process: its peak (RSS on CPU, allocated memory on CUDA) is this case's alone (on the H200, cases
    run one after another in one process read 18-24 GiB higher each, whatever held the earlier cases' memory)."""
    # glibc keeps freed blocks below its (growing) mmap threshold for reuse, so the RSS would keep the peak of
    # an earlier phase; allocations of 64 KiB and more go straight back to the system with this (the child
    # reads it at start; spawn starts a fresh interpreter)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(impl, seq, args, ce, ckpt, pointwise, queue))
    proc.start()
    res = queue.get()  # before join: a large result must not block the child's exit
    proc.join()
    return res if proc.exitcode == 0 else {"impl": impl, "ce": ce, "seq": seq, "anchors": args.anchors,
                                           "ckpt": ckpt, "pointwise": pointwise, "error": f"exit code {proc.exitcode}"}


def show(r: dict) -> str:
    head = (f"{r['impl']:6s} ce={r.get('ce', 'fused'):10s} T={r['seq']:6d}x{r.get('batch', 1)} A={r['anchors']} "
            f"ckpt={r.get('ckpt', 'off')} pointwise={r.get('pointwise', 'fused')}")
    if "error" in r:
        return f"{head}: {r['error']}"
    mem = (f"peak {r['peak_gib']:.2f} GiB" if "peak_gib" in r
           else f"peak RSS {r['peak_rss_gib']:.2f} GiB (step {1024 * r['step_rss_gib']:.0f} MiB)")
    mem += f", kept for backward {1024 * r['saved_gib']:.0f} MiB"
    if "estimate_gib" in r:
        mem += f", train's estimate {r['estimate_gib']:.1f} GiB"
    line = (f"{head}: {r['ms_per_step']:9.1f} ms/step {r['tokens_per_s']:9.0f} tokens/s  {mem}  "
            f"{r['tflop_per_step']:.2f} TFLOP/step  MFU {100 * r['mfu']:.1f}%")
    if "profile" in r:
        pr = r["profile"]
        line += (f"\n    forward {r['phases_ms']['forward']} ms, backward {r['phases_ms']['backward']} ms; profiled step "
                 f"{pr['ms']} ms: " + ", ".join(f"{k} {v}%" for k, v in pr["by_class_pct"].items()))
        line += "".join(f"\n      {t['ms']:8.2f} ms {t['pct']:5.1f}%  {t['class']:18s} {t['name']}" for t in pr["top"])
        line += "\n    gather, copy, cast by shape:" + "".join(
            f"\n      {c['ms']:8.2f} ms {c['calls']:4d}x  {c['op']} {c['shapes']}" for c in pr.get("copies", []))
    return line


def check(args, device, dtype):
    """Loss and gradients of every other (attention, cross entropy) case equal the reference, sdpa with
    unchunked logits (with padding)."""
    out = {}
    seq = args.seq[0]
    for impl, ce in dict.fromkeys([("sdpa", "full")] + [(i, c) for i in args.impl for c in args.ce]):
        model = make(impl, args, seq, device, dtype)
        batch = make_batch(args, seq, device, dtype, B=2)
        batch["attention_mask"] = torch.ones_like(batch["loss_mask"])
        batch["attention_mask"][1, seq * 2 // 3:] = False
        batch["loss_mask"] = batch["loss_mask"] & batch["attention_mask"]
        batch["anchors"] = batch_anchors(batch["loss_mask"].cpu(), args.anchors,
                                         torch.Generator().manual_seed(2)).to(device)
        loss = step(model, batch, ce, args.ce_chunk)
        out[impl, ce] = (loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()})
    l1, g1 = out.pop(("sdpa", "full"))
    for (impl, ce), (l2, g2) in out.items():
        worst = max(((g1[n] - g2[n]).norm() / g1[n].norm().clamp(min=1e-12)).item() for n in g1)
        print(f"check {impl}/{ce}: loss sdpa/full {l1.item():.6f} {impl}/{ce} {l2.item():.6f}; "
              f"worst relative grad diff {worst:.2e}")
        assert torch.allclose(l1, l2, rtol=1e-2) and worst < 5e-2, f"{impl}/{ce} and sdpa/full disagree"


def main():
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--impl", nargs="+", default=["sdpa", "blocks"], choices=ATTN_IMPLS)
    ap.add_argument("--ce", nargs="+", default=["fused"], choices=CE_IMPLS,
                    help="lm_head + cross entropy: full (all logits at once), checkpoint, fused (the default)")
    ap.add_argument("--ce-chunk", type=int, default=1024, help="query rows per lm_head chunk (checkpoint, fused)")
    ap.add_argument("--seq", type=int, nargs="+", default=[4096], help="sequence lengths (--batch sequences per step)")
    ap.add_argument("--anchors", type=int, default=512, help="anchors per sequence")
    ap.add_argument("--batch", type=int, default=1, help="sequences per step (each --seq long)")
    ap.add_argument("--ckpt", nargs="+", default=["off"], choices=list(CHECKPOINT_POLICIES),
                    help="what each draft layer recomputes in backward (train --checkpoint-layers): off, mlp (its MLP "
                         "half), full (the whole layer); 'off mlp full' compares")
    ap.add_argument("--pointwise", nargs="+", default=["fused"], choices=["eager", "fused"],
                    help="the layers' norms, RoPE and SwiGLU and the fused CE's chunk math: fused (compiled on CUDA, "
                         "the trainer's) or eager; "
                         "'eager fused' compares")
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--window", type=int, default=0, help="sliding window of the layers (0: full attention)")
    ap.add_argument("--full-last", action="store_true", help="the last layer full attention, the others --window")
    ap.add_argument("--published", action="store_true",
                    help="the published 27B drafter's layers: 4 sliding-window 2048 + 1 full (with the default sizes)")
    add_drafter_size_args(ap)
    ap.add_argument("--tiny", action="store_true", help="tiny sizes for a CPU smoke test")
    ap.add_argument("--chunk-rows", type=int, default=None, help="blocks: query rows per chunk (default "
                    f"{masks_mod.ATTN_CHUNK_ROWS})")
    ap.add_argument("--full-groups", type=int, default=None, help="blocks: SDPA calls per full-attention layer "
                    f"(default {masks_mod.FULL_LAYER_GROUPS})")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--check", action="store_true", help="compare --impl with sdpa instead of timing")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="for MFU (989: H200 dense bf16)")
    ap.add_argument("--profile", type=int, default=0, metavar="TOP",
                    help="after the timed steps, one step's device time by operator class and its TOP operators, "
                         "and its forward and backward timed apart")
    ap.add_argument("--optim", action="store_true", help="time the optimizer update alone instead (foreach vs fused)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.tiny:
        for k, v in TINY.items():
            setattr(args, k, v)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.chunk_rows:
        masks_mod.ATTN_CHUNK_ROWS = args.chunk_rows
    if args.full_groups:
        masks_mod.FULL_LAYER_GROUPS = args.full_groups
    if args.check:
        check(args, torch.device(args.device), getattr(torch, args.dtype))
        return
    if args.optim:
        print(json.dumps(optimizer_steps(args)), flush=True)
        return
    results = []
    for seq in args.seq:
        for impl in args.impl:
            for ce in args.ce:
                for ckpt in args.ckpt:
                    for pointwise in args.pointwise:
                        results.append(bench(impl, seq, args, ce, ckpt, pointwise))
                        print(json.dumps(results[-1]) if args.json else show(results[-1]), flush=True)
    if not args.json:
        print(summary(results))


def summary(results) -> str:
    """Per sequence length, every case against the first one measured in this run: speed and peak memory."""
    lines = []
    for seq in dict.fromkeys(r["seq"] for r in results):
        rs = [r for r in results if r["seq"] == seq and "error" not in r]
        if len(rs) < 2:
            continue
        base, key = rs[0], "peak_gib" if "peak_gib" in rs[0] else "step_rss_gib"
        name = lambda r: f"{r['impl']}/{r['ce']}/ckpt-{r.get('ckpt', 'off')}/{r.get('pointwise', 'fused')}"  # noqa: E731
        lines.append(f"T={seq}, against {name(base)}: " + ", ".join(
            f"{name(r)} {base['ms_per_step'] / r['ms_per_step']:.2f}x speed, "
            f"{1024 * (r[key] - base[key]):+.0f} MiB peak" for r in rs[1:]))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
