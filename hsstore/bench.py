"""Store throughput against raw reads/writes of the same bytes on the same filesystem.

Machines here are noisy, so speed is reported as a ratio measured in one run: store write vs
``fs.pipe`` of byte-identical objects, store read (decoded, all layers, as tensors) vs ``fs.cat`` of
the store's own files. Rounds alternate (raw, store, raw, store) and the best of each is kept.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

import numpy as np
import torch

from . import shard, storage
from .manifest import Manifest, TargetIdentity, TokenizerIdentity
from .reader import Store
from .writer import StoreWriter, default_chunk_tokens

log = logging.getLogger(__name__)


def synthetic_samples(total_bytes: int, layers: int, hidden: int, seed: int = 0, mean_len: int = 2048):
    """Finite random bf16 features (random bits with the exponent's top bit clear), ~total_bytes in all."""
    g = torch.Generator().manual_seed(seed)
    per_token = layers * hidden * 2
    out, size, i = [], 0, 0
    while size < total_bytes:
        T = int(torch.randint(mean_len // 2, mean_len * 3 // 2, (1,), generator=g))
        bits = torch.randint(0, 1 << 15, (T, layers, hidden), dtype=torch.int32, generator=g) & 0x3FFF
        bits |= torch.randint(0, 2, (T, layers, hidden), dtype=torch.int32, generator=g) << 15
        hs = bits.to(torch.int16).view(torch.bfloat16)
        ids = torch.randint(0, 32000, (T,), generator=g)
        mask = torch.rand(T, generator=g) > 0.3
        out.append((f"bench-{i}", ids, mask, hs))
        size += T * per_token
        i += 1
    return out


def bench_manifest(layers: int, hidden: int, codec: str) -> Manifest:
    return Manifest(
        target=TargetIdentity(name="bench", num_layers=max(64, layers), hidden_size=hidden, config_hash="bench"),
        tokenizer=TokenizerIdentity(name="bench", vocab_hash="bench"),
        layers=tuple(range(layers)), codec=codec, chunk_tokens=default_chunk_tokens(hidden, 2))


def _time(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def run_store_bench(url: str, storage_options: dict[str, Any], size_mb: int = 512, hidden: int = 5120,
                    layers: int = 5, codec: str = "none", rounds: int = 2, what: str = "store") -> dict[str, dict]:
    fs, root = storage.resolve(url, storage_options)
    samples = synthetic_samples(size_mb << 20, layers, hidden)
    nbytes = sum(s[3].numel() * 2 for s in samples)
    run = f"bench-{uuid.uuid4().hex[:8]}"
    manifest = bench_manifest(layers, hidden, codec)
    best = {"write": np.inf, "raw_write": np.inf, "read": np.inf, "raw_read": np.inf}
    try:
        for r in range(rounds):
            store_url = f"{url.rstrip('/')}/{run}/store{r}"
            raw_root = storage.join(root, run, f"raw{r}")

            def write_store():
                with StoreWriter(store_url, manifest, storage_options=storage_options, shard_bytes=256 << 20) as w:
                    for sid, ids, mask, hs in samples:
                        w.add(sid, ids, mask, hs)

            best["write"] = min(best["write"], _time(write_store))
            store = Store(store_url, storage_options)
            files = [storage.join(store.root, k) for c in store.commits for k in c.files]
            blobs = fs.cat(files)  # byte-identical payloads for the raw write
            raw_objects = {storage.join(raw_root, f"{i:06d}"): blobs[p] for i, p in enumerate(files)}
            del blobs
            fs.makedirs(raw_root, exist_ok=True)
            best["raw_write"] = min(best["raw_write"], _time(lambda: fs.pipe(raw_objects)))
            del raw_objects
            best["raw_read"] = min(best["raw_read"], _time(lambda: fs.cat(files)))

            def read_store():  # sequential decode of every sample, all layers, as tensors
                for _ in store:
                    pass

            best["read"] = min(best["read"], _time(read_store))
            fs.rm(storage.join(root, run, f"raw{r}"), recursive=True)
            fs.rm(storage.join(root, run, f"store{r}"), recursive=True)
    finally:
        try:
            fs.rm(storage.join(root, run), recursive=True)
        except FileNotFoundError:
            pass
    gb = nbytes / 1e9
    result = {
        "store_write": {"gbps": gb / best["write"], "raw_gbps": gb / best["raw_write"], "bytes": nbytes},
        "store_read": {"gbps": gb / best["read"], "raw_gbps": gb / best["raw_read"], "bytes": nbytes},
    }
    for r in result.values():
        r["ratio"] = r["gbps"] / r["raw_gbps"]
        r.update({"codec": codec, "hidden": hidden, "layers": layers, "url": url})
    return result
