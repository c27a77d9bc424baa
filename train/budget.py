"""How big a training step may be on this device: defaults per device and a memory estimate checked up front.

The published recipe (16,384-token batches, 512 anchors per sequence) is sized for an 80-140 GB GPU. On a CPU
machine the same step does not fail: it grows until the kernel kills the process, with nothing said (23.5 GB on
a 24 GB machine, stuck at step 0). So unset batch settings take the device's defaults, and on a CPU a step whose
estimate exceeds the memory available is refused with a hint before anything is loaded.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Sequence

import numpy as np
import torch

from hsstore.app.devices import DEVICE_DEFAULTS, defaults_for
from hsstore.app.schema import replace

from .config import TrainSettings
from .model import checkpoint_policy

ASSUMED_MIN_SEQUENCE = 2048  # for the estimate: sequences per batch at most budget / this (anchors count per sequence)


def with_device_defaults(settings: TrainSettings, device: torch.device) -> TrainSettings:
    """``settings`` with unset (None) ``token_budget`` and ``anchors`` set to ``device``'s defaults
    (``hsstore.app.devices.DEVICE_DEFAULTS``)."""
    row = defaults_for(device)
    unset = {f.name: getattr(row, f.name) for f in dataclasses.fields(row)
             if getattr(settings.batch, f.name) is None}
    return dataclasses.replace(settings, batch=dataclasses.replace(settings.batch, **unset)) if unset else settings


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


def check_cpu_memory(dcfg, settings: TrainSettings, trainable_params: int, frozen_params: int) -> int:
    """Refuse (ValueError, one line with what to lower) a CPU step estimated above the available memory;
    returns the estimate."""
    batch = settings.batch
    need = step_bytes(dcfg, batch.token_budget, batch.anchors, trainable_params, frozen_params,
                      ce_chunk=settings.schedule.ce_chunk, checkpoint_layers=settings.memory.checkpoint_layers,
                      device="cpu")
    have = available_bytes()
    cpu = DEVICE_DEFAULTS["cpu"]
    if have is not None and need > have:
        raise ValueError(
            f"a training step of {batch.token_budget:,} tokens with {batch.anchors} anchors per sequence and "
            f"{dcfg.num_layers} draft layers needs about {need / 2**30:.1f} GiB, and this machine has "
            f"{have / 2**30:.1f} GiB available: lower --token-budget and --anchors (CPU defaults "
            f"{cpu.token_budget} and {cpu.anchors}) or --draft-layers, or train on a GPU")
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



# bytes kept per query row and draft layer beyond the formula's tensors (autocast copies, attention and backward
# temporaries), as measured for the published drafter on the GPU machine (docs/PERFORMANCE.md, "Training step":
# each peak beside this estimate, tools/bench_attention.py): the largest measured peak is met, the others
# overestimated, since the estimate exists to refuse a step before it runs out of memory
GPU_ROW_SLACK = 2.85
# on a CPU the step runs in fp32 and attention materialises its scores; no measured peak calibrates it: it errs high
CPU_ROW_SLACK = 1.5
MIN_ANCHORS = 64  # below this, lowering anchors stops and the step is refused


@dataclasses.dataclass(frozen=True)
class Precision:
    """How a device holds a step: bytes of an activation and of a frozen weight, the per-row slack, and whether
    attention keeps its scores (the CPU's math attention does; the GPU's fused kernels do not)."""

    activation: int
    frozen: int
    row_slack: float
    scores: bool


PRECISION = {"cuda": Precision(2, 2, GPU_ROW_SLACK, False), "cpu": Precision(4, 4, CPU_ROW_SLACK, True)}


def step_bytes(dcfg, token_budget: int, anchors: int, trainable_params: int, frozen_params: int, *,
               sequences: int | None = None, ce_chunk: int = 1024, checkpoint_layers: str = "off",
               device: str = "cuda") -> int:
    """Estimated peak of one training step on ``device`` ("cuda": bf16 autocast; "cpu": fp32), in bytes: the one
    memory model of the GPU's fit (``fit_gpu_step``) and the CPU's refusal (``check_cpu_memory``).

    fp32 weights, gradients and AdamW moments (16 B per trainable parameter), the frozen embedding and head; the
    batch's features, context and each layer's context keys/values; per query row (sequences x anchors x block, at
    most tokens x block) and draft layer the activations kept for backward (input, norms, q/k/v/attention out,
    o_proj, residual, gate/up/act/product, down), on a CPU also the attention scores over the keys a row sees;
    with ``checkpoint_layers`` "full" only each layer's input is kept, plus one layer's activations while it is
    recomputed; with "mlp" each layer's attention half and MLP input, plus one MLP half; one fp32 logits chunk of
    the cross entropy and its gradient. ``sequences``: sequences per batch at most (default: tokens /
    ``ASSUMED_MIN_SEQUENCE``)."""
    p = PRECISION["cpu" if str(device).startswith("cpu") else "cuda"]
    e = p.activation
    H, I, L, S = dcfg.hidden_size, dcfg.intermediate_size, dcfg.num_layers, dcfg.block_size
    q_w, kv_w = dcfg.num_heads * dcfg.head_dim, dcfg.num_kv_heads * dcfg.head_dim
    token_budget = int(token_budget)
    seqs = sequences if sequences is not None else max(1, -(-token_budget // ASSUMED_MIN_SEQUENCE))
    rows = min(int(anchors) * seqs, token_budget) * S
    fixed = 16 * trainable_params + p.frozen * frozen_params
    data = e * token_budget * (len(dcfg.target_layers) * H + 3 * H) + L * e * 2 * token_budget * kv_w
    attn_half = p.row_slack * e * (4 * H + 2 * q_w + 2 * kv_w)  # input, norm, q/k/v, attention out, o_proj
    mlp_half = p.row_slack * e * (2 * H + 3 * I)  # norm, gate/up/act/product, down
    if p.scores:  # scores and their softmax over the keys each row sees (its window + block, or the context)
        keys = [(min(w, token_budget) if w else token_budget) + S for w in (dcfg.sliding_window or [None] * L)]
        attn_half += p.row_slack * e * 2 * dcfg.num_heads * max(keys)
    policy = checkpoint_policy(checkpoint_layers)
    if policy == "full":
        kept = rows * (L * e * H + attn_half + mlp_half)
    elif policy == "mlp":  # the attention halves stay, one MLP half is recomputed at a time
        kept = rows * (L * (attn_half + e * H) + mlp_half)
    else:
        kept = rows * L * (attn_half + mlp_half)
    ce = 3 * 4 * int(ce_chunk) * dcfg.vocab_size
    return int(fixed + data + kept + ce)


def store_lengths(stores) -> np.ndarray:
    """Token counts of every sample of ``stores`` (opened ``hsstore.Store``s), from their commit records: what
    bounds the batches the loader can make of them (``max_sequences``)."""
    parts = [np.asarray(s.table.samples["length"], dtype=np.int64) for s in stores]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def max_sequences(lengths: Sequence[int] | np.ndarray, token_budget: int) -> int | None:
    """The most sequences one padded token-budget batch can hold for samples of these lengths, whatever the
    shuffle: a batch of B samples costs B x its longest <= ``token_budget`` (``hsstore.loader.batching``), and its
    longest is at least the B-th shortest length, so B is at most the largest B with ``sorted[B-1] * B <=
    token_budget`` (at least 1: a sample over the budget is a batch of its own). None when no lengths are known."""
    ls = np.sort(np.asarray(lengths, dtype=np.int64))
    if ls.size == 0:
        return None
    fits = ls * np.arange(1, ls.size + 1) <= int(token_budget)  # a prefix: sorted lengths times a growing count
    return max(1, int(fits.sum()))


def fit_gpu_step(dcfg, token_budget: int, anchors: int, trainable_params: int, frozen_params: int, *, have: int,
                 sequences: int | None = None, longest: int | None = None, ce_chunk: int = 1024,
                 checkpoint_layers: str = "off") -> tuple[int, int]:
    """(anchors, estimated bytes) of a step that fits in ``have`` bytes of GPU memory: ``anchors`` as asked when
    it fits, else halved until it does (a warning says so and what would keep them), else ValueError (one
    line: what to change). Decided before step 1, so a run never dies of out-of-memory hours in.
    ``sequences``: sequences per batch at most (``max_sequences``; None: assumed from ``ASSUMED_MIN_SEQUENCE``);
    ``longest``: the longest sample, which is a batch of its own when over ``token_budget``."""
    def need(a: int, ckpt: str) -> int:
        est = step_bytes(dcfg, token_budget, a, trainable_params, frozen_params, sequences=sequences,
                             ce_chunk=ce_chunk, checkpoint_layers=ckpt)
        if longest is not None and longest > token_budget:  # the one batch that exceeds the budget
            est = max(est, step_bytes(dcfg, longest, a, trainable_params, frozen_params, sequences=1,
                                          ce_chunk=ce_chunk, checkpoint_layers=ckpt))
        return est

    checkpoint_layers = checkpoint_policy(checkpoint_layers)
    est = need(anchors, checkpoint_layers)
    if est <= have:
        return int(anchors), est
    hint = {"off": f"; --checkpoint-layers would need {need(anchors, 'mlp') / 2**30:.1f} GiB with all {anchors} "
                   f"(--checkpoint-layers full {need(anchors, 'full') / 2**30:.1f} GiB)",
            "mlp": f"; --checkpoint-layers full would need {need(anchors, 'full') / 2**30:.1f} GiB with all {anchors}",
            "full": ""}[checkpoint_layers]
    a = int(anchors)
    while a > MIN_ANCHORS:
        a = max(MIN_ANCHORS, a // 2)
        if need(a, checkpoint_layers) <= have:
            import warnings

            msg = (f"a step of {token_budget:,} tokens with {anchors} anchors per sequence needs about "
                   f"{est / 2**30:.1f} GiB of the GPU's {have / 2**30:.1f} GiB: lowering anchors to {a} per "
                   f"sequence ({need(a, checkpoint_layers) / 2**30:.1f} GiB){hint}")
            warnings.warn(msg, UserWarning, stacklevel=2)
            return a, need(a, checkpoint_layers)
    raise ValueError(f"a step of {token_budget:,} tokens with {anchors} anchors per sequence needs about "
                     f"{est / 2**30:.1f} GiB of the GPU's {have / 2**30:.1f} GiB, and {MIN_ANCHORS} anchors still "
                     f"do not fit: lower --token-budget"
                     f"{dict(off=' or add --checkpoint-layers', mlp=' or use --checkpoint-layers full').get(checkpoint_layers, '')}")


GPU_USABLE = 0.93  # of the device's memory: the CUDA context, cuBLAS workspaces and the allocator's fragmentation


def plan_gpu_step(dcfg, settings: TrainSettings, trainable_params: int, frozen_params: int, have: int, stores=None,
                  ) -> tuple[int, int, int | None]:
    """(anchors, estimated bytes, sequences per batch at most or None) of the settings' step within ``have``
    bytes (``fit_gpu_step``, which warns when it lowers anchors). ``stores``: the training stores, whose samples'
    lengths (``store_lengths``) bound the sequences per batch (``max_sequences``); without them (or samples) up
    to ``token_budget / ASSUMED_MIN_SEQUENCE`` are assumed."""
    lengths = store_lengths(stores) if stores else None
    seqs = None if lengths is None else max_sequences(lengths, settings.batch.token_budget)
    longest = None if seqs is None else int(np.max(lengths))
    anchors, need = fit_gpu_step(dcfg, settings.batch.token_budget, settings.batch.anchors, trainable_params,
                                 frozen_params, have=have, sequences=seqs, longest=longest,
                                 ce_chunk=settings.schedule.ce_chunk,
                                 checkpoint_layers=settings.memory.checkpoint_layers)
    return anchors, need, seqs


def check_gpu_memory(dcfg, settings: TrainSettings, trainable_params: int, frozen_params: int, device: torch.device,
                     stores=None) -> TrainSettings:
    """``settings`` with anchors that fit the GPU (``plan_gpu_step``; logged when lowered), or ValueError.

    ``settings.memory.gpu_memory_gib`` plans for that much memory instead of the device's and holds the process to
    it (``torch.cuda.set_per_process_memory_fraction``), so a larger GPU can check a recipe for a smaller one."""
    import logging
    import warnings

    total = torch.cuda.get_device_properties(device).total_memory
    limit = total if settings.memory.gpu_memory_gib is None else min(total, int(settings.memory.gpu_memory_gib * 2**30))
    if limit < total:
        torch.cuda.set_per_process_memory_fraction(limit / total, device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        anchors, need, seqs = plan_gpu_step(dcfg, settings, trainable_params, frozen_params, int(limit * GPU_USABLE),
                                            stores)
    log = logging.getLogger("hsstore.train")
    for w in caught:
        log.warning("%s", w.message)
    per_batch = (f"at most {seqs} sequences per batch (the stores' lengths)" if seqs is not None else
                 f"up to {max(1, -(-settings.batch.token_budget // ASSUMED_MIN_SEQUENCE))} sequences per batch "
                 "(assumed)")
    log.info("estimated GPU peak %.1f GiB of %.1f GiB usable (%d anchors per sequence, %s%s)", need / 2**30,
             limit * GPU_USABLE / 2**30, anchors, per_batch,
             {"mlp": ", the draft layers' MLP halves recomputed in backward",
              "full": ", draft layers recomputed in backward"}.get(checkpoint_policy(settings.memory.checkpoint_layers), ""))
    return settings if anchors == settings.batch.anchors else replace(settings, anchors=anchors)
