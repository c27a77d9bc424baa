"""Small synthetic manifests, samples and stores: deterministic, a few kilobytes, for tests of any layout."""

from __future__ import annotations

import torch

from ..format.manifest import Manifest, TargetIdentity, TokenizerIdentity
from ..store.writer import StoreWriter

TOKEN_BYTES = 3 * 48 * 2  # make_manifest's defaults: layers (1, 3, 5), hidden 48, bf16
SOURCES = ("chat", "code", "math")


def make_manifest(layers=(1, 3, 5), hidden=48, dtype="bfloat16", codec="none", chunk_tokens=64,
                  config_hash="cfg-a", vocab_hash="vocab-a") -> Manifest:
    return Manifest(
        target=TargetIdentity(name="tiny-target", num_layers=8, hidden_size=hidden, config_hash=config_hash,
                              model_type="qwen3_5_text"),
        tokenizer=TokenizerIdentity(name="tiny-tok", vocab_hash=vocab_hash, chat_template_hash="tmpl"),
        layers=tuple(layers), dtype=dtype, codec=codec, chunk_tokens=chunk_tokens)


def make_samples(n: int, n_layers: int = 3, hidden: int = 48, seed: int = 0, dtype=torch.bfloat16,
                 min_len: int = 3, max_len: int = 200, prefix: str = "s"):
    """Deterministic random samples: list of dicts with sample_id, input_ids, loss_mask, hidden_states."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        T = int(torch.randint(min_len, max_len, (1,), generator=g))
        out.append({
            "sample_id": f"{prefix}{i}",
            "input_ids": torch.randint(0, 5000, (T,), generator=g),
            "loss_mask": torch.rand(T, generator=g) > 0.4,
            "hidden_states": (torch.randn(T, n_layers, hidden, generator=g) * 3).to(dtype),
        })
    return out


def write_samples(url, manifest, samples, **kw):
    """``samples`` written to a new store at ``url`` (``kw``: ``StoreWriter``'s); returns the closed writer."""
    with StoreWriter(url, manifest, **kw) as w:
        for s in samples:
            w.add(s["sample_id"], s["input_ids"], s["loss_mask"], s["hidden_states"])
    return w


def write_store(url, samples, manifest=None, shard_tokens=1500, sources=True, storage_options=None):
    """Several shards of ~shard_tokens tokens; chunk grid of 64 tokens; sources cycle through SOURCES."""
    manifest = manifest or make_manifest(chunk_tokens=64)
    with StoreWriter(url, manifest, shard_bytes=TOKEN_BYTES * shard_tokens, storage_options=storage_options) as w:
        for i, s in enumerate(samples):
            w.add(s["sample_id"], s["input_ids"], s["loss_mask"], s["hidden_states"],
                  source=SOURCES[i % 3] if sources else "")
    return url
