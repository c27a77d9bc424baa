"""The trainer's settings (``TrainConfig``) and what a run records of them.

``RESUME_KEYS`` are the settings a resumed run must share with the run it continues (the weights or the data
order would not match); ``recordable_config`` is the config as ``train_config.json`` and every checkpoint's
``trainer.json`` hold it (no secrets).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from hsstore.redaction import recordable_url

from . import tracking

DEFAULT_EPOCHS = 6
# settings that must not change when resuming (the weights or the data order would not match)
RESUME_KEYS = ("stores", "weights", "seed", "max_tokens", "anchors", "block_size", "draft_layers",
               "sliding_window", "sliding_causal", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
               "rope_theta", "mask_token_id", "gamma", "workers")
# what a run saved before a key existed did (sliding layers were non-causal; shapes followed the target)
LEGACY_RESUME_VALUES = {"sliding_causal": False}


@dataclass
class TrainConfig:
    stores: list[str]
    out: str
    steps: int | None = None  # optimizer steps; or
    epochs: int | None = None  # passes over the data (default DEFAULT_EPOCHS when steps is None too)
    device: str | None = None  # default: cuda:LOCAL_RANK when available, else cpu
    max_tokens: int | None = None  # token budget per batch and rank (batch x longest); None: budget.DEFAULTS
    anchors: int | None = None  # anchors per sequence (at most); None: the device's default (budget.DEFAULTS)
    block_size: int = 16
    draft_layers: int = 5
    sliding_window: int | None = 2048  # for all draft layers but the last; None or 0: full attention
    sliding_causal: bool = True  # False: sliding layers non-causal inside the block (exported is_causal: false)
    # drafter shape; None: the rule in DrafterConfig.from_target_config (the published drafters' shape)
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None
    rope_theta: float | None = None
    init: str | None = None  # a drafter directory (DFlash format) to start from instead of random weights
    mask_token_id: int | None = None
    gamma: float | None = None  # loss decay; default from the block size (7 for 16)
    lr: float = 6e-4
    warmup: float = 0.04
    min_lr_ratio: float = 0.0
    clip: float = 1.0
    seed: int = 0
    attn: str = "auto"  # blocks | sdpa | flex | auto (= blocks; flex recompiles when batch shapes vary)
    log_every: int = 10
    save_every: int = 1000
    cpu_threads: int | None = None  # torch CPU threads per rank (default: see share_cpu_threads)
    keep: int = 2  # checkpoints kept
    workers: int = 0  # loader worker processes per rank (0: read in-process, on threads)
    prefetch: int = 2  # batches read (and copied to the GPU) ahead
    resume: bool = True  # continue from OUT's latest checkpoint when there is one
    progress: bool = True
    log_samples: bool = False  # write OUT/samples.rankNNNNN.jsonl: the sample ids of every step
    weights: list[float] | None = None  # per store (see HiddenStateDataset)
    storage_options: dict[str, Any] = field(default_factory=dict)
    cache_dir: str | None = None
    cache_bytes: int | None = None  # chunk cache cap (None: the loader's default)
    partition: str = "global"  # "node": each node keeps one share of the stores every epoch (HiddenStateDataset)
    checkpoint_layers: bool = False  # recompute draft layers in backward (activation checkpointing): less memory
    gpu_memory_gib: float | None = None  # GPU memory to plan for (and hold to); None: the device's
    ce_chunk: int = 1024  # query rows per lm_head + cross-entropy chunk
    ce_impl: str = "fused"  # fused | checkpoint | full (all logits at once): objective.chunked_cross_entropy
    val_stores: list[str] | None = None  # teacher-forced evaluation (evaluate.py) during and after training
    val_every: int | None = None  # steps between evaluations (default: save_every)
    report_to: list[str] | None = None  # experiment trackers (tracking.py): tensorboard, wandb, mlflow

    def __post_init__(self):
        if self.steps is not None and self.epochs is not None:
            raise ValueError("give --steps or --epochs, not both")
        if self.steps is None and self.epochs is None:
            self.epochs = DEFAULT_EPOCHS
        if (self.steps is not None and self.steps < 1) or (self.epochs is not None and self.epochs < 1):
            raise ValueError("steps / epochs must be >= 1")
        if not self.stores:
            raise ValueError("at least one --store is needed")
        self.stores = [str(s) for s in self.stores]
        self.val_stores = [str(s) for s in self.val_stores] if self.val_stores else None
        if self.val_every is not None and self.val_every < 1:
            raise ValueError("val_every must be >= 1")
        self.report_to = tracking.parse_report_to(self.report_to) or None


def recordable_config(cfg: TrainConfig) -> dict[str, Any]:
    """The training config as ``train_config.json`` and every checkpoint's ``trainer.json`` record it: no storage
    options (they may hold secrets) and store URLs in their recordable form (no ``user:password@``)."""
    d = {**dataclasses.asdict(cfg), "storage_options": None}
    for key in ("stores", "val_stores"):
        if d.get(key):
            d[key] = [recordable_url(u) for u in d[key]]
    return d
