"""How big a training step may be on this device: defaults per device and a memory estimate checked up front.

The published recipe (16,384-token batches, 512 anchors per sequence) is sized for an 80-140 GB GPU. On a CPU
machine the same step does not fail: it grows until the kernel kills the process, with nothing said (23.5 GB on
a 24 GB machine, stuck at step 0). So unset batch settings take the device's defaults, and on a CPU a step whose
estimate exceeds the memory available is refused with a hint before anything is loaded.
"""

from __future__ import annotations

import dataclasses
import os

import torch

# the published recipe on a GPU; a quarter of its tokens and anchors on a CPU
DEFAULTS = {"cuda": {"max_tokens": 16384, "anchors": 512}, "cpu": {"max_tokens": 4096, "anchors": 128}}
ASSUMED_MIN_SEQUENCE = 2048  # for the estimate: sequences per batch at most budget / this (anchors count per sequence)


def with_device_defaults(cfg, device: torch.device):
    """``cfg`` with unset (None) ``max_tokens`` and ``anchors`` set to ``device``'s defaults."""
    table = DEFAULTS["cuda" if device.type == "cuda" else "cpu"]
    unset = {k: v for k, v in table.items() if getattr(cfg, k) is None}
    return dataclasses.replace(cfg, **unset) if unset else cfg


def step_bytes(dcfg, cfg, trainable_params: int, frozen_params: int, element_bytes: int = 4) -> int:
    """A rough upper estimate of one training step's peak memory, in bytes.

    Parameters: weights, gradients and AdamW's two moments of the drafter (fp32), the frozen embedding and
    head. Activations kept for the backward pass: the batch's features and their projection; each draft
    layer's context keys/values over the batch; per query row (sequences x anchors x block) the layer's
    projections, MLP and the attention scores over the keys it can see (window + block, or the whole
    context in a full layer); the cross-entropy's logits chunk."""
    e = element_bytes
    H, I, L = dcfg.hidden_size, dcfg.intermediate_size, dcfg.num_layers
    kv = dcfg.num_kv_heads * dcfg.head_dim
    T = int(cfg.max_tokens)
    sequences = max(1, -(-T // ASSUMED_MIN_SEQUENCE))
    queries = min(int(cfg.anchors) * sequences, T) * dcfg.block_size
    windows = dcfg.sliding_window or [None] * L
    total = 16 * trainable_params + e * frozen_params
    total += e * T * (len(dcfg.target_layers) * H + 2 * H)
    for w in windows:
        keys = (min(w, T) if w else T) + dcfg.block_size
        total += e * (2 * T * kv + queries * (12 * H + 3 * I) + 2 * queries * dcfg.num_heads * keys)
    total += 3 * e * int(cfg.ce_chunk) * dcfg.vocab_size
    return int(total * 1.25)  # allocator slack and temporaries


def available_bytes() -> int | None:
    """Memory this process may still take on this machine (Linux ``MemAvailable``; None where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def check_cpu_memory(dcfg, cfg, trainable_params: int, frozen_params: int) -> int:
    """Refuse (ValueError, one line with what to lower) a CPU step estimated above the available memory;
    returns the estimate."""
    need, have = step_bytes(dcfg, cfg, trainable_params, frozen_params), available_bytes()
    if have is not None and need > have:
        raise ValueError(
            f"a training step of {cfg.max_tokens:,} tokens with {cfg.anchors} anchors per sequence and "
            f"{dcfg.num_layers} draft layers needs about {need / 2**30:.1f} GiB, and this machine has "
            f"{have / 2**30:.1f} GiB available: lower --token-budget and --anchors (CPU defaults "
            f"{DEFAULTS['cpu']['max_tokens']} and {DEFAULTS['cpu']['anchors']}) or --draft-layers, or train on a GPU")
    return need


def saved_activation_bytes(fn, exclude=()) -> tuple[int, object]:
    """(bytes of the tensors autograd keeps for backward while ``fn()`` runs, ``fn()``'s result).

    Each storage counts once, as long as ``fn``'s result (which holds the graph) is alive; storages of
    ``exclude`` (weights, frozen buffers) are not counted. Exact on any device, unlike the process's RSS:
    what a step's activations cost before backward starts (the CUDA peak adds the weights, gradients and
    the backward's temporaries)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out

