"""``hsstore train``: the DFlash drafter trained from hidden-state stores alone.

Everything the trainer needs is in the store: the features, the tokens and loss masks, and (as
assets) the target's config, embedding and lm_head. It never opens the target's weights, so a team can
train on a machine that has only the store.

``train`` reads top to bottom: set up the process -> build the drafter from the store -> the data ->
resume if OUT has a checkpoint -> for each epoch, for each token-budget batch (``--grad-accum`` of them per step):
loss -> backward -> clip -> AdamW -> cosine schedule -> log -> checkpoint -> the drafter. The pieces, one module each:

    config.py      the settings (TrainSettings, by section), RESUME_KEYS
    launch.py      rank, device, process group, CPU threads
    build.py       the drafter from the store (frozen head, config, --init) and its loss module (DraftLoss)
    data.py        token-budget batches, anchors, read-ahead, DDP lockstep
    objective.py   the loss;  optim.py: AdamW + schedule;  masks.py: attention masks (model.py)
    metrics.py     metrics.jsonl: the interval's sums over all ranks, the best checkpoint
    evaluate.py    teacher-forced validation (--val-store)
    interrupt.py   Ctrl-C / SIGTERM: stop at a step boundary with a checkpoint
    checkpoint.py  checkpoints, resume, the exported drafter;  rundir.py: OUT's own files

Choices worth knowing:
* **Precision**: fp32 master weights and optimizer; on CUDA the step runs under bf16 autocast and the
  frozen head stays in its stored dtype; on CPU everything is fp32 (so tests can compare exactly).
* **DDP** (``torchrun``): each rank reads its own share of the store (the loader's rank split); ranks run in
  lockstep (``data.lockstep``) so every sample is seen once per epoch. The loss is normalised over all ranks'
  batches (``build.DraftLoss``), so the step is the one a single process would take on their union.
* **metrics.jsonl**: see ``metrics.py``.
"""

from __future__ import annotations

import logging
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hsstore.io.backends import backend_for
from hsstore.format import codec, encodings, names
from hsstore.loader.follow import FollowStopped, poll_seconds
from hsstore.progress import is_terminal
from hsstore.redaction import recordable_url
from hsstore.store.reader import open_shared

from . import checkpoint as ckpt
from . import rundir, tracking
from .budget import with_device_defaults
from .build import (DraftLoss, build_drafter, check_healthy, drafter_meta, serving_warnings, settings_line,
                    wrap_ddp)
from .checkpoint import Checkpointer
from .settings import TrainSettings, recordable_config
from .data import Proposal, StoreBatches, add_anchors, empty_batch, lockstep, read_ahead
from .follow import FollowSchedule, Following, Tally, arrival_columns, wait_for_stores
from .evaluate import Validation, check_val_stores, eval_source
from .interrupt import StopOnInterrupt
from .launch import init_distributed, share_cpu_threads
from .metrics import BestTracker, Meter, MetricsLog, row_line
from .objective import default_gamma
from .optim import build_scheduler, clip_grad, set_total_steps
from .sharding import planned_optimizer

log = logging.getLogger(__name__)

# torch threads of the read-ahead thread (and the loader threads it starts) on a GPU: one keeps them off the
# cores of the thread that launches the step's kernels, whose launch rate is higher for it, while the loader-fed
# step keeps pace with the resident one either way (docs/PERFORMANCE.md, "Training step").
GPU_READ_AHEAD_THREADS = 1


@dataclass
class TrainResult:
    steps: int
    epochs_done: int
    seconds: float
    drafter_dir: Path | None
    last: dict[str, Any]
    resumed_from: Path | None = None
    start_step: int = 0  # the step this run started at (0, or the resumed checkpoint's)
    tokens: int = 0  # trained by this run: the sum of its metrics.jsonl lines' tokens (all ranks)
    step_seconds: float = 0.0  # wall time of this run's steps: the sum of its lines' interval_seconds
    followed: Tally | None = None  # --follow, rank 0: what epoch 0 trained against what the stores hold at the end

    @property
    def tokens_per_s(self) -> float:
        """This run's throughput: its tokens over its steps' wall time (what metrics.jsonl sums to)."""
        return self.tokens / self.step_seconds if self.step_seconds > 0 else 0.0

    @property
    def steps_this_run(self) -> int:
        return self.steps - self.start_step


def train(settings: TrainSettings, source=None, flags: dict[str, Any] | None = None) -> TrainResult:
    """Train (or resume) a drafter; ``source`` replaces the store batches (tests feed online features);
    ``flags`` (the command's flags by section, ``hsstore.app.config.flag_values``) go into OUT/run.yaml."""
    t_start = time.perf_counter()
    tracking.check_available(settings.output.report_to or [])  # before any work: a missing package is one line
    rank, world, device, group = init_distributed(settings.run.device)
    settings = with_device_defaults(settings, device)
    out = rundir.prepare(settings.run.out, rank)
    point = continues_from(out, settings)  # the checkpoint this run continues from (None: from step 0)

    # -- the drafter, from the store alone; opened once per job: under DDP rank 0 reads the records and
    # broadcasts them, and the loader reuses these (--follow: once each store has its first shard)
    follow = settings.data.follow and source is None
    if follow:
        wait_for_stores(settings.run.store, settings.storage.storage_options, poll_seconds())
    stores = [open_shared(u, settings.storage.storage_options) for u in settings.run.store]
    check_healthy(stores, settings.health.allow_unhealthy)  # a store of zeros or NaNs trains nothing: refused first
    if rank == 0:  # a drafter tap an engine cannot serve is named now, not at serving time
        for line in serving_warnings(stores[0].manifest.layers, stores[0].manifest.target.num_layers):
            log.warning("drafter %s", line)
    drafter, settings = build_drafter(stores, settings, device, rank)
    share_cpu_threads(settings.data.cpu_threads, device, sum(p.numel() for p in drafter.parameters()))
    schedule = settings.schedule
    gamma = schedule.gamma if schedule.gamma is not None else default_gamma(drafter.config.block_size)
    model = wrap_ddp(DraftLoss(drafter, gamma, schedule.ce_chunk, world, schedule.ce_impl), world, device)
    opt = planned_optimizer(drafter, schedule, settings.memory.shard_optimizer, world)
    if rank == 0:
        log.info("%s", settings_line(drafter.config, settings, device, world, drafter.num_trainable_parameters()))

    # -- the data: this rank's share of the stores, in token-budget batches (--follow: epoch 0 from the journal
    # that rank 0's leader writes as shards commit; the length estimated until epoch 0 ends)
    following = Following.start(out, stores, settings, rank, world) if follow else None
    if source is None:
        source = store_batches(stores, drafter.config.target_layers, settings, rank, world, device,
                               follow=following.options if following else None)
    length = following.schedule(source, settings) if following and settings.run.steps is None else None
    total = (settings.run.steps if settings.run.steps is not None else
             length.agreed_start(rank, world, group) if length is not None else
             source.planned_steps(settings.run.epochs, grad_accum=schedule.grad_accum))
    sched = build_scheduler(opt, total, schedule.warmup, schedule.min_lr_ratio)

    # -- resume, and what the run logs
    checkpoints = Checkpointer(out=out, drafter=drafter, opt=opt, sched=sched, settings=settings,
                               config_json=recordable_config(settings), extra=drafter_meta(stores[0].manifest),
                               device=device, rank=rank, world=world)
    step, epoch, resumed = checkpoints.resume_at(point, source)
    best = best_tracker(out, resumed=resumed is not None, rank=rank)
    validation = validation_for(settings, stores[0].manifest, drafter, gamma, device, rank, world, group)
    metrics = MetricsLog(out, rank, device, settings.output.log_samples or following is not None)
    metrics.truncate(step, epoch)
    if following is not None:
        following.resumed_at(step, epoch, rank, world)
    if rank == 0:
        rundir.record(out, checkpoints.config_json, flags, stores, device, resumed)
        if settings.output.report_to:
            metrics.trackers = tracking.Trackers(settings.output.report_to, out, flags or checkpoints.config_json)

    # -- the loop
    loop = Loop(settings=settings, model=model, drafter=drafter, opt=opt, sched=sched, source=source, gamma=gamma,
                device=device, world=world, group=group, total=total, step=step, epoch=epoch,
                checkpoints=checkpoints, metrics=metrics, best=best, validation=validation,
                stored_dtype=codec.TORCH_DTYPE[stores[0].manifest.dtype], manifest=stores[0].manifest, length=length,
                journal=following.journal if following else None)
    try:
        with StopOnInterrupt() as interrupt:
            loop.run(interrupt)
    finally:
        if following is not None:
            following.stop()
    if interrupt.stopping(world):
        loop.stop()  # raises KeyboardInterrupt, after a checkpoint
    loop.finish()

    drafter_dir = final_drafter(out, drafter, checkpoints.extra, metrics) if rank == 0 else None
    followed = following.tally(settings, rank, world) if following is not None else None
    if world > 1:
        dist.barrier()
    return TrainResult(loop.step, loop.epoch, time.perf_counter() - t_start, drafter_dir, loop.last, point, step,
                       loop.run_tokens, loop.run_seconds, followed)


def final_drafter(out: Path, drafter, extra: dict, metrics: MetricsLog) -> Path:
    """Rank 0's end of a run: the drafter directory of the last step written, the metrics log closed."""
    drafter_dir = ckpt.save_final_drafter(out, drafter, extra)
    metrics.close()
    return drafter_dir


def continues_from(out: Path, settings: TrainSettings) -> Path | None:
    """The checkpoint this run continues from (``checkpoint.resume_point``; None: from step 0), once the user has
    repeated what the run's record names of where it read (before any store is opened: a run folder from elsewhere
    chooses nothing)."""
    point = ckpt.resume_point(out, settings)
    if point is not None:
        rundir.check_authority(out, settings.storage.storage_options, names.allowed())
    return point


def store_batches(stores, layers, settings: TrainSettings, rank: int, world: int, device: torch.device,
                  follow=None) -> StoreBatches:
    """This rank's share of the stores (their ``layers``), in token-budget batches (``follow``: the loader's
    ``Follow`` options of a --follow run)."""
    data = settings.data
    if data.workers and device.type == "cpu" and rank == 0:
        # measured on 2 cores (docs/PERFORMANCE.md): worker processes take the cores the step computes on
        log.warning("--workers %d on a CPU: the loader's worker processes take the cores the step computes on (a CPU "
                    "run is usually slower with them); --workers 0, the default, reads in the trainer's process",
                    data.workers)
    remote = [s.url for s in stores if not backend_for(s.fs).local_paths]
    if remote and data.workers == 0 and device.type == "cuda" and rank == 0:
        # the S3 client's Python shares the GIL with the thread that launches the step's kernels; in workers it
        # does not (docs/PERFORMANCE.md, "Reading from S3")
        log.info("reading %s in the trainer's process: for a remote store, --workers 2 (needs torchdata) keeps "
                 "the S3 client off the thread that launches the step", recordable_url(remote[0]))
    return StoreBatches(stores, layers=layers, token_budget=settings.batch.token_budget, seed=settings.schedule.seed,
                        rank=rank, world_size=world, workers=data.workers, weights=data.weight,
                        storage_options=settings.storage.storage_options, cache_dir=data.cache_dir,
                        pin_memory=device.type == "cuda", partition=data.partition, cache_bytes=data.cache_bytes,
                        follow=follow)


def validation_for(settings: TrainSettings, manifest, drafter, gamma: float, device: torch.device, rank: int,
                   world: int, group) -> Validation | None:
    """``--val-store``: the evaluation during training, over this rank's share of the validation stores
    (refused first unless they come from the training store's target and tokenizer)."""
    val, options = settings.validation, settings.storage.storage_options
    if not val.val_store:
        return None
    check_val_stores(manifest, val.val_store, options)
    source = eval_source(val.val_store, drafter.config.target_layers, settings.batch.token_budget, rank, world,
                         options, settings.data.cache_dir, pin_memory=device.type == "cuda")
    return Validation(drafter, source, val.val_every or settings.output.save_every, device, gamma,
                      settings.batch.anchors, settings.schedule.ce_chunk, world, group, settings.data.prefetch)


def best_tracker(out: Path, resumed: bool, rank: int) -> BestTracker:
    """The best checkpoint so far: a resumed run's, or none (a run starting over drops an old pointer)."""
    if resumed:
        return BestTracker(ckpt.read_best(out))
    if rank == 0 and ckpt.read_best(out) is not None:  # starting over: not this run's best
        ckpt.best_path(out).unlink()
    return BestTracker(None)


def train_step(model, drafter, opt, sched, window: list[dict], clip: float, amp):
    """One optimizer step over a window of micro-batches (``--grad-accum``; one batch without it): for each, loss
    (under autocast on CUDA) -> backward, gradients adding up (under DDP synchronised at the last one only) ->
    clip -> AdamW -> schedule. Returns the last loss, each micro-batch's metrics, the gradient norm."""
    metrics = []
    for i, batch in enumerate(window):
        last = i == len(window) - 1
        with nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync():
            with amp:
                loss, m = model(batch)
            loss.backward()
        metrics.append(m)
    grad_norm = clip_grad(drafter, clip)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach(), metrics, grad_norm


def window_weights(window: list[dict]) -> list[dict]:
    """The micro-batches of one step, each normalised by the loss weights of all of them (over every rank): the
    step's loss is the weighted mean over every anchor of the window, as one batch of their union would have it
    (Hugging Face Trainer's ``num_items_in_batch``), not the mean of the micro-batches' means."""
    if len(window) == 1:
        return window
    total = sum(float(b.get("global_weight_sum") or 0.0) for b in window)
    return [{**b, "global_weight_sum": total} for b in window] if total > 0 else window


@dataclass(kw_only=True)
class Loop:
    """The epochs and steps of one run, from ``step``/``epoch`` (a resumed run's) to ``total`` steps (or the
    configured epochs): what changes as it runs is here (``step``, ``epoch``, the loader position, the
    interval's ``meter``, the ``last`` metrics row)."""

    settings: TrainSettings
    model: torch.nn.Module  # DraftLoss, in DDP under torchrun
    drafter: Any
    opt: Any
    sched: Any
    source: Any
    gamma: float
    device: torch.device
    world: int
    group: Any
    total: int
    step: int
    epoch: int
    checkpoints: Checkpointer
    metrics: MetricsLog
    best: BestTracker
    validation: Validation | None
    stored_dtype: torch.dtype  # what encoded features decode into, as Store.read does
    manifest: Any = None  # the store's: its encoding and hidden size, for that decoding
    length: FollowSchedule | None = None  # --follow without --steps: the run's length, estimated until epoch 0 ends
    journal: Any = None  # --follow: the epoch-0 journal (what had arrived goes into metrics rows)

    def __post_init__(self):
        from hsstore.progress import progress_bar

        settings, dev = self.settings, self.device
        self.val_step = self.step  # the step of the last evaluation
        self.start_step = self.step  # this run's first step is the next one (a resumed run's too)
        self.loader_state = None
        self.last: dict[str, Any] = {}
        self.run_tokens, self.run_seconds = 0, 0.0  # this run's lines, summed
        self.lr = self.grad_norm = None  # the last step's, for its line
        self.meter = Meter(self.drafter.config.block_size)
        self.proposal = Proposal(lead=self.checkpoints.rank == 0) if self.length is not None else None
        self.amp = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else nullcontext()
        self.feat_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        self.bar = progress_bar(total=self.total, initial=self.step, desc="train", unit="step", dynamic_ncols=True,
                                disable=self.checkpoints.rank != 0 or not settings.output.progress)

    def run(self, interrupt: StopOnInterrupt) -> None:
        """Epochs until ``total`` steps (or the configured epochs), or until interrupted."""
        epochs_limit = self.settings.run.epochs if self.settings.run.steps is None else math.inf
        while self.step < self.total and self.epoch < epochs_limit:
            try:
                finished = self.run_epoch(interrupt)
            except FollowStopped:  # every rank stopped at this step: keep it, then say why (one line)
                self.halt()
                raise FollowStopped(self.journal.outcome().why) from None  # (a worker's is wrapped in its traceback)
            if finished and self.epoch == 0 and self.length is not None:
                self.retotal(self.length.total())  # exact now, and the same on every rank (the journal says it)
            if finished:
                self.epoch += 1
            if interrupt.stopping(self.world):
                break

    def run_epoch(self, interrupt: StopOnInterrupt) -> bool:
        """One pass over this rank's share (lockstep with the others); True when it ran to the epoch's end."""
        settings, epoch = self.settings, self.epoch
        self.source.set_epoch(epoch)

        def prepare(batch):
            return add_anchors(batch, settings.schedule.seed, epoch, settings.batch.anchors,
                               self.drafter.config.block_size, self.gamma, self.drafter.key_lengths)

        threads = GPU_READ_AHEAD_THREADS if self.device.type == "cuda" else None
        stream = lockstep(read_ahead(self.source, prepare, self.device, settings.data.prefetch, threads=threads,
                                     decode=self.decode),
                          self.world, self.group, interrupt, self.proposal)
        finished, window = True, []
        t_wait = time.perf_counter()
        for batch, state in stream:
            self.meter.wait += time.perf_counter() - t_wait
            self.loader_state = state if state is not None else self.loader_state
            if self.proposal is not None:  # the length rank 0 proposed, taken at this step by every rank
                if self.proposal.agreed is not None and int(self.proposal.agreed) != self.total:
                    self.retotal(self.proposal.agreed)
                self.proposal.value = float(self.length.total()) if self.proposal.lead else None
            window.append(batch)
            if len(window) < settings.schedule.grad_accum:
                t_wait = time.perf_counter()
                continue
            self.train_on(window)
            window = []
            # the planned steps done, or Ctrl-C: stop here, at a step boundary, with a checkpoint
            if (settings.run.steps is not None and self.step >= self.total) or interrupt.stopping(self.world):
                finished = False
                break
            t_wait = time.perf_counter()
        stream.close()
        if window:  # the epoch's last micro-batches, fewer than --grad-accum: a step of their own
            self.train_on(window)
        return finished

    def decode(self, batch: dict) -> dict:
        """An encoded store's batch decoded into the dtype its features were computed in, on the batch's device."""
        m = self.manifest
        return encodings.decode_batch(batch, m.encoding, m.hidden_size, self.stored_dtype) if m is not None else batch

    def train_on(self, window: list) -> None:
        """One step on a window of micro-batches, then its bookkeeping: metrics row, validation, checkpoint when
        due."""
        settings, dcfg = self.settings, self.drafter.config
        # None: this rank's share of the epoch is done, others' is not; an encoded store's batches are decoded on the
        # read-ahead already (the stored bytes crossed to the device), a batch made here is not
        window = window_weights([self.decode(empty_batch(dcfg.num_taps, dcfg.hidden_size, self.feat_dtype, self.device)
                                             if b is None else b) for b in window])
        lr = self.opt.param_groups[0]["lr"]  # the rate this step uses
        t0 = time.perf_counter()
        _, ms, grad_norm = train_step(self.model, self.drafter, self.opt, self.sched, window, settings.schedule.clip,
                                      self.amp)
        self.step += 1
        step = self.step
        if step == self.start_step + 1:
            self.say_cost(time.perf_counter() - t0)
        for i, (batch, m) in enumerate(zip(window, ms)):
            self.meter.add(m, batch["label_counts"], batch["tokens"], len(batch["sample_id"]), batch["num_anchors"],
                           steps=int(i == 0))
            self.metrics.samples(step, self.epoch, batch)
        val_due = self.validation is not None and self.validation.due(step, self.total)
        self.lr, self.grad_norm = lr, grad_norm  # the norm stays on the device until a line reads it
        if step % settings.output.log_every == 0 or step == self.total or val_due:
            self.log_row(val_due)
        self.bar.update(1)
        if step % settings.output.save_every == 0 or step == self.total or self.best.pending:
            self.checkpoints.save(step, self.epoch, self.loader_state, self.best.take())

    def say_cost(self, seconds: float) -> None:
        """On a CPU, after this run's first step: what the run will cost at that pace and the flags that cut it (the
        defaults are the published recipe's drafter, sized for a GPU; with -q nothing else would say so)."""
        if self.device.type != "cpu" or self.checkpoints.rank != 0:
            return
        left = self.total - self.step
        log.info("step %d took %.1fs on the CPU: the %d step(s) left take about %s (h:mm:ss) at that pace; a CPU "
                 "step's work follows the anchors (--anchors, now %d) and the draft layers (--draft-layers, now %d): "
                 "fewer of them cut it, --steps N cuts the run", self.step, seconds, left,
                 timedelta(seconds=round(left * seconds)), self.settings.batch.anchors, self.drafter.config.num_layers)

    def log_row(self, val_due: bool = False) -> None:
        """The metrics line of the steps since the last one (with an evaluation when due)."""
        step = self.step
        row = {"step": step, "epoch": self.epoch, **self.meter.summary(self.world, self.group), "lr": self.lr,
               "grad_norm": None if self.grad_norm is None else float(self.grad_norm)}
        if self.journal is not None:  # --follow: what had arrived, beside the loss
            row.update(arrival_columns(self.journal))
        if val_due:
            row.update(self.validation.run(step))
            self.val_step = step
            self.best.offer(step, row)
        self.meter.reset()  # after the evaluation: its time is not the next interval's
        self.run_tokens += row["tokens"]
        self.run_seconds += row["interval_seconds"]
        self.last = row
        self.metrics.row(row)
        if self.checkpoints.rank == 0 and (self.bar.disable or not is_terminal()):  # no bar on a terminal shows it
            log.info("%s", row_line(row, self.total))
        self.bar.set_postfix(loss=f"{row['loss']:.3f}", acc=f"{row['acc']:.3f}", tok_s=f"{row['tokens_per_s']:.0f}",
                             refresh=False)

    def retotal(self, total: float) -> None:
        """The run's length changed (``FollowSchedule``): the schedule and the progress bar follow it."""
        total = max(int(total), self.step)
        if total == self.total:
            return
        if self.checkpoints.rank == 0:
            log.info("--follow: the run is now planned at %d steps (was %d)", total, self.total)
        schedule = self.settings.schedule
        set_total_steps(self.sched, total, schedule.warmup, schedule.min_lr_ratio)
        self.total = self.bar.total = total
        self.bar.refresh()

    def halt(self) -> None:
        """A followed store's arrival stopped epoch 0: a checkpoint at this step (unless it has one)."""
        if self.meter.pending:
            self.log_row()
        self.bar.close()
        if self.step % self.settings.output.save_every and self.step != self.total:
            self.checkpoints.save(self.step, self.epoch, self.loader_state)
        self.metrics.close(failed=True)

    def stop(self) -> None:
        """After Ctrl-C: the steps since the last metrics line logged, a checkpoint at this step (unless it has one),
        then KeyboardInterrupt."""
        if self.meter.pending:  # else a resumed run's first line would cover only its own steps of the interval
            self.log_row()
        self.bar.close()
        if self.step % self.settings.output.save_every and self.step != self.total:  # not saved at this step yet
            self.checkpoints.save(self.step, self.epoch, self.loader_state)
        log.warning("stopped at step %d: checkpoint %s; re-run the same command to resume", self.step,
                    ckpt.checkpoint_dir(self.checkpoints.out, self.step))
        self.metrics.close(failed=True)
        raise KeyboardInterrupt

    def finish(self) -> None:
        """The epochs ended: a last evaluation and checkpoint unless the last step had them."""
        step = self.step
        if (self.validation is not None and self.val_step != step) or self.meter.pending:
            self.log_row(val_due=self.validation is not None and self.val_step != step)  # the epochs ended early
        self.bar.close()
        if (step % self.settings.output.save_every and step != self.total) or self.best.pending:
            self.checkpoints.save(step, self.epoch, self.loader_state, self.best.take())


# names that lived here before train/ was split by concept and that this module no longer uses itself: they
# keep working, with a warning, for a release (the ones it imports, e.g. Meter or DraftLoss, import as before)
