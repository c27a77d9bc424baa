"""Reading a store: ``hsstore.open(url)`` -> :class:`Store`.

A store is the set of committed shards under a prefix; the sample order is shard-name order, then
order within the shard. Opening reads the manifest and the commit records only (no feature data), so
it is cheap on a large store; ``read`` fetches just the chunks of the requested layers that overlap
the sample, all layers concurrently.
"""

from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

from ..format import admission, codec, commit, encodings, fp8, index, names, records
from ..layouts import base as layout
from ..io import memory, storage
from ..format.commit import CommitRecord
from ..errors import CorruptionError, ManifestError, SampleError, StoreError
from .items import make_item
from ..format.manifest import Manifest, read_manifest
from ..io.storage import MANIFEST_FILE
from ..redaction import recordable_url
from ..terminal import lookalike, lookalike_refusal
from ..layouts.source import ShardSource
from . import broadcast, fork  # noqa: F401  (fork: its hooks installed with the reader, before any worker forks)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SampleRef:
    """Where sample ``index`` lives: shard, token range within the shard."""

    index: int
    shard: str
    local: int
    start: int
    stop: int
    sample_id: str


def _fits(dest, shape: tuple[int, ...], dtype: np.dtype) -> bool:
    """Whether ``dest`` (an array, or one ``memory.Rows`` per layer) can take features of ``shape`` (layer-major)."""
    if isinstance(dest, np.ndarray):
        return dest.shape == shape and dest.dtype == dtype and dest.flags.c_contiguous
    return (isinstance(dest, (list, tuple)) and len(dest) == shape[0]
            and all(isinstance(r, memory.Rows) and len(r) == shape[1] and r.dtype == dtype
                    and r.row_shape == shape[2:] for r in dest))


def _described(dest) -> str:
    if isinstance(dest, np.ndarray):
        return f"{dest.dtype} {dest.shape}"
    return f"{type(dest).__name__} of {len(dest)}" if isinstance(dest, (list, tuple)) else type(dest).__name__


class Store:
    """A read-only view of the committed shards of one store, as they were when opened."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, *, use_index: bool = True,
                 loaded: tuple[Manifest, records.RecordTable, index.IndexUse] | None = None,
                 allow_locations: Sequence[str] | None = None) -> None:
        """``use_index=False`` reads every commit record one by one (what ``verify`` compares the index with);
        ``loaded``: manifest, records and index use read elsewhere (``open_shared``: rank 0's).
        ``allow_locations``: prefixes (URLs, local paths) that shards merged by reference may be read from, besides
        the store itself; ``names.allowed`` adds the command's and ``env.ALLOW_LOCATIONS``'s (``names.location``:
        local system paths never).

        The records are held as columns (``self.table``, ``records.RecordTable``); ``self.commits`` is the
        sequence of :class:`CommitRecord`, each parsed when first asked for."""
        self.url = url
        self.storage_options = storage_options or {}
        fs, self.root = storage.resolve(url, self.storage_options)
        if loaded is None:
            manifest = read_manifest(fs, self.root, url)
            if manifest.chunk_tokens is None:
                raise ManifestError(f"{url}/{MANIFEST_FILE}: chunk_tokens is not set (no writer has initialised "
                                    "this store)")
            snap = index.load(fs, self.root, use_index=use_index)
            loaded, self._origin = (manifest, snap.table, snap.use), snap.origin
            self.damaged = snap.damaged
        else:
            self._origin, self.damaged = None, {}
        self._breaches: list[admission.Breach] | None = None  # the store's rules, checked when first asked
        self.manifest, self.table, self.index_use = loaded
        self.commits = records.Records(self.table, fallback=self._from_commits)
        t = self.table
        key = self.manifest.shard_key()
        # shards written under another manifest: the manifest was edited afterwards (verify names them)
        odd = [c for c, k in enumerate(t.manifest_key.values) if k and k != key]
        self.manifest_mismatch = [t.shard[i] for i in np.flatnonzero(np.isin(t.manifest_key.codes, odd))]
        self._first = t.first
        self._by_name: dict[str, int] | None = None  # shard name -> row, made when first needed
        # shards merged by reference live in another store: shard name -> that store's URL
        # (a location outside the store, unless allowed: refused when the shard is read, named by verify)
        self.allow_locations = allow = names.allowed(allow_locations)
        self.locations, self.bad_locations = {}, {}
        elsewhere = [c for c, v in enumerate(t.location.values) if v is not None]
        for i in np.flatnonzero(np.isin(t.location.codes, elsewhere)).tolist():
            shard = t.shard[i]
            try:
                self.locations[shard] = names.location(url, t.location[i], allow, f"store {url!r}, shard {shard!r}")
            except StoreError as e:
                self.bad_locations[shard] = str(e)
        # all that the layout sees of this store (layouts never get the Store itself)
        self.source = ShardSource.opened(url, fs, self.root, self.storage_options, self.manifest, self.locations,
                                         self.bad_locations)

    # -- admission -------------------------------------------------------------------------------
    def breaches(self) -> list[admission.Breach]:
        """Every breach of the store-wide rules of the admission (``format/admission.py``), from the columns the
        store holds (no request): what ``info`` leads with and ``verify`` reports."""
        if self._breaches is None:
            self._breaches = list(admission.table_breaches(self.table, self.manifest, self.damaged))
        return self._breaches

    def admit(self) -> None:
        """Refuse (``admission.AdmissionRefused``, one line naming the shard and the rule) a store that breaks a store-wide
        rule; every reader calls it before it serves anything of the store."""
        bad = self.breaches()
        if bad:
            raise admission.refusal(self.url, bad[0])

    def shard_breaches(self, rec: CommitRecord) -> list[admission.Breach]:
        """The breaches of a shard's own rules in its parsed record (the layout's extent through this store's
        shard source), a ``location`` this store refuses first."""
        bad = self.bad_locations.get(rec.shard)
        first = [admission.Breach(rec.shard, "names", f"location not followed: {bad}", "location")] if bad else []
        return first + list(admission.shard_breaches(rec, lambda r: self._layout.check_extent(self.source, r)))

    def admit_shard(self, rec: CommitRecord) -> None:
        """``admit``, then refuse a shard that breaks a rule of its own; checked once per parsed record (a reader
        touches a shard's record before it reads any of its bytes)."""
        self.admit()
        if getattr(rec, "_admitted", False):
            return
        bad = self.shard_breaches(rec)
        if bad:
            raise admission.refusal(self.url, bad[0])
        rec._admitted = True

    def check_served(self, i: int, mask: np.ndarray) -> None:
        """Refuse sample ``i`` read for serving when its loss_mask (read anyway) is not what its record says
        (``admission.served_problem``)."""
        why = admission.served_problem(int(self.table.samples["loss_tokens"][i]), mask)
        if why:
            r = self.ref(i)
            raise CorruptionError(f"store {self.url!r}, shard {r.shard!r}, sample {r.sample_id!r}: refused by rule "
                                  f"'served' ({why}); `hsstore verify` names every problem")

    def check_shard(self, shard_index: int, mask: np.ndarray, samples: range | None = None) -> None:
        """``check_served`` for samples ``samples`` of shard ``shard_index`` (default: all) at once
        (``admission.loss_disagreements``), refusing at the first that breaks it; ``mask`` holds their tokens, from
        the first one's on. What copies a shard as it is (``convert``) asks it of the shard read whole before writing
        any of it, a scan of each window before handing any of it on."""
        off, base = self._offsets(shard_index), int(self._first[shard_index])  # (the counts rule: off[-1] = T)
        k = range(len(off) - 1) if samples is None else samples
        at = off[k.start:k.stop + 1] - off[k.start]
        tokens = self.table.samples["loss_tokens"][base + k.start:base + k.stop]
        bad = admission.loss_disagreements(tokens, mask, at)
        if len(bad):
            j = int(bad[0])
            self.check_served(base + k.start + j, mask[int(at[j]):int(at[j + 1])])

    def check_loss_tokens(self, shard_name: str) -> None:
        """A shard's loss_mask (a byte a token, beside its features) read whole (``Layout.read_loss_mask``) and
        every sample held to its record (``check_shard``): what hands a shard on without reading its samples
        (``merge``, ``copy``) asks this before the first write, so a record whose loss tokens its mask does not hold
        goes nowhere."""
        rec = self.admitted(shard_name)  # its rules first: the record sizes what is read
        self.check_shard(self._by_name[shard_name], self._layout.read_loss_mask(self.source, rec))

    def admitted(self, shard_name: str) -> CommitRecord:
        """The commit record of a committed shard, admitted (``admit_shard``)."""
        rec = self.record(shard_name)
        self.admit_shard(rec)
        return rec

    # -- index -----------------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self._first[-1])

    @property
    def layers(self) -> list[int]:
        return list(self.manifest.layers)

    @property
    def num_tokens(self) -> int:
        return int(self.table.n_tokens.sum())

    def ref(self, i: int) -> SampleRef:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample index {i} out of range for store {self.url!r} with {n} samples")
        i %= n
        s = int(np.searchsorted(self._first, i, side="right") - 1)
        local = i - int(self._first[s])
        t = self.table
        start = int(t.starts[i])
        return SampleRef(i, t.shard[s], local, start, start + int(t.samples["length"][i]), t.sample_id[i])

    @property
    def _layout(self) -> layout.Layout:
        return layout.get(self.manifest.layout)

    def record(self, shard_name: str) -> CommitRecord:
        """The commit record of a committed shard."""
        if self._by_name is None:
            self._by_name = {n: i for i, n in enumerate(self.table.shard.tolist())}
        try:
            return self.commits[self._by_name[shard_name]]
        except KeyError:
            raise StoreError(f"no committed shard {shard_name!r} in store {self.url!r}") from None

    def sample_ids(self) -> list[str]:
        return self.table.sample_id.tolist()

    def _offsets(self, s: int) -> np.ndarray:
        """Token offsets of shard ``s``'s samples (``CommitRecord.offsets``), from the columns."""
        return self.table.offsets(s)

    # -- data ------------------------------------------------------------------------------------
    @property
    def fs(self):
        """The store's filesystem in this process (re-created after a fork: a child must not reuse the parent's
        event loop; the inherited one is kept, never finalised here, see ``store/fork.py``)."""
        return self.source.filesystem()

    @property
    def chunk_cache(self):
        """The ``cache.ChunkCache`` remote chunk reads go through (see :meth:`use_chunk_cache`), or None."""
        return self.source.chunk_cache

    def use_chunk_cache(self, cache) -> None:
        """Read this store's remote chunks through ``cache`` (a ``cache.ChunkCache``, one per process; None:
        none). The loader calls it in each process that reads; local stores ignore the cache."""
        self.source = self.source.with_cache(cache)

    def _from_commits(self, row: int, why: str) -> CommitRecord:
        """The record of ``row`` read from ``commits/`` when its index entry's bytes are junk (``Records``'s
        fallback): used when it says what the row's columns say, else the index is named as the fault."""
        seg = self._origin.of(row) if self._origin is not None else "(records from another rank)"
        if seg is None:  # the row was read from commits/ itself: nothing else to fall back on
            raise CorruptionError(why)
        name = self.table.shard[row]
        data = commit.read_records(self.fs, self.root, [name])[0]
        rec = CommitRecord.from_json(data, where=f"commit record of shard {name!r}")
        if rec.shard != name or not records.matches_object(self.table, row, rec, data):
            raise CorruptionError(f"store {self.url!r}: index segment {index.INDEX_DIR}/{seg}: the entry of shard "
                                  f"{name!r} disagrees with its commit record ({why}); `hsstore index {self.url}` "
                                  "rewrites the index")
        log.warning("store %r: index segment %s/%s: the entry of shard %r is unusable (%s); read from its commit "
                    "record (`hsstore index` rewrites the index)", self.url, index.INDEX_DIR, seg, name, why)
        return rec

    def shard_location(self, name: str) -> tuple[Any, str, str]:
        """(filesystem, root, URL) of the store that holds shard ``name``'s files: this one, or for a shard
        merged by reference the store its commit record's ``location`` names (same storage options). A shard
        name that is not one path part, a location refused by ``names.location`` and (local disk) a shard path
        that resolves outside the store through a link raise ``StoreError``."""
        return self.source.locate(name)

    def cache_namespace(self) -> str:
        """Key of this store in a shared chunk cache: URL plus endpoint (secrets excluded)."""
        return self.source.cache_namespace()

    def __setstate__(self, state: dict) -> None:
        # (spawned DataLoader workers: the source resolves the filesystem there on first use, without a cache)
        self.__dict__.update(state)
        self.commits.fallback = self._from_commits  # (a bound method is not part of the records' state)

    def check_manifest(self) -> None:
        """Raise unless every shard was written under this manifest (a hand-edited manifest would make
        readers decode the bytes as something they are not)."""
        if self.manifest_mismatch:
            raise ManifestError(f"{self.url}/{MANIFEST_FILE} differs from the manifest that shards "
                                f"{self.manifest_mismatch[:3]} ({len(self.manifest_mismatch)} in all) were written "
                                "under (edited after writing?); run hsstore verify")

    def check_layers(self, layers: Sequence[int] | None) -> list[int]:
        """The layer ids asked for (None: all), checked; a named feature (``final_hidden``) of the store counts
        as one, read after the layers."""
        if layers is None:
            return self.layers
        layers = list(layers)
        missing = [l for l in layers if l not in self.manifest.all_features]
        if missing:
            raise StoreError(f"layers {missing} are not in store {self.url!r} (it holds {self.layers})")
        return layers

    def read_range(self, shard_name: str, start: int, stop: int, layers: Sequence[int] | None = None,
                   out: np.ndarray | None = None, carry: dict | None = None, scales_out: np.ndarray | None = None,
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Tokens ``start:stop`` of one shard: (input_ids int32, loss_mask uint8, features ``[n_layers, T, W]``
        layer-major in the storage dtype; ``W`` is ``hidden``, or a block encoding's bytes per row
        (``codec.row_width``: its values decode with ``encodings.get(manifest.encoding)``)).

        Only the requested layers' bytes are fetched, through the store's layout (zarr: the chunks that
        overlap the range, all at once, concurrently, on object stores; wds: the samples' ``.npy`` members
        by byte range), and every chunk's or member's CRC32C is checked. Zarr, on local disk, uncompressed
        chunks that lie wholly inside the range are read straight into the output (no intermediate copy;
        partial ones go through a reused buffer), as are wds members; that is why the output is layer-major:
        each layer's rows are contiguous, as in the chunk files and members.

        ``out`` (optional) is the features destination, ``[n_layers, T, H]`` C-contiguous in the storage
        dtype, or one ``memory.Rows`` of ``T`` rows of ``H`` per layer (the rows in pieces: the loader reads each
        sample straight into its slot of a batch); the loader passes pinned or shared memory so items need no
        further copy.
        ``carry`` (optional, remote stores): fetched objects shared by consecutive reads of a scan. It is
        consulted before fetching and left holding this read's last chunks, so the chunk that straddles
        two windows crosses the network once.
        ``scales_out`` (required for fp8 stores, whose features are then e4m3fn bits as uint8): the
        destination of the per-row scales, ``[n_layers, T]`` C-contiguous float32 (or one ``Rows`` per layer).
        """
        layers = self.check_layers(layers)
        m = self.manifest
        T, H = stop - start, codec.row_width(m.hidden_size, m.encoding)
        rec = self.admitted(shard_name)  # the rules of the store and the shard, before a byte of it is read
        if not 0 <= start <= stop <= rec.n_tokens:
            raise CorruptionError(f"shard {shard_name!r}: tokens {start}:{stop} outside its {rec.n_tokens} tokens")
        memory.check_fits(T * len(layers) * H * codec.storage_dtype(m.dtype, m.encoding).itemsize,
                          f"store {self.url!r}, shard {shard_name!r}: tokens {start}:{stop} of {len(layers)} layers x "
                          f"hidden {H}")
        ids = np.empty(T, np.int32)
        mask = np.empty(T, np.uint8)
        shape, dtype = (len(layers), T, H), codec.storage_dtype(m.dtype, m.encoding)
        is_fp8 = encodings.get(m.encoding).row_scale
        if is_fp8 and (scales_out is None or not _fits(scales_out, shape[:2], np.dtype(fp8.SCALE_DTYPE))):
            got = "none" if scales_out is None else _described(scales_out)
            raise ValueError(f"store {self.url!r} is {m.encoding}-encoded: scales_out must be a C-contiguous float32 "
                             f"array of shape {shape[:2]}, got {got}")
        if out is None:
            feats = np.empty(shape, dtype)
        elif not _fits(out, shape, dtype):
            raise ValueError(f"out must be a C-contiguous {dtype} array of shape {shape}, got {_described(out)}")
        else:
            feats = out
        if T <= 0:
            return ids, mask, feats
        self._layout.read_into(self.source, rec, start, stop, layers, ids, mask, feats, carry,
                               scales_out if is_fp8 else None)
        return ids, mask, feats

    def chunk_files(self, shard_name: str, spans: Sequence[tuple[int, int]], layers: Sequence[int]) -> dict[str, int]:
        """The objects (key -> listed size) that ``read_range`` of these token spans of ``layers`` of one shard
        leaves in a chunk cache, each once (the layout's ``chunk_files``)."""
        return self._layout.chunk_files(self.manifest, self.record(shard_name), spans, self.check_layers(layers))

    def new_scales(self, n_layers: int, T: int) -> np.ndarray | None:
        """A destination for ``read_range``'s ``scales_out`` in an fp8 store (None otherwise)."""
        return np.empty((n_layers, T), fp8.SCALE_DTYPE) if encodings.get(self.manifest.encoding).row_scale else None

    def read(self, i: int, layers: Sequence[int] | None = None, dequantise: bool = True) -> dict[str, Any]:
        """Sample ``i``: ``sample_id``, ``input_ids`` (int64), ``loss_mask`` (bool),
        ``hidden_states`` ``[T, n_layers, H]`` in the stored dtype (bit-exact). Encoded stores: decoded into the
        manifest dtype, or with ``dequantise=False`` as stored: fp8's e4m3fn values plus ``hidden_scales``
        ``[T, n_layers]``, a block encoding's uint8 rows ``[T, n_layers, W]``."""
        r = self.ref(i)
        layers = self._with_features(layers)
        scales = self.new_scales(len(layers), r.stop - r.start)
        try:
            ids, mask, feats = self.read_range(r.shard, r.start, r.stop, layers, scales_out=scales)
        except CorruptionError as e:
            raise CorruptionError(f"sample {r.sample_id!r} (index {r.index}): {e}") from None
        self.check_served(r.index, mask)
        return self.sample_dict(r.sample_id, ids, mask, feats, scales, dequantise, layers[-1] == "final_hidden")

    def _with_features(self, layers: Sequence[int] | None) -> list:
        """``layers`` checked; None: every layer, then the store's named features (items get ``final_hidden``)."""
        return self.manifest.all_features if layers is None else self.check_layers(layers)

    def sample_dict(self, sample_id: str, ids: np.ndarray, mask: np.ndarray, feats: np.ndarray,
                    scales: np.ndarray | None = None, dequantise: bool = True, final_hidden: bool = False,
                    ) -> dict[str, Any]:
        """The item (``items.make_item``) of stored arrays: ``feats`` layer-major ``[n_layers, T, W]`` in the
        storage dtype, ``scales`` ``[n_layers, T]`` (fp8 stores: see :meth:`read` for ``dequantise``);
        ``final_hidden``: the last feature of ``feats`` is the final norm's output."""
        m = self.manifest
        if scales is not None:
            import torch

            t, sc = torch.from_numpy(feats).view(fp8.FP8_DTYPE), torch.from_numpy(scales)
        elif encodings.get(m.encoding).quantised:
            import torch

            t, sc = torch.from_numpy(feats), None
        else:
            t, sc = codec.from_storage(feats, m.dtype), None
        return make_item(sample_id, ids, mask, t, sc, dtype=m.dtype, final_hidden=final_hidden,
                         dequantise=dequantise, encoding=m.encoding, hidden=m.hidden_size)

    def windows(self, shard_index: int, layers: Sequence[int], window_bytes: int = 512 << 20,
                ) -> list[tuple[int, int, int]]:
        """``(shard_index, first, stop)`` runs of whole samples of about ``window_bytes`` (at least one chunk):
        the large reads a sequential scan makes, each chunk fetched about once. A shard whose columns list no
        sample is admitted here (``admit_shard``), as it is never read: its columns decide nothing unchecked."""
        n, off = int(self.table.n_samples[shard_index]), self._offsets(shard_index)
        if n == 0:
            self.admit_shard(self.commits[shard_index])
        m = self.manifest
        token_bytes = codec.token_bytes(m.dtype, m.encoding, max(1, len(layers)), m.hidden_size)
        window = max(self.manifest.chunk_tokens, window_bytes // token_bytes)
        out, i = [], 0
        while i < n:
            j = i + 1
            while j < n and off[j + 1] - off[i] <= window:
                j += 1
            out.append((shard_index, i, j))
            i = j
        return out

    def iter_windows(self, windows: Sequence[tuple[int, int, int]], layers: Sequence[int] | None = None,
                     prefetch: int = 1, dequantise: bool = True) -> Iterator[dict[str, Any]]:
        """Samples of the given windows in order; the next ``prefetch`` windows are read in a background
        thread while this one is consumed (on object stores, I/O overlaps decoding). ``dequantise``: see
        :meth:`read`."""
        final = self._with_features(layers)[-1] == "final_hidden"
        for sample_id, ids, mask, feats, scales in self.iter_stored(windows, layers, prefetch):
            yield self.sample_dict(sample_id, ids, mask, feats, scales, dequantise, final)

    def iter_stored(self, windows: Sequence[tuple[int, int, int]], layers: Sequence[int] | None = None,
                    prefetch: int = 1) -> Iterator[tuple[str, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]]:
        """``iter_windows`` as the store holds each sample: (sample_id, ids, mask, features ``[n_layers, T, H]``
        in the storage dtype, fp8 scales or None), numpy views, no torch: what a copy into another store
        (``StoreWriter.add_stored``) needs."""
        self.admit()  # before any window: a store whose every shard is refused yields nothing silently otherwise
        layers = self._with_features(layers)
        carry: dict = {}  # the boundary chunk of the previous window (used by one thread at a time)

        def load(w):
            s, i, j = w
            off = self._offsets(s)
            scales = self.new_scales(len(layers), int(off[j] - off[i]))
            return w, self.read_range(self.table.shard[s], int(off[i]), int(off[j]), layers, carry=carry,
                                      scales_out=scales) + (scales,)

        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="hsstore-read") as pool:
            pending: deque = deque()
            todo = iter(windows)
            for w in todo:
                pending.append(pool.submit(load, w))
                if len(pending) > prefetch:
                    break
            while pending:
                (s, i, j), (ids, mask, feats, scales) = pending.popleft().result()
                nxt = next(todo, None)
                if nxt is not None:
                    pending.append(pool.submit(load, nxt))
                off, ids_of = self._offsets(s), self.table.sample_id
                base = int(self._first[s])
                # the whole window held to its record before any of it is handed on: a copy never writes a
                self.check_shard(s, mask, range(i, j))  # sample whose neighbour in the window shows the record forged
                for k in range(i, j):
                    a, b = int(off[k] - off[i]), int(off[k + 1] - off[i])
                    yield (ids_of[base + k], ids[a:b], mask[a:b], feats[:, a:b],
                           None if scales is None else scales[:, a:b])

    def iter_shard(self, shard_index: int, layers: Sequence[int] | None = None,
                   window_bytes: int = 512 << 20) -> Iterator[dict[str, Any]]:
        """The samples of one shard in order, read in large windows (the sequential path for scans)."""
        return self.iter_windows(self.windows(shard_index, self._with_features(layers), window_bytes), layers)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Every sample in store order, with read-ahead across shard boundaries."""
        return self.iter_windows([w for s in range(len(self.commits)) for w in self.windows(s, self.layers)])

    def __repr__(self) -> str:
        return (f"Store({self.url!r}, samples={len(self)}, shards={len(self.commits)}, layers={self.layers}, "
                f"dtype={self.manifest.dtype}, encoding={self.manifest.encoding})")


def committed_ids(url: str, storage_options: dict[str, Any] | None = None) -> set[str]:
    """Sample ids already committed to a store (empty when the store does not exist yet): what a resumed
    job skips. A store the admission refuses is refused here too (a record that does not parse hides ids a
    resumed job would write again)."""
    fs, root = storage.resolve(url, storage_options)
    if not storage.store_exists(fs, root, url):
        return set()
    store = Store(url, storage_options)
    store.admit()
    return set(store.sample_ids())


def refuse_lookalikes(ids: Sequence[str], done: set[str], url: str) -> None:
    """Refuse, before anything is written, a new sample id (of ``ids``, not yet in ``done``: the ids ``url``
    holds) that a person cannot tell from one held or one before it (``terminal.lookalike``)."""
    pair = lookalike(ids, done)
    if pair is not None:
        sid, other = pair
        raise SampleError(lookalike_refusal(sid, other, f"in {recordable_url(url)}" if other in done else "before it"))


def open(url: str, *, allow_locations: Sequence[str] | None = None, **storage_options: Any) -> Store:  # noqa: A001
    """Open a store read-only (``hsstore.open``, named as ``zarr.open``; this module never uses the builtin).
    ``storage_options`` go to fsspec (e.g. ``anon=True``, ``endpoint_url=...``); ``allow_locations``: see
    :class:`Store`."""
    return Store(url, storage_options, allow_locations=allow_locations)


def open_shared(url: str, storage_options: dict[str, Any] | None = None, group=None) -> Store:
    """``Store(url, storage_options)`` opened once per job: under ``torch.distributed`` (initialised, more than
    one rank) the group's first rank reads the manifest and the records and broadcasts them (JSON, never
    pickle); the others read nothing. Every rank of ``group`` must call it, in the same order (a collective).
    Without a process group it is ``Store(url, storage_options)``. Either way the store is admitted
    (``Store.admit``) before it is returned."""
    import torch

    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        store = Store(url, storage_options)
        store.admit()  # as every rank of a group is refused below
        return store
    src = 0 if group is None else dist.get_global_rank(group, 0)
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":  # NCCL moves device tensors only
        device = torch.device("cuda", torch.cuda.current_device())
    if dist.get_rank() == src:
        store, error = None, None
        try:
            store = Store(url, storage_options)
            store.admit()  # refused on every rank alike (the others never see a record that did not parse)
            payload = broadcast.encode(store.manifest, store.index_use, store.table)
        except Exception as e:  # the other ranks are waiting for the broadcast: tell them, then raise here
            error = e
            payload = broadcast.encode_error(e)
        broadcast.broadcast_bytes(payload, src, group, device)
        if error is not None:
            raise error
        return store
    data = broadcast.broadcast_bytes(None, src, group, device)
    return Store(url, storage_options, loaded=broadcast.decode(data, url, src))
