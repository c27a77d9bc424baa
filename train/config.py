"""The trainer's settings: one schema (``TrainSettings``, grouped by section) and the flat ``TrainConfig`` made
from it.

Every setting is written once, below, with its flag, help and default; from the schema come the
``hsstore train`` flags in their ``--help`` groups (``cli.py``), the sections of ``--config`` files and
``run.yaml`` (``hsstore.config``: the groups' titles, the flags' keys), ``RESUME_KEYS`` (``resume=True``: the
settings a resumed run must share with the run it continues, or the weights or the data order would not
match) and ``TrainConfig``, the same fields in one namespace, which is what the trainer reads
(``cfg.lr``). ``recordable_config`` is the config as ``train_config.json`` and every checkpoint's
``trainer.json`` hold it (no secrets).

Keys of run.yaml files are the flags' (``token_budget`` for ``max_tokens``, ``no_resume`` for ``resume``,
``non_causal_sliding`` for ``sliding_causal``, ``store`` for ``stores``): files written before this schema
load unchanged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from hsstore.config import absolute_path
from hsstore.redaction import recordable_url
from hsstore.schema import flat, flat_class, option, resume_keys, section

from . import tracking

DEFAULT_EPOCHS = 6


@dataclass
class Run:
    stores: list[str] = option(flag="--store", dest="store", required=True, metavar="URL", resume=True, path=True,
                               help="store URL (repeatable)")
    out: str = option(required=True, path=True, help="run directory (metrics, checkpoints, drafter)")
    steps: int | None = option(None, exclusive="length", help="optimizer steps")
    epochs: int | None = option(None, exclusive="length", help=f"passes over the data (default {DEFAULT_EPOCHS})")
    device: str | None = option(None, help="cpu, cuda (this process's GPU: cuda:LOCAL_RANK) or cuda:N (default: "
                                "the GPU when there is one)")


@dataclass
class Batch:
    max_tokens: int | None = option(
        None, flag="--token-budget", dest="token_budget", old="--max-tokens", metavar="N", resume=True,
        help="padded tokens per batch and rank (default: 16384 on a GPU, the published recipe; 4096 on a CPU; a "
             "CPU step estimated above the available memory is refused)")
    anchors: int | None = option(None, metavar="N", resume=True,
                                 help="anchors per sequence, at most (default: 512 on a GPU, 128 on a CPU)")


@dataclass
class Drafter:
    block_size: int = option(16, resume=True, help="anchor + mask tokens drafted per block")
    draft_layers: int = option(5, resume=True, help="draft decoder layers")
    sliding_window: int | None = option(
        2048, convert=lambda w: w or None, resume=True,
        help="window of every draft layer but the last, in positions counting the query's own, as Hugging "
             "Face's sliding_window (0: full attention everywhere)")
    sliding_causal: bool = option(
        True, flag="--non-causal-sliding", dest="non_causal_sliding", negate=True, resume=True,
        help="sliding layers see their whole block (exported as is_causal: false); default: causal inside the "
             "block, as SpecForge trains and SGLang/vLLM serve")
    init: str | None = option(None, metavar="DIR", path=True,
                              help="start from this drafter (DFlash format: ours, SpecForge's, z-lab's); refused "
                                   "unless its taps, hidden size, vocabulary and block size fit the store")
    mask_token_id: int | None = option(None, resume=True,
                                       help="default: first unused embedding row, else the target's pad token")


@dataclass
class Shape:
    """None: the rule in ``DrafterConfig.from_target_config`` (the published drafters' shape)."""

    num_heads: int | None = option(None, resume=True, help="attention heads")
    num_kv_heads: int | None = option(None, resume=True, help="key/value heads")
    head_dim: int | None = option(None, resume=True, help="per head")
    intermediate_size: int | None = option(None, resume=True, help="SwiGLU width (default: the target's)")
    rope_theta: float | None = option(None, resume=True, help="RoPE base, full rotary (default: the target's)")


@dataclass
class Schedule:
    gamma: float | None = option(None, resume=True, help="loss decay over block positions (default by block)")
    lr: float = option(6e-4, help="peak learning rate (AdamW, cosine)")
    warmup: float = option(0.04, help="warmup share of the steps")
    min_lr_ratio: float = option(0.0, help="final lr / peak lr")
    clip: float = option(1.0, help="gradient norm clip")
    seed: int = option(0, resume=True, help="data order, anchors and initial weights")
    attn: str = option("auto", choices=["auto", "blocks", "sdpa", "flex"],
                       help="auto: blocks (each chunk of anchors attends to only the keys it may see; memory and "
                            "time follow the visible keys). sdpa: one dense mask [queries x (context + queries)], "
                            "the reference. flex: compiles on its first step and again when batch shapes vary")
    ce_chunk: int = option(1024, cli=False, help="query rows per lm_head + cross-entropy chunk")
    ce_impl: str = option("fused", cli=False, choices=["fused", "checkpoint", "full"],
                          help="fused | checkpoint | full (all logits at once): objective.chunked_cross_entropy")


@dataclass
class Data:
    weights: list[float] | None = option(
        None, flag="--weight", dest="weight", metavar="W", resume=True,
        help="per --store, in order: 2 = every sample twice per epoch, 0.5 = a seeded half")
    workers: int = option(0, resume=True, help="loader worker processes per rank (needs torchdata)")
    prefetch: int = option(2, help="batches read (and copied to the GPU) ahead")
    cpu_threads: int | None = option(
        None, help="torch CPU threads per rank (default: under torchrun on GPUs, the cores / local ranks)")
    cache_dir: str | None = option(None, path=True, help="local chunk cache for remote stores")
    cache_bytes: int | None = option(
        None, metavar="N",
        help="cap of --cache-dir in bytes (default 64 GiB); with --partition node, at least a node's share")
    partition: str = option(
        "global", choices=["global", "node"],
        help="global: one permutation of the stores per epoch over all ranks. node: each node (torchrun's "
             "GROUP_RANK, LOCAL_WORLD_SIZE) reads one fixed share every epoch, shuffled within, so a --cache-dir "
             "that holds the share serves epochs 2.. without remote reads")
    checkpoint_layers: bool = option(
        False, help="recompute each draft layer in backward instead of keeping its activations (about a third "
                    "more layer compute, a fraction of the memory: the published recipe on an 80 GB GPU)")
    gpu_memory_gib: float | None = option(
        None, metavar="GIB", help="GPU memory to plan the step for, and hold to (default: the device's); e.g. 80 "
                                  "on a larger GPU to check a recipe for an 80 GB one")
    allow_unhealthy: bool = option(
        False, help="train on a store whose feature statistics show a non-finite or all-zero feature for a "
                    "sample (refused by default: such a store trains nothing; `hsstore subset --exclude-unhealthy` "
                    "drops those samples)")


@dataclass
class Output:
    log_every: int = option(10, help="steps between metrics.jsonl rows")
    save_every: int = option(1000, help="steps between checkpoints (Ctrl-C also saves one)")
    keep: int = option(2, help="checkpoints to keep (0: all)")
    resume: bool = option(True, flag="--no-resume", dest="no_resume", negate=True,
                          help="start over even if OUT has checkpoints")
    log_samples: bool = option(False, help="write OUT/samples.rankN.jsonl (sample ids per step)")
    progress: bool = option(True, cli=False, help="progress bar (the command's --quiet turns it off)")
    # a list once parsed (tracking.parse_report_to); the flag takes them comma-separated
    report_to: str | list[str] | None = option(
        "none", metavar="NAMES",
        help="also send the metrics.jsonl rows and the settings to tensorboard, wandb and/or mlflow "
             "(comma-separated; OUT/tensorboard, OUT/wandb, OUT/mlruns unless their environment says otherwise; "
             "WANDB_MODE=offline works without a network; pip install 'hsstore[track]')")


@dataclass
class Validation:
    val_stores: list[str] | None = option(
        None, flag="--val-store", dest="val_store", metavar="URL", path=True,
        help="held-out store (repeatable, same target): teacher-forced loss, acceptance and tau over every valid "
             "anchor (as `hsstore eval` without --model), logged to metrics.jsonl as val_*")
    val_every: int | None = option(
        None, metavar="N", help="steps between evaluations on --val-store (default: --save-every); always at the "
                                "end too")


@dataclass
class Storage:
    storage_options: dict[str, Any] = option(default_factory=dict, cli=False,
                                             help="fsspec options (the command's -S KEY=VALUE)")


@dataclass
class TrainSettings:
    """``hsstore train``'s settings by section; a section's title is its ``--help`` group and its run.yaml key."""

    run: Run = section(Run, "run")
    batch: Batch = section(Batch, "batch")
    drafter: Drafter = section(Drafter, "drafter")
    shape: Shape = section(Shape, "drafter shape (default: the published DFlash drafters' rule, e.g. "
                                  "Qwen3.6-27B -> 32 heads x 128, 8 KV heads; FFN, RoPE base from the target)")
    schedule: Schedule = section(Schedule, "training")
    data: Data = section(Data, "data")
    output: Output = section(Output, "output")
    validation: Validation = section(Validation, "validation")
    storage: Storage = section(Storage, "storage")


RESUME_KEYS = resume_keys(TrainSettings)
# what a run saved before a key existed did (sliding layers were non-causal; shapes followed the target)
LEGACY_RESUME_VALUES = {"sliding_causal": False}


def _check(self) -> None:
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


TrainConfig = flat_class(TrainSettings, "TrainConfig", __name__, __post_init__=_check, __doc__=(
    "Every setting of ``TrainSettings`` as one flat dataclass (``TrainConfig(stores=[...], out=..., lr=...)``); "
    "steps and epochs are exclusive (neither: DEFAULT_EPOCHS epochs)."))


def from_settings(settings: TrainSettings) -> "TrainConfig":
    """The flat config of a parsed ``TrainSettings`` (``schema.from_args``)."""
    return TrainConfig(**flat(settings))


def recordable_config(cfg: TrainConfig) -> dict[str, Any]:
    """The training config as ``train_config.json`` and every checkpoint's ``trainer.json`` record it: no storage
    options (they may hold secrets) and store URLs in their recordable form (no ``user:password@``)."""
    d = {**dataclasses.asdict(cfg), "storage_options": None}
    for key in ("stores", "val_stores"):
        if d.get(key):
            d[key] = recordable_stores(d[key])
    return d


def recordable_stores(urls: list[str]) -> list[str]:
    """Store URLs as records keep them: no user info, local paths absolute (a record read from another folder,
    or a resume started from one, means the same stores)."""
    return [recordable_url(absolute_path(u)) for u in urls]
