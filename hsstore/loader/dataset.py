"""Streaming loader: ``HiddenStateDataset`` yields store samples to a trainer, exactly once per epoch
over all ranks and DataLoader workers, in a seeded order that survives restarts and world-size changes.

How an epoch is laid out (everything below is computed from commit records alone, no feature bytes):

1. **Catalog**: every sample that passes the filters, in store order. Samples are gathered into *units*:
   the consecutive samples of one shard inside one ``unit_tokens`` cell of the chunk grid. A unit is what
   one read fetches (one ``read_range`` per contiguous token range of it): large and contiguous, which
   object stores want. "Unit" is the one word for this read granularity throughout the loader.
2. **Entries**: the epoch's samples with per-store weights applied (weight 2 = every sample twice,
   0.5 = a seeded half chosen anew each epoch). Entry ids are the positions in this canonical list.
3. **Global order**: a seeded permutation of units (``seed``, ``epoch``), samples inside a unit in
   storage order. It depends on nothing else: not on ranks, not on workers. With ``partition="node"``
   each node first gets a fixed share of the units for the whole run (seed and node count only), and the
   order is each node's share permuted anew per epoch, node after node; step 4 then cuts each node's part
   among that node's ranks.
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

    ds = hsstore.HiddenStateDataset(url, layers=[1, 16, 31], planning=hsstore.Planning(seed=0))  # World.detect()
    loader = StatefulDataLoader(hsstore.TokenBatches(ds, token_budget=16384), batch_size=None, num_workers=2)
    for epoch in range(start_epoch, epochs):
        ds.set_epoch(epoch)                      # every epoch, before iterating (persistent workers too)
        for batch in loader: ...
    # checkpoint: every rank saves loader.state_dict()
    # resume, same world size and workers: loader.load_state_dict(saved_state_of_this_rank)
    # resume, another world size or worker count: merge the states of *all* old ranks, then before
    #   building the loader: ds.load_state_dict(hsstore.merge_states(all_old_rank_states))

Reads run on the dataset's own threads (file reads and copies release the GIL; so do CRC32C checks),
and unit buffers are recycled once the trainer drops the items viewing them: in-process from a
``BufferPool``, in DataLoader workers (fork and spawn) from shared-memory segments that the main process
releases as it drops the items (``memory.SharedRing``), so handing an item over copies nothing and a
worker rewrites no memory the trainer still holds. Under ``TokenBatches`` a sample is read straight into its slot
of the batch it will be in (``batching.BatchSlots``; ``_SlotReader.place``) instead of a unit buffer.

Where the parts live: steps 1-5 in ``plan``, each epoch's source (the plan of the stores as they stand, or of a
follower's journal) in ``epochs``, the resume state in ``resume``, item and batch memory in ``memory``; this
module builds the dataset and reads each slot's plan.
"""

from __future__ import annotations

import copy
import logging
import math
import multiprocessing
import time
import os
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import numpy as np
import torch
from torch.utils.data import IterableDataset

from ..format import codec, encodings, fp8, layout_spec
from ..io import storage
from ..io.backends import backend_for
from .batching import Placed
from .cache import ChunkCache, copy_size
from ..errors import CorruptionError, StoreError, salvage_hint
from ..store.items import make_item
from ..distributed import World
from ..format.manifest import check_compatible
from ..io.memory import BufferPool, Rows, empty_host, hand_over
from .options import Planning, Reading, Selection
from .epochs import EpochPart, EpochParts, EpochSource, LiveEpoch, LiveStores, PlanInputs, StoreEpoch
from .plan import SlotPlan, build_catalog
from ..store import reader
from ..store.reader import Store, open_shared
from .resume import LoaderState, LoaderStateError, SlotProgress

log = logging.getLogger(__name__)

def read_ahead_units(rate: float, request_s: float, request_bytes: float, requests_per_unit: float,
                     concurrency: int, floor: int, cap: int) -> int:
    """Units to keep in flight so ``rate`` bytes/s arrive when one request of ``request_bytes`` takes
    ``request_s`` (the store's latency plus the transfer at one connection's bandwidth): Little's law, requests
    in flight = rate x request_s / request_bytes, in units of ``requests_per_unit`` requests, plus the unit
    being handed out. More than ``concurrency`` requests (the connections a read may use) cannot be in flight,
    so no more units than those fill are asked for; never fewer than ``floor`` nor more than ``cap``."""
    need = rate * max(0.0, request_s) / max(1.0, request_bytes)
    need = min(need, float(concurrency) + requests_per_unit)
    return int(min(cap, max(floor, math.ceil(need / max(1.0, requests_per_unit)) + 1)))


class _ReadSample(NamedTuple):
    """One sample as read from a unit buffer (``read_unit``), before it becomes an item (``items.make_item``)."""

    sample_id: str
    input_ids: np.ndarray
    loss_mask: np.ndarray
    feats: torch.Tensor          # [L, T, W] view of the unit buffer (fp8 stores: e4m3fn bits; block: row bytes)
    scales: torch.Tensor | None  # [L, T] row scales of fp8 stores


def _as_sources(url_or_urls, weights, storage_options, share: bool = False) -> tuple[list[Store], list[float]]:
    """The stores to read, opened (``share``: ``open_shared``), and their weights."""
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
    # shared: one rank reads the metadata and broadcasts it (every rank builds the dataset, as under DDP)
    stores = [x if isinstance(x, Store) else open_shared(os.fspath(x), o) if share else reader.open(os.fspath(x), **o)
              for x, o in zip(items, options)]
    return stores, weights


class HiddenStateDataset(IterableDataset):
    """Samples of one or more hsstore stores as a torch ``IterableDataset`` (see the module doc).

    Items are the store's item dicts: ``sample_id``, ``input_ids`` (int64), ``loss_mask`` (bool),
    ``hidden_states`` ``[T, n_layers, H]`` (a view of layer-major memory; with ``pin_memory`` that memory
    is pinned, in DataLoader workers it is shared memory, so handing an item over copies nothing).

    ``layers``: tapped layer ids to read (default: all); only their bytes are fetched. The options come in
    groups (``loader.options``): ``selection`` (which samples and features), ``planning`` (order, rank cut,
    units, shuffle pool; a resume state must agree on it) and ``reading`` (read-ahead, memory, cache,
    corruption). ``world``: who reads (``hsstore.distributed.World``; default ``World.detect()``: torch.distributed
    when initialised, else torchrun's variables, at build; DataLoader workers are found at iteration).
    ``storage_options``: fsspec options, one mapping for all stores or one per store. ``share_metadata``: under
    torch.distributed, the first rank reads the stores' commit records and broadcasts them
    (``hsstore.store.reader.open_shared``): a collective, so every rank must build the dataset (as DDP code does).
    DataLoader workers never re-read them: they get the opened stores with the dataset. ``follow``: epoch 0 takes
    the stores' shards as they commit and ends when every writer finished (``loader.follow.Follow``); epochs 1.. are
    ordinary epochs of what it took. Each epoch is planned and started by its source (``epoch_source``).
    """

    def __init__(
        self,
        url_or_urls: str | Store | Sequence[str | Store] | Mapping[str, float],
        layers: Sequence[int] | None = None,
        *,
        selection: Selection = Selection(),
        planning: Planning = Planning(),
        reading: Reading = Reading(),
        world: World | None = None,
        storage_options: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
        share_metadata: bool = False,
        follow: LiveStores | None = None,
    ) -> None:
        super().__init__()
        if follow is not None and selection.where is not None:
            raise ValueError("follow: where= is applied once, when the dataset is built, so it cannot filter what "
                             "arrives later; use sources, min_loss_tokens or the length bounds")
        if follow is not None and planning.even:
            raise ValueError("follow: even is not supported (epoch 0's size is not known ahead)")
        self.selection, self.planning, self.reading, self.follow = selection, planning, reading, follow
        self.stores, self.weights = _as_sources(url_or_urls, selection.weights, storage_options,
                                                share=share_metadata)
        self._check_stores(layers)
        m = self.stores[0].manifest
        # what is read per token: the layers, then the final norm's output when asked for
        self._features = list(self.layers) + (["final_hidden"] if selection.final_hidden else [])
        self.token_bytes = codec.token_bytes(m.dtype, m.encoding, len(self._features), m.hidden_size)
        self.encoding = encodings.get(m.encoding)
        self.row_scales = self.encoding.row_scale  # the rows' scales read beside them
        self.unit_tokens = planning.unit_tokens(self.token_bytes, m.chunk_tokens)
        self.catalog = build_catalog(self.stores, selection.filters(), self.unit_tokens)
        if len(self.catalog) == 0 and follow is None:
            raise StoreError(f"no samples left after filters {selection.filters().describe()} in "
                             + ", ".join(repr(s.url) for s in self.stores))
        self.selection = replace(selection, where=None)  # applied; a lambda does not pickle (spawn)
        self.filters = self.selection.filters()
        self.world = (world or World.detect(by_node=planning.partition == "node")).at(worker=0, workers=1)
        self.max_prefetch = reading.max_prefetch(self.unit_tokens * self.token_bytes)
        self.plan_inputs = PlanInputs(self.filters, tuple(self.weights), planning, self.unit_tokens, self.token_bytes,
                                      self.nodes)
        self._plan_stores()
        self._final = False  # following: whether the stores are those epoch 0 took (``_finalize``)
        self._first_epoch: LiveEpoch | None = (None if follow is None else
                                               follow.first_epoch(self.plan_inputs, self.stores, self.world))
        if self.nodes is not None:
            self._log_share()
        self._built = time.time()  # the chunk cache keeps what this run cached since (``cache.ChunkCache``)
        self._epoch_box = _shared_int(0)
        self._epoch_plain = 0
        self.share_memory: bool | None = None  # None: shared memory in DataLoader workers (see _alloc)
        self._resume: LoaderState | None = None
        self._live: SlotProgress | None = None

    def _plan_stores(self) -> None:
        """The planner of ``self.catalog`` (every epoch but a follower's epoch 0)."""
        self.planner = self.plan_inputs.planner(self.catalog)

    def _check_stores(self, layers: Sequence[int] | None) -> None:
        """The stores agree (one manifest's compatibility key), hold samples and the layers asked for
        (``self.layers``), and the final norm's output when it is asked for."""
        first = self.stores[0]
        for store in self.stores[1:]:
            check_compatible(first.manifest, store.manifest, f"store {first.url!r}", f"store {store.url!r}")
        for store in self.stores:
            store.check_manifest()
            if len(store) == 0 and self.follow is None:
                raise StoreError(f"store {store.url!r} has no committed samples (nothing to load)")
        self.layers = first.check_layers(layers)
        for store in self.stores[1:]:
            store.check_layers(self.layers)
        if self.selection.final_hidden and "final_hidden" not in first.manifest.features:
            raise StoreError(f"final_hidden asked for, store {first.url!r} does not hold it (written without "
                             "hsstore extract --final-hidden, or imported from files without hidden_state)")

    @property
    def nodes(self) -> int | None:
        """The plan's node count: the world's with ``partition="node"``; None for a global plan (one part over
        the whole world: its states carry no node count)."""
        return self.world.nodes if self.planning.partition == "node" else None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_live"] = None
        state.pop("_buffers", None)
        if self._epoch_box is not None and multiprocessing.context.get_spawning_popen() is None:
            state["_epoch_box"], state["_epoch_plain"] = None, self.epoch  # plain pickling: a snapshot
        return state

    # -- epochs and the plan ------------------------------------------------------------------------------
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
        """Select the epoch (a new order per epoch). A loaded resume state for another epoch is dropped. A
        follower's epochs after the first need its epoch 0 ended (every writer finished)."""
        if self._first_epoch is not None and int(epoch) > 0:
            self._finalize()
        self.epoch = int(epoch)
        if self._resume is not None and self._resume.epoch != self.epoch:
            self._resume = None

    # -- the epochs' sources ---------------------------------------------------------------------------------
    def epoch_source(self, epoch: int | None = None) -> EpochSource:
        """How epoch ``epoch`` (default: the current one) is planned and read (``loader.epochs``): a follower's epoch
        0 from its journal, every other epoch from the stores (a follower's later epochs: as epoch 0 took them)."""
        epoch = self.epoch if epoch is None else int(epoch)
        if self._first_epoch is not None:
            if epoch == 0:
                return self._first_epoch
            self._finalize()  # here too, not only in set_epoch: persistent workers learn the epoch from shared memory
        return self._stores_epoch(epoch)

    def _stores_epoch(self, epoch: int) -> StoreEpoch:
        """Epoch ``epoch`` planned from the stores as this dataset holds them (``epochs.StoreEpoch``)."""
        return StoreEpoch(self.planner, self.stores, self.catalog, int(epoch), self.world, self.nodes)

    def follow_plan(self) -> Any:
        """Deprecated: ``epoch_source(0).plan()`` (a follower's epoch 0 is ``loader.follow.JournalEpoch``)."""
        warnings.warn("HiddenStateDataset.follow_plan() is deprecated: a follower's epoch_source(0) plans epoch 0 "
                      "(its plan() is what this returned)", DeprecationWarning, stacklevel=2)
        return self.epoch_source(0).plan()  # type: ignore[attr-defined]

    def _finalize(self) -> None:
        """Epochs 1..: the stores as epoch 0 took them (every joined shard), planned as any store."""
        if self._final:
            return
        self.stores = self._first_epoch.final_stores()
        self.catalog = self.plan_inputs.catalog(self.stores)
        if len(self.catalog) == 0:
            raise StoreError(f"no samples left after filters {self.filters.describe()} in what epoch 0 followed")
        self._plan_stores()
        self._final = True

    def _log_share(self) -> None:
        units, nbytes = self.planner.node_share(self.world.nodes, self.world.node)
        log.info("partition=node: node %d of %d reads a fixed %d of %d read unit(s), %.2f GB, every epoch",
                 self.world.node, self.world.nodes, units, self.catalog.n_units, nbytes / 1e9)
        cache_bytes = self.reading.cache_bytes
        first = self.world.rank % self.world.ranks_per_node == 0  # the node's ranks share its cache: one says it
        need = self.node_cache_bytes() if self.reading.cache_dir is not None and first else 0
        if need > cache_bytes:
            log.warning("cache_bytes %s (%.2f GB) holds %.0f%% of this node's part of the store: every epoch after "
                        "the first fetches the other %.2f GB again; cache_bytes %d (%.2f GB) serves it from the "
                        "cache alone", cache_bytes, cache_bytes / 1e9, 100 * cache_bytes / need,
                        (need - cache_bytes) / 1e9, need, need / 1e9)

    def node_cache_bytes(self) -> int:
        """Bytes of chunk cache this node's part of the stores (``partition="node"``) fills: every remote chunk
        object its reads fetch, once, with its digest (``cache.copy_size``): with at least this much, epochs after
        the first fetch nothing. 0 when nothing it reads is cached (local stores, layouts without chunk cache)."""
        cat = self.catalog
        rows = self.planner.node_rows(self.world.nodes, self.world.node)
        total = 0
        for si, store in enumerate(self.stores):
            if backend_for(store.fs).local_paths or not layout_spec.get(store.manifest.layout).chunk_cache:
                continue
            mine = rows[cat.store[rows] == si]
            shards = cat.shard[mine]
            for sh in np.unique(shards):
                part = mine[shards == sh]
                spans = list(zip(cat.start[part].tolist(), cat.stop[part].tolist()))
                files = store.chunk_files(store.commits[int(sh)].shard, spans, self._features)
                total += sum(copy_size(n) for n in files.values())
        return total

    def _resumed(self) -> LoaderState | None:
        """The loaded resume state when it is for the current epoch."""
        return self._resume if self._resume is not None and self._resume.epoch == self.epoch else None

    def planned_lengths(self, epoch: int, world: World | None = None) -> np.ndarray:
        """Token counts of the samples one slot hands out in ``epoch``, in order, from the epoch's start.

        A slot is one reader of this dataset's world (default: this rank, in-process: worker 0 of 1; another:
        ``ds.world.at(rank, worker, workers)``). Metadata only, so cheap: with ``hsstore.count_token_batches``
        it gives the steps of every epoch before any is read. A follower's epoch 0: what joined so far."""
        parts = self.epoch_source(epoch).planned(self.world if world is None else world)
        return _joined([p.lengths() for p in parts])

    def planned_ids(self, epoch: int, world: World | None = None) -> list[str]:
        """The sample ids of that same order (what the slot yields, less skipped corrupt samples)."""
        parts = self.epoch_source(epoch).planned(self.world if world is None else world)
        return [i for p in parts for i in p.sample_ids()]

    def rank_counts(self) -> list[int]:
        """Entries each rank hands out this epoch (rank ranges do not depend on the worker count)."""
        return self.epoch_source().rank_counts(self._resumed(), self.world)

    def __len__(self) -> int:
        """Entries this rank hands out in the current epoch (after a resume: from the start of the
        resumed phase, i.e. not less what was consumed in it)."""
        return self.rank_counts()[self.world.rank]

    # -- resume state ---------------------------------------------------------------------------------------
    def state_dict(self, pending: int = 0) -> dict[str, Any]:
        """Where this process's iterator is: its slot and how many entries it handed out.

        ``pending``: the last ``pending`` items handed out are not consumed yet (a batcher holds them),
        so a resume hands them out again. Without a live iterator: the loaded state, or the epoch start.
        """
        live = self._live
        if live is None or live.epoch != self.epoch:
            resume = self._resumed()
            if resume is not None:
                return resume.to_dict()
            return self.epoch_source().initial_state().to_dict()
        return live.state(self.epoch_source().config(), pending).to_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume the epoch recorded in ``state`` (from ``state_dict`` or ``merge_states``) at its position."""
        resume = LoaderState.find(state)
        if resume.follow is not None:
            if self._first_epoch is None:
                raise LoaderStateError("resume state is of a following dataset's epoch 0 (follow journal "
                                       f"{resume.follow['journal']}); this dataset does not follow")
            config = self._first_epoch.config()
        else:  # a follower's later epochs: the stores as epoch 0 took them
            config = (self.epoch_source(resume.epoch) if resume.epoch > 0 else self._stores_epoch(0)).config()
        diffs = [f"{k}: {resume.config.get(k)!r} vs {v!r}" for k, v in config.items()
                 if resume.config.get(k) != v]
        partition = self.planning.partition
        if resume.config.get("partition", "global") != partition and "partition" not in config:
            diffs.append(f"partition: {resume.config.get('partition', 'global')!r} vs {partition!r}")
        if diffs:
            raise LoaderStateError("resume state was made by a differently configured dataset (state vs this): "
                                   + "; ".join(diffs))
        self.epoch = resume.epoch
        self._resume = resume
        self._live = None

    # -- iteration ----------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, Any]]:
        progress, read = self.epoch_source().start(self._resumed(), self.world.in_worker())
        self._live = progress
        if isinstance(read, EpochPart):  # the epoch planned ahead: one plan, its samples placeable in batches
            return _SlotReader(self._over(read), read.plan, progress)
        return _PartsReader(self, read, progress)

    # -- reading ------------------------------------------------------------------------------------------
    def _over(self, part: EpochPart) -> "HiddenStateDataset":
        """This dataset reading ``part``'s rows of its stores: itself for its own, else a shallow copy that shares
        this process's buffers and chunk caches (a follower's join: the same stores, holding the join's shards)."""
        if part.catalog is self.catalog:
            return self
        self._attach_cache()
        for mine, base in zip(part.stores, self.stores):
            if base.chunk_cache is not None:
                mine.use_chunk_cache(base.chunk_cache)
        self._pool()
        view = copy.copy(self)
        view.stores, view.catalog = list(part.stores), part.catalog
        return view

    def _attach_cache(self) -> None:
        cache_dir = self.reading.cache_dir
        if cache_dir is None:
            return
        for store in self.stores:  # one cache object per process: a forked child must not share its lock
            cache = store.chunk_cache
            serves = layout_spec.get(store.manifest.layout).chunk_cache
            if serves and (cache is None or cache.pid != os.getpid()) and not backend_for(store.fs).local_paths:
                store.use_chunk_cache(ChunkCache(cache_dir, self.reading.cache_bytes, keep_since=self._built))

    def _alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Memory for a token range's features (``memory.empty_host``): shared (recycled) in DataLoader workers, pinned when
        asked in the main process, else recycled from this process's pool (numpy's allocator asks for
        huge pages: fresh memory faults in several times faster than torch's)."""
        return empty_host(shape, dtype, pin=self.reading.pin_memory, shared=self.share_memory, pool=self._pool())

    def _pool(self) -> BufferPool:
        pool = self.__dict__.get("_buffers")
        if pool is None or pool.pid != os.getpid():
            pool = self.__dict__["_buffers"] = BufferPool(self.window_bytes())
        return pool

    def window_bytes(self) -> int:
        """About what a slot holds at its peak: the shuffle pool plus the units read ahead."""
        return self.planning.shuffle_bytes + (self.reading.prefetch + 2) * self.unit_tokens * self.token_bytes

    def remote_read(self) -> tuple[float, float] | None:
        """(bytes per request, requests per unit) when any store is remote (the read-ahead is then sized
        from measured request times), else None."""
        if self.reading.remote_rate <= 0 or all(backend_for(s.fs).local_paths for s in self.stores):
            return None
        ct, n = self.stores[0].manifest.chunk_tokens, len(self._features)
        return ct * self.token_bytes / n, max(1.0, n * self.unit_tokens / ct)  # one layer's chunk per request

    def _store_gone(self, store: Store) -> str | None:
        try:
            return None if storage.store_exists(store.fs, store.root, store.url) else "its manifest is gone"
        except Exception as e:  # unreachable counts as gone: nothing can be read from it
            return f"it cannot be reached ({type(e).__name__}: {e})"

    def _sample_id(self, row: int) -> str:
        return self.catalog.sample_id(self.stores, row)

    def feature_layout(self) -> tuple[int, int, torch.dtype, bool, bool]:
        """What an item's features are, per token: (features read, elements per row (the hidden size, or a block
        encoding's bytes), torch dtype of the features, fp8 with row scales, whether the last feature is
        ``final_hidden``) (``batching.BatchSlots`` sizes batches by it)."""
        m = self.stores[0].manifest
        return (len(self._features), self.encoding.width(m.hidden_size), self._stored_dtype(), self.row_scales,
                self.selection.final_hidden)

    def _stored_dtype(self) -> torch.dtype:
        """The torch dtype items hold features in before any decoding: the manifest's, e4m3fn, or bytes."""
        if self.row_scales:
            return fp8.FP8_DTYPE
        return torch.uint8 if self.encoding.quantised else codec.TORCH_DTYPE[self.stores[0].manifest.dtype]

    def can_place(self) -> bool:
        """Whether items can be read straight into memory the caller places them in (``read_placed``): not when
        the host decodes encoded features (the item is then new memory)."""
        return not (self.encoding.quantised and self.reading.dequantise)

    def read_unit(self, rows: np.ndarray) -> dict[int, _ReadSample | CorruptionError]:
        """Read catalog rows of one shard (one unit): row -> the sample read, or the ``CorruptionError``
        of that sample. Contiguous rows are read with one ``read_range``."""
        return self._read_rows(np.unique(rows), None)

    def read_placed(self, rows: np.ndarray, positions: np.ndarray, place: Callable[[int], Placed]
                    ) -> dict[int, _ReadSample | CorruptionError]:
        """``read_unit`` of the samples at plan ``positions`` (catalog ``rows``, one per position), each read
        straight into the memory ``place(position)`` gives it (its slot of a batch: ``batching.BatchSlots``), every
        chunk checked there before this returns: position -> the sample, or its ``CorruptionError``. A row at
        several positions (weights above 1) is read once and copied to the others."""
        first: dict[int, int] = {}
        for r, p in zip(rows.tolist(), positions.tolist()):
            first.setdefault(r, p)
        got = self._read_rows(np.array(sorted(first), np.int64), {r: place(p) for r, p in first.items()})
        out: dict[int, Any] = {}
        for r, p in zip(rows.tolist(), positions.tolist()):
            sample = got[r]
            if p != first[r] and isinstance(sample, _ReadSample):
                feats, scales = place(p)
                feats.copy_(sample.feats)
                if scales is not None:
                    scales.copy_(sample.scales)
                sample = sample._replace(feats=feats, scales=scales)
            out[p] = sample
        return out

    def _read_rows(self, rows: np.ndarray, places: dict[int, Placed] | None) -> dict[int, _ReadSample | CorruptionError]:
        """``read_unit`` of sorted unique ``rows``, into ``places`` (row -> its memory) when given."""
        cat = self.catalog
        store = self.stores[int(cat.store[rows[0]])]
        commit = store.commits[int(cat.shard[rows[0]])]
        out: dict[int, Any] = {}
        ranges = np.split(rows, np.flatnonzero(cat.start[rows[1:]] != cat.stop[rows[:-1]]) + 1)
        try:
            for contiguous in ranges:
                self._read_range(store, commit, contiguous, out, places)
        except (CorruptionError, StoreError) as e:
            gone = self._store_gone(store)
            if gone:
                raise StoreError(f"store {store.url!r} disappeared mid-epoch ({gone}) while reading shard "
                                 f"{commit.shard!r}: {e}") from None
            if not isinstance(e, CorruptionError):
                raise
            out = {}
            for row in rows:  # find the samples at fault, keep the rest
                try:
                    self._read_range(store, commit, np.array([row]), out, places)
                except CorruptionError as e1:
                    out[int(row)] = CorruptionError(f"store {store.url!r}, shard {commit.shard!r}, "
                                                    f"sample {self._sample_id(int(row))!r}: {e1}")
        return out

    def _read_range(self, store: Store, commit, rows: np.ndarray, out: dict[int, Any],
                    places: dict[int, Placed] | None = None) -> None:
        """Catalog rows whose tokens are one contiguous range of a shard: one ``read_range``, into a unit buffer, or
        with ``places`` each row's features into its own memory (``memory.Rows``: one piece per sample)."""
        cat = self.catalog
        a, b = int(cat.start[rows[0]]), int(cat.stop[rows[-1]])
        m = store.manifest
        sid = commit.samples["sample_id"]
        if places is not None:
            placed = [places[int(row)] for row in rows]
            bits = [Rows([_storage_bits(f[j], m.dtype) for f, _ in placed]) for j in range(len(self._features))]
            scales = ([Rows([sc[j].numpy() for _, sc in placed]) for j in range(len(self._features))]
                      if self.row_scales else None)
            ids, mask, _ = store.read_range(commit.shard, a, b, self._features, out=bits, scales_out=scales)
            for row, (feats, sc) in zip(rows, placed):
                s, e = int(cat.start[row]) - a, int(cat.stop[row]) - a
                self._check_served(store, int(row), mask[s:e])
                out[int(row)] = _ReadSample(sid[int(cat.local[row])], ids[s:e], mask[s:e], feats, sc)
            return
        shape = (len(self._features), b - a, self.encoding.width(m.hidden_size))
        scales = None
        if self.row_scales:  # e4m3fn bits, and the rows' scales
            feats = self._alloc(shape, torch.uint8).view(fp8.FP8_DTYPE)
            scales = self._alloc(shape[:2], torch.float32)
        else:
            feats = self._alloc(shape, self._stored_dtype())
        ids, mask, _ = store.read_range(commit.shard, a, b, self._features, out=_storage_bits(feats, m.dtype),
                                        scales_out=None if scales is None else scales.numpy())
        for row in rows:
            s, e = int(cat.start[row]) - a, int(cat.stop[row]) - a
            self._check_served(store, int(row), mask[s:e])
            out[int(row)] = _ReadSample(sid[int(cat.local[row])], ids[s:e], mask[s:e],
                                        feats[:, s:e], None if scales is None else scales[:, s:e])

    def _check_served(self, store: Store, row: int, mask: np.ndarray) -> None:
        """Catalog row ``row``'s sample as read, held to its record before it is served (``Store.check_served``)."""
        cat = self.catalog
        store.check_served(int(store.table.first[int(cat.shard[row])]) + int(cat.local[row]), mask)

    def _item(self, sample: _ReadSample) -> dict[str, Any]:
        item = make_item(sample.sample_id, sample.input_ids, sample.loss_mask, sample.feats, sample.scales,
                         dtype=self.stores[0].manifest.dtype, final_hidden=self.selection.final_hidden,
                         dequantise=self.reading.dequantise, encoding=self.encoding.name,
                         hidden=self.stores[0].manifest.hidden_size,
                         pin=self.reading.pin_memory and sample.feats.is_pinned())  # pinned in the main process only
        return hand_over(item)  # in a worker: its shared segment is reused once the consumer drops it

    def __repr__(self) -> str:
        return (f"HiddenStateDataset({[s.url for s in self.stores]}, samples={len(self.catalog)}, layers={self.layers}, "
                f"rank={self.world.rank}/{self.world.world}, epoch={self.epoch})")


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    """One array of a slot's parts' arrays, in order."""
    return parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _storage_bits(feats: torch.Tensor, dtype: str) -> np.ndarray:
    """The bits of features (an item's dtype, fp8, or a block encoding's bytes) as the store's storage dtype, for
    ``read_range`` to fill."""
    if feats.dtype in (fp8.FP8_DTYPE, torch.uint8):
        return feats.view(torch.uint8).numpy()
    return feats.view(torch.int16 if feats.element_size() == 2 else torch.int32).numpy().view(codec.STORAGE_DTYPE[dtype])


def _shared_int(value: int):
    """An int in shared memory, inherited by forked and spawned workers (None where unavailable)."""
    try:
        return multiprocessing.Value("q", value, lock=False)
    except (OSError, ImportError):  # no usable shared memory: epochs then reach workers at their start only
        return None


class _SlotReader:
    """Iterator over one slot's plan: reads units ahead on threads, hands out items in plan order.

    Units are submitted in order of first use, up to ``prefetch`` units beyond the one being handed
    out; a unit's data is released after its last item is handed out (the shuffle pool's memory). ``offset``:
    where the plan starts in the slot's stream (a follower's epoch 0 is one plan per join, one after another).
    ``place`` (before the first item): each sample is read straight into the memory it gives the sample's plan
    position (``TokenBatches``: its slot of the batch it will be in), rather than into a unit buffer."""

    def __init__(self, ds: HiddenStateDataset, plan: SlotPlan, progress: SlotProgress, offset: int = 0) -> None:
        self.ds, self.plan, self.progress, self.offset = ds, plan, progress, offset
        self.pos = progress.count - offset
        self.rows = plan.rows
        self.unit_rows: dict[int, np.ndarray] = {}
        self.unit_pos: dict[int, np.ndarray] = {}  # unit -> the plan positions of its rows
        self.last_use: dict[int, int] = {}
        self.rank_of: dict[int, int] = {}  # unit -> index in order of first use
        self.order: list[int] = []
        rest = plan.units[self.pos:]
        if len(rest):
            srt = np.argsort(rest, kind="stable")
            u_sorted = rest[srt]
            cuts = np.flatnonzero(np.r_[True, u_sorted[1:] != u_sorted[:-1]])
            firsts = {}
            for c0, c1 in zip(cuts.tolist(), np.r_[cuts[1:], len(srt)].tolist()):
                g = int(u_sorted[c0])
                self.unit_pos[g] = self.pos + srt[c0:c1]
                self.unit_rows[g] = self.rows[self.unit_pos[g]]
                self.last_use[g] = self.pos + int(srt[c1 - 1])
                firsts[g] = int(srt[c0])
            self.order = sorted(firsts, key=firsts.__getitem__)
            self.rank_of = {g: i for i, g in enumerate(self.order)}
        self.futures: dict[int, Future] = {}
        self.depth = ds.reading.prefetch  # units read ahead: grows on remote stores (read_ahead_units)
        self.remote = ds.remote_read()
        self.request_s = math.inf  # the fastest request time seen (remote stores)
        self.next_submit = 0
        self.pool: ThreadPoolExecutor | None = None
        self.placer: Callable[[int], Placed] | None = None
        self.closed = False

    def __iter__(self) -> "_SlotReader":
        return self

    def lengths(self) -> np.ndarray:
        """Token counts of the samples still to come, in order (plan positions ``first()`` on)."""
        cat = self.ds.catalog
        rows = self.rows[self.pos:]
        return cat.stop[rows] - cat.start[rows]

    def first(self) -> int:
        """The plan position of the next sample."""
        return self.pos

    def place(self, placer: Callable[[int], Placed]) -> None:
        """Read every sample from now on into ``placer(plan position)`` (see the class doc)."""
        if self.next_submit:
            raise RuntimeError("place() comes before the first item")
        self.placer = placer

    def _submit_through(self, idx: int) -> None:
        if self.pool is None:
            self.ds._attach_cache()
            workers = self.ds.max_prefetch if self.remote else self.ds.reading.prefetch
            self.pool = ThreadPoolExecutor(workers, thread_name_prefix="hsstore-loader")
        while self.next_submit < len(self.order) and self.next_submit <= idx:
            g = self.order[self.next_submit]
            rows, positions = self.unit_rows.pop(g), self.unit_pos.pop(g)
            self.futures[g] = self.pool.submit(self._read if self.remote else self._read_local, rows, positions)
            self.next_submit += 1

    def _read_local(self, rows: np.ndarray, positions: np.ndarray):
        """One unit's samples: row -> sample (position -> sample when placed)."""
        if self.placer is None:
            return self.ds.read_unit(rows)
        return self.ds.read_placed(rows, positions, self.placer)

    def _read(self, rows: np.ndarray, positions: np.ndarray):
        """A remote unit read, timed: its per-request time sizes the read-ahead (``read_ahead_units``)."""
        t = time.perf_counter()
        out = self._read_local(rows, positions)
        took = time.perf_counter() - t
        cat, ds = self.ds.catalog, self.ds
        request, per_unit = self.remote
        requests = max(1.0, float((cat.stop[rows] - cat.start[rows]).sum()) * ds.token_bytes / request)
        rounds = math.ceil(requests / storage.metadata_concurrency())
        self.request_s = min(self.request_s, took / rounds)
        self.depth = read_ahead_units(ds.reading.remote_rate, self.request_s, request, per_unit,
                                      storage.metadata_concurrency(), ds.reading.prefetch, ds.max_prefetch)
        return out

    def __next__(self) -> dict[str, Any]:
        plan, ds, progress = self.plan, self.ds, self.progress
        try:
            while self.pos < len(plan):
                p = self.pos
                g = int(plan.units[p])
                self._submit_through(self.rank_of[g] + self.depth)
                sample = self.futures[g].result()[p if self.placer is not None else int(self.rows[p])]
                if p == self.last_use[g]:
                    del self.futures[g]
                self.pos = p + 1
                progress.count = self.offset + p + 1
                if isinstance(sample, Exception):
                    if ds.reading.skip_corrupt and isinstance(sample, CorruptionError):
                        progress.skipped += 1
                        log.warning("skipping corrupt sample (%d skipped so far): %s", progress.skipped, sample)
                        continue
                    if isinstance(sample, CorruptionError):  # the one line that stops training says the way on
                        url = ds.stores[int(ds.catalog.store[int(self.rows[p])])].url
                        raise CorruptionError(f"{sample}; {salvage_hint(url)}") from None
                    raise sample
                progress.recent.append(self.offset + p)
                return ds._item(sample)
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


class _PartsReader:
    """Iterator over a slot's epoch that its source gives part after part (``epochs.EpochParts``: a follower's epoch
    0, a part per join): each part's plan read by a ``_SlotReader``, its positions after the parts before it. A part
    wholly handed out before a resume is passed over."""

    def __init__(self, ds: HiddenStateDataset, parts: EpochParts, progress: SlotProgress) -> None:
        self.ds, self.parts, self.progress = ds, parts, progress
        self.offset, self.length = 0, 0
        self.reader: _SlotReader | None = None

    def __iter__(self) -> "_PartsReader":
        return self

    def _open_next(self) -> None:
        while True:
            part = next(self.parts)
            if self.progress.count >= self.offset + len(part.plan):
                self.offset += len(part.plan)
                continue
            self.reader = _SlotReader(self.ds._over(part), part.plan, self.progress, offset=self.offset)
            self.length = len(part.plan)
            return

    def __next__(self) -> dict[str, Any]:
        try:
            while True:
                if self.reader is None:
                    self._open_next()
                try:
                    return next(self.reader)
                except StopIteration:
                    self.offset += self.length
                    self.reader = None
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
        self.parts.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
