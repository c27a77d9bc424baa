"""What a ``HiddenStateDataset`` iterates: the epochs of its stores, each planned by an *epoch source*.

An ``EpochSource`` answers, for one epoch: what a resume state of it must agree on, what any slot of the
dataset's world hands out (a fresh plan, metadata only), how many entries each rank hands out, and where a slot
starts reading it (its position and what it reads). What a slot reads is made of ``EpochPart``s: a slot's plan
over a catalog of some stores, which the dataset reads. Two sources: ``StoreEpoch`` (here), any epoch of the
stores as they stand, one part planned ahead; and ``loader.follow.JournalEpoch``, epoch 0 of stores still being
written, a part per join of its journal as the joins arrive. The dataset knows this interface only; the ``follow``
option (``LiveStores``) makes its first epoch's source, and that source says which stores every later epoch
reads (``LiveEpoch.final_stores``).

``PlanInputs`` is what every source plans from besides the stores: which samples (filters), how often each
store's come (weights), the order and cut (``Planning``), the read unit, a token's feature bytes and the plan's
node count.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterator, Protocol, Sequence

import numpy as np

from ..distributed import World
from ..store.reader import Store
from .options import Planning
from .plan import Catalog, Filters, Planner, SlotPlan, build_catalog, plan_settings
from .resume import LoaderState, LoaderStateError, SlotProgress, log_recut

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlanInputs:
    """What an epoch is planned from besides the stores (the ``loader.dataset`` module doc, steps 1-5).

    ``filters`` carry no ``where``: it is applied once, to the dataset's first catalog. ``nodes``: the plan's node
    count (``partition="node"``; None: a global plan, one part over the whole world)."""

    filters: Filters
    weights: tuple[float, ...]
    planning: Planning
    unit_tokens: int
    token_bytes: int
    nodes: int | None

    def catalog(self, stores: Sequence[Store]) -> Catalog:
        """Step 1 over ``stores``: their samples that pass the filters, in read units."""
        return build_catalog(stores, self.filters, self.unit_tokens)

    def planner(self, catalog: Catalog, seed: int | None = None) -> Planner:
        """The plan of ``catalog`` for any epoch (``seed``: another than the planning's own)."""
        p = self.planning
        return Planner(catalog, self.weights, seed=p.seed if seed is None else seed, shuffle=p.shuffle, even=p.even,
                       unit_tokens=self.unit_tokens, token_bytes=self.token_bytes, shuffle_bytes=p.shuffle_bytes,
                       partition=p.partition)

    def settings(self) -> dict[str, Any]:
        """What a resume state must agree on besides the catalog (``Planner.config`` less its ``catalog``)."""
        p = self.planning
        return plan_settings(self.weights, seed=p.seed, shuffle=p.shuffle, even=p.even, unit_tokens=self.unit_tokens,
                             shuffle_bytes=p.shuffle_bytes, partition=p.partition)


@dataclass(frozen=True)
class EpochPart:
    """One part of a slot's epoch: the slot's plan (``plan``) over a catalog of these stores."""

    stores: Sequence[Store]
    catalog: Catalog
    plan: SlotPlan

    def lengths(self) -> np.ndarray:
        """Token counts of the samples the slot hands out of this part, in order."""
        return (self.catalog.stop - self.catalog.start)[self.plan.rows]

    def sample_ids(self) -> list[str]:
        """Their sample ids, in the same order."""
        return [self.catalog.sample_id(self.stores, int(row)) for row in self.plan.rows]


class EpochParts(Protocol):
    """A slot's parts of an epoch as they come, one after another; ``close`` stops waiting for more."""

    def __iter__(self) -> Iterator[EpochPart]: ...

    def __next__(self) -> EpochPart: ...

    def close(self) -> None: ...


class EpochSource(Protocol):
    """One epoch of a dataset's stores: its plan, for any slot of the dataset's world, and where a slot starts.
    ``resume``: the loaded resume state of this epoch (None: from its start)."""

    def config(self) -> dict[str, Any]:
        """What a resume state of this epoch must agree on (``LoaderState.config``)."""
        ...

    def initial_state(self) -> LoaderState:
        """The resume state of the epoch's start, before any slot handed anything out."""
        ...

    def planned(self, world: World) -> Iterator[EpochPart]:
        """What slot ``world`` hands out from the epoch's start (a fresh plan; metadata only), part by part."""
        ...

    def rank_counts(self, resume: LoaderState | None, world: World) -> list[int]:
        """Entries each rank of ``world`` hands out (after a resume: from the start of its phase)."""
        ...

    def start(self, resume: LoaderState | None, world: World) -> tuple[SlotProgress, EpochPart | EpochParts]:
        """Where slot ``world`` starts (its position, which ``state_dict`` reads) and what it reads: one part
        planned ahead, or the parts as they come."""
        ...


class LiveEpoch(EpochSource, Protocol):
    """The first epoch of stores still being written (``loader.follow.JournalEpoch``): it takes what arrives."""

    def final_stores(self) -> list[Store]:
        """The stores as this epoch took them, which every later epoch reads (a ``StoreError`` while it has not
        ended); this epoch's own readers take them too from then on."""
        ...


class LiveStores(Protocol):
    """A dataset's ``follow`` option (``loader.follow.Follow``): its stores are read while they are written."""

    def first_epoch(self, inputs: PlanInputs, stores: Sequence[Store], world: World) -> LiveEpoch:
        """Epoch 0's source, made where the dataset is built (on every rank) from the stores as opened."""
        ...


@dataclass(frozen=True)
class StoreEpoch:
    """Epoch ``epoch`` of the stores as they stand: ``Planner``'s plan of their catalog, one part planned ahead (every
    epoch of a dataset but a follower's first). ``world``: the dataset's (what is planned is for its readers)."""

    planner: Planner
    stores: Sequence[Store]
    catalog: Catalog
    epoch: int
    world: World
    nodes: int | None

    def config(self) -> dict[str, Any]:
        return self.planner.config

    def initial_state(self) -> LoaderState:
        return LoaderState(self.config(), self.epoch, nodes=self.nodes)

    def planned(self, world: World) -> Iterator[EpochPart]:
        if (world.world, world.nodes) != (self.world.world, self.world.nodes):
            raise ValueError(f"{world} is not a reader of this dataset's world {self.world}")
        return iter([EpochPart(self.stores, self.catalog, self.planner.slot_plan(self.epoch, None, 0, world))])

    def rank_counts(self, resume: LoaderState | None, world: World) -> list[int]:
        done, phase = (resume.done, resume.phase) if resume else (None, 0)
        return self.planner.rank_counts(self.epoch, done, phase, world)

    def start(self, resume: LoaderState | None, world: World) -> tuple[SlotProgress, EpochPart]:
        """Slot ``world``'s position: the resume state's count where it has the same world, else the epoch's
        remaining entries cut anew for this world (a new phase)."""
        done, phase, count, skipped = None, 0, 0, 0
        if resume is not None:
            done, phase = resume.done, resume.phase
            if resume.world is None:
                if resume.nodes != self.nodes:
                    log.info("epoch %d starts on %s node(s), the saved state was from %s: node shares are "
                             "re-partitioned (local caches hold other units now)", self.epoch, self.nodes,
                             resume.nodes)
            elif resume.world == (world.world, world.workers) and resume.nodes == self.nodes:
                if world.slot not in resume.counts:
                    raise LoaderStateError(
                        f"resume state has no position for rank {world.rank} worker {world.worker} (it covers "
                        f"slots {sorted(resume.counts)}); load each worker's own state (StatefulDataLoader does) "
                        "or a merge of all of them")
                count, skipped = resume.counts[world.slot], resume.skipped.get(world.slot, 0)
            else:
                if resume.nodes != self.nodes:
                    log.info("resuming epoch %d on %s node(s) from a state of %s node(s): re-partitioning the "
                             "remaining samples over the nodes (node shares, and so what local caches hold, "
                             "change)", self.epoch, self.nodes, resume.nodes)
                log_recut(str(self.epoch), world, resume.world)
                done, phase = self.planner.fold(resume), phase + 1
        plan = self.planner.slot_plan(self.epoch, done, phase, world)
        if count > len(plan):
            raise LoaderStateError(f"resume position {count} beyond this slot's {len(plan)} entries")
        return (SlotProgress(self.epoch, done, phase, world, self.nodes, count, skipped),
                EpochPart(self.stores, self.catalog, plan))
