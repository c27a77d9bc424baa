"""Extraction throughput vs forward-only throughput of the same model and batches (GPU benchmark).

Builds a random-weight Qwen3.5-architecture target (default: 27B scale, 64 layers, hidden 5120),
synthetic sequences, and times, on the same batches, alternating:
  forward_full   the whole decoder, no lm_head, no capture (the brief's "forward only");
  forward_taps   the decoder up to the last tapped layer, no capture, no copy;
  extract        the real pipeline: hooks, GPU pack, pinned copy, StoreWriter to a local store.
Prints JSON with tokens/s, ratios and MFU.

    python -m tools.bench_extract --out /tmp/bench-store [--layers-total 64 --hidden 5120 ...]
"""

from __future__ import annotations

import argparse
import json
import shutil
import time

import numpy as np
import torch

from extract.capture import base_model, decoder_layers, default_taps, run_tapped
from extract.forward import extract_batches, pad_right, token_budget_batches
from extract.tokenize import TokenizedSample
from hsstore import Manifest, StoreWriter, TargetIdentity, TokenizerIdentity


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


def timed(fn) -> float:
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/bench-extract-store")
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
    args = p.parse_args()

    t0 = time.perf_counter()
    model = build_model(args)
    build_s = time.perf_counter() - t0
    layers = default_taps(args.layers_total)
    samples = synthetic(args.samples, args.min_len, args.max_len, args.vocab)
    batches = token_budget_batches(samples, args.token_budget)
    tokens = sum(s.num_tokens for s in samples)
    manifest = Manifest(
        target=TargetIdentity(name="random-qwen3.5", num_layers=args.layers_total, hidden_size=args.hidden,
                              config_hash="bench"),
        tokenizer=TokenizerIdentity(name="bench", vocab_hash="bench"), layers=tuple(layers))

    close_s = []

    def extract_once():
        """Until every sample is handed to the writer (steady-state pipeline); the final flush of the
        last shards is timed separately (in a long run it is paid once)."""
        shutil.rmtree(args.out, ignore_errors=True)
        w = StoreWriter(args.out, manifest, writer_tag="bench", check_finite=False)  # checked on the device
        extract_batches(model, layers, batches,
                        lambda s, f: w.add(s.sample_id, s.input_ids, s.loss_mask, f), 0, torch.device(args.device),
                        staging_tokens=args.token_budget)
        t = time.perf_counter()
        w.close()
        close_s.append(time.perf_counter() - t)

    def capture_only():
        """Capture + GPU pack + pinned copy, no writer: splits overhead between capture and storage."""
        extract_batches(model, layers, batches, lambda s, f: None, 0, torch.device(args.device),
                        staging_tokens=args.token_budget)

    forward_pass(model, batches[:1], layers, full=True)  # warm-up: kernels, autotuning
    forward_pass(model, batches[:1], layers, full=False)
    best = {"forward_full": np.inf, "forward_taps": np.inf, "capture_only": np.inf, "extract": np.inf}
    for _ in range(args.rounds):
        best["forward_full"] = min(best["forward_full"], timed(lambda: forward_pass(model, batches, layers, True)))
        best["extract"] = min(best["extract"], timed(extract_once))
        best["forward_taps"] = min(best["forward_taps"], timed(lambda: forward_pass(model, batches, layers, False)))
        best["capture_only"] = min(best["capture_only"], timed(capture_only))
    stack = decoder_layers(model)
    params_full = sum(p.numel() for p in stack.parameters())
    params_taps = sum(p.numel() for l in stack[: max(layers) + 1] for p in l.parameters())
    n_full_attn = sum(1 for i in range(args.layers_total) if (i + 1) % 4 == 0)
    mean_T = tokens / len(samples)
    attn_flops_per_token = 2 * 2 * (mean_T / 2) * args.heads * args.head_dim * n_full_attn  # QK^T and PV, causal

    def mfu(seconds, params, attn):
        flops = tokens * (2 * params + attn)
        return flops / seconds / 1e12

    res = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device, "tokens": tokens, "samples": len(samples), "batches": len(batches),
        "layers_total": args.layers_total, "hidden": args.hidden, "taps": layers, "build_model_s": build_s,
        "fla": _fla_available(),
        "tokens_per_s": {k: tokens / v for k, v in best.items()},
        "ratio_extract_vs_forward_full": best["forward_full"] / best["extract"],
        "ratio_extract_vs_forward_taps": best["forward_taps"] / best["extract"],
        "ratio_capture_only_vs_forward_taps": best["forward_taps"] / best["capture_only"],
        "final_flush_s": min(close_s),
        "ratio_extract_end_to_end_vs_forward_full": best["forward_full"] / (best["extract"] + min(close_s)),
        "tflops": {"forward_full": mfu(best["forward_full"], params_full, attn_flops_per_token),
                   "forward_taps": mfu(best["forward_taps"], params_taps,
                                       attn_flops_per_token * (max(layers) + 1) / args.layers_total),
                   "extract": mfu(best["extract"], params_taps,
                                  attn_flops_per_token * (max(layers) + 1) / args.layers_total)},
        "store_bytes_per_pass": tokens * len(layers) * args.hidden * 2,
    }
    res["mfu_vs_989"] = {k: v / 989 for k, v in res["tflops"].items()}
    print(json.dumps(res, indent=2))
    shutil.rmtree(args.out, ignore_errors=True)


def _fla_available() -> bool:
    try:
        import fla  # noqa: F401

        return True
    except Exception:
        return False


if __name__ == "__main__":
    main()
