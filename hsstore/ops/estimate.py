"""What an extraction will cost before any GPU time (``hsstore check``): the store's size in each encoding and a
month of it in object storage, GPU-hours, bytes read per training epoch, and the encoding the evidence recommends.
Plain arithmetic on the store format (docs/FORMAT.md), so the figures are the store's own:

* features: tokens x taps x each encoding's bytes per row (``format/encodings.py``): bf16 2 B per value; fp8 1 B
  per value plus a float32 scale per token and tap; nvfp4 and mxfp4 half a byte per value plus their block scales
  and outlier channels; ``--final-hidden`` adds one feature per token (stored raw: the manifest allows no other);
* per token besides: ``input_ids`` int32 + ``loss_mask`` uint8 = 5 B (offsets and records are negligible);
* on disk, each shard's last chunk of every array is full size: about half a chunk per shard of padding at the
  writer's default shard (1 GiB) and chunk (~16 MiB per layer) sizes, ~4% at 27B scale;
* a month of object storage: S3 Standard's list price (``STORAGE_PRICE``);
* extraction time: tokens / the target's forward throughput per GPU;
* a DFlash training epoch reads every token's tapped features, ids and mask once (not ``final_hidden``).

Peers' users found their store size too late (35 TB for 30K samples); DeepSpec ships a size estimator.
"""

from __future__ import annotations

import math

from ..format import codec, encodings
from ..store.writer import DEFAULT_SHARD_BYTES, default_chunk_tokens

# The reference extraction rate (docs/PERFORMANCE.md, "Extraction"): one GPU, a random-weight Qwen3.5
# architecture at 27B scale (64 layers, hidden 5120), compiled, with the writer process. It holds for that
# target only: a smaller target extracts faster, roughly in proportion to its FLOPs per token.
REFERENCE_TOKENS_PER_S = 11_049.0
TOKEN_BYTES = 4 + 1  # input_ids int32 + loss_mask uint8
# S3 Standard, US East (N. Virginia), list price in USD per GB-month (GB of 2^30 bytes) by tier: the first 50 TB,
# the next 450 TB, beyond
STORAGE_PRICE = ((50 << 40, 0.023), (450 << 40, 0.022), (math.inf, 0.021))
# the encodings the estimate sizes, by the name it shows (bf16: raw features in bfloat16)
SIZED = {("bf16" if e == "raw" else e): e for e in encodings.NAMES}
# The encoding the evidence recommends (docs/PERFORMANCE.md, "Encodings below fp8": tools/encoding_evidence.py on
# the demo's target, drafters of several seeds each) and why, in a line.
RECOMMENDED = "nvfp4"
RECOMMENDED_WHY = ("3.5x under bf16, and its drafters' tau within the bf16 drafters' seed-to-seed spread on the "
                   "demo's target; of the 4-bit encodings the lower feature error")


def feature_bytes_per_token(taps: int, hidden: int, encoding: str = "bf16") -> int:
    """Stored feature bytes per token of ``taps`` features in ``encoding`` (a ``SIZED`` name), scales included."""
    if encoding not in SIZED:
        raise ValueError(f"encoding {encoding!r}: one of {', '.join(SIZED)}")
    return codec.token_bytes("bfloat16", SIZED[encoding], taps, hidden)


def storage_month_usd(nbytes: float) -> float:
    """A month of ``nbytes`` in S3 Standard at its list price (``STORAGE_PRICE``, tiered)."""
    left, usd = float(nbytes), 0.0
    for size, per_gb in STORAGE_PRICE:
        part = min(left, size)
        usd += part / (1 << 30) * per_gb
        left -= part
        if left <= 0:
            break
    return usd


def estimate(*, samples: int, tokens: int, layers: list[int], hidden: int,
             tokens_per_s: float = REFERENCE_TOKENS_PER_S, final_hidden: bool = False) -> dict:
    """Sizes (bytes), GPU-hours and per-epoch reads for ``tokens`` tokens in ``samples`` samples."""
    if tokens_per_s <= 0:
        raise ValueError(f"tokens/s must be positive (got {tokens_per_s})")
    n = len(layers)

    def features(encoding: str, final: bool) -> int:
        """Feature bytes per token: the taps in ``encoding``, and ``final_hidden`` raw in bf16."""
        return feature_bytes_per_token(n, hidden, encoding) + (feature_bytes_per_token(1, hidden) if final else 0)

    def data(encoding: str, final: bool) -> int:
        return tokens * (features(encoding, final) + TOKEN_BYTES)

    def store(encoding: str, final: bool) -> int:
        """Data plus the expected padding: each shard's last chunk of every array is written full size (a
        regular chunk grid), half empty on average, with the writer's default shard and chunk sizes."""
        per_token = features(encoding, final) + TOKEN_BYTES
        shards = math.ceil(tokens * features(encoding, final) / DEFAULT_SHARD_BYTES)
        enc = encodings.get(SIZED[encoding])
        chunk = default_chunk_tokens(enc.width(hidden), enc.storage_dtype("bfloat16").itemsize)
        return data(encoding, final) + int(shards * chunk / 2 * per_token)

    sizes = {e: store(e, False) for e in SIZED}
    return {
        "samples": int(samples), "tokens": int(tokens), "layers": list(layers), "hidden": int(hidden),
        "final_hidden": bool(final_hidden),
        "bytes_per_token": {e: features(e, False) + TOKEN_BYTES for e in SIZED},
        "data_bytes": {**{e: data(e, False) for e in SIZED}, **{f"{e}_final_hidden": data(e, True) for e in SIZED}},
        "store_bytes": {**sizes, **{f"{e}_final_hidden": store(e, True) for e in SIZED}},
        "storage_month_usd": {e: storage_month_usd(b) for e, b in sizes.items()},
        "recommended": {"encoding": RECOMMENDED, "why": RECOMMENDED_WHY},
        "tokens_per_s": float(tokens_per_s),
        "tokens_per_s_note": ("the reference rate of a 27B-scale Qwen3.5 target on one GPU"
                              if tokens_per_s == REFERENCE_TOKENS_PER_S else "given"),
        "gpu_hours": tokens / tokens_per_s / 3600.0,
        "epoch_read_bytes": {e: data(e, False) for e in SIZED},
    }


def _ratio(bf16: float, size: float) -> str:
    """How many times smaller than bf16 (an input of no tokens sizes every encoding at 0 bytes: no ratio)."""
    return f"{bf16 / size:4.2f}x" if size else "    -"


def format_text(e: dict) -> str:
    from .info import human_bytes

    s, usd = e["store_bytes"], e["storage_month_usd"]
    sized = f"{'with --final-hidden, ' if e['final_hidden'] else ''}chunk padding included"
    rows = "\n".join(f"    {name:6} {human_bytes(s[name + ('_final_hidden' if e['final_hidden'] else '')]):>10}  "
                     f"{_ratio(s['bf16'], s[name])} under bf16  ${usd[name]:,.0f} a month in S3 Standard"
                     + ("  <- recommended" if name == _shown(e["recommended"]["encoding"]) else "")
                     for name in SIZED)
    r = e["epoch_read_bytes"]
    return (f"cost estimate: {e['samples']:,} samples, {e['tokens']:,} tokens, taps {e['layers']} of hidden "
            f"{e['hidden']}\n"
            f"  store size by encoding ({sized}; the month: taps, ids and masks, S3 Standard list price):\n{rows}\n"
            f"  recommended: --encoding {e['recommended']['encoding']} ({e['recommended']['why']})\n"
            f"  extraction: {e['gpu_hours']:,.1f} GPU-hours at {e['tokens_per_s']:,.0f} tokens/s per GPU "
            f"({e['tokens_per_s_note']}; --tokens-per-s to change)\n"
            f"  training reads per epoch: " + ", ".join(f"{k} {human_bytes(v)}" for k, v in r.items()) + "\n")


def _shown(encoding: str) -> str:
    return next(k for k, v in SIZED.items() if v == encoding)
