"""``hsstore train --follow``: the trainer's side of training while the stores are written (``hsstore.loader.follow``).

Before step 1 each store must hold a manifest, the assets the drafter is built from and one committed shard, so
the trainer waits for those (saying what it waits for). Rank 0 keeps the journal in OUT/follow and runs the
leader in its own process; every rank and loader worker plans epoch 0 from the journal. Until epoch 0 ends the
schedule's length is an estimate (the steps of what joined, scaled by the tokens the writers plan), exact from
then on; rank 0's estimate reaches every rank through the step's lockstep all-reduce (``data.Proposal``), so all
ranks use one learning rate. metrics.jsonl rows carry what had arrived beside the loss.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from hsstore.io import door, storage
from hsstore.format import assets, commit
from hsstore.loader.batching import TokenBudget
from hsstore.loader.follow import Follow, Journal, Leader
from hsstore.redaction import recordable_url
from hsstore.terminal import escape

from .metrics import SAMPLES_FILE, SAMPLES_NAME, samples_step, truncate_jsonl

log = logging.getLogger(__name__)

JOURNAL_DIR = "follow"  # OUT/follow: the epoch-0 journal of a --follow run
SHOWN_IDS = 3  # sample ids a line names of those trained twice or never
WAIT_REPORT_S = 30.0


def missing_parts(url: str, options: dict[str, Any] | None) -> str | None:
    """What store ``url`` lacks before a trainer can start on it (None: nothing)."""
    fs, root = storage.resolve(url, options)
    if not storage.store_exists(fs, root, url):
        return "its manifest (no writer has created the store yet)"
    if not assets.has_assets(fs, root, url):
        return "its assets (the target's config, embedding and head, written by extraction's rank 0)"
    if not commit.list_records(fs, root):
        return "its first committed shard"
    return None


def wait_for_stores(urls: Sequence[str], options: dict[str, Any] | None, poll_s: tuple[float, float]) -> None:
    """Block until every store can be trained on (``missing_parts``), polling with a backoff, saying what it waits
    for at once and every ``WAIT_REPORT_S``."""
    since, reported, delay = time.time(), -math.inf, poll_s[0]
    for url in urls:
        while (missing := missing_parts(url, options)) is not None:
            if time.time() - reported >= WAIT_REPORT_S:
                reported = time.time()
                log.info("--follow: waiting for store %r to have %s (since %s)", recordable_url(url), missing,
                         time.strftime("%H:%M:%S", time.localtime(since)))
            time.sleep(delay)
            delay = min(poll_s[1], delay * 2)


def follow_options(out: Path, allow_unhealthy: bool, deadline_s: float | None = None) -> Follow:
    """The loader's follow options: the journal in OUT, led by the trainer's rank 0 (``start_leader``)."""
    return Follow(journal=str(out / JOURNAL_DIR), lead=False, allow_unhealthy=allow_unhealthy, deadline_s=deadline_s)


def start_leader(journal: Journal, stores, follow: Follow) -> Leader | None:
    """Rank 0's leader, once epoch 0 is still to come: one look at the stores now (so the schedule starts from what
    is there), then its thread. Making it checks a journal taken up again against the stores (``check_join``)."""
    leader = Leader(journal, stores, follow)
    if leader.done:
        return None
    leader.poll()
    return leader.start()


class TrainedIds:
    """The sample ids the ranks trained in epoch 0, read from the samples log (OUT/samples.rankNNNNN.jsonl, which a
    --follow run always writes): what the end of the run counts against the stores' ids. What the trainer took is
    the evidence that every sample trained once; the journal's counts, a writer's or the loader's are what should
    have been handed out, and a sample served twice in another's place leaves them all right."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def files(self) -> list[str]:
        """Every rank's samples log, a run of another world size's too."""
        return sorted(n for n in os.listdir(self.folder) if SAMPLES_NAME.fullmatch(n))

    def truncate_departed(self, step: int, epoch: int, world: int) -> None:
        """Lines after ``step`` (of epoch ``epoch``) dropped from the logs of ranks this run does not have (rank 0,
        on a resume, before its first step: a run of another world size wrote them, and the resumed run trains
        those steps again), and lines no step before it logged (``truncate_jsonl``). The logs of ranks 0..world-1
        are their own rank's to truncate (``MetricsLog.truncate``): one writer a file."""
        own = {SAMPLES_FILE.format(r) for r in range(world)}
        for name in self.files():
            if name not in own:
                truncate_jsonl(self.folder / name, step, last_epoch=epoch)

    def counts(self) -> collections.Counter[str]:
        """How often each sample id was trained in epoch 0, over every rank's log (``ValueError``, one line naming
        the file, where a line is not one the samples log writes)."""
        out: collections.Counter[str] = collections.Counter()
        for name in self.files():
            where = str(self.folder / name)
            try:
                text = door.read_beneath(self.folder, name, bound=door.RUN_LOG_CAP, where=str(self.folder))
            except door.Refused as e:
                raise ValueError(str(e)) from None
            for n, line in enumerate(text.decode("utf-8", "replace").splitlines(), 1):
                row = door.load_json(line, f"{where}, line {n}", error=ValueError)
                if samples_step(row, math.inf) is None:
                    raise ValueError(f"{where}, line {n}: not a line of the sample ids a step trained")
                epoch, ids = row["epoch"], row["samples"]
                if epoch == 0:
                    out.update(ids)
        return out


@dataclass
class Following:
    """A --follow run's journal, the loader's follow options, rank 0's leader (None on other ranks, or once
    epoch 0 has ended) and what the ranks trained in epoch 0 (their samples logs)."""

    journal: Journal
    options: Follow
    leader: Leader | None
    trained: TrainedIds

    @classmethod
    def start(cls, out: Path, stores, settings, rank: int, world: int) -> "Following":
        """OUT/follow created (or taken up again, on a resume) by rank 0, and checked against the stores by its
        leader before any other rank opens it; then opened by every rank."""
        options = follow_options(out, settings.health.allow_unhealthy, settings.data.follow_deadline)
        path, leader = out / JOURNAL_DIR, None
        if rank == 0:
            leader = start_leader(Journal.create(path, [s.url for s in stores]), stores, options)
        if world > 1:
            dist.barrier()
        return cls(leader.journal if leader is not None else Journal(path), options, leader, TrainedIds(out))

    def schedule(self, source, settings) -> "FollowSchedule":
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        return FollowSchedule(source, self.journal, settings.run.epochs, settings.batch.token_budget, world,
                              settings.data.workers)

    def stop(self) -> None:
        if self.leader is not None:
            self.leader.stop()

    def resumed_at(self, step: int, epoch: int, rank: int, world: int) -> None:
        """The run starts after ``step`` (of epoch ``epoch``): rank 0 drops what the records of ranks this run lacks
        hold after it, before any rank's first step (each rank of this run drops its own; what the run trains from
        here on is added)."""
        if rank == 0:
            self.trained.truncate_departed(step, epoch, world)

    def tally(self, settings, rank: int, world: int) -> "Tally | None":
        """What epoch 0 trained against what the stores hold now (rank 0, at the end of the run, once every rank's
        record of what it trained is written; None on the other ranks)."""
        if world > 1:
            dist.barrier()
        if rank != 0:
            return None
        return tally(self.trained.counts(), settings.run.store, settings.storage.storage_options, settings.run.steps,
                     settings.data.weight)


class Epoch0Steps:
    """The optimizer steps of epoch 0's joins so far: the batch counts of a fresh plan, per rank the sum over its
    workers, the largest rank's (the others run empty steps), counted join by join as they arrive."""

    def __init__(self, dataset, world: int, workers: int, token_budget: int) -> None:
        self.ds, self.world, self.workers = dataset, world, max(1, workers)
        self.budgets = {(r, w): TokenBudget(token_budget) for r in range(world) for w in range(self.workers)}
        self.batches = dict.fromkeys(self.budgets, 0)
        self.next = 0

    def update(self) -> int:
        plan = self.ds.epoch_source(0).plan()  # a follower's: loader.follow.JournalEpoch
        for k in plan.joins():
            if k < self.next:
                continue
            cat = plan.part(k).catalog
            for (r, w), budget in self.budgets.items():
                rows = plan.slot_plan(k, None, 0, 0, self.ds.world.at(r, w, self.workers)).rows
                self.batches[(r, w)] += sum(budget.add(int(t)) for t in (cat.stop - cat.start)[rows])
            self.next = k + 1
        return max(sum(self.batches[(r, w)] for w in range(self.workers)) for r in range(self.world))


class FollowSchedule:
    """The run's length in steps while it follows: estimated until epoch 0 ends, then exact."""

    def __init__(self, source, journal: Journal, epochs: int, token_budget: int, world: int, workers: int) -> None:
        self.source, self.journal, self.epochs = source, journal, epochs
        self.epoch0 = Epoch0Steps(source.dataset, world, workers, token_budget)
        self.exact: int | None = None

    def total(self) -> int:
        if self.exact is not None:
            return self.exact
        steps0 = self.epoch0.update()
        out = self.journal.outcome()
        if out is not None and out.kind == "end":
            self.exact = steps0 + self.source.planned_steps(self.epochs, first=1)
            return self.exact
        joins = [e for e in self.journal.entries() if e.kind == "join"]
        joined = sum(e.tokens for e in joins)
        expected = joins[-1].expected_tokens if joins else None
        scale = expected / joined if expected and joined else 1.0
        return max(1, math.ceil(steps0 * max(1.0, scale))) * self.epochs

    def agreed_start(self, rank: int, world: int, group) -> int:
        """The total every rank starts with: rank 0's."""
        t = torch.tensor([float(self.total()) if rank == 0 else 0.0], dtype=torch.float64)
        if world > 1:
            dist.broadcast(t, 0, group=group)
        return int(t.item())


def arrival_columns(journal: Journal) -> dict[str, Any]:
    """What had joined epoch 0 when a metrics row was logged: samples, tokens, and whether every writer finished."""
    entries = journal.entries()
    joins = [e for e in entries if e.kind == "join"]
    return {"arrived_samples": sum(e.samples for e in joins), "arrived_tokens": sum(e.tokens for e in joins),
            "arrival_done": any(e.kind == "end" for e in entries)}


@dataclass
class Tally:
    """What a --follow run's epoch 0 trained against what its stores hold when it finishes, by sample id."""

    trained: int  # distinct sample ids epoch 0 trained (every rank's record)
    held: int  # distinct sample ids the stores hold now
    reason: str | None = None  # why they may differ, when the user asked for it (--steps, --weight)
    items: int = 0  # samples epoch 0 trained, counting each time a sample came
    twice: list[str] = field(default_factory=list)  # ids trained more than once, and more often than the stores hold
    never: list[str] = field(default_factory=list)  # ids the stores hold more often than epoch 0 trained them

    @property
    def differs(self) -> bool:
        """Whether epoch 0 did not train every sample the stores hold exactly once, without a reason the user asked
        for (a sample trained twice has none but --weight)."""
        return bool(self.twice) or ((self.trained != self.held or bool(self.never)) and self.reason is None)

    def line(self) -> str:
        if self.twice:
            never = f"; {len(self.never):,} the stores hold never trained ({_shown(self.never)})" if self.never else ""
            return (f"--follow: epoch 0 trained {self.trained:,} distinct sample(s) in {self.items:,}: "
                    f"{len(self.twice):,} trained more than once ({_shown(self.twice)}){never}; the stores hold "
                    f"{self.held:,}. Every sample trains once an epoch: this run's epoch 0 did not")
        if self.trained == self.held and not self.never:
            return f"--follow: epoch 0 trained {self.trained:,} sample(s), all the stores hold"
        why = (f" ({self.reason})" if self.reason else ": samples committed after epoch 0 ended (a writer the "
               "follower took as finished was not), or removed since; train on the store again to use them")
        never = f" ({len(self.never):,} never trained: {_shown(self.never)})" if self.never and not self.reason else ""
        return f"--follow: epoch 0 trained {self.trained:,} sample(s); the stores hold {self.held:,} now{why}{never}"


def _shown(ids: Sequence[str]) -> str:
    """The first few of ``ids``, escaped for a terminal."""
    more = f" and {len(ids) - SHOWN_IDS:,} more" if len(ids) > SHOWN_IDS else ""
    return ", ".join(repr(escape(i)) for i in ids[:SHOWN_IDS]) + more


def tally(trained: collections.Counter[str], urls: Sequence[str], options: dict[str, Any] | None,
          steps: int | None, weights: Sequence[float] | None = None) -> Tally:
    """Epoch 0's trained sample ids (``TrainedIds.counts``) against a fresh look at the stores' ids (``steps``: a run
    cut short by --steps may train less, as asked; ``weights`` other than 1: a sample comes as often as its store's
    weight says, so only what was never trained is counted)."""
    from hsstore.store.reader import Store

    held: collections.Counter[str] = collections.Counter()
    for u in urls:
        held.update(Store(u, options).sample_ids())
    unknown = sorted(i for i in trained if i not in held)
    if unknown:  # no step trained a sample no store holds: a line that says so was not the trainer's
        log.warning("--follow: %d sample id(s) of the samples logs are in none of the stores, not counted as trained: "
                    "%s", len(unknown), _shown(unknown))
        trained = collections.Counter({i: n for i, n in trained.items() if i in held})
    weighted = any(w != 1 for w in weights or ())
    reason = ("--weight makes a sample come other than once" if weighted else
              None if steps is None else f"--steps {steps} bounds the run")
    twice = [] if weighted else sorted(i for i, n in trained.items() if n > max(1, held[i]))
    never = sorted(i for i, n in held.items() if n > trained[i])
    return Tally(len(trained), len(held), reason, sum(trained.values()), twice, never)
