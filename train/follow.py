"""``hsstore train --follow``: the trainer's side of training while the stores are written (``hsstore.loader.follow``).

Before step 1 each store must hold a manifest, the assets the drafter is built from and one committed shard, so
the trainer waits for those (saying what it waits for). Rank 0 keeps the journal in OUT/follow and runs the
leader in its own process; every rank and loader worker plans epoch 0 from the journal. Until epoch 0 ends the
schedule's length is an estimate (the steps of what joined, scaled by the tokens the writers plan), exact from
then on; rank 0's estimate reaches every rank through the step's lockstep all-reduce (``data.Proposal``), so all
ranks use one learning rate. metrics.jsonl rows carry what had arrived beside the loss.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from hsstore.io import storage
from hsstore.format import assets, commit
from hsstore.loader.batching import TokenBudget
from hsstore.loader.follow import Follow, Journal, Leader
from hsstore.redaction import recordable_url

log = logging.getLogger(__name__)

JOURNAL_DIR = "follow"  # OUT/follow: the epoch-0 journal of a --follow run
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


@dataclass
class Following:
    """A --follow run's journal, the loader's follow options, and rank 0's leader (None on other ranks, or once
    epoch 0 has ended)."""

    journal: Journal
    options: Follow
    leader: Leader | None

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
        return cls(leader.journal if leader is not None else Journal(path), options, leader)

    def schedule(self, source, settings) -> "FollowSchedule":
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        return FollowSchedule(source, self.journal, settings.run.epochs, settings.batch.token_budget, world,
                              settings.data.workers)

    def stop(self) -> None:
        if self.leader is not None:
            self.leader.stop()

    def tally(self, settings) -> "Tally":
        """What epoch 0 trained against what the stores hold now (rank 0, at the end of the run)."""
        return tally(self.journal, settings.run.store, settings.storage.storage_options, settings.run.steps)


class Epoch0Steps:
    """The optimizer steps of epoch 0's joins so far: the batch counts of a fresh plan, per rank the sum over its
    workers, the largest rank's (the others run empty steps), counted join by join as they arrive."""

    def __init__(self, dataset, world: int, workers: int, token_budget: int) -> None:
        self.ds, self.world, self.workers = dataset, world, max(1, workers)
        self.budgets = {(r, w): TokenBudget(token_budget) for r in range(world) for w in range(self.workers)}
        self.batches = dict.fromkeys(self.budgets, 0)
        self.next = 0

    def update(self) -> int:
        plan = self.ds.follow_plan()
        for k in plan.joins():
            if k < self.next:
                continue
            cat = plan.part(k).view.catalog
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
    """What a --follow run's epoch 0 trained against what its stores hold when it finishes."""

    trained: int  # samples that joined epoch 0 (each trained once when it ran to its end)
    held: int  # samples the stores hold now
    reason: str | None = None  # why they may differ, when the user asked for it (--steps)

    @property
    def differs(self) -> bool:
        """Whether they differ without a reason the user asked for."""
        return self.trained != self.held and self.reason is None

    def line(self) -> str:
        if self.trained == self.held:
            return f"--follow: epoch 0 trained {self.trained:,} sample(s), all the stores hold"
        why = (f" ({self.reason})" if self.reason else ": samples committed after epoch 0 ended (a writer the "
               "follower took as finished was not), or removed since; train on the store again to use them")
        return f"--follow: epoch 0 trained {self.trained:,} sample(s); the stores hold {self.held:,} now{why}"


def tally(journal: Journal, urls: Sequence[str], options: dict[str, Any] | None, steps: int | None) -> Tally:
    """Epoch 0's joined samples against a fresh look at the stores (``steps``: a run cut short by --steps may
    train less, as asked)."""
    from hsstore.store.reader import Store

    trained = sum(e.samples for e in journal.entries() if e.kind == "join")
    held = sum(len(Store(u, options)) for u in urls)
    return Tally(trained, held, None if steps is None else f"--steps {steps} bounds the run")
