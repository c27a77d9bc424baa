"""``hsstore train``: the DFlash drafter trained from hidden-state stores alone.

Everything the trainer needs is in the store: the features, the tokens and loss masks, and (as
assets) the target's config, embedding and lm_head. It never opens the target's weights, so a team can
train on a machine that has only the store.

The loop, in order: build the drafter from the store -> resume if OUT has a checkpoint -> for each
epoch, for each token-budget batch: loss -> backward -> clip -> AdamW -> cosine schedule -> log ->
checkpoint. The pieces it uses live next to it: ``data.py`` (batches, anchors, read-ahead, DDP
lockstep), ``objective.py`` (the loss), ``optim.py`` (AdamW + schedule), ``checkpoint.py``.

Choices worth knowing:
* **Mask token**: ``mask_token_id`` if given; else the first embedding row past the tokenizer's
  vocabulary (Qwen checkpoints pad their embedding: e.g. 248320 rows), an id no text can produce;
  else the target's ``pad_token_id`` (``<|endoftext|>`` for Qwen, never inside a chat sample).
* **Draft layers**: the published Qwen3.6-27B drafter by default: 5 Qwen3-style layers, all but the
  last with a sliding window of 2048 (causal inside the block, as the engines serve it); hidden size,
  FFN width, RoPE base and context length are the target's, the attention shape the published
  drafters' (``model.reference_attention_shape``: 32 heads x 128, 8 KV heads for Qwen3.6-27B). Flags
  override each. ``--init DIR`` starts from a drafter in the DFlash format instead (its shape, taps,
  mask token), after checking that it fits the store.
* **Precision**: fp32 master weights and optimizer; on CUDA the step runs under bf16 autocast and the
  frozen head stays in its stored dtype; on CPU everything is fp32 (so tests can compare exactly).
* **DDP** (``torchrun``): gloo on CPU, nccl on GPU; each rank reads its own share of the store (the
  loader's rank split); ranks run in lockstep (``data.lockstep``) so every sample is seen once per epoch.
  The loss is normalised over all ranks' batches (``DraftLoss``), so the step is the one a single process
  would take on their union.
* **metrics.jsonl**: one line per logged step: step, epoch, loss (weighted CE over all ranks), acc,
  acc_k (draft positions 1..S-1), tau (teacher-forced acceptance estimate on the training anchors), lr,
  grad_norm, tokens, tokens_per_s, samples, wait_frac (share of the time spent waiting for data).
  With ``val_stores``, every ``val_every`` steps and at the end the line also has val_loss, val_acc,
  val_tau, val_acceptance (per draft position), val_anchors, val_seconds: ``evaluate.py`` over every
  valid anchor of the validation stores, each rank its share.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import math
import os
import signal
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

import hsstore
from hsstore import assets, codec, fp8, storage
from hsstore.devices import resolve_device
from hsstore.distributed import local_rank, rank_and_world
from hsstore.manifest import check_compatible
from hsstore.redaction import recordable_url
from hsstore.reader import open_shared, read_manifest
from hsstore.taps import text_config

from . import checkpoint as ckpt
from . import tracking
from .budget import check_cpu_memory, check_gpu_memory, with_device_defaults
from .data import StoreBatches, add_anchors, empty_batch, lockstep, read_ahead
from .evaluate import eval_source, evaluate
from .model import DFlashDrafter, DrafterConfig
from .objective import default_gamma, dflash_loss
from .optim import build_optimizer, build_scheduler, clip_grad

log = logging.getLogger(__name__)

DEFAULT_EPOCHS = 6
# settings that must not change when resuming (the weights or the data order would not match)
RUN_MARKER = "train_config.json"  # what makes a folder a run (``--out`` of an earlier train, resumed)
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


@dataclass
class TrainResult:
    steps: int
    epochs_done: int
    seconds: float
    drafter_dir: Path | None
    last: dict[str, Any]
    resumed_from: Path | None = None


# ---------------------------------------------------------------------------------------------- setup


def load_frozen(store: hsstore.Store, device="cpu", dtype: torch.dtype | None = None):
    """(target config dict, embedding [V, H], lm_head [V, H]) from the store's assets."""
    cfg = json.loads(assets.read_asset(store.fs, store.root, assets.CONFIG, store.url))
    embed = assets.load_tensors(store.fs, store.root, assets.EMBED, store.url)["weight"]
    head = assets.load_tensors(store.fs, store.root, assets.LM_HEAD, store.url)["weight"]
    if dtype is not None:
        embed, head = embed.to(dtype), head.to(dtype)
    return cfg, embed.to(device), head.to(device)


def pick_mask_token(target_cfg: dict[str, Any], manifest: hsstore.Manifest, vocab_rows: int,
                    requested: int | None = None) -> int:
    """See the module doc: requested > first unused embedding row > pad token."""
    if requested is not None:
        if not 0 <= requested < vocab_rows:
            raise ValueError(f"mask token id {requested} outside the embedding (0..{vocab_rows - 1})")
        return int(requested)
    used = manifest.tokenizer.vocab_size
    if used is not None and used < vocab_rows:
        return int(used)
    pad = text_config(target_cfg).get("pad_token_id", target_cfg.get("pad_token_id"))
    if pad is not None:
        return int(pad)
    raise ValueError("cannot choose a mask token: the embedding has no unused row and the target config no "
                     "pad_token_id; pass --mask-token-id")


def drafter_config(manifest: hsstore.Manifest, target_cfg: dict[str, Any], vocab_rows: int, cfg: TrainConfig,
                   device: torch.device) -> DrafterConfig:
    tc = text_config(target_cfg)
    if tc.get("hidden_size") != manifest.hidden_size:
        raise ValueError(f"store assets' config has hidden_size {tc.get('hidden_size')}, the store's features "
                         f"{manifest.hidden_size}")
    attn = cfg.attn if cfg.attn != "auto" else "blocks"  # equal to sdpa, faster (tests/test_attention_blocks.py)
    if cfg.init is not None:
        return init_config(cfg.init, manifest, vocab_rows, cfg, attn)
    window = cfg.sliding_window or None
    windows = [window] * (cfg.draft_layers - 1) + [None] if window else None
    shape = {k: getattr(cfg, k) for k in SHAPE_KEYS if getattr(cfg, k) is not None}
    return DrafterConfig.from_target_config(
        SimpleNamespace(**{**tc, "vocab_size": vocab_rows}),
        mask_token_id=pick_mask_token(target_cfg, manifest, vocab_rows, cfg.mask_token_id),
        target_layers=list(manifest.layers), num_layers=cfg.draft_layers, block_size=cfg.block_size,
        sliding_window=windows, sliding_causal=cfg.sliding_causal, attn_impl=attn,
        num_target_layers=manifest.target.num_layers, **shape)


SHAPE_KEYS = ("num_heads", "num_kv_heads", "head_dim", "intermediate_size", "rope_theta")


def init_config(path: str, manifest: hsstore.Manifest, vocab_rows: int, cfg: TrainConfig, attn: str) -> DrafterConfig:
    """The config of the drafter at ``path`` (``--init``), refused in one line when it does not fit the store:
    its taps must be among the store's layers, its hidden size, vocabulary, target depth and block size
    those of the store and flags; explicit shape flags must agree with it."""
    dcfg, _ = ckpt.read_drafter_config(path)
    problems = []
    missing = [t for t in dcfg.target_layers if t not in manifest.layers]
    if missing:
        problems.append(f"taps {dcfg.target_layers} need layers {missing} the store lacks (it has "
                        f"{list(manifest.layers)})")
    if dcfg.num_target_layers is not None and dcfg.num_target_layers != manifest.target.num_layers:
        problems.append(f"it was made for a {dcfg.num_target_layers}-layer target, the store's has "
                        f"{manifest.target.num_layers}")
    if dcfg.hidden_size != manifest.hidden_size:
        problems.append(f"hidden size {dcfg.hidden_size} != the store's {manifest.hidden_size}")
    if dcfg.vocab_size != vocab_rows:
        problems.append(f"vocabulary {dcfg.vocab_size} != the store's embedding rows {vocab_rows}")
    if dcfg.block_size != cfg.block_size:
        problems.append(f"block size {dcfg.block_size} != --block-size {cfg.block_size}")
    if cfg.mask_token_id is not None and cfg.mask_token_id != dcfg.mask_token_id:
        problems.append(f"mask token {dcfg.mask_token_id} != --mask-token-id {cfg.mask_token_id}")
    mine = {"num_heads": dcfg.num_heads, "num_kv_heads": dcfg.num_kv_heads, "head_dim": dcfg.head_dim,
            "intermediate_size": dcfg.intermediate_size, "rope_theta": dcfg.rope_theta}
    problems += [f"{k} {mine[k]} != --{k.replace('_', '-')} {getattr(cfg, k)}" for k in SHAPE_KEYS
                 if getattr(cfg, k) is not None and getattr(cfg, k) != mine[k]]
    if problems:
        raise ValueError(f"--init {path} does not fit: {'; '.join(problems)}")
    ckpt.check_weights_file(path, dcfg)  # its config describes its weights: checked before any is built
    if dcfg.num_layers != cfg.draft_layers or dcfg.sliding_window != (
            [cfg.sliding_window] * (cfg.draft_layers - 1) + [None] if cfg.sliding_window else None):
        log.info("--init %s: %d layers, windows %s (its own; --draft-layers/--sliding-window do not apply)",
                 path, dcfg.num_layers, dcfg.sliding_window)
    return dataclasses.replace(dcfg, attn_impl=attn, num_target_layers=manifest.target.num_layers)


class DraftLoss(torch.nn.Module):
    """The drafter plus its objective as one module: DDP must wrap the call that produces the loss
    (the drafter's own forward would build [B, A, S, V] logits).

    Global normalisation: with ``batch["global_weight_sum"]`` (``data.lockstep``: the loss weights summed
    over all ranks' batches, W) each rank's loss is ``world * sum(w * CE) / W``. DDP averages gradients
    over the ``world`` ranks, so the step follows the gradient of ``sum over ranks (w * CE) / W``: exactly
    one process's step on the union of the batches, whatever each rank's share of the weights."""

    def __init__(self, drafter: DFlashDrafter, gamma: float, ce_chunk: int, world: int = 1, ce_impl: str = "fused"):
        super().__init__()
        self.drafter, self.gamma, self.ce_chunk, self.world, self.ce_impl = drafter, gamma, ce_chunk, world, ce_impl

    def forward(self, batch):
        total = batch.get("global_weight_sum")
        return dflash_loss(self.drafter, batch, gamma=self.gamma, ce_chunk=self.ce_chunk, ce_impl=self.ce_impl,
                           weight_total=None if not total else total / self.world)


def init_distributed(device: str | None):
    """(rank, world, device, CPU group for small all-reduces); starts the process group under torchrun."""
    rank, world = rank_and_world()
    local = local_rank(rank, world)
    dev = resolve_device(device, local)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    group = None
    if world > 1:
        if not dist.is_initialized():
            dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
        if dev.type == "cuda":
            group = dist.new_group(backend="gloo")
    return rank, world, dev, group


def share_cpu_threads(requested: int | None, dev: torch.device) -> int:
    """Threads for torch's CPU ops (the batch collate: a layer-major -> token-major copy of ~1 GB per step).
    torchrun sets ``OMP_NUM_THREADS=1`` unless told otherwise. On 2 H200s (``tools/bench_train.py
    --loader-only``, both ranks at once) one thread capped the earlier collate-then-pin path at 24-34K
    tokens/s per rank, which starved DDP; collating straight into pinned memory does 72-118K with one thread,
    and training no longer depends on it (39.3K vs 39.5K tokens/s on 2 GPUs). Default under torchrun on
    GPUs: each local rank gets its share of this machine's cores (``--cpu-threads`` overrides)."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    n = requested
    if n is None and local_world > 1 and dev.type == "cuda":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        n = max(1, cores // local_world)
    if n:
        torch.set_num_threads(n)
    return torch.get_num_threads()


# ---------------------------------------------------------------------------------------------- metrics


class Meter:
    """Sums over a logging interval; ``summary`` all-reduces them so the line covers every rank."""

    def __init__(self, S: int):
        self.S = S
        self.reset()

    def reset(self):
        self.v = torch.zeros(7 + 2 * (self.S - 1), dtype=torch.float64)
        self.t0, self.wait = time.perf_counter(), 0.0

    def add(self, metrics: dict, label_counts, tokens: int, samples: int):
        if label_counts is None or int(metrics["num_tokens"]) == 0:
            self.v[4] += 1  # steps (an empty step still counts)
            return
        w = float(metrics["weight_sum"])
        anchors = int(metrics["num_anchors"])
        counts = torch.tensor(label_counts, dtype=torch.float64)
        hits = torch.nan_to_num(metrics["acc_k"].double().cpu()) * counts
        S1 = self.S - 1
        # the weighted CE sum, not the loss: under DDP the loss is scaled for the gradient (DraftLoss)
        self.v[:7] += torch.tensor([float(metrics["ce_sum"]), w, float(metrics["tau"]) * anchors, anchors, 1,
                                    tokens, samples], dtype=torch.float64)
        self.v[7:7 + S1] += hits.round()
        self.v[7 + S1:] += counts

    def summary(self, world: int, group) -> dict[str, Any]:
        v = self.v.clone()
        if world > 1:
            dist.all_reduce(v, group=group)
        S1 = self.S - 1
        dt = time.perf_counter() - self.t0
        hits, counts = v[7:7 + S1], v[7 + S1:]
        nan = float("nan")
        acc_k = [float(h / c) if c > 0 else nan for h, c in zip(hits, counts)]
        return {"loss": float(v[0] / v[1]) if v[1] > 0 else nan,
                "acc": float(hits.sum() / counts.sum()) if counts.sum() > 0 else nan,
                "acc_k": acc_k, "tau": float(v[2] / v[3]) if v[3] > 0 else nan,
                "tokens": int(v[5]), "samples": int(v[6]), "tokens_per_s": float(v[5]) / dt if dt > 0 else nan,
                "wait_frac": self.wait / dt if dt > 0 else 0.0}


class BestTracker:
    """Which checkpoint OUT/checkpoints/best names: the step with the highest val_tau so far (SpecForge's
    best-checkpoint metric is its acceptance-length estimate too). A new best forces a checkpoint at its step."""

    KEYS = ("step", "val_tau", "val_loss", "val_acc", "val_anchors")

    def __init__(self, saved: dict[str, Any] | None):
        self.tau = float(saved["val_tau"]) if saved and saved.get("val_tau") is not None else -math.inf
        self.pending: dict[str, Any] | None = None

    def offer(self, step: int, row: dict[str, Any]) -> None:
        tau = row.get("val_tau")
        if tau is not None and math.isfinite(tau) and tau > self.tau:
            self.tau = tau
            self.pending = {k: _json_safe(row[k]) if k != "step" else step for k in self.KEYS if k in row or
                            k == "step"}

    def take(self) -> dict[str, Any] | None:
        p, self.pending = self.pending, None
        return p


def val_metrics(ev) -> dict[str, Any]:
    """The metrics.jsonl fields of a teacher-forced evaluation (``evaluate.StoreEval``)."""
    return {"val_loss": ev.loss, "val_acc": ev.acc, "val_tau": ev.tau, "val_acceptance": ev.acceptance,
            "val_anchors": ev.anchors, "val_seconds": ev.seconds}


def check_val_stores(train: hsstore.Manifest, urls: list[str], storage_options: dict) -> None:
    """A validation store must come from the same target and tokenizer (the drafter's frozen head and its
    tokens); its taps, dtype and encoding may differ (the loader reads the drafter's taps from it)."""
    for url in urls:  # the manifest alone: the records are read once, by the evaluation's loader
        fs, root = storage.resolve(url, storage_options)
        m = read_manifest(fs, root, url)
        same_layout = dataclasses.replace(m, layers=train.layers, dtype=train.dtype, encoding=train.encoding)
        check_compatible(train, same_layout, "the training store", f"validation store {url!r}")


def truncate_jsonl(path: Path, after_step: int) -> None:
    """Drop lines logged after ``after_step`` (a resumed run logs them again)."""
    if not path.exists():
        return
    keep = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= after_step]
    path.write_text("".join(ln + "\n" for ln in keep))


def _json_safe(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, list):
        return [_json_safe(v) for v in x]
    return x


# ---------------------------------------------------------------------------------------------- the loop


def train(cfg: TrainConfig, source=None, settings: dict[str, Any] | None = None) -> TrainResult:
    """Train (or resume) a drafter; ``source`` replaces the store batches (tests feed online features);
    ``settings`` (the command's flags by section, ``hsstore.config.settings``) go into OUT/run.yaml."""
    t_start = time.perf_counter()
    tracking.check_available(cfg.report_to or [])  # before any work: a missing package is one line
    rank, world, device, group = init_distributed(cfg.device)
    share_cpu_threads(cfg.cpu_threads, device)
    cfg = with_device_defaults(cfg, device)
    out = Path(cfg.out)
    if rank == 0:  # a user's folder is not a run to resume (other ranks would see rank 0's first files)
        storage.check_output_folder(out, (RUN_MARKER,), "train --out")
    out.mkdir(parents=True, exist_ok=True)

    # -- the drafter, from the store alone
    # opened once per job: under DDP rank 0 reads the records and broadcasts them; the loader reuses these
    stores = [open_shared(u, cfg.storage_options) for u in cfg.stores]
    manifest = stores[0].manifest
    head_dtype = None if device.type == "cuda" else torch.float32
    target_cfg, embed, head = load_frozen(stores[0], device, head_dtype)
    dcfg = drafter_config(manifest, target_cfg, embed.shape[0], cfg, device)
    gamma = cfg.gamma if cfg.gamma is not None else default_gamma(dcfg.block_size)
    torch.manual_seed(cfg.seed)
    drafter = DFlashDrafter(dcfg, embed, head).to(device)
    if cfg.init is not None:  # a resumed run then loads its checkpoint over these
        drafter.load_state_dict(ckpt.read_weights(cfg.init, dcfg))
        log.info("rank %d: drafter initialised from %s", rank, cfg.init)
    drafter.checkpoint_layers = cfg.checkpoint_layers
    if device.type == "cpu":  # past the memory there, the kernel kills the process without a word
        check_cpu_memory(dcfg, cfg, drafter.num_trainable_parameters(), embed.numel() + head.numel())
    elif device.type == "cuda":  # an out-of-memory at step 1 (or hours in, at a batch of short rows): decide now
        cfg = check_gpu_memory(dcfg, cfg, drafter.num_trainable_parameters(), embed.numel() + head.numel(), device,
                               stores)
    loss_fn = DraftLoss(drafter, gamma, cfg.ce_chunk, world, cfg.ce_impl)
    opt = build_optimizer(drafter, lr=cfg.lr)
    S = dcfg.block_size
    if rank == 0:
        log.info("%s", settings_line(dcfg, cfg, device, world, drafter.num_trainable_parameters()))

    # -- the data: this rank's share of the stores, in token-budget batches
    if source is None:
        source = StoreBatches(stores, layers=dcfg.target_layers, max_tokens=cfg.max_tokens, seed=cfg.seed,
                              rank=rank, world_size=world, workers=cfg.workers, weights=cfg.weights,
                              storage_options=cfg.storage_options, cache_dir=cfg.cache_dir,
                              pin_memory=device.type == "cuda", partition=cfg.partition,
                              cache_bytes=cfg.cache_bytes)
    total = cfg.steps if cfg.steps is not None else source.planned_steps(cfg.epochs)
    sched = build_scheduler(opt, total, cfg.warmup, cfg.min_lr_ratio)
    config_json = recordable_config(cfg)
    extra = {"target": dataclasses.asdict(manifest.target), "taps": list(manifest.layers),
             "tokenizer": dataclasses.asdict(manifest.tokenizer), "hsstore_version": hsstore.__version__}

    checkpoints = Checkpointer(out=out, drafter=drafter, opt=opt, sched=sched, cfg=cfg, config_json=config_json,
                               extra=extra, device=device, rank=rank, world=world)

    # -- resume
    step, epoch = 0, 0
    latest = ckpt.latest_checkpoint(out) if cfg.resume else None
    if latest is not None:
        step, epoch = resume(latest, cfg, drafter, opt, sched, source, device, rank, world)
        log.info("rank %d: resumed from %s (step %d, epoch %d)", rank, latest, step, epoch)
    metrics_path = out / "metrics.jsonl"
    samples_path = out / f"samples.rank{rank:05d}.jsonl"
    val_source, val_every, val_step = None, cfg.val_every or cfg.save_every, step
    best = BestTracker(ckpt.read_best(out) if latest is not None else None)
    if latest is None and rank == 0 and ckpt.read_best(out) is not None:  # starting over: not this run's best
        ckpt.best_path(out).unlink()
    if cfg.val_stores:
        check_val_stores(manifest, cfg.val_stores, cfg.storage_options)
        val_source = eval_source(cfg.val_stores, dcfg.target_layers, cfg.max_tokens, rank, world,
                                 cfg.storage_options, cfg.cache_dir, pin_memory=device.type == "cuda")

    def validate() -> dict[str, Any]:
        ev = evaluate(drafter, val_source, device, gamma=gamma, anchor_chunk=cfg.anchors, ce_chunk=cfg.ce_chunk,
                      world=world, group=group, prefetch=cfg.prefetch)
        log.info("step %d: val loss %.4f, val tau %.3f (%d anchors, %.1fs)", step, ev.loss, ev.tau, ev.anchors,
                 ev.seconds)
        return val_metrics(ev)

    def write_row(row: dict[str, Any]) -> None:
        if device.type == "cuda":
            row["gpu_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        if rank == 0:
            with metrics_path.open("a") as f:
                f.write(json.dumps({k: _json_safe(v) for k, v in row.items()}) + "\n")
            if trackers is not None:
                trackers.log(row, row["step"])
    if rank == 0:
        truncate_jsonl(metrics_path, step)
    if cfg.log_samples:
        truncate_jsonl(samples_path, step)
    if rank == 0:
        (out / RUN_MARKER).write_text(json.dumps(config_json, indent=2))
        if settings is not None:
            write_run_file(out / RUN_FILE, settings, stores, {**config_json, "device": str(device)})
    trackers = None
    if rank == 0 and cfg.report_to:
        trackers = tracking.Trackers(cfg.report_to, out, settings or config_json)

    model = loss_fn
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        # the frozen head is identical on every rank (it comes from the store): never broadcast it
        DDP._set_params_and_buffers_to_ignore_for_model(loss_fn, ["drafter.embed_tokens", "drafter.lm_head"])
        model = DDP(loss_fn, device_ids=[device.index] if device.type == "cuda" else None)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    feat_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    stored_dtype = codec.TORCH_DTYPE[manifest.dtype]  # what fp8 features dequantise into, as Store.read does

    from tqdm import tqdm

    bar = tqdm(total=total, initial=step, desc="train", unit="step", disable=rank != 0 or not cfg.progress,
               dynamic_ncols=True)
    meter = Meter(S)
    last: dict[str, Any] = {}
    epochs_limit = cfg.epochs if cfg.steps is None else math.inf
    loader_state = None
    interrupt = StopOnInterrupt()
    with interrupt:
        while step < total and epoch < epochs_limit:
            source.set_epoch(epoch)

            def prepare(batch, e=epoch):
                return add_anchors(batch, cfg.seed, e, cfg.anchors, S, gamma)

            stream = lockstep(read_ahead(source, prepare, device, cfg.prefetch), world, group, interrupt)
            t_wait = time.perf_counter()
            finished_epoch = True
            for batch, state in stream:
                meter.wait += time.perf_counter() - t_wait
                loader_state = state if state is not None else loader_state
                if batch is None:  # this rank's share of the epoch is done; others are not
                    batch = empty_batch(dcfg.num_taps, dcfg.hidden_size, feat_dtype, device)
                # fp8 stores: values and scales crossed to the device (half the bytes); dequantise there
                batch = fp8.dequantise_batch(batch, stored_dtype)

                lr = sched.get_last_lr()[0]  # the rate this step uses
                _, m, grad_norm = train_step(model, drafter, opt, sched, batch, cfg.clip, amp)
                step += 1

                # -- bookkeeping
                meter.add(m, batch["label_counts"], batch["tokens"], len(batch["sample_id"]))
                if cfg.log_samples:
                    with samples_path.open("a") as f:
                        f.write(json.dumps({"step": step, "epoch": epoch, "samples": list(batch["sample_id"])}) + "\n")
                val_due = val_source is not None and (step % val_every == 0 or step == total)
                if step % cfg.log_every == 0 or step == total or val_due:
                    row = {"step": step, "epoch": epoch, **meter.summary(world, group), "lr": lr,
                           "grad_norm": float(grad_norm)}
                    if val_due:
                        row.update(validate())
                        val_step = step
                        best.offer(step, row)
                    meter.reset()  # after the evaluation: its time is not the next interval's
                    last = row
                    write_row(row)
                    bar.set_postfix(loss=f"{row['loss']:.3f}", acc=f"{row['acc']:.3f}",
                                    tok_s=f"{row['tokens_per_s']:.0f}", refresh=False)
                bar.update(1)
                if step % cfg.save_every == 0 or step == total or best.pending:
                    checkpoints.save(step, epoch, loader_state, best.take())
                if cfg.steps is not None and step >= total:
                    finished_epoch = False
                    break
                if interrupt.stopping(world):  # Ctrl-C: stop here, at a step boundary, with a checkpoint
                    finished_epoch = False
                    break
                t_wait = time.perf_counter()
            stream.close()
            if finished_epoch:
                epoch += 1
            if interrupt.stopping(world):
                break
    if interrupt.stopping(world):
        bar.close()
        if step % cfg.save_every and step != total:  # not saved at this step yet
            checkpoints.save(step, epoch, loader_state)
        log.warning("stopped at step %d: checkpoint %s; re-run the same command to resume", step,
                    ckpt.checkpoint_dir(out, step))
        if trackers is not None:
            trackers.close(failed=True)
        raise KeyboardInterrupt
    bar.close()
    if val_source is not None and val_step != step:  # the epochs ended before the planned step count
        last = {"step": step, "epoch": epoch, **meter.summary(world, group), **validate()}
        write_row(last)
        best.offer(step, last)
    if (step % cfg.save_every and step != total) or best.pending:  # the epochs ended before the planned steps
        checkpoints.save(step, epoch, loader_state, best.take())
    drafter_dir = None
    if rank == 0:
        drafter_dir = ckpt.save_drafter(out / ckpt.DRAFTER_DIR, drafter, extra)
        if trackers is not None:
            trackers.close()
    if world > 1:
        dist.barrier()
    return TrainResult(step, epoch, time.perf_counter() - t_start, drafter_dir, last, latest)


RUN_FILE = "run.yaml"


def write_run_file(path: Path, settings: dict[str, Any], stores, resolved: dict[str, Any]) -> None:
    """OUT/run.yaml: the command's settings (``hsstore train --config OUT/run.yaml`` runs it again), and for
    people the version, each store's identity and the values the device chose."""
    from hsstore.config import dump
    from hsstore.redaction import scrub

    recorded = {"hsstore_version": hsstore.__version__,
                "stores": [{"url": scrub(s.url), "samples": len(s), "layers": list(s.manifest.layers),
                            "dtype": s.manifest.dtype, "encoding": s.manifest.encoding,
                            "target": dataclasses.asdict(s.manifest.target),
                            "tokenizer": dataclasses.asdict(s.manifest.tokenizer)} for s in stores],
                "resolved": {k: v for k, v in resolved.items() if k in ("device", "max_tokens", "anchors",
                                                                         "epochs", "steps")}}
    header = ("hsstore train settings of this run. `hsstore train --config run.yaml --out NEW` runs it again\n"
              "(flags given with --config win); secret storage options are not recorded: pass them with -S.")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(dump(settings, recorded, header))
    os.replace(tmp, path)


def settings_line(dcfg: DrafterConfig, cfg: TrainConfig, device, world: int, params: int) -> str:
    """What this run will do, in one line at its start: device, drafter shape, batch and schedule."""
    windows = sorted({w for w in (dcfg.sliding_window or [None])}, key=lambda w: (w is None, w or 0))
    kind = ", ".join("full" if w is None else f"window {w}" for w in windows)
    steps = f"{cfg.steps} steps" if cfg.steps is not None else f"{cfg.epochs} epochs"
    return (f"training on {device} x {world}: drafter {dcfg.num_layers} layers ({kind}), {dcfg.num_heads} heads x "
            f"{dcfg.head_dim}, {dcfg.num_kv_heads} KV heads, FFN {dcfg.intermediate_size}, {params / 1e6:.1f}M "
            f"trainable parameters, block {dcfg.block_size}, taps {dcfg.target_layers}; {cfg.max_tokens:,} tokens "
            f"per batch and rank, {cfg.anchors} anchors per sequence, {steps}, lr {cfg.lr:g}, attention "
            f"{dcfg.attn_impl}")


class StopOnInterrupt:
    """Ctrl-C (SIGINT) or SIGTERM stops training at a step boundary, after a checkpoint, instead of losing every
    step since the last save; a second Ctrl-C, a few seconds after the first, stops at once.

    Under torchrun every rank gets the signal (from the terminal, and again from the launcher, which forwards it
    and kills the ranks 30 s later), but not at the same step: ``requested`` is this rank's wish, and ``agreed`` is
    set by the step's lockstep all-reduce when any rank asked, so all of them stop after the same step and write
    the checkpoint together."""

    REPEAT_S = 3.0  # a repeat within this time is the same request (torchrun forwards the terminal's signal)

    def __init__(self, enabled: bool = True):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.requested = False
        self.agreed = False
        self._first = 0.0
        self._previous: dict = {}

    def _handle(self, signum, frame):
        now = time.monotonic()
        if self.requested:
            if signum == signal.SIGINT and now - self._first > self.REPEAT_S:
                raise KeyboardInterrupt
            return
        self.requested, self._first = True, now
        log.warning("%s: stopping after this step, with a checkpoint (Ctrl-C again to stop at once)",
                    signal.Signals(signum).name)

    def __enter__(self) -> "StopOnInterrupt":
        if self.enabled:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def stopping(self, world: int) -> bool:
        """Stop after this step? One process: when asked; DDP: when the ranks agreed at this step's all-reduce."""
        return self.requested if world == 1 else self.agreed


def train_step(model, drafter, opt, sched, batch, clip: float, amp):
    """One optimizer step: loss (under autocast on CUDA) -> backward -> clip -> AdamW -> schedule."""
    with amp:
        loss, metrics = model(batch)
    loss.backward()
    grad_norm = clip_grad(drafter, clip)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach(), metrics, grad_norm


@dataclass(kw_only=True)
class Checkpointer:
    """What every checkpoint of one run writes besides its position: set up once, then ``save`` per checkpoint."""

    out: Path
    drafter: DFlashDrafter
    opt: Any
    sched: Any
    cfg: TrainConfig
    config_json: dict[str, Any]  # the run's settings as saved (no storage options: they may hold secrets)
    extra: dict[str, Any]  # target, taps, tokenizer: written into the drafter's meta
    device: torch.device
    rank: int
    world: int

    def save(self, step: int, epoch: int, loader_state, best: dict[str, Any] | None = None) -> None:
        """All ranks write their loader/RNG files into a staging dir; rank 0 the rest, then publishes it (and
        points OUT/checkpoints/best at it when ``best``, its validation metrics, is given)."""
        rank, world = self.rank, self.world
        tmp, final = ckpt.staging_dir(self.out, step), ckpt.checkpoint_dir(self.out, step)
        if rank == 0:
            tmp.mkdir(parents=True, exist_ok=True)
        if world > 1:
            dist.barrier()
        with checkpoint_errors(tmp, step):
            ckpt.write_rank_files(tmp, rank, loader_state, self.device)
        if world > 1:
            dist.barrier()
        if rank == 0:
            with checkpoint_errors(tmp, step):
                ckpt.write_main_files(tmp, self.drafter, self.opt, self.sched, step=step, epoch=epoch,
                                      config=self.config_json, world=[world, self.cfg.workers], extra=self.extra)
                ckpt.publish(tmp, final, self.cfg.keep, best)
        if world > 1:
            dist.barrier()


@contextmanager
def checkpoint_errors(tmp: Path, step: int):
    """A checkpoint that cannot be written (a full disk above all: safetensors raises its own ``SafetensorError``)
    as one ``OSError`` line saying so; the checkpoints published before stay as they were (a resume uses them)."""
    try:
        yield
    except Exception as e:
        text = f"{type(e).__name__}: {e}"
        full = isinstance(e, OSError) and e.errno == errno.ENOSPC or "No space left" in text or "StorageFull" in text
        why = "the disk is full" if full else text
        raise OSError(errno.ENOSPC if full else errno.EIO,
                      f"checkpoint of step {step} could not be written to {tmp}: {why}; the checkpoints published "
                      "before are kept (free space, then run the same command again to resume)") from e


def recordable_config(cfg: TrainConfig) -> dict[str, Any]:
    """The training config as ``train_config.json`` and every checkpoint's ``trainer.json`` record it: no storage
    options (they may hold secrets) and store URLs in their recordable form (no ``user:password@``)."""
    d = {**dataclasses.asdict(cfg), "storage_options": None}
    for key in ("stores", "val_stores"):
        if d.get(key):
            d[key] = [recordable_url(u) for u in d[key]]
    return d


def resume(path: Path, cfg: TrainConfig, drafter, opt, sched, source, device, rank: int, world: int):
    """Restore from ``path``; returns (step, epoch). Refuses settings that would not continue the same run."""
    saved = ckpt.read_trainer_state(path)
    now = recordable_config(cfg)  # as it was saved
    before = {k: saved["config"].get(k, LEGACY_RESUME_VALUES.get(k)) for k in RESUME_KEYS}
    diffs = [f"{k}: {before[k]!r} -> {now[k]!r}" for k in RESUME_KEYS if before[k] != now[k]]
    saved_cfg, _ = ckpt.read_drafter_config(path)
    mine = dataclasses.replace(drafter.config, attn_impl=saved_cfg.attn_impl)
    diffs += [f"drafter {f.name}: {getattr(saved_cfg, f.name)!r} -> {getattr(mine, f.name)!r}"
              for f in dataclasses.fields(mine) if getattr(saved_cfg, f.name) != getattr(mine, f.name)]
    if diffs:
        raise ValueError(f"{cfg.out} holds a run with other settings ({'; '.join(diffs)}): use another --out, "
                         "or --no-resume to start over")
    state = ckpt.restore(path, drafter, opt, sched, device, rank)
    states = ckpt.loader_states(path)
    if saved["world"] == [world, cfg.workers] and rank in states:
        if states[rank] is not None:
            source.load_state_dict(states[rank])
    elif any(s is not None for s in states.values()):
        log.info("resuming a run of %s rank(s) x workers on %d x %d: re-cutting the rest of the epoch",
                 saved["world"], world, cfg.workers)
        source.load_merged([s for s in states.values() if s is not None])
    return int(state["step"]), int(state["epoch"])
