"""Streaming loader: ``HiddenStateDataset`` yields store samples to a trainer, exactly once per epoch
over all ranks and DataLoader workers, in a seeded order that survives restarts and world-size changes.

How an epoch is laid out (everything below is computed from commit records alone, no feature bytes):

1. **Catalog**: every sample that passes the filters, in store order. Samples are grouped into *units*:
   runs of consecutive samples of one shard inside one window of ``unit_tokens`` tokens (aligned to
   the chunk grid). A unit is what one read fetches: large and contiguous, which object stores want.
2. **Entries**: the epoch's samples with per-store weights applied (weight 2 = every sample twice,
   0.5 = a seeded half chosen anew each epoch). Entry ids are the positions in this canonical list.
3. **Global order**: a seeded permutation of units (``seed``, ``epoch``), samples inside a unit in
   storage order. It depends on nothing else: not on ranks, not on workers.
4. **Slots**: the global order minus what earlier *phases* consumed (see resume) is cut into
   ``world_size`` contiguous rank ranges, and each range into ``num_workers`` contiguous slot ranges.
   ``even`` acts at the rank cut: ``"drop"`` gives every rank ``N // R`` entries (the last ``N % R`` of
   the global order, a random handful that changes every epoch, are not seen that epoch);
   ``"repeat"`` gives every rank ``ceil(N / R)``, padding with entries from the start of the global order.
5. **Shuffle buffer**: each slot reads its units in order with ``prefetch`` units in flight and emits
   samples in a seeded random order drawn from a pool of loaded units holding ~``shuffle_bytes``; a unit
   is dropped once all its samples are out. Memory per slot is about ``shuffle_bytes`` + prefetch units.

Resume: a slot's emission order is a pure function of (epoch plan, slot), so its state is one number,
how many entries it has handed out. ``state_dict()`` in a worker gives that slot's count (this is what
``torchdata``'s ``StatefulDataLoader`` snapshots per worker); with the same world size and worker count
each slot skips its count and continues in the same order. With another world size or worker count,
``merge_states`` joins the states of all ranks (and workers) into one; loading it folds the consumed
entries of every old slot into a ``done`` bitmap and starts a new phase: the remaining entries, still
in global order, are cut for the new world. Every entry is still handed out exactly once per epoch.

Use in a DDP trainer::

    ds = hsstore.HiddenStateDataset(url, layers=[1, 16, 31], seed=0)      # rank/world from torch.distributed
    loader = StatefulDataLoader(hsstore.TokenBatches(ds, max_tokens=16384), batch_size=None, num_workers=2)
    for epoch in range(start_epoch, epochs):
        ds.set_epoch(epoch)                      # every epoch, before iterating (persistent workers too)
        for batch in loader: ...
    # checkpoint: every rank saves loader.state_dict()
    # resume, same world size and workers: loader.load_state_dict(saved_state_of_this_rank)
    # resume, another world size or worker count: merge the states of *all* old ranks, then before
    #   building the loader: ds.load_state_dict(hsstore.merge_states(all_old_rank_states))

In-process iteration (``num_workers=0``) is the fast path: reads run on the dataset's own threads (file
copies release the GIL; CRC32C checks hold it, ~20 GB/s per core), and run buffers are recycled once
the trainer drops the items viewing them. DataLoader workers work too (fork and spawn), but each item's
memory then comes from fresh shared memory, which faults in more slowly.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import logging
import multiprocessing
import os
import sys
import threading
import zlib
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from . import codec, fp8, storage
from .cache import ChunkCache
from .errors import CorruptionError, StoreError
from .manifest import MANIFEST_FILE, check_compatible
from .reader import Store, open_store

log = logging.getLogger(__name__)

STATE_KEY = "hsstore_loader"
STATE_VERSION = 1
DEFAULT_UNIT_BYTES = 256 << 20
DEFAULT_SHUFFLE_BYTES = 1 << 30
DEFAULT_CACHE_BYTES = 64 << 30
EVEN_MODES = ("drop", "repeat")


class LoaderStateError(StoreError, ValueError):
    """A resume state does not fit this dataset (other stores, filters, seed, or an incomplete merge)."""


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


def build_catalog(stores: Sequence[Store], filters: Filters, unit_tokens: int) -> Catalog:
    cols: dict[str, list[np.ndarray]] = {k: [] for k in ("store", "shard", "local", "start", "stop", "window")}
    store_rows, n = [], 0
    for si, st in enumerate(stores):
        first = n
        for hi, rec in enumerate(st.commits):
            s = rec.samples
            length = np.asarray(s["length"], dtype=np.int64)
            keep = length >= filters.min_length
            if filters.max_length is not None:
                keep &= length <= filters.max_length
            if filters.min_loss_tokens:
                keep &= np.asarray(s["loss_tokens"], dtype=np.int64) >= filters.min_loss_tokens
            if filters.sources is not None:
                keep &= np.fromiter((x in filters.sources for x in s["source"]), bool, len(length))
            if filters.where is not None:
                names = list(s)
                keep &= np.fromiter((bool(filters.where(dict(zip(names, row)))) for row in zip(*s.values())),
                                    bool, len(length))
            idx = np.flatnonzero(keep)
            off = rec.offsets
            cols["store"].append(np.full(len(idx), si, np.int32))
            cols["shard"].append(np.full(len(idx), hi, np.int32))
            cols["local"].append(idx.astype(np.int32))
            cols["start"].append(off[idx])
            cols["stop"].append(off[idx + 1])
            cols["window"].append(off[idx] // unit_tokens)
            n += len(idx)
        store_rows.append((first, n))
    arr = {k: (np.concatenate(v) if v else np.zeros(0, np.int64)) for k, v in cols.items()}
    if n:
        new = np.ones(n, bool)
        new[1:] = (arr["store"][1:] != arr["store"][:-1]) | (arr["shard"][1:] != arr["shard"][:-1]) | (
            arr["window"][1:] != arr["window"][:-1])
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
    """The epoch's entries and their global order (independent of world size)."""

    entry_cat: np.ndarray   # catalog row of each entry
    entry_key: np.ndarray   # read-unit key of each entry (unit id + copy * n_units)
    order: np.ndarray       # entry ids in global order

    def __len__(self) -> int:
        return len(self.entry_cat)


def epoch_order(cat: Catalog, weights: Sequence[float], seed: int, epoch: int, shuffle: bool) -> EpochOrder:
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
    if n == 0 or not shuffle:
        return EpochOrder(entry_cat, entry_key, np.arange(n, dtype=np.int64))
    starts = np.flatnonzero(np.r_[True, entry_key[1:] != entry_key[:-1]])
    lengths = np.diff(np.r_[starts, n])
    perm = _rng(seed, epoch, 2).permutation(len(starts))
    plen = lengths[perm]
    out_starts = np.cumsum(plen) - plen
    order = np.arange(n, dtype=np.int64) - np.repeat(out_starts, plen) + np.repeat(starts[perm], plen)
    return EpochOrder(entry_cat, entry_key, order)


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
    """What one (rank, worker) slot hands out, in order: entry ids and the read group of each."""

    entries: np.ndarray  # entry ids in emission order
    groups: np.ndarray   # read-group id of each emitted entry (a group = one contiguous read)

    def __len__(self) -> int:
        return len(self.entries)


def slot_streams(eo: EpochOrder, done: np.ndarray | None, world: int, workers: int, even: str | None,
                 ) -> list[tuple[np.ndarray, np.ndarray]]:
    """(entries in stream order, group ids) for every slot ``rank * workers + worker``."""
    remaining = eo.order if done is None else eo.order[~done[eo.order]]
    n = len(remaining)
    key = eo.entry_key[remaining]
    out = []
    for a, b in rank_ranges(n, world, even):
        idx = np.arange(a, b, dtype=np.int64)
        wrapped = idx >= n  # "repeat" padding wraps around to the start of the global order
        ent = remaining[idx % n] if n else remaining[:0]
        k = key[idx % n] if n else key[:0]
        brk = np.r_[True, (k[1:] != k[:-1]) | (wrapped[1:] != wrapped[:-1])] if len(ent) else np.zeros(0, bool)
        grp = np.cumsum(brk) - 1
        m = len(ent)
        for w in range(workers):
            lo, hi = w * m // workers, (w + 1) * m // workers
            out.append((ent[lo:hi], grp[lo:hi]))
    return out


def pool_shuffle(groups: np.ndarray, group_bytes: np.ndarray, budget: int, rng: np.random.Generator) -> np.ndarray:
    """Emission order (positions into the stream) of a shuffle buffer over read groups.

    Groups enter the pool in stream order while the pool holds less than ``budget`` bytes (at least
    one group); each step emits a uniformly random pooled sample; a group leaves when it is empty.
    """
    n = len(groups)
    out = np.empty(n, np.int64)
    if n == 0:
        return out
    starts = np.flatnonzero(np.r_[True, groups[1:] != groups[:-1]])
    ends = np.r_[starts[1:], n]
    gid = np.repeat(np.arange(len(starts)), ends - starts)
    remaining = (ends - starts).tolist()
    gbytes = group_bytes.tolist()
    rand = rng.random(n).tolist()
    pool: list[int] = []
    loaded, nxt, ng = 0, 0, len(starts)
    for i in range(n):
        while nxt < ng and (not pool or loaded < budget):
            pool.extend(range(int(starts[nxt]), int(ends[nxt])))
            loaded += gbytes[nxt]
            nxt += 1
        j = int(rand[i] * len(pool))
        p = pool[j]
        pool[j] = pool[-1]
        pool.pop()
        out[i] = p
        g = int(gid[p])
        remaining[g] -= 1
        if remaining[g] == 0:
            loaded -= gbytes[g]
    return out


def _pack_done(done: np.ndarray | None) -> str | None:
    if done is None or not done.any():
        return None
    return base64.b64encode(zlib.compress(np.packbits(done).tobytes())).decode()


def _unpack_done(text: str | None, n: int) -> np.ndarray | None:
    if not text:
        return None
    bits = np.frombuffer(zlib.decompress(base64.b64decode(text)), np.uint8)
    return np.unpackbits(bits, count=n).astype(bool)


# -- the dataset ----------------------------------------------------------------------------------------
@dataclass
class _Progress:
    """The live iterator's position, read by ``state_dict`` (in the process that iterates)."""

    epoch: int
    done: str | None
    phase: int
    world: list[int]
    slot: int
    count: int = 0
    skipped: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=256))  # emission positions of recent items


def _world_from_dist(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is None or world_size is None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
    rank, world_size = int(rank or 0), int(world_size or 1)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for world_size {world_size}")
    return rank, world_size


def _as_sources(url_or_urls, weights, storage_options) -> tuple[list[Store], list[float]]:
    if isinstance(url_or_urls, (str, os.PathLike, Store)):
        items: list = [url_or_urls]
    elif isinstance(url_or_urls, Mapping):
        if weights is not None:
            raise ValueError("pass weights either as a {url: weight} mapping or as weights=, not both")
        items, weights = list(url_or_urls), list(url_or_urls.values())
    else:
        items = list(url_or_urls)
    if not items:
        raise StoreError("no store given")
    weights = [1.0] * len(items) if weights is None else [float(w) for w in weights]
    if len(weights) != len(items):
        raise ValueError(f"{len(weights)} weights for {len(items)} stores")
    if any(w < 0 or not np.isfinite(w) for w in weights) or not any(w > 0 for w in weights):
        raise ValueError(f"weights must be finite, >= 0 and not all 0, got {weights}")
    if storage_options is None or isinstance(storage_options, Mapping):
        options = [dict(storage_options or {})] * len(items)
    else:
        options = [dict(o or {}) for o in storage_options]
    stores = [x if isinstance(x, Store) else open_store(os.fspath(x), **o) for x, o in zip(items, options)]
    return stores, weights


class HiddenStateDataset(IterableDataset):
    """Samples of one or more hsstore stores as a torch ``IterableDataset`` (see the module doc).

    Items are the store's item dicts: ``sample_id``, ``input_ids`` (int64), ``loss_mask`` (bool),
    ``hidden_states`` ``[T, n_layers, H]`` (a view of layer-major memory; with ``pin_memory`` that memory
    is pinned, in DataLoader workers it is shared memory, so handing an item over copies nothing).

    Arguments beyond the obvious:
      layers          tapped layer ids to read (default: all); only their bytes are fetched.
      weights         per store; 2.0 = each sample twice per epoch, 0.5 = a seeded half each epoch.
      rank, world_size  default from torch.distributed when initialised when the dataset is built.
      even            None (default: exactly once, rank counts may differ by one), "drop" (each rank
                      gets N // world entries; up to world - 1 entries are skipped that epoch) or
                      "repeat" (each rank gets ceil(N / world); up to world - 1 entries seen twice).
                      ``True`` means "drop". For equal *step* counts with token batching, also stop all
                      ranks at the minimum step count.
      unit_bytes      size of one read (bytes of the requested layers), rounded to whole chunks.
      shuffle_bytes   shuffle-buffer size per slot in bytes of loaded units (memory per worker).
      prefetch        units read ahead, concurrently, per slot.
      cache_dir, cache_bytes   local LRU disk cache of chunks for remote stores (shared by workers).
      skip_corrupt    skip samples whose chunks fail their checksum or are gone (counted in ``state_dict()``
                      and logged) instead of raising ``CorruptionError`` naming store, shard and sample.
                      A read that fails after retries (``FetchError``: the network, not the bytes) is
                      always raised, so an epoch is never silently short.
      dequantise      fp8 stores: items carry e4m3fn ``hidden_states`` plus float32 ``hidden_scales``
                      ``[T, n_layers]`` (half the bytes to move; the trainer dequantises on the GPU with
                      ``hsstore.fp8.dequantise_batch``); ``True`` dequantises here, on the host, into the
                      manifest dtype. No effect on raw stores.
    """

    def __init__(
        self,
        url_or_urls: str | Store | Sequence[str | Store] | Mapping[str, float],
        layers: Sequence[int] | None = None,
        shuffle: bool = True,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        *,
        weights: Sequence[float] | None = None,
        even: bool | str | None = None,
        sources: Iterable[str] | None = None,
        min_loss_tokens: int = 0,
        min_length: int = 0,
        max_length: int | None = None,
        where: Callable[[dict[str, Any]], bool] | None = None,
        unit_bytes: int = DEFAULT_UNIT_BYTES,
        shuffle_bytes: int = DEFAULT_SHUFFLE_BYTES,
        prefetch: int = 4,
        pin_memory: bool = False,
        cache_dir: str | None = None,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        skip_corrupt: bool = False,
        dequantise: bool = False,
        storage_options: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
        final_hidden: bool = False,
    ) -> None:
        super().__init__()
        self.stores, self.weights = _as_sources(url_or_urls, weights, storage_options)
        first = self.stores[0]
        for st in self.stores[1:]:
            check_compatible(first.manifest, st.manifest, f"store {first.url!r}", f"store {st.url!r}")
        for st in self.stores:
            st.check_manifest()
            if len(st) == 0:
                raise StoreError(f"store {st.url!r} has no committed samples (nothing to load)")
        self.layers = first.check_layers(layers)
        for st in self.stores[1:]:
            st.check_layers(self.layers)
        m = first.manifest
        self.final_hidden = bool(final_hidden)
        if self.final_hidden and "final_hidden" not in m.features:
            raise StoreError(f"final_hidden asked for, store {first.url!r} does not hold it (written without "
                             "hsstore extract --final-hidden, or imported from files without hidden_state)")
        # what is read per token: the layers, then the final norm's output when asked for
        self._slots = list(self.layers) + (["final_hidden"] if self.final_hidden else [])
        self.token_bytes = codec.token_bytes(m.dtype, m.encoding, len(self._slots), m.hidden_size)
        self.fp8, self.dequantise = m.encoding == fp8.ENCODING, bool(dequantise)
        ct = m.chunk_tokens
        self.unit_tokens = max(1, -(-max(1, unit_bytes // self.token_bytes) // ct)) * ct
        if even is True:
            even = "drop"
        if even not in (None, False) and even not in EVEN_MODES:
            raise ValueError(f"even must be None, True or one of {EVEN_MODES}, got {even!r}")
        self.even = even or None
        if isinstance(sources, str):
            sources = [sources]
        self.filters = Filters(frozenset(sources) if sources is not None else None, int(min_loss_tokens),
                               int(min_length), max_length, where)
        self.catalog = build_catalog(self.stores, self.filters, self.unit_tokens)
        if len(self.catalog) == 0:
            raise StoreError(f"no samples left after filters {self.filters.describe()} in "
                             + ", ".join(repr(s.url) for s in self.stores))
        self.filters = Filters(**{**self.filters.__dict__, "where": None})  # applied; not picklable (spawn)
        self.shuffle, self.seed = bool(shuffle), int(seed)
        self.rank, self.world_size = _world_from_dist(rank, world_size)
        self.shuffle_bytes, self.prefetch = int(shuffle_bytes), max(1, int(prefetch))
        self.pin_memory, self.skip_corrupt = bool(pin_memory), bool(skip_corrupt)
        self.cache_dir, self.cache_bytes = cache_dir, int(cache_bytes)
        self._epoch_box = _shared_int(0)
        self._epoch_plain = 0
        self.share_memory: bool | None = None  # None: shared memory in DataLoader workers (see _alloc)
        self._resume: dict[str, Any] | None = None
        self._live: _Progress | None = None
        self._memo: dict[Any, Any] = {}
        self._config = {"catalog": self.catalog.digest(), "weights": self.weights, "seed": self.seed,
                        "shuffle": self.shuffle, "unit_tokens": self.unit_tokens,
                        "shuffle_bytes": self.shuffle_bytes, "even": self.even}

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_memo"], state["_live"] = {}, None  # plans are recomputed where they are used
        state.pop("_buffers", None)
        if self._epoch_box is not None and multiprocessing.context.get_spawning_popen() is None:
            state["_epoch_box"], state["_epoch_plain"] = None, self.epoch  # plain pickling: a snapshot
        return state

    # -- epochs and plans -------------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The current epoch. Shared with DataLoader workers, so ``set_epoch`` in the main process also
        reaches persistent workers (``persistent_workers=True``), which keep their own dataset copy."""
        return int(self._epoch_box.value) if self._epoch_box is not None else self._epoch_plain

    @epoch.setter
    def epoch(self, value: int) -> None:
        if self._epoch_box is not None:
            self._epoch_box.value = int(value)
        self._epoch_plain = int(value)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (a new order per epoch). A loaded resume state for another epoch is dropped."""
        self.epoch = int(epoch)
        if self._resume is not None and self._resume["epoch"] != self.epoch:
            self._resume = None

    def _epoch(self, epoch: int) -> EpochOrder:
        key = ("epoch", epoch)
        if key not in self._memo:
            self._memo = {k: v for k, v in self._memo.items() if k[0] != "epoch"}
            self._memo[key] = epoch_order(self.catalog, self.weights, self.seed, epoch, self.shuffle)
        return self._memo[key]

    def _streams(self, epoch: int, done_text: str | None, phase: int, world: int, workers: int):
        key = ("streams", epoch, done_text, phase, world, workers)
        if key not in self._memo:
            eo = self._epoch(epoch)
            done = _unpack_done(done_text, len(eo))
            self._memo = {k: v for k, v in self._memo.items() if k[0] != "streams"}
            self._memo[key] = slot_streams(eo, done, world, workers, self.even)
        return self._memo[key]

    def slot_plan(self, epoch: int, done_text: str | None, phase: int, world: int, workers: int,
                  slot: int) -> SlotPlan:
        """The exact emission order of one slot (metadata only; cheap)."""
        eo = self._epoch(epoch)
        ent, grp = self._streams(epoch, done_text, phase, world, workers)[slot]
        if not self.shuffle or len(ent) == 0:
            return SlotPlan(ent, grp)
        tokens = (self.catalog.stop - self.catalog.start)[eo.entry_cat[ent]]
        starts = np.flatnonzero(np.r_[True, grp[1:] != grp[:-1]])
        gbytes = np.add.reduceat(tokens, starts) * self.token_bytes
        pos = pool_shuffle(grp, gbytes, self.shuffle_bytes, _rng(self.seed, epoch, 3, phase, world, workers, slot))
        return SlotPlan(ent[pos], grp[pos])

    def _fold(self, st: dict[str, Any]) -> str | None:
        """``done`` after the phase recorded in ``st``: earlier phases plus every old slot's consumed prefix."""
        R, W = st["world"]
        counts = st["counts"]
        missing = [s for s in range(R * W) if s not in counts]
        if missing:
            raise LoaderStateError(
                f"resume state covers slots {sorted(counts)} of {R} rank(s) x {W} worker(s); slots {missing[:8]} "
                "are missing. To resume with another world size or worker count, pass the states of all ranks "
                "(and workers) through hsstore.merge_states and load the result with dataset.load_state_dict")
        eo = self._epoch(st["epoch"])
        done = _unpack_done(st["done"], len(eo))
        done = np.zeros(len(eo), bool) if done is None else done.copy()
        for s in range(R * W):
            plan = self.slot_plan(st["epoch"], st["done"], st["phase"], R, W, s)
            done[plan.entries[: counts[s]]] = True
        return _pack_done(done)

    def rank_counts(self) -> list[int]:
        """Entries each rank hands out this epoch (rank ranges do not depend on the worker count)."""
        st = self._resume if self._resume is not None and self._resume["epoch"] == self.epoch else None
        done, phase = (st["done"], st["phase"]) if st else (None, 0)
        return [len(e) for e, _ in self._streams(self.epoch, done, phase, self.world_size, 1)]

    def __len__(self) -> int:
        """Entries this rank hands out in the current epoch (after a resume: from the start of the
        resumed phase, i.e. not less what was consumed in it)."""
        return self.rank_counts()[self.rank]

    # -- state --------------------------------------------------------------------------------------------
    def _state(self, epoch, done, phase, world, counts, skipped) -> dict[str, Any]:
        return {STATE_KEY: STATE_VERSION, "config": dict(self._config), "epoch": epoch, "done": done,
                "phase": phase, "world": world, "counts": counts, "skipped": skipped}

    def state_dict(self, pending: int = 0) -> dict[str, Any]:
        """Where this process's iterator is: its slot and how many entries it handed out.

        ``pending``: the last ``pending`` items handed out are not consumed yet (a batcher holds them),
        so a resume hands them out again. Without a live iterator: the loaded state, or the epoch start.
        """
        p = self._live
        if p is None or p.epoch != self.epoch:
            if self._resume is not None and self._resume["epoch"] == self.epoch:
                return copy.deepcopy(self._resume)
            return self._state(self.epoch, None, 0, None, {}, {})
        count = p.count
        if pending:
            if pending > len(p.recent):
                raise ValueError(f"cannot un-consume {pending} items (only the last {len(p.recent)} are tracked)")
            count = p.recent[-pending]
        return self._state(p.epoch, p.done, p.phase, list(p.world), {p.slot: count},
                           {p.slot: p.skipped} if p.skipped else {})

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume the epoch recorded in ``state`` (from ``state_dict`` or ``merge_states``) at its position."""
        st = _normalise(state)
        diffs = [f"{k}: {st['config'].get(k)!r} vs {v!r}" for k, v in self._config.items() if st["config"].get(k) != v]
        if diffs:
            raise LoaderStateError("resume state was made by a differently configured dataset (state vs this): "
                                   + "; ".join(diffs))
        self.epoch = st["epoch"]
        self._resume = st
        self._live = None

    # -- iteration ----------------------------------------------------------------------------------------
    def _position(self) -> tuple[_Progress, SlotPlan]:
        info = get_worker_info()
        W, w = (info.num_workers, info.id) if info is not None else (1, 0)
        R, r = self.world_size, self.rank
        slot = r * W + w
        st = self._resume if self._resume is not None and self._resume["epoch"] == self.epoch else None
        done, phase, count, skipped = None, 0, 0, 0
        if st is not None:
            done, phase = st["done"], st["phase"]
            if st["world"] is None:
                pass
            elif st["world"] == [R, W]:
                if slot not in st["counts"]:
                    raise LoaderStateError(
                        f"resume state has no position for rank {r} worker {w} (it covers slots {sorted(st['counts'])})"
                        "; load each worker's own state (StatefulDataLoader does) or a merge of all of them")
                count, skipped = st["counts"][slot], st["skipped"].get(slot, 0)
            else:
                log.info("resuming epoch %d on %d rank(s) x %d worker(s) from a state of %d x %d: "
                         "re-cutting the remaining samples", self.epoch, R, W, *st["world"])
                done, phase = self._fold(st), phase + 1
        plan = self.slot_plan(self.epoch, done, phase, R, W, slot)
        if count > len(plan):
            raise LoaderStateError(f"resume position {count} beyond this slot's {len(plan)} entries")
        return _Progress(self.epoch, done, phase, [R, W], slot, count, skipped), plan

    def __iter__(self) -> Iterator[dict[str, Any]]:
        progress, plan = self._position()
        self._live = progress
        return _SlotReader(self, plan, progress)

    # -- reading ------------------------------------------------------------------------------------------
    def _attach_cache(self) -> None:
        if self.cache_dir is None:
            return
        for st in self.stores:  # one cache object per process: a forked child must not share its lock
            cache = st.chunk_cache
            if (cache is None or cache.pid != os.getpid()) and not storage.is_local(st._fs()):
                st.chunk_cache = ChunkCache(self.cache_dir, self.cache_bytes)

    def _alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Memory for a run's features: shared memory in DataLoader workers (the hand-over to the main
        process then moves nothing), pinned memory when asked in the main process, else numpy's
        allocator (it asks for huge pages: fresh memory faults in several times faster than torch's)."""
        nbytes = int(np.prod(shape)) * dtype.itemsize
        in_worker = get_worker_info() is not None
        if self.share_memory if self.share_memory is not None else in_worker:
            t = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(nbytes))
        elif self.pin_memory and not in_worker and _can_pin():
            t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        else:
            t = torch.from_numpy(self._pool().take(nbytes))
        return t.view(dtype).view(shape)

    def _pool(self) -> "BufferPool":
        pool = self.__dict__.get("_buffers")
        if pool is None or pool.pid != os.getpid():
            # about what a slot holds at its peak: the shuffle pool plus the units read ahead
            pool = self.__dict__["_buffers"] = BufferPool(
                self.shuffle_bytes + (self.prefetch + 2) * self.unit_tokens * self.token_bytes)
        return pool

    def _store_gone(self, st: Store) -> str | None:
        try:
            fs = st._fs()
            return None if fs.exists(storage.join(st.root, MANIFEST_FILE)) else "its manifest is gone"
        except Exception as e:  # unreachable counts as gone: nothing can be read from it
            return f"it cannot be reached ({type(e).__name__}: {e})"

    def read_group(self, rows: np.ndarray) -> dict[int, Any]:
        """Read catalog rows of one shard (one group): row -> (sample_id, ids, mask, feats[L, T, H] tensor)
        or the ``CorruptionError`` of that sample. Contiguous rows are read with one ``read_range``."""
        cat = self.catalog
        rows = np.unique(rows)
        st = self.stores[int(cat.store[rows[0]])]
        rec = st.commits[int(cat.shard[rows[0]])]
        out: dict[int, Any] = {}
        runs = np.split(rows, np.flatnonzero(cat.start[rows[1:]] != cat.stop[rows[:-1]]) + 1)
        try:
            for run in runs:
                self._read_run(st, rec, run, out)
        except (CorruptionError, StoreError) as e:
            gone = self._store_gone(st)
            if gone:
                raise StoreError(f"store {st.url!r} disappeared mid-epoch ({gone}) while reading shard "
                                 f"{rec.shard!r}: {e}") from None
            if not isinstance(e, CorruptionError):
                raise
            out = {}
            for row in rows:  # find the samples at fault, keep the rest
                try:
                    self._read_run(st, rec, np.array([row]), out)
                except CorruptionError as e1:
                    sid = rec.samples["sample_id"][int(cat.local[row])]
                    out[int(row)] = CorruptionError(f"store {st.url!r}, shard {rec.shard!r}, sample {sid!r}: {e1}")
        return out

    def _read_run(self, st: Store, rec, run: np.ndarray, out: dict[int, Any]) -> None:
        cat = self.catalog
        a, b = int(cat.start[run[0]]), int(cat.stop[run[-1]])
        m = st.manifest
        shape = (len(self._slots), b - a, m.hidden_size)
        scales = None
        if self.fp8:  # e4m3fn bits, and the rows' scales
            feats = self._alloc(shape, torch.uint8)
            bits = feats.numpy()
            scales = self._alloc(shape[:2], torch.float32)
            feats = feats.view(fp8.FP8_DTYPE)
        else:
            feats = self._alloc(shape, codec.TORCH_DTYPE[m.dtype])
            bits = feats.view(torch.int16 if feats.element_size() == 2 else torch.int32).numpy().view(
                codec.STORAGE_DTYPE[m.dtype])
        ids, mask, _ = st.read_range(rec.shard, a, b, self._slots, out=bits,
                                     scales_out=None if scales is None else scales.numpy())
        for row in run:
            s, e = int(cat.start[row]) - a, int(cat.stop[row]) - a
            out[int(row)] = (rec.samples["sample_id"][int(cat.local[row])], ids[s:e], mask[s:e], feats[:, s:e],
                             None if scales is None else scales[:, s:e])

    def _item(self, rec: tuple) -> dict[str, Any]:
        sid, ids, mask, feats, scales = rec
        item = {"sample_id": sid, "input_ids": torch.from_numpy(ids.astype(np.int64)),
                "loss_mask": torch.from_numpy(mask.astype(bool)), "hidden_states": feats.permute(1, 0, 2)}
        if self.final_hidden:  # the last slot read: the final norm's output [T, H]
            item["hidden_states"], item["final_hidden"] = feats[:-1].permute(1, 0, 2), feats[-1]
        if scales is not None:
            item["hidden_scales"] = scales.permute(1, 0)
            if self.dequantise:
                item = fp8.dequantise_batch(item, codec.TORCH_DTYPE[self.stores[0].manifest.dtype])
        if self.pin_memory and feats.is_pinned():  # pinned only in the main process (see _alloc)
            item["input_ids"] = item["input_ids"].pin_memory()
            item["loss_mask"] = item["loss_mask"].pin_memory()
        return item

    def __repr__(self) -> str:
        return (f"HiddenStateDataset({[s.url for s in self.stores]}, samples={len(self.catalog)}, layers={self.layers}, "
                f"rank={self.rank}/{self.world_size}, epoch={self.epoch})")


class BufferPool:
    """Recycles run buffers once no item views them any more.

    Fresh memory must be faulted in page by page, which costs as much as reading the bytes (more under
    gVisor); a trainer drops each batch after its step, so a buffer whose items are all gone is reused.
    "All gone" is read from the buffer's reference count: every item tensor keeps a numpy view of it
    alive (``torch.from_numpy``), so only the pool's own references remain when none is left.
    Buffers beyond ``max_bytes`` in all are plain allocations, freed as usual; pooled ones stay
    allocated between epochs (they are what the loader holds at its peak anyway).
    """

    GRAIN = 16 << 20  # size classes: fewer distinct sizes, more reuse

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes, self.pid = int(max_bytes), os.getpid()
        self.buffers: list[np.ndarray] = []
        self.lock = threading.Lock()
        self.reused = self.allocated = 0
        self._unused = 0
        for probe in [np.empty(1, np.uint8)]:  # calibrate: references of an unviewed buffer, seen as in take
            self._unused = self._refs(probe)

    @staticmethod
    def _refs(buf: np.ndarray) -> int:
        return sys.getrefcount(buf)

    def take(self, nbytes: int) -> np.ndarray:
        size = -(-nbytes // self.GRAIN) * self.GRAIN
        with self.lock:
            best = None
            for b in self.buffers:
                if b.nbytes >= size and self._refs(b) <= self._unused and (best is None or b.nbytes < best.nbytes):
                    best = b
            if best is not None:
                self.reused += 1
                return best[:nbytes]  # the view is made under the lock: the buffer is claimed
            self.allocated += 1
            fresh = np.empty(size, np.uint8)
            if sum(b.nbytes for b in self.buffers) + size <= self.max_bytes:
                self.buffers.append(fresh)
            else:  # full: replace the largest unused buffer, if any, so that sizes keep up
                free = None
                for b in self.buffers:
                    if self._refs(b) <= self._unused and (free is None or b.nbytes > free.nbytes):
                        free = b
                if free is not None:
                    self.buffers = [fresh if b is free else b for b in self.buffers]
            return fresh[:nbytes]


def _shared_int(value: int):
    """An int in shared memory, inherited by forked and spawned workers (None where unavailable)."""
    try:
        return multiprocessing.Value("q", value, lock=False)
    except (OSError, ImportError):  # no usable shared memory: epochs then reach workers at their start only
        return None


_PIN_WARNED = False


def _can_pin() -> bool:
    global _PIN_WARNED
    ok = torch.accelerator.is_available() if hasattr(torch, "accelerator") else torch.cuda.is_available()
    if not ok and not _PIN_WARNED:
        log.warning("pin_memory=True but no accelerator is available: items are not pinned")
        _PIN_WARNED = True
    return ok


class _SlotReader:
    """Iterator over one slot's plan: reads groups ahead on threads, hands out items in plan order.

    Groups are submitted in order of first use, up to ``prefetch`` groups beyond the one being handed
    out; a group's data is released after its last item is handed out (the shuffle pool's memory)."""

    def __init__(self, ds: HiddenStateDataset, plan: SlotPlan, progress: _Progress) -> None:
        self.ds, self.plan, self.progress = ds, plan, progress
        self.pos = progress.count
        self.rows = ds._epoch(progress.epoch).entry_cat[plan.entries]
        self.group_rows: dict[int, np.ndarray] = {}
        self.last_use: dict[int, int] = {}
        self.rank_of: dict[int, int] = {}  # group -> index in order of first use
        self.order: list[int] = []
        rest = plan.groups[self.pos:]
        if len(rest):
            srt = np.argsort(rest, kind="stable")
            g_sorted = rest[srt]
            cuts = np.flatnonzero(np.r_[True, g_sorted[1:] != g_sorted[:-1]])
            firsts = {}
            for c0, c1 in zip(cuts.tolist(), np.r_[cuts[1:], len(srt)].tolist()):
                g = int(g_sorted[c0])
                self.group_rows[g] = self.rows[self.pos + srt[c0:c1]]
                self.last_use[g] = self.pos + int(srt[c1 - 1])
                firsts[g] = int(srt[c0])
            self.order = sorted(firsts, key=firsts.__getitem__)
            self.rank_of = {g: i for i, g in enumerate(self.order)}
        self.futures: dict[int, Future] = {}
        self.next_submit = 0
        self.pool: ThreadPoolExecutor | None = None
        self.closed = False

    def __iter__(self) -> "_SlotReader":
        return self

    def _submit_through(self, idx: int) -> None:
        if self.pool is None:
            self.ds._attach_cache()
            self.pool = ThreadPoolExecutor(self.ds.prefetch, thread_name_prefix="hsstore-loader")
        while self.next_submit < len(self.order) and self.next_submit <= idx:
            g = self.order[self.next_submit]
            self.futures[g] = self.pool.submit(self.ds.read_group, self.group_rows.pop(g))
            self.next_submit += 1

    def __next__(self) -> dict[str, Any]:
        plan, ds, progress = self.plan, self.ds, self.progress
        try:
            while self.pos < len(plan):
                p = self.pos
                g = int(plan.groups[p])
                self._submit_through(self.rank_of[g] + ds.prefetch)
                rec = self.futures[g].result()[int(self.rows[p])]
                if p == self.last_use[g]:
                    del self.futures[g]
                self.pos = progress.count = p + 1
                if isinstance(rec, Exception):
                    if ds.skip_corrupt and isinstance(rec, CorruptionError):
                        progress.skipped += 1
                        log.warning("skipping corrupt sample (%d skipped so far): %s", progress.skipped, rec)
                        continue
                    raise rec
                progress.recent.append(p)
                return ds._item(rec)
        except BaseException:
            self.close()
            raise
        self.close()
        raise StopIteration

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for f in self.futures.values():
            f.cancel()
        self.futures.clear()
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


# -- states across ranks and workers ----------------------------------------------------------------------
def _normalise(state: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(state, Mapping) or STATE_KEY not in state:
        found = list(_find_states(state))
        if len(found) == 1:
            state = found[0]
        elif found:
            state = merge_states(found)
        else:
            raise LoaderStateError("not an hsstore loader state (no 'hsstore_loader' key found)")
    if state[STATE_KEY] > STATE_VERSION:
        raise LoaderStateError(f"loader state version {state[STATE_KEY]} is newer than this hsstore reads")
    st = dict(state)
    st["counts"] = {int(k): int(v) for k, v in (state.get("counts") or {}).items()}
    st["skipped"] = {int(k): int(v) for k, v in (state.get("skipped") or {}).items()}
    st["world"] = [int(x) for x in state["world"]] if state.get("world") else None
    st["epoch"], st["phase"] = int(state["epoch"]), int(state["phase"])
    st["config"] = dict(state["config"])
    return st


def _find_states(obj: Any) -> Iterator[Mapping[str, Any]]:
    if isinstance(obj, Mapping):
        if STATE_KEY in obj:
            yield obj
            return
        for v in obj.values():
            yield from _find_states(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _find_states(v)


def merge_states(states: Iterable[Any]) -> dict[str, Any]:
    """One resume state from the states of all ranks and workers of a run.

    Accepts ``HiddenStateDataset.state_dict()`` results, ``StatefulDataLoader.state_dict()`` results
    (per-worker states are found inside), or lists of them, e.g. the ``all_gather_object`` of every
    rank's loader state. Load the result with ``dataset.load_state_dict`` before building the loader.
    """
    found = [_normalise(s) for s in _find_states(list(states))]
    if not found:
        raise LoaderStateError("no hsstore loader state found in what was given")
    live = [s for s in found if s["world"] is not None] or found[:1]
    base = live[0]
    for s in live[1:]:
        for k in ("config", "epoch", "done", "phase", "world"):
            if s[k] != base[k]:
                raise LoaderStateError(f"states disagree on {k!r} ({s[k]!r} vs {base[k]!r}): "
                                       "they are not from one run at one step")
    counts: dict[int, int] = {}
    skipped: dict[int, int] = {}
    for s in live:
        for slot, c in s["counts"].items():
            if slot in counts and counts[slot] != c:
                raise LoaderStateError(f"two states give slot {slot} different positions ({counts[slot]} vs {c})")
            counts[slot] = c
        skipped.update(s["skipped"])
    return {**base, "counts": counts, "skipped": skipped}
