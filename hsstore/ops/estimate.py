"""What an extraction will cost before any GPU time (``hsstore check``): the store's size, GPU-hours, bytes read
per training epoch. Plain arithmetic on the store format (docs/FORMAT.md), so the figures are the store's own:

* features: tokens x taps x hidden x 2 B in bf16; fp8 (e4m3) is 1 B per value plus a float32 scale per token
  and tap; ``--final-hidden`` adds one feature per token in the same encoding;
* per token besides: ``input_ids`` int32 + ``loss_mask`` uint8 = 5 B (offsets and records are negligible);
* on disk, each shard's last chunk of every array is full size: about half a chunk per shard of padding at the
  writer's default shard (1 GiB) and chunk (~16 MiB per layer) sizes, ~4% at 27B scale;
* extraction time: tokens / the target's forward throughput per GPU;
* a DFlash training epoch reads every token's tapped features, ids and mask once (not ``final_hidden``).

Peers' users found their store size too late (35 TB for 30K samples); DeepSpec ships a size estimator.
"""

from __future__ import annotations

import math

from ..store.writer import DEFAULT_SHARD_BYTES, default_chunk_tokens

# The reference extraction rate (docs/PERFORMANCE.md, "Extraction"): one GPU, a random-weight Qwen3.5
# architecture at 27B scale (64 layers, hidden 5120), compiled, with the writer process. It holds for that
# target only: a smaller target extracts faster, roughly in proportion to its FLOPs per token.
REFERENCE_TOKENS_PER_S = 11_049.0
TOKEN_BYTES = 4 + 1  # input_ids int32 + loss_mask uint8
FP8_SCALE_BYTES = 4


def feature_bytes_per_token(taps: int, hidden: int, encoding: str = "bf16") -> int:
    if encoding == "bf16":
        return taps * hidden * 2
    if encoding == "fp8":
        return taps * (hidden + FP8_SCALE_BYTES)
    raise ValueError(f"encoding {encoding!r}: bf16 or fp8")


def estimate(*, samples: int, tokens: int, layers: list[int], hidden: int,
             tokens_per_s: float = REFERENCE_TOKENS_PER_S, final_hidden: bool = False) -> dict:
    """Sizes (bytes), GPU-hours and per-epoch reads for ``tokens`` tokens in ``samples`` samples."""
    if tokens_per_s <= 0:
        raise ValueError(f"tokens/s must be positive (got {tokens_per_s})")
    n = len(layers)

    def data(encoding: str, final: bool) -> int:
        return tokens * (feature_bytes_per_token(n + int(final), hidden, encoding) + TOKEN_BYTES)

    def store(encoding: str, final: bool) -> int:
        """Data plus the expected padding: each shard's last chunk of every array is written full size (a
        regular chunk grid), half empty on average, with the writer's default shard and chunk sizes."""
        per_token = feature_bytes_per_token(n + int(final), hidden, encoding) + TOKEN_BYTES
        features = tokens * feature_bytes_per_token(n + int(final), hidden, encoding)
        shards = math.ceil(features / DEFAULT_SHARD_BYTES)
        chunk = default_chunk_tokens(hidden, 2 if encoding == "bf16" else 1)
        return data(encoding, final) + int(shards * chunk / 2 * per_token)

    return {
        "samples": int(samples), "tokens": int(tokens), "layers": list(layers), "hidden": int(hidden),
        "final_hidden": bool(final_hidden),
        "bytes_per_token": {"bf16": feature_bytes_per_token(n, hidden) + TOKEN_BYTES,
                            "fp8": feature_bytes_per_token(n, hidden, "fp8") + TOKEN_BYTES},
        "data_bytes": {"bf16": data("bf16", False), "fp8": data("fp8", False),
                       "bf16_final_hidden": data("bf16", True), "fp8_final_hidden": data("fp8", True)},
        "store_bytes": {"bf16": store("bf16", False), "fp8": store("fp8", False),
                        "bf16_final_hidden": store("bf16", True), "fp8_final_hidden": store("fp8", True)},
        "tokens_per_s": float(tokens_per_s),
        "tokens_per_s_note": ("the reference rate of a 27B-scale Qwen3.5 target on one GPU"
                              if tokens_per_s == REFERENCE_TOKENS_PER_S else "given"),
        "gpu_hours": tokens / tokens_per_s / 3600.0,
        "epoch_read_bytes": {"bf16": data("bf16", False), "fp8": data("fp8", False)},
    }


def format_text(e: dict) -> str:
    from .info import human_bytes

    s = e["store_bytes"]
    chosen = "bf16_final_hidden" if e["final_hidden"] else "bf16"
    return (f"cost estimate: {e['samples']:,} samples, {e['tokens']:,} tokens, taps {e['layers']} of hidden "
            f"{e['hidden']}\n"
            f"  store size (with chunk padding): bf16 {human_bytes(s['bf16'])}, fp8 {human_bytes(s['fp8'])}; with --final-hidden "
            f"bf16 {human_bytes(s['bf16_final_hidden'])}, fp8 {human_bytes(s['fp8_final_hidden'])}"
            f"{' (chosen: ' + human_bytes(s[chosen]) + ')' if e['final_hidden'] else ''}\n"
            f"  extraction: {e['gpu_hours']:,.1f} GPU-hours at {e['tokens_per_s']:,.0f} tokens/s per GPU "
            f"({e['tokens_per_s_note']}; --tokens-per-s to change)\n"
            f"  training reads per epoch: bf16 {human_bytes(e['epoch_read_bytes']['bf16'])}, fp8 "
            f"{human_bytes(e['epoch_read_bytes']['fp8'])}\n")
