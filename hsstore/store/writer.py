"""StoreWriter: takes samples one at a time, fills a shard buffer, writes shards in the background.

Why this shape: the extraction GPU must never wait on storage. ``add`` only copies a sample into a
preallocated per-layer shard buffer; full shards are encoded and uploaded by background threads while
the next forward runs. Memory is bounded: at most ``max_pending`` shards are in flight, after which
``add`` blocks (back-pressure) instead of growing without limit.

Nothing is visible to readers until a shard's commit record is written, so a crash (or an exception
inside ``with StoreWriter(...)``) leaves only invisible debris, never a half-shard. Shard names carry a
random part, so any number of writers (ranks, machines, teams) can add to one store concurrently, each under its
own writer tag: a tag is one writer at a time (its slot, ``format/sessions.py``), so a second writer of a tag that
is being written is refused at its start.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import re
import socket
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from ..format import codec, commit, encodings, fp8, health, index, sessions
from ..format.encodings import Encoded
from ..layouts import base as layout
from ..io import destination, memory, storage, transfer
from ..errors import ManifestError, SampleError, StoreError
from ..format.manifest import PER_WRITER_EXTRA, Manifest, check_compatible, now_iso, read_manifest
from ..io.storage import MANIFEST_FILE
from ..terminal import lookalike_refusal, visible_key
from ..version import __version__
from .session import WriterSession

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

DEFAULT_SHARD_BYTES = 1 << 30
DEFAULT_CHUNK_BYTES = 16 << 20


MAX_CHUNK_TOKENS = 8192


def default_chunk_tokens(hidden: int, itemsize: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Tokens per chunk so one layer's chunk is about ``chunk_bytes`` (large objects, few requests), at
    most ``MAX_CHUNK_TOKENS``: a shard's last chunk is padded to full size, so small models with huge
    chunks would store mostly padding."""
    return max(64, min(MAX_CHUNK_TOKENS, (chunk_bytes // (hidden * itemsize)) // 64 * 64))


def ensure_manifest(fs, root: str, url: str, manifest: Manifest) -> Manifest:
    """Create the store's manifest, or check that the existing one is compatible. Returns the one in force.

    The first writer's manifest wins (chunking, codec); later writers must agree on the compat key.
    """
    path = storage.join(root, MANIFEST_FILE)
    if not storage.store_exists(fs, root, url):
        try:
            # each one atomic: a second writer starting at once must see all of an object or none of it
            for key, data in layout.get(manifest.layout).store_objects().items():
                transfer.put_atomic(fs, storage.join(root, key), data, root)
            transfer.put_atomic(fs, path, manifest.to_json().encode(), root)
        except Exception as e:
            raise StoreError(storage.explain(e, url, "write", fs, root)) from None
    existing = read_manifest(fs, root, url)
    check_compatible(existing, manifest, f"store {url!r}", "the data being written")  # taps, dtype, encoding, ...
    if existing.layout != manifest.layout:  # a resumed job must not write another layout than it asks for
        raise ManifestError(f"store {url!r} exists with layout {existing.layout!r}; {manifest.layout!r} was asked "
                            "for (give another destination, or the store's layout)")
    return merge_writer_extra(fs, root, url, existing, manifest)


def _missing_entries(existing: Manifest, manifest: Manifest) -> dict[str, dict]:
    """The per-writer ``extra`` entries (``PER_WRITER_EXTRA``) of ``manifest`` that ``existing`` lacks or holds
    otherwise."""
    out = {}
    for key in PER_WRITER_EXTRA:
        mine, theirs = manifest.extra.get(key), existing.extra.get(key)
        theirs = theirs if isinstance(theirs, dict) else {}
        if isinstance(mine, dict) and any(theirs.get(tag) != v for tag, v in mine.items()):
            out[key] = mine
    return out


def merge_writer_extra(fs, root: str, url: str, existing: Manifest, manifest: Manifest, tries: int = 5) -> Manifest:
    """Add this writer's per-writer ``extra`` entries (``PER_WRITER_EXTRA``: e.g. ``compile_check`` of rank 3) to
    the manifest in force, keeping every other writer's, and return the manifest then in force. Only ``extra``
    changes (no shard's key covers it). Writers racing to rewrite it read it back after a random pause and write
    again while their entry is missing: the last writer's rewrite holds everyone's that it read."""
    for _ in range(tries):
        missing = _missing_entries(existing, manifest)
        if not missing:
            return existing
        extra = dict(existing.extra)
        for key, mine in missing.items():
            theirs = extra.get(key)
            extra[key] = {**(theirs if isinstance(theirs, dict) else {}), **mine}
        try:
            transfer.put_atomic(fs, storage.join(root, MANIFEST_FILE),
                               dataclasses.replace(existing, extra=extra).to_json().encode())
        except Exception as e:
            raise StoreError(storage.explain(e, url, "write", fs, root)) from None
        time.sleep(random.uniform(0.02, 0.2))
        existing = read_manifest(fs, root, url)
    log.warning("store %r: could not record %s in the manifest (other writers kept rewriting it)", url,
                sorted(_missing_entries(existing, manifest)))
    return existing


def _flat_array(x) -> np.ndarray:
    """Token ids or a loss mask (list, numpy array, or torch tensor on any device) as a flat numpy array."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x).reshape(-1)


def _safe_tag(tag: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "-", tag)[:64] or "w"


_WRITERS_HERE = iter(range(1 << 62))  # next() is atomic under the GIL: one number per writer of this process


def _default_tag() -> str:
    """host-pid, and a count after it for a second writer of the same process: a tag names one writer at a time,
    and threads of one process (one writer per GPU, say) are writers of their own; a tag the user did not give
    names no job to resume, so a fresh one costs nothing."""
    n = next(_WRITERS_HERE)
    return f"{socket.gethostname()}-{os.getpid()}" + (f"-{n}" if n else "")


class StoreWriter:
    """Write samples into a store (local path or any fsspec URL).

    >>> with StoreWriter(url, manifest) as w:
    ...     w.add("s0", input_ids, loss_mask, hidden_states)   # hidden_states [T, n_layers, H]
    """

    def __init__(
        self,
        url: str,
        manifest: Manifest,
        *,
        writer_tag: str | None = None,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        max_pending: int = 2,
        num_threads: int = 2,
        check_finite: bool = True,
        storage_options: dict[str, Any] | None = None,
        index_every: int = 64,
        expects: list[str] | None = None,
        planned_samples: int | None = None,
        planned_tokens: int | None = None,
        record_stats: bool = True,
    ) -> None:
        """``expects``: the writer tags of this writer's job (extraction: every rank's), so a follower of the store
        waits for all of them; ``planned_samples``/``planned_tokens``: what this session means to write, which a
        follower's schedule is estimated from (``format/sessions.py``). ``record_stats=False``: no feature value
        statistics in the commit records (a store as older versions wrote it; a benchmark of their cost)."""
        self.url = url
        self.storage_options = storage_options or {}
        self.fs, self.root = destination.open_destination(url, self.storage_options, layout.own_objects())
        codec.ChunkCodec(manifest.codec).zarr_compressors()  # an unknown codec fails here, before any write
        itemsize = codec.storage_dtype(manifest.dtype, manifest.encoding).itemsize
        manifest = dataclasses.replace(
            manifest,
            chunk_tokens=manifest.chunk_tokens or default_chunk_tokens(
                codec.row_width(manifest.hidden_size, manifest.encoding), itemsize),
            created_by=manifest.created_by or f"hsstore {__version__}",
            created_at=manifest.created_at or now_iso())
        self.manifest = ensure_manifest(self.fs, self.root, url, manifest)
        self.layers = list(self.manifest.layers)
        self.all_features = self.manifest.all_features  # the layers, then named features (final_hidden) if any
        self._write_shard = layout.get(self.manifest.layout).write_shard
        self.hidden = self.manifest.hidden_size
        self.encoding = encodings.get(self.manifest.encoding)
        self.width = self.encoding.width(self.hidden)  # a layer row's elements: hidden, or a block encoding's bytes
        self.row_scales = self.encoding.row_scale  # per-row scales stored beside the rows (fp8)
        self.storage_dtype = codec.storage_dtype(self.manifest.dtype, self.manifest.encoding)
        self.tag = _safe_tag(writer_tag or _default_tag())
        self.session = uuid.uuid4().hex[:8]
        # this session's records in one index segment (format/index.py), rewritten every ``index_every`` commits
        self._index = index.SegmentAppender(self.fs, self.root, f"{self.tag}-{self.session}", index_every)
        self.check_finite, self.record_stats = check_finite, record_stats
        token_bytes = codec.token_bytes(self.manifest.dtype, self.manifest.encoding, len(self.all_features), self.hidden)
        self.capacity = max(1, shard_bytes // token_bytes)
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="hsstore-writer")
        self._pending_shards = threading.BoundedSemaphore(max_pending)  # one permit per shard in memory
        self._futures: list[Future] = []
        self._seq = 0
        self._closed = False
        self._free: list[tuple[np.ndarray, np.ndarray | None]] = []  # (features, fp8 scales or None)
        self._lock = threading.Lock()
        self._skipped: dict[str, list[str]] = {}
        self._seen: set[str] = set()  # sample ids added (a repeated one is refused)
        self._visible: dict[str, str] = {}  # visible_key -> the id added (one a person cannot tell apart is refused)
        self._scratch = np.empty(0, dtype=codec.BITS_NUMPY[self.manifest.dtype])
        self.committed: list[commit.CommitRecord] = []
        self.bytes_written = 0
        self.wait_s = 0.0  # time add() spent blocked on storage (back-pressure): storage too slow if large
        self._new_buffer(self.capacity)
        # the session record (and its heartbeat) before any shard: followers wait for a writer that has not ended
        self._session = WriterSession(self.fs, self.root, self.tag, self.session, expects=expects,
                                      planned_samples=planned_samples, planned_tokens=planned_tokens)
        try:
            self._session.start(url)
        except sessions.SlotHeld:
            self._pool.shutdown(wait=False)
            raise
        except Exception as e:
            self._pool.shutdown(wait=False)
            raise StoreError(storage.explain(e, url, "write", self.fs, self.root)) from None

    # -- filling ---------------------------------------------------------------------------------
    def _new_buffer(self, capacity: int) -> None:
        # Recycle a written shard's buffer when one is free: fresh pages cost as much as the copy into them.
        bufs = None
        with self._lock:
            if capacity == self.capacity and self._free:
                bufs = self._free.pop()
        if bufs is None:
            memory.check_fits(len(self.all_features) * capacity * self.width * self.storage_dtype.itemsize,
                              f"store {self.url!r}: a shard buffer of {capacity} tokens x {len(self.all_features)} layers x "
                              f"hidden {self.hidden}")
            bufs = (np.empty((len(self.all_features), capacity, self.width), dtype=self.storage_dtype),
                    np.empty((len(self.all_features), capacity), dtype=fp8.SCALE_DTYPE) if self.row_scales else None)
        self._buf, self._scales = bufs
        self._buf_bits = (self._buf if self.encoding.quantised
                          else self._buf.view(codec.BITS_NUMPY[self.manifest.dtype]))
        self._ids: list[np.ndarray] = []
        self._mask: list[np.ndarray] = []
        self._cols: dict[str, list] = {c: [] for c in commit.SAMPLE_COLUMNS}
        self._feature_stats: list[np.ndarray] = []  # per sample [features, 5] (health.SUMS)
        self._fill = 0

    def add(
        self,
        sample_id: str,
        input_ids,
        loss_mask,
        hidden_states: torch.Tensor | np.ndarray | Mapping[int, torch.Tensor | np.ndarray],
        *,
        source: str = "",
        thinking_tokens: int = 0,
        flags: list[str] | None = None,
        final_hidden: torch.Tensor | np.ndarray | None = None,
        feature_stats: np.ndarray | None = None,
    ) -> None:
        """Queue one sample. ``hidden_states`` is ``[T, n_layers, H]`` in manifest layer order, or a
        mapping ``{layer_id: [T, H]}``; its dtype must be the manifest's (bf16 stays bf16). An encoded store
        also takes :class:`hsstore.format.encodings.Encoded` (values ``[T, n_layers, W]``, fp8's scales
        ``[T, n_layers]``, or one per layer in the mapping) as extraction makes it on the GPU; features in the
        manifest dtype are encoded here, on the host. ``final_hidden`` ``[T, H]`` (the final norm's output) is required exactly
        when the store's manifest names the ``final_hidden`` feature. ``feature_stats``: the sample's
        ``[features, 5]`` statistics (``health.sample_stats``) when the producer computed them (extraction, on
        the GPU); otherwise they are computed here from the bits written."""
        sample_id, ids, mask = self._check_sample(sample_id, input_ids, loss_mask)
        layers, scales = self._layer_views(f"sample {sample_id!r}", hidden_states, ids.shape[0], final_hidden)
        self._queue(sample_id, ids, mask, layers, scales, source, thinking_tokens, flags, feature_stats)

    def add_stored(self, sample_id: str, input_ids, loss_mask, features: np.ndarray,
                   scales: np.ndarray | None = None, *, source: str = "", thinking_tokens: int = 0,
                   flags: list[str] | None = None) -> None:
        """Queue one sample given as a store holds it: ``features`` ``[n_features, T, W]`` in the storage dtype
        (every feature of the manifest in ``all_features`` order, as ``Store.read_range`` returns them) and, for
        fp8 stores, their ``scales`` ``[n_features, T]``. A copy between stores of one manifest (``subset``)
        is then bit-exact by construction and needs no torch."""
        sample_id, ids, mask = self._check_sample(sample_id, input_ids, loss_mask)
        T, where = ids.shape[0], f"sample {sample_id!r}"
        want = (len(self.all_features), T, self.width)
        if features.shape != want or features.dtype != self.storage_dtype:
            raise SampleError(f"{where}: stored features {features.dtype} {tuple(features.shape)}, expected "
                              f"{self.storage_dtype} {want}")
        if self.row_scales and (scales is None or scales.shape != want[:2]):
            raise SampleError(f"{where}: an fp8 store needs scales of shape {want[:2]}")
        bits = features if self.encoding.quantised else features.view(codec.BITS_NUMPY[self.manifest.dtype])
        self._queue(sample_id, ids, mask, list(bits), list(scales) if self.row_scales else None, source,
                    thinking_tokens, flags)

    def _check_sample(self, sample_id, input_ids, loss_mask) -> tuple[str, np.ndarray, np.ndarray]:
        """(id, ids, mask) of a sample about to be added, checked: not added before, ids and mask alike."""
        if self._closed:
            raise StoreError("writer is closed")
        self.raise_background_error()
        sample_id = str(sample_id)
        if sample_id in self._seen:  # readers would serve it twice; resume and merge key on ids
            raise SampleError(f"sample {sample_id!r}: added twice to this writer (sample ids are unique in a store)")
        other = self._visible.get(visible_key(sample_id), sample_id)
        if other != sample_id:
            raise SampleError(lookalike_refusal(sample_id, other, "added before"))
        ids, mask = _flat_array(input_ids), _flat_array(loss_mask)
        T = ids.shape[0]
        where = f"sample {sample_id!r}"
        if T == 0:
            raise SampleError(f"{where}: empty sample (0 tokens)")
        if mask.shape[0] != T:
            raise SampleError(f"{where}: loss_mask has {mask.shape[0]} tokens, input_ids has {T}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise SampleError(f"{where}: input_ids must be integers, got {ids.dtype}")
        if ids.min() < 0 or ids.max() > np.iinfo(np.int32).max:
            raise SampleError(f"{where}: input_ids out of int32 range")
        if not (np.issubdtype(mask.dtype, np.integer) or mask.dtype == np.bool_) or mask.min() < 0 or mask.max() > 1:
            raise SampleError(f"{where}: loss_mask must hold 0/1 values")
        return sample_id, ids, mask

    def _queue(self, sample_id: str, ids: np.ndarray, mask: np.ndarray, layers: list[np.ndarray],
               scales: list[np.ndarray] | None, source, thinking_tokens, flags,
               feature_stats: np.ndarray | None = None) -> None:
        """Copy a checked sample's feature bits into the shard buffer (NaN/Inf refused), its columns and feature
        statistics beside."""
        T, where = ids.shape[0], f"sample {sample_id!r}"
        if not 0 <= int(thinking_tokens) <= T:  # every reader refuses such a record (admission rule 'bounds')
            raise SampleError(f"{where}: {int(thinking_tokens)} thinking tokens in a sample of {T}")
        if T > self._buf.shape[1] - self._fill:
            if self._fill:
                self._submit()
            if T > self._buf.shape[1]:  # one sample larger than a shard: give it a shard of its own size
                self._new_buffer(T)
        region = self._buf_bits[:, self._fill:self._fill + T]
        for j, x in enumerate(layers):
            # numpy, not torch: one core with the GIL released. torch's multi-threaded copy starves the
            # extraction thread that launches the GPU's kernels (docs/PERFORMANCE.md, "Design choices").
            region[j] = x
        if scales is not None:
            self._scales[:, self._fill:self._fill + T] = np.stack(scales)
        if self.encoding.quantised:
            if self.check_finite:
                for j, layer in enumerate(self.all_features):
                    sc = self._scales[j, self._fill:self._fill + T] if scales is not None else None
                    bad = np.flatnonzero(self.encoding.bad_rows(region[j], sc, self.hidden))
                    if bad.size:
                        raise SampleError(f"{where}: layer {layer} has NaN/Inf features (first at token "
                                          f"{int(bad[0])})")
        elif self.check_finite and self._has_nonfinite(region):
            for j, layer in enumerate(self.all_features):
                bad = codec.first_nonfinite_row(self._buf[j, self._fill:self._fill + T], self.manifest.dtype)
                if bad is not None:  # the region is simply overwritten by the next sample
                    raise SampleError(f"{where}: layer {layer} has NaN/Inf features (first at token {bad})")
        if self.record_stats:
            if feature_stats is None:
                sc = self._scales[:, self._fill:self._fill + T] if scales is not None else None
                feature_stats = health.bits_stats(self._buf[:, self._fill:self._fill + T], self.manifest.dtype, sc,
                                                  self.manifest.encoding, self.hidden)
            feature_stats = np.asarray(feature_stats, dtype=np.float64)
            if feature_stats.shape != (len(self.all_features), len(health.SUMS)):
                raise SampleError(f"{where}: feature_stats shape {feature_stats.shape}, expected "
                                  f"[{len(self.all_features)}, {len(health.SUMS)}]")
            self._feature_stats.append(feature_stats)
        self._ids.append(ids.astype(np.int32))
        self._mask.append(mask.astype(np.uint8))
        c = self._cols
        self._seen.add(sample_id)
        self._visible.setdefault(visible_key(sample_id), sample_id)
        c["sample_id"].append(sample_id)
        c["source"].append(str(source))
        c["length"].append(int(T))
        c["loss_tokens"].append(int(mask.sum()))
        c["thinking_tokens"].append(int(thinking_tokens))
        c["flags"].append(list(flags or []))
        self._fill += T
        if self._fill >= self.capacity:
            self._submit()

    def _has_nonfinite(self, region: np.ndarray) -> bool:
        """Any all-ones exponent in the bits (NaN/Inf), using a reused scratch buffer: no page faults,
        all cores, no float conversion."""
        mask = codec.EXPONENT_MASK[self.manifest.dtype]
        n = region.size
        if self._scratch.size < n:
            self._scratch = np.empty(n, dtype=region.dtype)
        scratch = self._scratch[:n].reshape(region.shape)
        np.bitwise_and(region, mask, out=scratch)
        return int(scratch.max()) == mask

    def _layer_views(self, where: str, hs, T: int, final_hidden=None,
                     ) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
        """Per feature (layers, then final_hidden): the storage bits ``[T, W]``, and (fp8 stores) the scales ``[T]``."""
        # all features in one tensor (extraction's [T, layers + final_hidden, H]) when final_hidden is not given apart
        n = len(self.all_features) if final_hidden is None and self.manifest.features else len(self.layers)
        if isinstance(hs, (Encoded, fp8.Quantised)):
            values, sc = hs
            if values.ndim != 3 or values.shape[1] != n or (sc is not None and sc.ndim != 2):
                raise SampleError(f"{where}: encoded values/scales shapes {tuple(values.shape)}/"
                                  f"{None if sc is None else tuple(sc.shape)}, expected [{T}, {n}, {self.width}]"
                                  + (f"/[{T}, {n}]" if self.row_scales else ""))
            parts = [Encoded(values[:, j], None if sc is None else sc[:, j]) for j in range(n)]
        elif isinstance(hs, Mapping):
            want = self.all_features if final_hidden is None and "final_hidden" in hs else self.layers
            if set(hs) != set(want):
                raise SampleError(f"{where}: layers {list(hs)} do not match the store's layers {self.all_features}")
            parts = [hs[l] for l in want]
        else:
            if hs.ndim != 3 or hs.shape[1] != n:
                raise SampleError(f"{where}: hidden_states shape {tuple(hs.shape)}, expected "
                                  f"[{T}, {n}, {self.hidden}] (tokens, features {self.all_features[:n]}, hidden)")
            parts = [hs[:, j] for j in range(n)]
        if self.manifest.features and len(parts) < len(self.all_features):
            if final_hidden is None:
                raise SampleError(f"{where}: the store holds final_hidden (the final norm's output): pass it")
            parts.append(final_hidden)
        elif not self.manifest.features and final_hidden is not None:
            raise SampleError(f"{where}: final_hidden given, the store does not hold it (manifest features [])")
        out, scales = [], []
        enc = self.encoding
        for layer, x in zip(self.all_features, parts):
            q = Encoded(*x) if isinstance(x, (Encoded, fp8.Quantised)) else None
            if q is not None and not enc.quantised:
                raise SampleError(f"{where}: encoded features given, the store's encoding is {self.manifest.encoding!r}")
            if q is None:
                if tuple(x.shape) != (T, self.hidden):
                    raise SampleError(f"{where}: layer {layer} has shape {tuple(x.shape)}, expected [{T}, {self.hidden}]")
                name = codec.dtype_name(x)
                if name != self.manifest.dtype:
                    raise SampleError(f"{where}: layer {layer} dtype {name}, the store holds {self.manifest.dtype} "
                                      "(features are stored bit-exact; convert explicitly if you mean to)")
                if not enc.quantised:
                    out.append(codec.bits_view(x).numpy())
                    continue
                import torch

                q = enc.encode(torch.as_tensor(x))
            out.append(self._encoded_bits(where, layer, q, T))
            if self.row_scales:
                scales.append(np.asarray(q.scales.detach().cpu(), dtype=fp8.SCALE_DTYPE))
        return out, (scales if self.row_scales else None)

    def _encoded_bits(self, where: str, layer, q: Encoded, T: int) -> np.ndarray:
        """The stored bytes ``[T, W]`` of one feature's encoded values, checked against the store's encoding."""
        import torch

        want = fp8.FP8_DTYPE if self.row_scales else torch.uint8
        shape_ok = tuple(q.values.shape) == (T, self.width) and (
            tuple(q.scales.shape) == (T,) if self.row_scales else q.scales is None)
        if q.values.dtype != want or not shape_ok:
            raise SampleError(f"{where}: layer {layer}: {self.manifest.encoding} values must be {want} [{T}, "
                              f"{self.width}]" + (f" with scales [{T}]" if self.row_scales else " (no scales)")
                              + f", got {q.values.dtype} {tuple(q.values.shape)}"
                              + (f" with scales {tuple(q.scales.shape)}" if q.scales is not None else ""))
        return fp8.as_bits(q.values)

    # -- writing ---------------------------------------------------------------------------------
    def _submit(self, force: bool = False) -> None:
        """Hand the filled buffer to a writer thread (``force``: even when empty, to carry skip notes)."""
        if not self._fill and not force:
            return
        n = self._fill
        bufs, ids, mask, cols = (self._buf, self._scales), self._ids, self._mask, self._cols
        cols = {**cols, "_feature_stats": self._feature_stats}  # travels with the shard to its record
        name = f"{self.tag}-{self.session}-{self._seq:05d}"
        self._seq += 1
        t = time.perf_counter()
        self._pending_shards.acquire()  # back-pressure: at most max_pending shards in memory
        self.wait_s += time.perf_counter() - t
        fut = self._pool.submit(self._write, name, bufs, n, np.concatenate(ids) if ids else np.zeros(0, np.int32),
                                np.concatenate(mask) if mask else np.zeros(0, np.uint8), cols)
        self._futures.append(fut)
        self._new_buffer(self.capacity)

    def _write(self, name, bufs, n, ids, mask, cols) -> commit.CommitRecord:
        buf, sbuf = bufs
        try:
            features = {layer: buf[j, :n] for j, layer in enumerate(self.all_features)}
            scales = {layer: sbuf[j, :n] for j, layer in enumerate(self.all_features)} if sbuf is not None else None
            per_sample = cols.pop("_feature_stats", None)
            record = self._write_shard(self.fs, self.root, name, self.tag, self.manifest, features, ids, mask, cols,
                                       stats=self._stats(cols, per_sample), scales=scales)
            stamp = commit.publish(self.fs, self.root, record)
            with self._lock:  # writer threads finish concurrently
                self.committed.append(record)
                self._index.add(record, stamp)
                self._session.committed(len(self.committed))
                self.bytes_written += sum(f["size"] for f in record.files.values())
            log.debug("committed shard %s: %d samples, %d tokens", name, record.n_samples, record.n_tokens)
            return record
        except Exception as e:
            raise StoreError(f"writing shard {name!r} of store {self.url!r} failed: {type(e).__name__}: {e}") from e
        finally:
            if buf.shape[1] == self.capacity:
                with self._lock:
                    self._free.append(bufs)
            self._pending_shards.release()

    def note_skipped(self, reason: str, sample_ids: list[str]) -> None:
        """Record samples the producer left out (over-length, no loss, ...). The ids travel in the next
        committed shard's stats, so ``info`` can count them once even when a resumed run skips them again."""
        with self._lock:
            self._skipped.setdefault(reason, []).extend(str(s) for s in sample_ids)

    def _stats(self, cols: dict[str, list], per_sample: list[np.ndarray] | None = None) -> dict[str, Any]:
        flags = Counter(f for fl in cols["flags"] for f in fl)
        with self._lock:
            skipped, self._skipped = self._skipped, {}
        out = {"loss_tokens": int(sum(cols["loss_tokens"])), "thinking_tokens": int(sum(cols["thinking_tokens"])),
               "flags": dict(flags)}
        if skipped:
            out["skipped"] = skipped
        if per_sample and len(per_sample) == len(cols["length"]):
            out["features"] = health.shard_stats(self.all_features, cols["length"], self.hidden, per_sample)
        return out

    def raise_background_error(self) -> None:
        """Raise the first error of a shard write that has finished (without waiting for the others)."""
        for f in self._futures:
            if f.done() and f.exception() is not None:
                raise f.exception()  # type: ignore[misc]
        self._futures = [f for f in self._futures if not f.done()]

    def flush(self) -> None:
        """Write the partially filled shard and wait for every pending shard to be committed."""
        self._submit(force=bool(self._skipped))
        futures, self._futures = self._futures, []
        errors = []
        for f in futures:
            try:
                f.result()
            except Exception as e:  # keep waiting for the others: what can be committed is
                errors.append(e)
        if errors:
            raise errors[0]

    def close(self, commit: bool = True, why: str | None = None) -> None:
        """Commit what is buffered (``commit=True``) or drop it, then stop the threads. The session's end record is
        written only after a clean commit; otherwise its record says it stopped (``why``: the error)."""
        if self._closed:
            return
        ended = False
        try:
            if commit:
                self.flush()
                ended = True
            else:
                self._new_buffer(1)
                for f in self._futures:
                    f.exception()
        except BaseException as e:
            why = why or f"{type(e).__name__}: {e}"
            raise
        finally:
            self._closed = True
            self._pool.shutdown(wait=True)
            with self._lock:
                self._index.flush()  # this session's records, as one index segment
            if ended:
                self._session.end(len(self.committed), sum(r.n_samples for r in self.committed),
                                  sum(r.n_tokens for r in self.committed))
            else:
                self._session.fail(why or "closed without committing")

    def __enter__(self) -> "StoreWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # On an exception the half-filled shard is not committed: it would hide the failure and a
        # resumed run re-extracts those samples anyway. Shards already submitted do complete.
        self.close(commit=exc_type is None, why=None if exc_type is None else f"{exc_type.__name__}: {exc}")
