"""Speed / memory of one DFlash training step with random weights (no target, no data needed).

    python -m tools.bench_attention --impl sdpa flex --seq 4096 --anchors 512       # 27B-sized drafter layer
    python -m tools.bench_attention --check                                         # flex == sdpa on this device
"""

from __future__ import annotations

import argparse
import time

import torch

from tools.bench_train import add_drafter_size_args
from hsstore.train.model import DFlashDrafter, DrafterConfig
from hsstore.train.objective import dflash_loss


def make(impl, args, device, dtype):
    cfg = DrafterConfig(hidden_size=args.hidden, intermediate_size=args.ffn, vocab_size=args.vocab,
                        target_layers=list(range(args.taps)), mask_token_id=args.vocab - 1,
                        num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                        num_layers=args.layers, block_size=args.block, attn_impl=impl,
                        sliding_window=args.window and [args.window] * args.layers or None)
    torch.manual_seed(0)
    embed = torch.randn(args.vocab, args.hidden, device=device, dtype=dtype) * 0.02
    head = torch.randn(args.vocab, args.hidden, device=device, dtype=dtype) * 0.02
    return DFlashDrafter(cfg, embed, head).to(device=device, dtype=dtype)


def make_batch(args, device, dtype, B=1):
    g = torch.Generator().manual_seed(1)
    T = args.seq
    return dict(
        input_ids=torch.randint(0, args.vocab - 1, (B, T), generator=g).to(device),
        loss_mask=torch.ones(B, T, dtype=torch.bool, device=device),
        hidden_states=torch.randn(B, T, args.taps, args.hidden, generator=g).to(device, dtype),
    )


def step(model, batch, args):
    g = torch.Generator().manual_seed(2)
    loss, m = dflash_loss(model, batch, anchors_per_seq=args.anchors, generator=g)
    loss.backward()
    return loss


def bench(impl, args, device, dtype):
    model = make(impl, args, device, dtype)
    batch = make_batch(args, device, dtype)
    for _ in range(args.warmup):
        step(model, batch, args)
        model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    for _ in range(args.steps):
        step(model, batch, args)
        model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / args.steps
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    print(f"{impl:5s} T={args.seq} A={args.anchors} S={args.block} layers={args.layers} H={args.hidden}: "
          f"{dt * 1e3:8.1f} ms/step  {args.seq / dt:9.0f} tokens/s  peak {peak:.1f} GiB", flush=True)


def check(args, device, dtype):
    """Loss and gradients of the flex path equal the SDPA reference (with padding and a window)."""
    out = {}
    for impl in ("sdpa", "flex"):
        model = make(impl, args, device, dtype)
        batch = make_batch(args, device, dtype, B=2)
        batch["attention_mask"] = torch.ones_like(batch["loss_mask"])
        batch["attention_mask"][1, args.seq * 2 // 3:] = False
        loss = step(model, batch, args)
        out[impl] = (loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()})
    (l1, g1), (l2, g2) = out["sdpa"], out["flex"]
    worst = max(((g1[n] - g2[n]).norm() / g1[n].norm().clamp(min=1e-12)).item() for n in g1)
    print(f"check: loss sdpa {l1.item():.6f} flex {l2.item():.6f}; worst relative grad diff {worst:.2e}")
    assert torch.allclose(l1, l2, rtol=1e-2) and worst < 5e-2, "flex and sdpa disagree"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", nargs="+", default=["sdpa", "flex"])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--anchors", type=int, default=512)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--window", type=int, default=0)
    add_drafter_size_args(ap)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--check", action="store_true", help="compare flex with sdpa instead of timing")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    if args.check:
        check(args, device, dtype)
        return
    for impl in args.impl:
        bench(impl, args, device, dtype)


if __name__ == "__main__":
    main()
