"""How big a training step may be on this device: defaults per device and a memory estimate checked up front.

The published recipe (16,384-token batches, 512 anchors per sequence) is sized for an 80-140 GB GPU. On a CPU
machine the same step does not fail: it grows until the kernel kills the process, with nothing said (23.5 GB on
a 24 GB machine, stuck at step 0). So unset batch settings take the device's defaults, and on a CPU a step whose
estimate exceeds the memory available is refused with a hint before anything is loaded.

Where a step does not fit, the plan (``plan_step``) gives up speed before it gives up the objective: with
``--checkpoint-layers auto`` (the default) it recomputes the draft layers' MLP halves, then whole layers, and
under torchrun shards the optimizer's states over the ranks (``sharding.py``; cheaper than recompute, so tried
first at each recompute level), and only when the most it can save is not enough lowers the anchors per
sequence, which changes what is trained (a warning says so). What it chose beyond what was asked is one line.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Sequence

import numpy as np
import torch

from hsstore.app.devices import DEVICE_DEFAULTS, defaults_for
from hsstore.app.schema import replace

from .settings import CHECKPOINT_POLICIES, TrainSettings
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


def check_cpu_memory(dcfg, settings: TrainSettings, trainable_params: int, frozen_params: int) -> TrainSettings:
    """``settings`` with the recompute policy the step fits the available memory with (``--checkpoint-layers
    auto``: off, else mlp, else full, said in one line), or ValueError (one line with what to lower) for a CPU
    step estimated above the available memory under every policy it may take. The optimizer's states are sharded
    only when asked (``--shard-optimizer on``): ranks on one machine share its memory, which the estimate per
    rank does not model."""
    import logging

    batch = settings.batch
    asked = settings.memory.checkpoint_layers
    policies = CHECKPOINT_POLICIES if asked == "auto" else (checkpoint_policy(asked),)
    have = available_bytes()
    need = {}
    for policy in policies:
        need[policy] = step_bytes(dcfg, batch.token_budget, batch.anchors, trainable_params, frozen_params,
                                  ce_chunk=settings.schedule.ce_chunk, checkpoint_layers=policy, device="cpu")
        if have is None or need[policy] <= have:
            if policy != policies[0]:
                logging.getLogger("hsstore.train").info(
                    "a step of %s tokens with %d anchors per sequence needs about %.1f GiB without recompute, and "
                    "this machine has %.1f GiB available: %s (--checkpoint-layers %s), %.1f GiB",
                    f"{batch.token_budget:,}", batch.anchors, need[policies[0]] / 2**30, have / 2**30,
                    RECOMPUTE[policy], policy, need[policy] / 2**30)
            return replace(settings, checkpoint_layers=policy, shard_optimizer=sharded_setting(settings, False))
    cpu = DEVICE_DEFAULTS["cpu"]
    raise ValueError(
        f"a training step of {batch.token_budget:,} tokens with {batch.anchors} anchors per sequence and "
        f"{dcfg.num_layers} draft layers needs about {need[policies[-1]] / 2**30:.1f} GiB"
        f"{' with every draft layer recomputed' if policies[-1] == 'full' else ''}, and this machine has "
        f"{have / 2**30:.1f} GiB available: lower --token-budget and --anchors (CPU defaults "
        f"{cpu.token_budget} and {cpu.anchors}) or --draft-layers, or train on a GPU")


def sharded_setting(settings: TrainSettings, planned: bool) -> str:
    """``--shard-optimizer`` resolved ("on"/"off"): as asked, "auto" as ``planned``; "off" without several ranks
    (nothing to shard over)."""
    from hsstore.distributed import rank_and_world

    asked = settings.memory.shard_optimizer
    on = planned if asked == "auto" else asked == "on"
    return "on" if on and rank_and_world()[1] > 1 else "off"


RECOMPUTE = {"mlp": "the draft layers' MLP halves recomputed in backward",
             "full": "the draft layers recomputed in backward"}


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
WEIGHT_GRAD_BYTES = 8  # per trainable parameter: its fp32 master weight and fp32 gradient
MOMENT_BYTES = 8  # per trainable parameter: AdamW's exp_avg and exp_avg_sq, fp32


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
               device: str = "cuda", world: int = 1, shard_optimizer: bool = False) -> int:
    """Estimated peak of one training step on ``device`` ("cuda": bf16 autocast; "cpu": fp32), in bytes: the one
    memory model of the GPU's fit (``fit_gpu_step``) and the CPU's refusal (``check_cpu_memory``).

    fp32 weights and gradients (8 B per trainable parameter; under DDP the gradients are views of its all-reduce
    buckets, ``build.wrap_ddp``), AdamW's two fp32 moments (8 B, over ``world`` ranks with ``shard_optimizer``:
    ``sharding.py``; the fused update keeps no other copy), the frozen embedding and head; the
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
    moments = MOMENT_BYTES * trainable_params / (max(1, int(world)) if shard_optimizer else 1)
    fixed = int(WEIGHT_GRAD_BYTES * trainable_params + moments) + p.frozen * frozen_params
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


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What a step runs with, as planned before step 1: anchors per sequence, the recompute policy, whether the
    optimizer's states are sharded over the ranks, the estimated peak (bytes), sequences per batch at most (None:
    assumed), and ``change``: the one line saying what the plan chose beyond what was asked ("" when nothing)."""

    anchors: int
    checkpoint_layers: str
    shard_optimizer: bool
    estimate: int
    sequences: int | None = None
    change: str = ""


def step_options(checkpoint_layers: str, shard_optimizer: str, world: int) -> list[tuple[str, bool]]:
    """(recompute policy, sharded) a step may take, cheapest first: "auto" recompute tries off, mlp, full;
    "auto" sharding (several ranks) tries each without, then with (its broadcast costs less than recomputing
    more); an explicit setting is the only choice."""
    policies = CHECKPOINT_POLICIES if checkpoint_layers == "auto" else (checkpoint_policy(checkpoint_layers),)
    shards = {"on": (True,), "off": (False,), "auto": (False, True)}[shard_optimizer] if world > 1 else (False,)
    return [(p, s) for p in policies for s in shards]


def plan_step(dcfg, token_budget: int, anchors: int, trainable_params: int, frozen_params: int, *, have: int,
              sequences: int | None = None, longest: int | None = None, ce_chunk: int = 1024,
              checkpoint_layers: str = "auto", shard_optimizer: str = "auto", world: int = 1) -> StepPlan:
    """The step that fits in ``have`` bytes of GPU memory: the first of ``step_options`` that keeps all
    ``anchors``; else the last (the most memory saved) with anchors halved until it fits (a warning says so and
    what would keep them); else ValueError (one line: what to change). Decided before step 1, so a run never dies
    of out-of-memory hours in. ``sequences``: sequences per batch at most (``max_sequences``; None: assumed from
    ``ASSUMED_MIN_SEQUENCE``); ``longest``: the longest sample, a batch of its own when over ``token_budget``;
    ``world``: ranks of the run (what sharding divides the moments by)."""
    def need(a: int, ckpt: str, shard: bool = False) -> int:
        kw = dict(ce_chunk=ce_chunk, checkpoint_layers=ckpt, world=world, shard_optimizer=shard)
        est = step_bytes(dcfg, token_budget, a, trainable_params, frozen_params, sequences=sequences, **kw)
        if longest is not None and longest > token_budget:  # the one batch that exceeds the budget
            est = max(est, step_bytes(dcfg, longest, a, trainable_params, frozen_params, sequences=1, **kw))
        return est

    options = step_options(checkpoint_layers, shard_optimizer, world)
    first = need(anchors, *options[0])
    for ckpt, shard in options:
        est = need(anchors, ckpt, shard)
        if est <= have:
            change = "" if (ckpt, shard) == options[0] else (
                f"a step of {token_budget:,} tokens with {anchors} anchors per sequence needs about "
                f"{first / 2**30:.1f} GiB {as_asked(*options[0], world)} of the GPU's {have / 2**30:.1f} GiB "
                f"usable: {choice(ckpt, shard, world)}, {est / 2**30:.1f} GiB with all {anchors} anchors")
            return StepPlan(int(anchors), ckpt, shard, est, sequences, change)
    ckpt, shard = options[-1]
    est = need(anchors, ckpt, shard)
    hint = {"off": f"; --checkpoint-layers would need {need(anchors, 'mlp', shard) / 2**30:.1f} GiB with all "
                   f"{anchors} (--checkpoint-layers full {need(anchors, 'full', shard) / 2**30:.1f} GiB)",
            "mlp": f"; --checkpoint-layers full would need {need(anchors, 'full', shard) / 2**30:.1f} GiB with all "
                   f"{anchors}",
            "full": ""}[ckpt]
    a = int(anchors)
    while a > MIN_ANCHORS:
        a = max(MIN_ANCHORS, a // 2)
        if need(a, ckpt, shard) <= have:
            import warnings

            msg = (f"a step of {token_budget:,} tokens with {anchors} anchors per sequence needs about "
                   f"{est / 2**30:.1f} GiB{'' if len(options) == 1 else ' ' + as_asked(ckpt, shard, world)} of the "
                   f"GPU's {have / 2**30:.1f} GiB: lowering anchors to {a} per sequence "
                   f"({need(a, ckpt, shard) / 2**30:.1f} GiB){hint}")
            warnings.warn(msg, UserWarning, stacklevel=2)
            return StepPlan(a, ckpt, shard, need(a, ckpt, shard), sequences, msg)
    raise ValueError(f"a step of {token_budget:,} tokens with {anchors} anchors per sequence needs about "
                     f"{est / 2**30:.1f} GiB of the GPU's {have / 2**30:.1f} GiB, and {MIN_ANCHORS} anchors still "
                     f"do not fit: lower --token-budget"
                     f"{dict(off=' or add --checkpoint-layers', mlp=' or use --checkpoint-layers full').get(ckpt, '')}")


def as_asked(ckpt: str, shard: bool, world: int) -> str:
    """How a step option reads in the plan's line ("without recompute", "with every draft layer recomputed and
    the optimizer's states sharded over 8 ranks")."""
    parts = [{"off": "without recompute", "mlp": "with the MLP halves recomputed",
              "full": "with every draft layer recomputed"}[ckpt]]
    if shard:
        parts.append(f"the optimizer's states sharded over {world} ranks")
    return " and ".join(parts)


def choice(ckpt: str, shard: bool, world: int) -> str:
    """What the plan turned on, with the flags that say it."""
    parts = [RECOMPUTE[ckpt]] if ckpt != "off" else []
    if shard:
        parts.append(f"the optimizer's states sharded over the {world} ranks")
    flags = " ".join(([f"--checkpoint-layers {ckpt}"] if ckpt != "off" else [])
                     + (["--shard-optimizer on"] if shard else []))
    return f"{' and '.join(parts)} ({flags})"


def fit_gpu_step(dcfg, token_budget: int, anchors: int, trainable_params: int, frozen_params: int, *, have: int,
                 sequences: int | None = None, longest: int | None = None, ce_chunk: int = 1024,
                 checkpoint_layers: str = "off") -> tuple[int, int]:
    """(anchors, estimated bytes) of ``plan_step`` for one process with the recompute policy as given."""
    plan = plan_step(dcfg, token_budget, anchors, trainable_params, frozen_params, have=have, sequences=sequences,
                     longest=longest, ce_chunk=ce_chunk, checkpoint_layers=checkpoint_layers, shard_optimizer="off")
    return plan.anchors, plan.estimate


GPU_USABLE = 0.93  # of the device's memory: the CUDA context, cuBLAS workspaces and the allocator's fragmentation


def plan_gpu_step(dcfg, settings: TrainSettings, trainable_params: int, frozen_params: int, have: int, stores=None,
                  world: int = 1) -> StepPlan:
    """``plan_step`` of the settings' step within ``have`` bytes, for ``world`` ranks (which warns when it lowers
    anchors). ``stores``: the training stores, whose samples' lengths (``store_lengths``) bound the sequences per
    batch (``max_sequences``); without them (or samples) up to ``token_budget / ASSUMED_MIN_SEQUENCE`` are
    assumed."""
    lengths = store_lengths(stores) if stores else None
    seqs = None if lengths is None else max_sequences(lengths, settings.batch.token_budget)
    longest = None if seqs is None else int(np.max(lengths))
    memory = settings.memory
    return plan_step(dcfg, settings.batch.token_budget, settings.batch.anchors, trainable_params, frozen_params,
                     have=have, sequences=seqs, longest=longest, ce_chunk=settings.schedule.ce_chunk,
                     checkpoint_layers=memory.checkpoint_layers, shard_optimizer=memory.shard_optimizer, world=world)


def check_gpu_memory(dcfg, settings: TrainSettings, trainable_params: int, frozen_params: int, device: torch.device,
                     stores=None) -> TrainSettings:
    """``settings`` as planned for the GPU (``gpu_plan``), or ValueError."""
    return gpu_plan(dcfg, settings, trainable_params, frozen_params, device, stores)[0]


def gpu_plan(dcfg, settings: TrainSettings, trainable_params: int, frozen_params: int, device: torch.device,
             stores=None) -> tuple[TrainSettings, StepPlan]:
    """(``settings`` as planned for the GPU, the plan): its anchors, recompute policy and sharding
    (``plan_gpu_step``), each choice beyond what was asked said in one line, or ValueError.

    ``settings.memory.gpu_memory_gib`` plans for that much memory instead of the device's and holds the process to
    it (``torch.cuda.set_per_process_memory_fraction``), so a larger GPU can check a recipe for a smaller one."""
    import logging
    import warnings

    from hsstore.distributed import rank_and_world

    world = rank_and_world()[1]
    total = torch.cuda.get_device_properties(device).total_memory
    limit = total if settings.memory.gpu_memory_gib is None else min(total, int(settings.memory.gpu_memory_gib * 2**30))
    if limit < total:
        torch.cuda.set_per_process_memory_fraction(limit / total, device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = plan_gpu_step(dcfg, settings, trainable_params, frozen_params, int(limit * GPU_USABLE), stores, world)
    log = logging.getLogger("hsstore.train")
    for w in caught:
        log.warning("%s", w.message)
    if plan.change and not caught:  # the objective kept: what the step gives up instead, in one line
        log.info("%s", plan.change)
    seqs = plan.sequences
    per_batch = (f"at most {seqs} sequences per batch (the stores' lengths)" if seqs is not None else
                 f"up to {max(1, -(-settings.batch.token_budget // ASSUMED_MIN_SEQUENCE))} sequences per batch "
                 "(assumed)")
    log.info("estimated GPU peak %.1f GiB of %.1f GiB usable (%d anchors per sequence, %s%s%s)", plan.estimate / 2**30,
             limit * GPU_USABLE / 2**30, plan.anchors, per_batch,
             {"mlp": ", the draft layers' MLP halves recomputed in backward",
              "full": ", draft layers recomputed in backward"}.get(plan.checkpoint_layers, ""),
             f", the optimizer's states sharded over {world} ranks" if plan.shard_optimizer else "")
    return replace(settings, anchors=plan.anchors, checkpoint_layers=plan.checkpoint_layers,
                   shard_optimizer=sharded_setting(settings, plan.shard_optimizer)), plan
