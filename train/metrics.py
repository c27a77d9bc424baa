"""What OUT/metrics.jsonl says: the sums of a logging interval over every rank, and the best checkpoint.

One line per logged step: step, epoch, loss (weighted CE over all ranks), acc, acc_k (draft positions
1..S-1), tau (teacher-forced acceptance estimate on the training anchors), lr, grad_norm, tokens,
tokens_per_s, samples, wait_frac (share of the time spent waiting for data), interval_steps and
interval_seconds (the steps the line covers, ending at ``step``, and their wall time: the lines of a run sum to
its steps, tokens and step time, a Ctrl-C logging the steps since the last line), gpu_mem_gib on CUDA. With
validation stores, every ``val_every`` steps and at the end the line also has val_loss, val_acc, val_tau,
val_acceptance (per draft position), val_anchors, val_seconds (``evaluate.py``).
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hsstore.io import door, sinks
from hsstore.ops.html_report import metrics_row

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"

# the interval's sums, in the order of the one float64 vector a DDP run all-reduces; after them come
# the hits and the label counts of each draft position 1..S-1
SUMS = ("ce_sum",  # sum(w * CE), not the loss: under DDP the loss is scaled for the gradient (DraftLoss)
        "weight_sum", "tau_sum", "anchors", "steps", "tokens", "samples")


class Meter:
    """Sums over a logging interval; ``summary`` all-reduces them so the line covers every rank."""

    def __init__(self, S: int):
        self.S = S
        self.reset()

    def reset(self):
        self.sums = dict.fromkeys(SUMS, 0.0)
        # ce_sum, weight_sum, tau_sum, then the hits of each draft position: summed where the step's metrics
        # are (on the GPU, without waiting for it), read once per interval in ``reduced``
        self.on_device: torch.Tensor | None = None
        self.counts = torch.zeros(self.S - 1, dtype=torch.float64)  # labels per position
        self.t0, self.wait = time.perf_counter(), 0.0

    def add(self, metrics: dict, label_counts, tokens: int, samples: int, anchors: int, steps: int = 1):
        """One batch of ``steps`` optimizer steps (0 for a step's later micro-batches): ``label_counts``,
        ``tokens``, ``samples`` and ``anchors`` (real ones) are the batch's, known on the CPU (``add_anchors``);
        ``metrics`` are the loss's tensors, never read here."""
        self.sums["steps"] += steps  # an empty step still counts
        if label_counts is None or sum(label_counts) == 0:
            return
        for k, v in (("anchors", anchors), ("tokens", tokens), ("samples", samples)):
            self.sums[k] += v
        self.counts += torch.tensor(label_counts, dtype=torch.float64)
        step = torch.cat([torch.stack([metrics["ce_sum"].double(), metrics["weight_sum"].double(),
                                       metrics["tau"].double() * anchors]), metrics["hits_k"].double()])
        self.on_device = step if self.on_device is None else self.on_device + step

    def reduced(self, world: int, group) -> tuple[dict[str, float], torch.Tensor, torch.Tensor]:
        """(sums, hits, counts) over every rank: one all-reduce of the vector [SUMS | hits | counts]."""
        S1 = self.S - 1
        dev = torch.zeros(3 + S1, dtype=torch.float64) if self.on_device is None else self.on_device.cpu()
        sums = {**self.sums, "ce_sum": float(dev[0]), "weight_sum": float(dev[1]), "tau_sum": float(dev[2])}
        v = torch.cat([torch.tensor([sums[k] for k in SUMS], dtype=torch.float64), dev[3:], self.counts])
        if world > 1:
            dist.all_reduce(v, group=group)
        n = len(SUMS)
        return dict(zip(SUMS, v[:n].tolist())), v[n:n + S1], v[n + S1:]

    def summary(self, world: int, group) -> dict[str, Any]:
        s, hits, counts = self.reduced(world, group)
        dt = time.perf_counter() - self.t0
        nan = float("nan")
        acc_k = [float(h / c) if c > 0 else nan for h, c in zip(hits, counts)]
        return {"loss": s["ce_sum"] / s["weight_sum"] if s["weight_sum"] > 0 else nan,
                "acc": float(hits.sum() / counts.sum()) if counts.sum() > 0 else nan,
                "acc_k": acc_k, "tau": s["tau_sum"] / s["anchors"] if s["anchors"] > 0 else nan,
                "tokens": int(s["tokens"]), "samples": int(s["samples"]),
                "tokens_per_s": s["tokens"] / dt if dt > 0 else nan, "wait_frac": self.wait / dt if dt > 0 else 0.0,
                "interval_steps": int(s["steps"]), "interval_seconds": dt}

    @property
    def pending(self) -> bool:
        """Steps taken since the last line (a line is due before stopping)."""
        return self.sums["steps"] > 0


def row_line(row: dict[str, Any], total: int) -> str:
    """A metrics row as one log line (what a batch job's log shows every --log-every steps, as HF Trainer logs its
    ``logging_steps``): step, loss, draft accuracy, teacher-forced tau, lr, gradient norm, tokens/s, validation."""
    def num(key: str, fmt: str) -> str:
        v = row.get(key)
        return "nan" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)

    line = (f"step {row['step']}/{total} (epoch {row['epoch']}): loss {num('loss', '.4f')}, acc {num('acc', '.3f')}, "
            f"tau {num('tau', '.2f')}, lr {num('lr', '.2e')}, grad_norm {num('grad_norm', '.3f')}, "
            f"{num('tokens_per_s', ',.0f')} tokens/s")
    if "val_loss" in row:
        line += f"; validation loss {num('val_loss', '.4f')}, tau {num('val_tau', '.2f')}"
    return line


SAMPLES_FILE = "samples.rank{:05d}.jsonl"  # OUT: the sample ids a rank trained, a line per step (--log-samples)
SAMPLES_NAME = re.compile(r"samples\.rank\d{5}\.jsonl")


class MetricsLog:
    """OUT/metrics.jsonl (rank 0) and the experiment trackers; ``samples`` also writes this rank's
    OUT/samples.rankNNNNN.jsonl (the sample ids of every step: what --log-samples asks for, and what a --follow
    run's end counts). A resumed run first drops the lines logged after its checkpoint (``truncate``): it logs them
    again."""

    def __init__(self, out: Path, rank: int, device: torch.device, samples: bool = False):
        self.rank, self.device, self.trackers = rank, device, None
        self.path = out / METRICS_FILE
        self.samples_path = out / SAMPLES_FILE.format(rank) if samples else None

    def truncate(self, step: int, epoch: int) -> None:
        """Lines after checkpoint ``step`` (of epoch ``epoch``) dropped, and those no step before it logged."""
        if self.rank == 0:
            truncate_jsonl(self.path, step, typed=True)
        if self.samples_path is not None:
            truncate_jsonl(self.samples_path, step, last_epoch=epoch)

    def row(self, row: dict[str, Any]) -> None:
        if self.device.type == "cuda":
            row["gpu_mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        if self.rank == 0:
            with sinks.open_append(self.path.parent, self.path.name) as f:  # a planted link refused, not followed
                f.write(json.dumps({k: json_safe(v) for k, v in row.items()}) + "\n")
            if self.trackers is not None:
                self.trackers.log(row, row["step"])

    def samples(self, step: int, epoch: int, batch: dict[str, Any]) -> None:
        if self.samples_path is not None:
            with sinks.open_append(self.samples_path.parent, self.samples_path.name) as f:
                f.write(json.dumps({"step": step, "epoch": epoch, "samples": list(batch["sample_id"])}) + "\n")

    def close(self, failed: bool = False) -> None:
        if self.trackers is not None:
            self.trackers.close(failed=failed)


class BestTracker:
    """Which checkpoint OUT/checkpoints/best names: the step with the highest val_tau so far (SpecForge's
    best-checkpoint metric is its acceptance-length estimate too), a tie going to the lower val_loss (tau counts
    whole accepted tokens and ties often on a small validation set; the loss still tells the two apart), an exact
    tie to the earlier step. A new best forces a checkpoint at its step."""

    KEYS = ("step", "val_tau", "val_loss", "val_acc", "val_anchors")

    def __init__(self, saved: dict[str, Any] | None):
        saved = saved or {}
        self.tau = finite(saved.get("val_tau"), -math.inf)
        self.loss = finite(saved.get("val_loss"), math.inf)
        self.pending: dict[str, Any] | None = None

    def better(self, tau: float, loss: float) -> bool:
        """Whether a validation of ``tau`` and ``loss`` beats the best so far."""
        return tau > self.tau or (tau == self.tau and loss < self.loss)

    def offer(self, step: int, row: dict[str, Any]) -> None:
        tau, loss = finite(row.get("val_tau"), None), finite(row.get("val_loss"), math.inf)
        if tau is not None and self.better(tau, loss):
            self.tau, self.loss = tau, loss
            self.pending = {k: json_safe(row[k]) if k != "step" else step for k in self.KEYS if k in row or
                            k == "step"}

    def take(self) -> dict[str, Any] | None:
        p, self.pending = self.pending, None
        return p


def finite(x: Any, default: Any) -> Any:
    """``x`` as a float when it is a finite number, else ``default`` (a metric that could not be computed)."""
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else default


def val_metrics(ev) -> dict[str, Any]:
    """The metrics.jsonl fields of a teacher-forced evaluation (``evaluate.StoreEval``)."""
    return {"val_loss": ev.loss, "val_acc": ev.acc, "val_tau": ev.tau, "val_acceptance": ev.acceptance,
            "val_anchors": ev.anchors, "val_seconds": ev.seconds}


def truncate_jsonl(path: Path, after_step: int, typed: bool = False, last_epoch: int | None = None) -> None:
    """Drop lines logged after ``after_step`` (a resumed run logs them again), and lines that are no log line of
    a step (torn by a crash mid-write, or not this project's; ``typed``: metrics rows whose fields are not all of
    their kinds, ``metrics_row``; ``last_epoch``: a samples log's lines that a run stopped at ``after_step`` in
    epoch ``last_epoch`` could not have written, ``samples_step``), with a warning. Read through the door (a regular
    file of bounded size, no link), rewritten in place of it (a link there replaced, never written through)."""
    if not door.is_file_beneath(path.parent, path.name):
        return
    try:
        text = door.read_beneath(path.parent, path.name, bound=door.RUN_LOG_CAP, where=str(path.parent))
    except door.Refused as e:
        raise ValueError(str(e)) from None
    keep, odd = [], 0
    for ln in text.decode("utf-8", "replace").splitlines():
        step = _step_of(ln, typed, last_epoch)
        if step is None:
            odd += bool(ln.strip())
        elif step <= after_step:
            keep.append(ln)
    if odd:
        log.warning("%s: %d line(s) that are not a step's log line dropped", path, odd)
    sinks.write_atomic(path.parent, path.name, "".join(ln + "\n" for ln in keep).encode(), what=f"rewriting {path}")


def _step_of(line: str, typed: bool, last_epoch: int | None = None) -> int | None:
    """The step of a log line (``typed``: of a metrics row whose fields are all of their kinds; ``last_epoch``: of
    a samples log line, ``samples_step``); None for any other line."""
    try:
        row = door.load_json(line, "log line", error=ValueError)
        if last_epoch is not None:
            return samples_step(row, last_epoch)
        step = metrics_row(row, "log line")["step"] if typed else row.get("step")
    except (ValueError, AttributeError):
        return None
    return step if type(step) is int else None


def samples_step(row: Any, last_epoch: float) -> int | None:
    """The step of a samples log line (``MetricsLog.samples``) that a run in epoch ``last_epoch`` or before could
    have written: a step from 1 (a step repeats where --grad-accum logs a line per micro-batch), an epoch in
    0..``last_epoch``, a list of sample ids; None for any other line (a forged one would be counted as trained)."""
    if not isinstance(row, dict):
        return None
    step, epoch, ids = row.get("step"), row.get("epoch"), row.get("samples")
    if (type(step) is int and step >= 1 and type(epoch) is int and 0 <= epoch <= last_epoch
            and isinstance(ids, list) and all(isinstance(i, str) for i in ids)):
        return step
    return None


def json_safe(x):
    """NaN and infinities as null (JSON has neither)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, list):
        return [json_safe(v) for v in x]
    return x
