"""Where the extraction forward's time goes, and what each speed-up buys (GPU; issue #18).

Builds the random-weight Qwen3.5 target of ``tools/bench_extract.py`` (same flags) and, on the same synthetic
batches in one process, times the tapped forward (``run_tapped``: the forward up to the last tap, the taps
stacked) under variants applied one after another:

  eager      the eager forward, the padding mask passed (what extraction did before)
  nomask     eager, no mask: right padding under a causal decoder never reaches a real token, and without a
             mask SDPA takes its fused causal kernel and Gated DeltaNet skips its masking pass
  compiled   + ``compile_forward`` (norms, MLP, attention blocks)
  mixers     + ``compile_forward(mixers=True)`` (the Gated DeltaNet mixers too, around fla's kernels)
  flaconv    + the short convolution on fla's Triton kernel (``use_fla_conv``): what ``extract --compile`` runs

Each variant's first batch is compared per token with the eager one (min/mean cosine per tap; the reference
spread is the eager forward's own, the same sample alone against inside its batch). Finally one batch of each
variant is profiled: CUDA kernel time by kind (GEMM, attention, fla, inductor-fused, other elementwise, copies,
convolution) and the top kernels; and the last variant's GEMMs by shape, each beside the same GEMM timed alone
(``F.linear`` on fresh tensors of that shape): how far the forward's GEMMs are from cuBLAS's own rate, and the
forward's time if everything but its GEMMs cost nothing (``gemm_bound``).

    python -m tools.profile_extract --variants eager,nomask,compiled,mixers,flaconv --samples 48 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import torch

from hsstore.extract.capture import run_tapped
from hsstore.app.conv import use_fla_conv
from hsstore.extract.forward import pad_right, token_budget_batches
from hsstore.format.taps import default_taps
from tools.bench_extract import add_model_args, build_model, synthetic, sync
from tools.measure import device_profile, gemm_profile, gemm_rate

log = logging.getLogger("profile_extract")

VARIANTS = ("eager", "nomask", "compiled", "mixers", "flaconv")
KINDS = (  # first match wins
    ("gemm", r"gemm|cutlass|xmma|nvjet|sm90_|cublas|matmul"),
    ("attention", r"flash|fmha|attention|sdpa|efficient"),
    ("conv", r"conv"),  # before fla: fla's own convolution kernel is a ``causal_conv1d_fwd_kernel``
    ("fla", r"chunk_|gated_delta|fwd_kernel|recompute_w_u|l2norm|solve_tril|merge_16x16|cumsum"),
    ("inductor", r"^triton_"),
    ("copy", r"copy|cat|Memcpy|memset|fill"),
    ("elementwise", r"elementwise|vectorized|reduce|unrolled|index"),
)


@torch.inference_mode()
def tapped(model, layers, batch, mask: bool) -> torch.Tensor:
    device = next(model.parameters()).device
    ids, attn = pad_right(batch, 0)
    ids, attn = ids.to(device, non_blocking=True), attn.to(device, non_blocking=True)
    return run_tapped(model, layers, ids, attn if mask else None)


def cosines(a: torch.Tensor, b: torch.Tensor, lengths: list[int]) -> dict:
    """Per-token cosine over real tokens, per tap: min and mean."""
    rows = []
    for i, n in enumerate(lengths):
        x, y = a[i, :n].float(), b[i, :n].float()
        rows.append(torch.nn.functional.cosine_similarity(x, y, dim=-1))  # [n, taps]
    c = torch.cat(rows)
    return {"min": [round(v, 6) for v in c.min(0).values.tolist()], "mean": [round(v, 6) for v in c.mean(0).tolist()]}


def profile(model, layers, batch, mask: bool, top: int) -> dict:
    tapped(model, layers, batch, mask)
    return device_profile(lambda: tapped(model, layers, batch, mask), KINDS, top=top)


def gemms(model, layers, batch, mask: bool) -> dict:
    """The forward's GEMMs by shape beside each shape alone, and the forward's time if only its GEMMs cost."""
    rows = gemm_profile(lambda: tapped(model, layers, batch, mask))
    for r in rows:
        r["alone_tflops"] = round(gemm_rate(r["m"], r["k"], r["n"]), 1)
    total_ms = device_profile(lambda: tapped(model, layers, batch, mask), KINDS, top=0)["ms"]
    gemm_ms = sum(r["ms"] for r in rows)
    alone_ms = sum(r["flop"] / (r["alone_tflops"] * 1e9) for r in rows)  # flop / (TFLOP/s) in ms
    return {"forward_ms": total_ms, "gemm_ms": round(gemm_ms, 2), "gemm_at_alone_rate_ms": round(alone_ms, 2),
            "gemm_tflops": round(sum(r["flop"] for r in rows) / gemm_ms / 1e9, 1),
            "gemm_bound": round(gemm_ms / total_ms, 4), "shapes": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"in order, each on top of the last: {VARIANTS}")
    add_model_args(p)
    p.add_argument("--top", type=int, default=25, help="kernels listed in the profile")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    if set(variants) - set(VARIANTS):
        p.error(f"unknown variants {sorted(set(variants) - set(VARIANTS))}")
    logging_setup()

    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    model = build_model(args)
    layers = default_taps(args.layers_total)
    samples = synthetic(args.samples, args.min_len, args.max_len, args.vocab)
    batches = token_budget_batches(samples, args.token_budget)
    tokens = sum(s.num_tokens for s in samples)
    first = batches[0]
    lengths = [s.num_tokens for s in first]
    res: dict = {"build_s": time.perf_counter() - t0, "tokens": tokens, "batches": len(batches), "layers": layers,
                 "variants": {}}
    reference = tapped(model, layers, first, mask=True).clone()
    alone = tapped(model, layers, first[:1], mask=True)
    res["eager_spread"] = cosines(alone, reference[:1], lengths[:1])  # the eager forward against itself
    del alone
    mask = True
    from hsstore.extract.speed import compile_forward

    for v in variants:
        if v == "nomask":
            mask = False
        elif v in ("compiled", "mixers", "flaconv"):
            torch._dynamo.reset()
            for m in model.modules():
                m._compiled_call_impl = None
            if v == "flaconv" and not use_fla_conv(model, next(model.parameters()).device):
                log.warning("flaconv: fla's convolution is not available here; the variant repeats mixers")
            compile_forward(model, mixers=v in ("mixers", "flaconv"))
        t = time.perf_counter()
        for b in batches:  # warm-up: every shape compiled once
            tapped(model, layers, b, mask)
        sync()
        warm_s = time.perf_counter() - t
        best = float("inf")
        for _ in range(args.rounds):
            sync()
            t = time.perf_counter()
            for b in batches:
                tapped(model, layers, b, mask)
            sync()
            best = min(best, time.perf_counter() - t)
        out = tapped(model, layers, first, mask)
        res["variants"][v] = {"tokens_per_s": tokens / best, "seconds": best, "warm_up_s": warm_s,
                              "cosine_vs_eager": cosines(out, reference, lengths)}
        del out
        if torch.cuda.is_available():
            res["variants"][v]["profile"] = profile(model, layers, first, mask, args.top if v == variants[-1] else 6)
        print(json.dumps({v: res["variants"][v]}), file=sys.stderr, flush=True)
    if torch.cuda.is_available() and variants:
        res["gemms"] = gemms(model, layers, first, mask)
    base = res["variants"][variants[0]]["tokens_per_s"]
    for v in variants:
        res["variants"][v]["vs_first"] = res["variants"][v]["tokens_per_s"] / base
    print(json.dumps(res, indent=1))


def logging_setup() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")


if __name__ == "__main__":
    main()
