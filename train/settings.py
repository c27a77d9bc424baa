"""The trainer's settings: ``TrainSettings``, written by section, which is what the trainer reads
(``settings.schedule.lr``, ``settings.batch.token_budget``).

Every setting is written once, below (those every family shares, ``--token-budget``, ``--seed``,
``--cache-dir``, ..., in ``hsstore.app.sections``), with its flag, help and default; from the schema come the
``hsstore train`` flags in their ``--help`` groups (``cli.py``), the sections of ``--config`` files and
``run.yaml`` (``hsstore.app.config``: the groups' titles, the flags' keys) and ``RESUME_KEYS`` (``resume=True``: the
settings a resumed run must share with the run it continues, or the weights or the data order would not
match). ``recordable_config`` is the settings as ``train_config.json`` and every checkpoint's ``trainer.json``
hold them (flat, by setting name; no secrets); ``saved_config`` reads such a record back, old names included.

A setting has one name, its field's, which is also its flag's (``--token-budget``) and its key in run.yaml
(``token_budget``). Files written before keep loading, with a warning: old keys are read as today's
(``max_tokens`` as ``token_budget``; ``no_resume`` and ``non_causal_sliding`` inverted, as ``resume`` and
``sliding_causal``), and keys now in another section where they are (``data.checkpoint_layers`` as
``memory.checkpoint_layers``); records (``train_config.json``, ``trainer.json``) with old field names
(``stores``) are read by today's (``saved_config``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hsstore.app.config import absolute_path
from hsstore.redaction import recordable_url
from hsstore.app.devices import DEVICE_DEFAULTS, device_option
from hsstore.app.threads import cpu_threads_option
from hsstore.app import sections
from hsstore.app.schema import flat, old_names, option, resume_keys, section
from hsstore.app.sections import Storage

from . import tracking

CHECKPOINT_POLICIES = ("off", "mlp", "full")  # --checkpoint-layers: what each draft layer recomputes in backward
# "auto": the memory plan (budget.plan_step) picks the first policy of CHECKPOINT_POLICIES whose step fits
CHECKPOINT_CHOICES = ("auto", *CHECKPOINT_POLICIES)

DEFAULT_EPOCHS = 6


@dataclass
class TrainRun:
    store: list[str] = option(required=True, metavar="URL", resume=True, path=True, was="stores",
                              help="store URL (repeatable)")
    out: str = option(required=True, path=True, help="run directory (metrics, checkpoints, drafter)")
    steps: int | None = option(None, exclusive="length", help="optimizer steps")
    epochs: int | None = option(None, exclusive="length", help=f"passes over the data (default {DEFAULT_EPOCHS})")
    device: str | None = device_option()

    def __post_init__(self) -> None:
        if self.steps is not None and self.epochs is not None:
            raise ValueError("give --steps or --epochs, not both")
        if self.steps is None and self.epochs is None:
            self.epochs = DEFAULT_EPOCHS
        if (self.steps is not None and self.steps < 1) or (self.epochs is not None and self.epochs < 1):
            raise ValueError("steps / epochs must be >= 1")
        if not self.store:
            raise ValueError("at least one --store is needed")
        self.store = [str(s) for s in self.store]


@dataclass
class Batch:
    token_budget: int | None = sections.token_budget(
        None, resume=True,
        help=f"padded tokens per batch and rank (default: {DEVICE_DEFAULTS['cuda'].token_budget} on a GPU, the "
             f"published recipe; {DEVICE_DEFAULTS['cpu'].token_budget} on a CPU; a CPU step estimated above the "
             "available memory is refused)")
    anchors: int | None = option(None, metavar="N", resume=True,
                                 help=f"anchors per sequence, at most (default: {DEVICE_DEFAULTS['cuda'].anchors} "
                                      f"on a GPU, {DEVICE_DEFAULTS['cpu'].anchors} on a CPU)")


@dataclass
class Drafter:
    block_size: int = option(16, resume=True, help="anchor + mask tokens drafted per block")
    draft_layers: int = option(5, resume=True, help="draft decoder layers")
    sliding_window: int | None = option(
        2048, convert=lambda w: w or None, resume=True,
        help="window of every draft layer but the last, in positions counting the query's own, as Hugging "
             "Face's sliding_window (0: full attention everywhere)")
    sliding_causal: bool = option(
        True, old_negated="--non-causal-sliding", resume=True,
        help="sliding layers causal inside the block, as SpecForge trains and SGLang/vLLM serve (--no-sliding-causal: "
             "they see their whole block, exported as is_causal: false)")
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
    grad_accum: int = option(
        1, metavar="N",
        help="micro-batches of --token-budget per optimizer step (Hugging Face's gradient_accumulation_steps): the "
             "step's loss is the weighted mean over all of their anchors, so N micro-batches step as one batch of "
             "their union; --steps counts optimizer steps")
    weight_decay: float = option(
        0.0, help="AdamW's decoupled weight decay (Hugging Face's weight_decay): every weight but biases and norm "
                  "weights")
    seed: int = sections.seed(0, "data order, anchors and initial weights", resume=True)
    attn: str = option("auto", choices=["auto", "blocks", "sdpa", "flex"],
                       help="auto: blocks (each chunk of anchors attends to only the keys it may see; memory and "
                            "time follow the visible keys). sdpa: one dense mask [queries x (context + queries)], "
                            "the reference. flex: compiles on its first step and again when batch shapes vary")
    ce_chunk: int = option(1024, cli=False, help="query rows per lm_head + cross-entropy chunk")
    ce_impl: str = option("fused", cli=False, choices=["fused", "checkpoint", "full"],
                          help="fused | checkpoint | full (all logits at once): objective.chunked_cross_entropy")

    def __post_init__(self) -> None:
        if self.grad_accum < 1:
            raise ValueError(f"--grad-accum {self.grad_accum}: must be >= 1 (micro-batches per optimizer step)")
        if not 0.0 <= self.weight_decay < float("inf"):
            raise ValueError(f"--weight-decay {self.weight_decay}: must be a number >= 0")


@dataclass
class Data:
    weight: list[float] | None = option(
        None, metavar="W", resume=True, was="weights",
        help="per --store, in order: 2 = every sample twice per epoch, 0.5 = a seeded half")
    workers: int = option(0, resume=True, help="loader worker processes per rank (needs torchdata): on a GPU, for "
                                              "a remote store; on a CPU they take the cores the step computes on")
    prefetch: int = option(2, help="batches read (and copied to the GPU) ahead")
    cpu_threads: int | None = cpu_threads_option(
        "each rank's step on a CPU", gpus="on GPUs, each local rank's share of the cores for the host's work")
    cache_dir: str | None = sections.cache_dir()
    cache_bytes: int | None = sections.cache_bytes(
        metavar="N",
        help="cap of --cache-dir in bytes (default 64 GiB); with --partition node, at least a node's part (the "
             "loader names that size in one line when the cap is less: later epochs then fetch only what the cap "
             "could not hold)")
    partition: str = option(
        "global", choices=["global", "node"],
        help="global: one permutation of the stores per epoch over all ranks. node: each node (torchrun's "
             "GROUP_RANK, LOCAL_WORLD_SIZE) reads one fixed share every epoch, shuffled within, so a --cache-dir "
             "that holds the share serves epochs 2.. without remote reads")
    follow: bool = option(
        False, resume=True,
        help="train while the stores are written: epoch 0 takes shards as they commit (waiting, with a backoff, for "
             "more) and ends when every writer of every store has finished (a killed writer is waited for: re-run "
             "its extraction); epochs 1.. are ordinary epochs of all of it. An arrival whose features train nothing "
             "stops the run (unless --allow-unhealthy); metrics.jsonl shows the arrivals beside the loss. A writer's "
             "end is believed once it agrees with its committed records and the writer has stayed silent two "
             "heartbeats; at the end the run prints what epoch 0 trained and what the stores hold, and exits 1 when "
             "they differ (unless --steps bounds it)")
    follow_deadline: float | None = option(
        None, metavar="S",
        help="with --follow: stop when nothing has arrived for S seconds and the stores are not finished, saying "
             "what epoch 0 trained and what the stores hold (exit 2, checkpoint kept; the same command follows on). "
             "Default: wait until every writer finishes")


@dataclass
class Memory:
    """What a step keeps in memory, and the memory it is planned for (``budget.py``)."""

    checkpoint_layers: str = option(
        "auto", choices=CHECKPOINT_CHOICES, nargs="?", const="mlp", metavar="{auto,off,mlp,full}",
        help="recompute draft layers in backward instead of keeping their activations: mlp (the bare flag) each "
             "layer's MLP half, the largest part of its activations and the cheapest to redo; full the whole "
             "layer (least memory, about a third more layer compute); auto: off where the step fits the device's "
             "memory, else mlp, else full, before any anchors are given up (said in one line); off keeps every "
             "activation and lowers anchors where the step does not fit")
    shard_optimizer: str = option(
        "auto", choices=("auto", "on", "off"),
        help="under torchrun, each rank keeps the AdamW moments of its share of the parameters only (PyTorch's "
             "ZeroRedundancyOptimizer; the same step, one broadcast of the updated parameters after it): auto where "
             "the step would otherwise need more recompute or fewer anchors; on always; off never")
    gpu_memory_gib: float | None = option(
        None, metavar="GIB", help="GPU memory to plan the step for, and hold to (default: the device's); e.g. 80 "
                                  "on a larger GPU to check a recipe for an 80 GB one")


@dataclass
class Health:
    """What the run does with stores whose feature statistics say they train nothing."""

    allow_unhealthy: bool = option(
        False, help="train on a store whose feature statistics show a non-finite or all-zero feature for a "
                    "sample (refused by default: such a store trains nothing; `hsstore subset --exclude-unhealthy` "
                    "drops those samples)")


@dataclass
class Output:
    log_every: int = option(10, help="steps between metrics.jsonl rows")
    save_every: int = option(1000, help="steps between checkpoints (Ctrl-C also saves one)")
    keep: int = option(2, help="checkpoints to keep (0: all)")
    resume: bool = option(True, old_negated="--no-resume",
                          help="go on from OUT's latest checkpoint (--no-resume: start over even if OUT has some)")
    resume_from: str | None = option(
        None, metavar="CHECKPOINT", path=True,
        help="go on from this checkpoint (OUT/checkpoints/step_N or OUT/checkpoints/best, of this run or another) "
             "rather than OUT's latest; refused where OUT holds later checkpoints (a new --out branches from it)")
    log_samples: bool = option(False, help="write OUT/samples.rankN.jsonl (sample ids per step; always on with "
                                           "--follow, whose end counts it)")
    progress: bool = sections.progress()
    # a list once parsed (tracking.parse_report_to); the flag takes them comma-separated
    report_to: str | list[str] | None = option(
        "none", metavar="NAMES",
        help="also send the metrics.jsonl rows and the settings to tensorboard, wandb and/or mlflow "
             "(comma-separated; OUT/tensorboard, OUT/wandb, OUT/mlruns unless their environment says otherwise; "
             "WANDB_MODE=offline works without a network; pip install 'hsstore[track]')")

    def __post_init__(self) -> None:
        self.report_to = tracking.parse_report_to(self.report_to) or None
        if self.resume_from is not None and not self.resume:
            raise ValueError("give --resume-from CHECKPOINT or --no-resume, not both")


@dataclass
class TrainValidation:
    val_store: list[str] | None = option(
        None, metavar="URL", path=True, was="val_stores",
        help="held-out store (repeatable, same target): teacher-forced loss, acceptance and tau over every valid "
             "anchor (as `hsstore eval` without --model), logged to metrics.jsonl as val_*")
    val_every: int | None = option(
        None, metavar="N", help="steps between evaluations on --val-store (default: --save-every); always at the "
                                "end too")

    def __post_init__(self) -> None:
        self.val_store = [str(s) for s in self.val_store] if self.val_store else None
        if self.val_every is not None and self.val_every < 1:
            raise ValueError("val_every must be >= 1")


@dataclass
class TrainSettings:
    """``hsstore train``'s settings by section; a section's title is its ``--help`` group and its run.yaml key."""

    run: TrainRun = section(TrainRun, "run")
    batch: Batch = section(Batch, "batch")
    memory: Memory = section(Memory, "memory")
    drafter: Drafter = section(Drafter, "drafter")
    shape: Shape = section(Shape, "drafter shape (default: the published DFlash drafters' rule, e.g. "
                                  "Qwen3.6-27B -> 32 heads x 128, 8 KV heads; FFN, RoPE base from the target)")
    schedule: Schedule = section(Schedule, "training")
    data: Data = section(Data, "data")
    health: Health = section(Health, "health")
    output: Output = section(Output, "output")
    validation: TrainValidation = section(TrainValidation, "validation")
    storage: Storage = section(Storage, "storage")

    def __post_init__(self) -> None:
        if self.data.follow and self.schedule.grad_accum > 1:
            raise ValueError("--grad-accum with --follow: not supported (epoch 0's length is estimated in batches as "
                             "the store grows); train the finished store, or follow with --grad-accum 1")


# --- eval ---------------------------------------------------------------------------------------------------


@dataclass
class EvalInput:
    store: str = option(required=True, help="without --model: the store to evaluate on; with it: the store the "
                                            "drafter was trained on (frozen head, taps)")
    drafter: str = option(required=True, help="drafter dir, or a training OUT dir (its drafter/ or latest "
                                              "checkpoint)")


@dataclass
class TeacherForced:
    """Without --model: teacher-forced, from the store alone."""

    token_budget: int | None = sections.token_budget(
        None,
        help=f"without --model: padded tokens per batch, as in training (default: "
             f"{DEVICE_DEFAULTS['cuda'].token_budget} on a GPU, {DEVICE_DEFAULTS['cpu'].token_budget} on a CPU)")
    anchor_chunk: int = option(512, help="without --model: anchors per sequence per forward (memory; the training "
                                         "default)")
    cache_dir: str | None = sections.cache_dir()


@dataclass
class Speculative:
    """With --model: greedy speculative decoding against the target."""

    model: str | None = option(None, help="target model directory: speculative decoding instead of the "
                                          "teacher-forced evaluation")
    input: list[str] | None = option(None, nargs="+", was="inputs",
                                     help="with --model: JSONL with 'messages' (prompt = before the last "
                                           "assistant turn) or 'prompt'")
    num_samples: int = option(8, help="with --model: prompts to decode")
    max_new_tokens: int = option(2048, help="with --model (DFlash's benchmark: 2048)")
    thinking: bool = option(True, help="with --model: render prompts with enable_thinking=True (--no-thinking: "
                                       "False)")
    dtype: str | None = option(None, choices=["bfloat16", "float16", "float32"],
                               help="with --model: default bfloat16 on CUDA, float32 on CPU")


@dataclass
class EvalRun:
    device: str | None = device_option()
    cpu_threads: int | None = cpu_threads_option("the drafter and the target on a CPU")
    progress: bool = sections.progress()


@dataclass
class EvalSettings:
    """``hsstore eval``'s settings by section (``--help`` shows the same groups)."""

    input: EvalInput = section(EvalInput, "input")
    store_eval: TeacherForced = section(TeacherForced, "store evaluation")
    speculative: Speculative = section(Speculative, "speculative decoding")
    run: EvalRun = section(EvalRun, "run")
    storage: Storage = section(Storage, "storage")


# --- export-drafter -----------------------------------------------------------------------------------------


@dataclass
class DrafterExport:
    ckpt: str = option(positional=True, metavar="CKPT", help="a drafter directory, a checkpoint "
                       "(OUT/checkpoints/step_N) or a training run (its drafter/ or latest checkpoint)")
    out: str = option(positional=True, metavar="OUT", help="the new drafter directory (must not exist or be empty)")
    best: bool = option(False, help="export the run's checkpoint with the best validation tau, a tie going to the "
                                    "lower validation loss, then to the earlier step (the one CKPT/checkpoints/best "
                                    "names; a run trained with --val-store has it) rather than its last step "
                                    "(CKPT/drafter)")


@dataclass
class ExportDrafterSettings:
    export: DrafterExport = section(DrafterExport, "export")


RESUME_KEYS = resume_keys(TrainSettings)
# what a run saved before a key existed did (sliding layers were non-causal; shapes followed the target)
LEGACY_RESUME_VALUES = {"sliding_causal": False, "follow": False}
# the settings a resume may change, as a run saved before they existed had them
LEGACY_VALUES = {"grad_accum": 1, "weight_decay": 0.0}
# what every segment of a run gives anew, never a change worth naming: where it goes, how long (said on its own),
# whether and from where it resumes, its progress bar and its storage options (never recorded)
SEGMENT_KEYS = frozenset({"out", "steps", "epochs", "resume", "resume_from", "progress", "storage_options"})


# settings recorded under another name before (train_config.json, trainer.json): read as the new one
RENAMED = {"max_tokens": "token_budget", **old_names(TrainSettings)}


def saved_config(recorded: dict[str, Any]) -> dict[str, Any]:
    """A recorded config (``recordable_config``'s dict, from this or an older release) by today's names."""
    return {RENAMED.get(k, k): v for k, v in recorded.items()}


def recordable_config(settings: TrainSettings) -> dict[str, Any]:
    """The settings as ``train_config.json`` and every checkpoint's ``trainer.json`` record them, by setting name:
    no storage options (they may hold secrets) and store URLs in their recordable form (no ``user:password@``)."""
    d = {**flat(settings), "storage_options": None}
    for key in ("store", "val_store"):
        if d.get(key):
            d[key] = recordable_stores(d[key])
    return d


def recordable_stores(urls: list[str]) -> list[str]:
    """Store URLs as records keep them: no user info, local paths absolute (a record read from another folder,
    or a resume started from one, means the same stores)."""
    return [recordable_url(absolute_path(u)) for u in urls]
