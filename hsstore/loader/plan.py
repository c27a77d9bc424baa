"""The epoch plan: which samples an epoch has, in which order, and which (rank, worker) slot hands out
which of them in which order. Computed from commit records alone (no feature bytes), and a pure
function of its inputs: resume and world-size changes rest on that (``loader`` module doc, steps 1-5).

``Planner`` holds one dataset's catalog and settings and answers for any (epoch, phase, world, slot);
``HiddenStateDataset.planned_lengths`` / ``planned_ids`` are its public face.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ..distributed import World
from ..format.commit import SAMPLE_COLUMNS
from ..store.reader import Store
from .resume import LoaderState, LoaderStateError, pack_done, unpack_done

EVEN_MODES = ("drop", "repeat")
PARTITIONS = ("global", "node")


# -- catalog: the samples that pass the filters, grouped into units -------------------------------------
@dataclass(frozen=True)
class Filters:
    """Which samples to load, decided from commit records (no feature bytes are read).

    ``where`` receives each sample's columns as a dict (sample_id, source, length, loss_tokens,
    thinking_tokens, flags) and is applied once, when the dataset is built, never in workers."""

    sources: frozenset[str] | None = None
    min_loss_tokens: int = 0
    min_length: int = 0
    max_length: int | None = None
    where: Callable[[dict[str, Any]], bool] | None = None

    def describe(self) -> dict[str, Any]:
        return {"sources": sorted(self.sources) if self.sources is not None else None,
                "min_loss_tokens": self.min_loss_tokens, "min_length": self.min_length,
                "max_length": self.max_length, "where": getattr(self.where, "__qualname__", None)}


@dataclass
class Catalog:
    """Parallel arrays, one row per kept sample, in store order (store, shard, position)."""

    store: np.ndarray   # int32 store index
    shard: np.ndarray   # int32 shard index within its store
    local: np.ndarray   # int32 sample index within its shard
    start: np.ndarray   # int64 first token within the shard
    stop: np.ndarray    # int64 end token
    unit: np.ndarray    # int64 unit id (non-decreasing)
    store_rows: list[tuple[int, int]]  # per store: catalog row range [a, b)

    def __len__(self) -> int:
        return len(self.start)

    @property
    def n_units(self) -> int:
        return int(self.unit[-1]) + 1 if len(self.unit) else 0

    def digest(self) -> str:
        h = hashlib.sha256()
        for a in (self.store, self.shard, self.local, self.start, self.unit):
            h.update(np.ascontiguousarray(a).tobytes())
        return h.hexdigest()[:24]

    def sample_id(self, stores: Sequence[Store], row: int) -> str:
        """The id of row ``row``'s sample (``stores``: those the catalog was built from)."""
        return stores[int(self.store[row])].commits[int(self.shard[row])].samples["sample_id"][int(self.local[row])]


def build_catalog(stores: Sequence[Store], filters: Filters, unit_tokens: int) -> Catalog:
    """Step 1: the samples that pass ``filters``, in store order, grouped into read units. Every store is admitted
    first (``Store.admit``: its columns keep the admission's rules), and every shard whose samples the filters drop
    is admitted here (``Store.admit_shard``: its record, and so its columns), as is every shard whose columns list
    no sample: a shard the epoch reads is admitted when it is read, so no column that disagrees with its record
    decides what an epoch holds."""
    cols: dict[str, list[np.ndarray]] = {k: [] for k in ("store", "shard", "local", "start", "stop", "unit_in_shard")}
    store_rows, n = [], 0
    for si, store in enumerate(stores):
        store.admit()
        first = n
        t = store.table  # the records' columns: no record is parsed
        length = t.samples["length"]
        keep = length >= filters.min_length
        if filters.max_length is not None:
            keep &= length <= filters.max_length
        if filters.min_loss_tokens:
            keep &= t.samples["loss_tokens"] >= filters.min_loss_tokens
        if filters.sources is not None:
            ok = np.array([v in filters.sources for v in t.source.values] or [False])
            keep &= ok[t.source.codes]
        if filters.where is not None:
            values = [t.sample_id.tolist(), t.source.tolist(), length.tolist(), t.samples["loss_tokens"].tolist(),
                      t.samples["thinking_tokens"].tolist(), [list(f) for f in t.flags.tolist()]]
            keep &= np.fromiter((bool(filters.where(dict(zip(SAMPLE_COLUMNS, row)))) for row in zip(*values)), bool,
                                len(length))
        idx = np.flatnonzero(keep)
        rows = np.repeat(np.arange(len(t), dtype=np.int32), np.diff(t.first))
        for dropped in np.union1d(rows[~keep], np.flatnonzero(np.diff(t.first) == 0)).tolist():
            store.admit_shard(store.commits[dropped])
        shard = rows[idx]
        start = t.starts[idx]
        cols["store"].append(np.full(len(idx), si, np.int32))
        cols["shard"].append(shard)
        cols["local"].append((idx - t.first[shard]).astype(np.int32))
        cols["start"].append(start)
        cols["stop"].append(start + length[idx])
        cols["unit_in_shard"].append(start // unit_tokens)  # the unit_tokens cell of the chunk grid
        n += len(idx)
        store_rows.append((first, n))
    arr = {k: (np.concatenate(v) if v else np.zeros(0, np.int64)) for k, v in cols.items()}
    if n:
        new = np.ones(n, bool)
        new[1:] = (arr["store"][1:] != arr["store"][:-1]) | (arr["shard"][1:] != arr["shard"][:-1]) | (
            arr["unit_in_shard"][1:] != arr["unit_in_shard"][:-1])
        unit = np.cumsum(new) - 1
    else:
        unit = np.zeros(0, np.int64)
    return Catalog(arr["store"].astype(np.int32), arr["shard"].astype(np.int32), arr["local"].astype(np.int32),
                   arr["start"].astype(np.int64), arr["stop"].astype(np.int64), unit.astype(np.int64), store_rows)


# -- plan: pure functions of (catalog, settings, epoch, done, world, slot) -------------------------------
def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([int(k) & 0xFFFFFFFF for k in key])


@dataclass
class EpochOrder:
    """The epoch's entries and their order (independent of the rank count within a node).

    ``bounds``: where each node's part of ``order`` starts and ends (``[0, n]`` for a global shuffle)."""

    entry_cat: np.ndarray   # catalog row of each entry
    entry_key: np.ndarray   # read-unit key of each entry (unit id + copy * n_units)
    order: np.ndarray       # entry ids in global order
    bounds: np.ndarray | None = None  # int64 [nodes + 1]; None: one part, the whole order

    def __len__(self) -> int:
        return len(self.entry_cat)

    def node_bounds(self) -> np.ndarray:
        return np.array([0, len(self.order)], np.int64) if self.bounds is None else self.bounds


def node_units(cat: Catalog, weights: Sequence[float], seed: int, nodes: int) -> np.ndarray:
    """The node of each read unit under ``partition="node"``: a fixed share per node for the whole run.

    A function of the catalog, weights, seed and node count only (never of the epoch), so a node reads the
    same units every epoch and a local cache that holds its share serves epochs 2.. alone. Units are put in
    a seeded order and cut into ``nodes`` contiguous shares of about equal weighted tokens (within one unit)."""
    nu = cat.n_units
    w = np.asarray(weights, np.float64)[cat.store] if len(cat) else np.zeros(0)
    tokens = np.bincount(cat.unit, weights=(cat.stop - cat.start) * w, minlength=nu) if nu else np.zeros(0)
    perm = _rng(seed, nodes, 4).permutation(nu)
    cum = np.cumsum(tokens[perm])
    total = cum[-1] if nu else 0.0
    mid = cum - tokens[perm] / 2
    share = np.minimum((mid * nodes // total).astype(np.int64), nodes - 1) if total > 0 else perm % nodes
    out = np.empty(nu, np.int64)
    out[perm] = share
    return out


def _unit_bounds(entry_key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n = len(entry_key)
    starts = np.flatnonzero(np.r_[True, entry_key[1:] != entry_key[:-1]])
    return starts, np.diff(np.r_[starts, n])


def _expand(starts: np.ndarray, lengths: np.ndarray, perm: np.ndarray) -> np.ndarray:
    """Entry ids of the units ``perm`` (indices into starts/lengths), unit after unit."""
    plen = lengths[perm]
    out_starts = np.cumsum(plen) - plen
    return np.arange(int(plen.sum()), dtype=np.int64) - np.repeat(out_starts, plen) + np.repeat(starts[perm], plen)


def epoch_order(cat: Catalog, weights: Sequence[float], seed: int, epoch: int, shuffle: bool,
                nodes: int | None = None) -> EpochOrder:
    """Steps 2 and 3: the entries (weights applied) and their seeded order of whole units.

    ``nodes`` (``partition="node"``): the order is node 0's units, then node 1's..., each node's share
    (``node_units``) in its own seeded order for the epoch."""
    parts_cat, parts_key = [], []
    nu = max(1, cat.n_units)
    for si, w in enumerate(weights):
        a, b = cat.store_rows[si]
        rows = np.arange(a, b, dtype=np.int64)
        whole, frac = int(w), w - int(w)
        for repeat in range(whole):
            parts_cat.append(rows)
            parts_key.append(cat.unit[rows] + repeat * nu)
        m = int(round(frac * len(rows)))
        if m:
            pick = np.sort(_rng(seed, epoch, 1, si).choice(len(rows), m, replace=False))
            parts_cat.append(rows[pick])
            parts_key.append(cat.unit[rows[pick]] + whole * nu)
    entry_cat = np.concatenate(parts_cat) if parts_cat else np.zeros(0, np.int64)
    entry_key = np.concatenate(parts_key) if parts_key else np.zeros(0, np.int64)
    n = len(entry_cat)
    if nodes is not None:
        starts, lengths = _unit_bounds(entry_key)
        run_node = node_units(cat, weights, seed, nodes)[entry_key[starts] % nu] if n else np.zeros(0, np.int64)
        pieces, bounds = [], [0]
        for g in range(nodes):
            mine = np.flatnonzero(run_node == g)
            if shuffle:
                mine = mine[_rng(seed, epoch, 5, nodes, g).permutation(len(mine))]
            pieces.append(_expand(starts, lengths, mine))
            bounds.append(bounds[-1] + len(pieces[-1]))
        order = np.concatenate(pieces) if pieces else np.zeros(0, np.int64)
        return EpochOrder(entry_cat, entry_key, order, np.array(bounds, np.int64))
    if n == 0 or not shuffle:
        return EpochOrder(entry_cat, entry_key, np.arange(n, dtype=np.int64))
    starts, lengths = _unit_bounds(entry_key)
    return EpochOrder(entry_cat, entry_key, _expand(starts, lengths, _rng(seed, epoch, 2).permutation(len(starts))))


def rank_ranges(n: int, world: int, even: str | None) -> list[tuple[int, int]]:
    """[a, b) of each rank in the (padded when ``even == "repeat"``) remaining global order."""
    if even == "drop":
        q = n // world
        return [(r * q, (r + 1) * q) for r in range(world)]
    if even == "repeat":
        q = -(-n // world) if n else 0
        return [(r * q, (r + 1) * q) for r in range(world)]
    return [(r * n // world, (r + 1) * n // world) for r in range(world)]


@dataclass
class SlotPlan:
    """What one (rank, worker) slot hands out, in order: entry ids, their catalog rows and read units."""

    entries: np.ndarray  # entry ids in emission order
    units: np.ndarray    # read unit of each emitted entry, numbered in this slot's stream (a unit or the part
                         # of one this slot holds; a repeat is another): what one ``read_unit`` reads
    rows: np.ndarray     # catalog row of each emitted entry (a weight > 1 repeats rows)

    def __len__(self) -> int:
        return len(self.entries)


def node_rank_ranges(counts: Sequence[int], per_node: int, even: str | None) -> list[tuple[int, int, int, int]]:
    """(part start, part length, a, b) of every rank, node by node: rank ``node * per_node + l`` takes
    ``[a, b)`` of its node's part (``b`` past the part's length wraps around it: ``even == "repeat"``).

    One part (a global shuffle) is ``rank_ranges``. With several, ``even`` evens every rank of the world:
    "drop" gives each the smallest per-rank share of any node, "repeat" the largest."""
    if len(counts) == 1 or even is None:
        per = [rank_ranges(int(n), per_node, even) for n in counts]
    else:
        q = (min(int(n) // per_node for n in counts) if even == "drop"
             else max(-(-int(n) // per_node) for n in counts))
        per = [[(r * q, (r + 1) * q) for r in range(per_node)] for _ in counts]
    offsets = np.r_[0, np.cumsum(counts)].astype(np.int64)
    return [(int(offsets[g]), int(counts[g]), a, b) for g, ranges in enumerate(per) for a, b in ranges]


def slot_streams(eo: EpochOrder, done: np.ndarray | None, world: int, workers: int, even: str | None,
                 ) -> list[tuple[np.ndarray, np.ndarray]]:
    """(entries in stream order, their unit numbers in the stream) for every slot ``rank * workers + worker``."""
    bounds = eo.node_bounds()
    nodes = len(bounds) - 1
    if world % nodes:
        raise ValueError(f"a world of {world} rank(s) does not split over {nodes} node(s)")
    if done is None:
        remaining, counts = eo.order, np.diff(bounds)
    else:
        keep = ~done[eo.order]
        remaining = eo.order[keep]
        counts = np.diff(np.r_[0, np.cumsum(keep)][bounds])
    key = eo.entry_key[remaining]
    out = []
    for c, n, a, b in node_rank_ranges(counts.tolist(), world // nodes, even):
        idx = np.arange(a, b, dtype=np.int64) if n else np.zeros(0, np.int64)
        wrapped = idx >= n  # "repeat" padding wraps around to the start of the part
        ent = remaining[c + idx % n] if n else remaining[:0]
        k = key[c + idx % n] if n else key[:0]
        brk = np.r_[True, (k[1:] != k[:-1]) | (wrapped[1:] != wrapped[:-1])] if len(ent) else np.zeros(0, bool)
        unit = np.cumsum(brk) - 1
        m = len(ent)
        for w in range(workers):
            lo, hi = w * m // workers, (w + 1) * m // workers
            out.append((ent[lo:hi], unit[lo:hi]))
    return out


def pool_shuffle(units: np.ndarray, unit_bytes: np.ndarray, budget: int, rng: np.random.Generator) -> np.ndarray:
    """Emission order (positions into the stream) of a shuffle buffer over read units.

    Units enter the pool in stream order while the pool holds less than ``budget`` bytes (at least
    one unit); each step emits a uniformly random pooled sample; a unit leaves when it is empty.
    """
    n = len(units)
    out = np.empty(n, np.int64)
    if n == 0:
        return out
    starts = np.flatnonzero(np.r_[True, units[1:] != units[:-1]])
    ends = np.r_[starts[1:], n]
    gid = np.repeat(np.arange(len(starts)), ends - starts)
    remaining = (ends - starts).tolist()
    ubytes = unit_bytes.tolist()
    rand = rng.random(n).tolist()
    pool: list[int] = []
    loaded, nxt, ng = 0, 0, len(starts)
    for i in range(n):
        while nxt < ng and (not pool or loaded < budget):
            pool.extend(range(int(starts[nxt]), int(ends[nxt])))
            loaded += ubytes[nxt]
            nxt += 1
        j = int(rand[i] * len(pool))
        p = pool[j]
        pool[j] = pool[-1]
        pool.pop()
        out[i] = p
        g = int(gid[p])
        remaining[g] -= 1
        if remaining[g] == 0:
            loaded -= ubytes[g]
    return out


def plan_settings(weights: Sequence[float], *, seed: int, shuffle: bool, even: str | None, unit_tokens: int,
                  shuffle_bytes: int, partition: str) -> dict[str, Any]:
    """What a resume state must agree on besides the catalog: the weights, the order and the cut."""
    out = {"weights": list(weights), "seed": seed, "shuffle": shuffle, "unit_tokens": unit_tokens,
           "shuffle_bytes": shuffle_bytes, "even": even}
    if partition != "global":  # absent for a global plan: states written before partitions still load
        out["partition"] = partition
    return out


class Planner:
    """One dataset's plan for any epoch, phase and world (step 4's cut, step 5's shuffle).

    Memoised: every slot of one world shares one global order and one cut, and ``len()`` is cheap.
    ``done`` arguments are ``LoaderState.done`` texts (what earlier phases consumed). ``nodes``: the
    node count of a ``partition="node"`` plan (ignored by a global one, which is one part)."""

    def __init__(self, catalog: Catalog, weights: Sequence[float], *, seed: int, shuffle: bool, even: str | None,
                 unit_tokens: int, token_bytes: int, shuffle_bytes: int, partition: str = "global") -> None:
        if partition not in PARTITIONS:
            raise ValueError(f"partition must be one of {PARTITIONS}, got {partition!r}")
        self.catalog, self.weights, self.seed, self.shuffle, self.even = catalog, list(weights), seed, shuffle, even
        self.token_bytes, self.shuffle_bytes, self.partition = token_bytes, shuffle_bytes, partition
        # what a resume state must agree on (LoaderState.config): the same catalog, order and cut
        self.config = {"catalog": catalog.digest(), **plan_settings(weights, seed=seed, shuffle=shuffle, even=even,
                                                                    unit_tokens=unit_tokens,
                                                                    shuffle_bytes=shuffle_bytes, partition=partition)}
        self._memo: dict[Any, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_memo": {}}  # recomputed where used (DataLoader workers)

    def _nodes(self, nodes: int | None) -> int | None:
        return max(1, int(nodes or 1)) if self.partition == "node" else None

    def epoch_order(self, epoch: int, nodes: int | None = None) -> EpochOrder:
        key = ("epoch", epoch, self._nodes(nodes))
        if key not in self._memo:
            self._memo = {k: v for k, v in self._memo.items() if k[0] != "epoch"}
            self._memo[key] = epoch_order(self.catalog, self.weights, self.seed, epoch, self.shuffle, key[2])
        return self._memo[key]

    def node_share(self, nodes: int, node: int) -> tuple[int, int]:
        """(read units, feature bytes) node ``node`` of ``nodes`` reads every epoch (weights applied once)."""
        cat = self.catalog
        owner = node_units(cat, self.weights, self.seed, nodes)
        mine = owner[cat.unit] == node
        return int((owner == node).sum()), int(((cat.stop - cat.start)[mine]).sum()) * self.token_bytes

    def node_rows(self, nodes: int, node: int) -> np.ndarray:
        """The catalog rows node ``node`` of ``nodes`` reads every epoch (``partition="node"``)."""
        return np.flatnonzero(node_units(self.catalog, self.weights, self.seed, nodes)[self.catalog.unit] == node)

    def _streams(self, epoch: int, done: str | None, phase: int, world: int, workers: int, nodes: int | None):
        key = ("streams", epoch, done, phase, world, workers, self._nodes(nodes))
        if key not in self._memo:
            eo = self.epoch_order(epoch, nodes)
            self._memo = {k: v for k, v in self._memo.items() if k[0] != "streams"}
            self._memo[key] = slot_streams(eo, unpack_done(done, len(eo)), world, workers, self.even)
        return self._memo[key]

    def slot_plan(self, epoch: int, done: str | None, phase: int, world: World) -> SlotPlan:
        """The exact emission order of ``world``'s reader, slot ``rank * workers + worker`` (metadata only;
        cheap). The world's node count matters to a node-partitioned plan only."""
        ranks, workers, slot, nodes = world.world, world.workers, world.slot, world.nodes
        eo = self.epoch_order(epoch, nodes)
        ent, unit = self._streams(epoch, done, phase, ranks, workers, nodes)[slot]
        if self.shuffle and len(ent):
            tokens = (self.catalog.stop - self.catalog.start)[eo.entry_cat[ent]]
            starts = np.flatnonzero(np.r_[True, unit[1:] != unit[:-1]])
            ubytes = np.add.reduceat(tokens, starts) * self.token_bytes
            pos = pool_shuffle(unit, ubytes, self.shuffle_bytes, _rng(self.seed, epoch, 3, phase, ranks, workers, slot))
            ent, unit = ent[pos], unit[pos]
        return SlotPlan(ent, unit, eo.entry_cat[ent])

    def rank_counts(self, epoch: int, done: str | None, phase: int, world: World) -> list[int]:
        """Entries each rank of ``world`` hands out in the phase (rank ranges do not depend on the workers)."""
        return [len(e) for e, _ in self._streams(epoch, done, phase, world.world, 1, world.nodes)]

    def fold(self, state: LoaderState) -> str | None:
        """``done`` after the phase recorded in ``state``: earlier phases plus every old slot's consumed prefix."""
        R, W = state.world
        missing = [s for s in range(R * W) if s not in state.counts]
        if missing:
            raise LoaderStateError(
                f"resume state covers slots {sorted(state.counts)} of {R} rank(s) x {W} worker(s); slots {missing[:8]} "
                "are missing. To resume with another world size or worker count, pass the states of all ranks "
                "(and workers) through hsstore.merge_states and load the result with dataset.load_state_dict")
        eo = self.epoch_order(state.epoch, state.nodes)
        done = unpack_done(state.done, len(eo))
        done = np.zeros(len(eo), bool) if done is None else done.copy()
        for s in range(R * W):
            plan = self.slot_plan(state.epoch, state.done, state.phase, state.reader(s))
            done[plan.entries[: state.counts[s]]] = True
        return pack_done(done)
