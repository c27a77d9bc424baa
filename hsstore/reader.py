"""Reading a store: ``hsstore.open(url)`` -> :class:`Store`.

A store is the set of committed shards under a prefix; the sample order is shard-name order, then
order within the shard. Opening reads the manifest and the commit records only (no feature data), so
it is cheap on a large store; ``read`` fetches just the chunks of the requested layers that overlap
the sample, all layers concurrently.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np
import torch
import zarr

from . import codec, shard, storage
from .errors import CorruptionError, ManifestError, StoreError
from .manifest import MANIFEST_FILE, Manifest


@dataclass(frozen=True)
class SampleRef:
    """Where sample ``index`` lives: shard, token range within the shard."""

    index: int
    shard: str
    local: int
    start: int
    stop: int
    sample_id: str


def read_manifest(fs, root: str, url: str) -> Manifest:
    path = storage.join(root, MANIFEST_FILE)
    try:
        data = fs.cat_file(path)
    except FileNotFoundError:
        raise ManifestError(f"{url!r} is not an hsstore store: no {MANIFEST_FILE} there") from None
    except Exception as e:
        raise StoreError(f"cannot read store {url!r}: {type(e).__name__}: {e}") from None
    return Manifest.from_json(data, where=f"{url}/{MANIFEST_FILE}")


class Store:
    """A read-only view of the committed shards of one store, as they were when opened."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url
        self.storage_options = storage_options or {}
        self.fs, self.root = storage.resolve(url, self.storage_options)
        self.manifest = read_manifest(self.fs, self.root, url)
        if self.manifest.chunk_tokens is None:
            raise ManifestError(f"{url}/{MANIFEST_FILE}: chunk_tokens is not set (no writer has initialised this store)")
        names = shard.list_committed(self.fs, self.root)
        self.commits: list[shard.CommitRecord] = shard.load_commits(self.fs, self.root, names)
        counts = np.array([c.n_samples for c in self.commits], dtype=np.int64)
        self._first = np.concatenate([[0], np.cumsum(counts)]) if len(counts) else np.zeros(1, np.int64)
        self._offsets = [c.offsets for c in self.commits]
        self._pid = os.getpid()
        self._codec = codec.ChunkCodec(self.manifest.codec)
        self._plain = codec.ChunkCodec("none")

    # -- index -----------------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self._first[-1])

    @property
    def layers(self) -> list[int]:
        return list(self.manifest.layers)

    @property
    def num_tokens(self) -> int:
        return sum(c.n_tokens for c in self.commits)

    def ref(self, i: int) -> SampleRef:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample index {i} out of range for store {self.url!r} with {n} samples")
        i %= n
        s = int(np.searchsorted(self._first, i, side="right") - 1)
        local = i - int(self._first[s])
        off = self._offsets[s]
        c = self.commits[s]
        return SampleRef(i, c.shard, local, int(off[local]), int(off[local + 1]), c.samples["sample_id"][local])

    def sample_ids(self) -> list[str]:
        return [sid for c in self.commits for sid in c.samples["sample_id"]]

    # -- data ------------------------------------------------------------------------------------
    def _fs(self):
        """The filesystem, re-created after a fork: a child must not reuse the parent's event loop."""
        if self._pid != os.getpid():
            self.fs, _ = storage.resolve(self.url, self.storage_options)
            self._pid = os.getpid()
        return self.fs

    def _group(self, name: str) -> zarr.Group:
        """The shard as a Zarr group (metadata checks in ``verify``; data reads do not need it)."""
        zstore = shard.zarr_store(self._fs(), self.root, self.url, self.storage_options, read_only=True)
        return zarr.open_group(zstore, path=shard.shard_path(name), mode="r")

    def check_layers(self, layers: Sequence[int] | None) -> list[int]:
        if layers is None:
            return self.layers
        layers = list(layers)
        missing = [l for l in layers if l not in self.manifest.layers]
        if missing:
            raise StoreError(f"layers {missing} are not in store {self.url!r} (it holds {self.layers})")
        return layers

    def read_range(self, shard_name: str, start: int, stop: int, layers: Sequence[int] | None = None,
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Tokens ``start:stop`` of one shard: (input_ids int32, loss_mask uint8, features ``[n_layers, T, H]``
        layer-major in the storage dtype).

        Only chunks of the requested layers that overlap the range are fetched (all at once, concurrently,
        on object stores) and each chunk's CRC32C is checked. On local disk, uncompressed chunks that lie
        wholly inside the range are read straight into the output (no intermediate copy); that is why the
        output is layer-major: each layer's rows are contiguous, as in the chunk files.
        """
        layers = self.check_layers(layers)
        m, ct = self.manifest, self.manifest.chunk_tokens
        T, H = stop - start, m.hidden_size
        base = shard.shard_path(shard_name)
        ids = np.empty(T, np.int32)
        mask = np.empty(T, np.uint8)
        feats = np.empty((len(layers), T, H), codec.STORAGE_DTYPE[m.dtype])
        if T <= 0:
            return ids, mask, feats
        k0, k1 = start // ct, (stop - 1) // ct
        targets = [(f"{base}/input_ids", ids, self._plain, 1), (f"{base}/loss_mask", mask, self._plain, 1)]
        targets += [(f"{base}/{shard.layer_array(l)}", feats[j], self._codec, H) for j, l in enumerate(layers)]
        fs = self._fs()
        direct = storage.is_local(fs) and self._codec.spec == "none"
        jobs = []  # (key, destination rows, rows of the chunk to take, codec, width, whole-chunk-in-place)
        for array_path, out, chunk_codec, width in targets:
            for k in range(k0, k1 + 1):
                lo, hi = max(start, k * ct), min(stop, (k + 1) * ct)
                key = shard.chunk_key(array_path, k, 1 if width == 1 else 2)
                in_place = direct and lo == k * ct and hi == (k + 1) * ct
                jobs.append((key, out[lo - start:hi - start], slice(lo - k * ct, hi - k * ct), chunk_codec, width,
                             in_place))
        fetch = [storage.join(self.root, j[0]) for j in jobs if not j[5]]
        blobs: dict = {}
        if fetch:
            try:
                blobs = fs.cat(fetch, on_error="return")
            except Exception as e:
                raise StoreError(f"shard {shard_name!r} of store {self.url!r}: read failed: "
                                 f"{type(e).__name__}: {e}") from None
            if isinstance(blobs, bytes):
                blobs = {fetch[0]: blobs}
        for key, dest, rows, chunk_codec, width, in_place in jobs:
            where = f"shard {shard_name!r}, file {key}"
            path = storage.join(self.root, key)
            if in_place:
                read_chunk_into(path, dest, where)
                continue
            blob = blobs.get(path)
            if blob is None or isinstance(blob, Exception):
                detail = f"{type(blob).__name__}: {blob}" if blob is not None else "not returned"
                raise CorruptionError(f"{where}: chunk missing or unreadable ({detail})")
            vals = chunk_codec.decode(blob, dest.dtype, ct * width, where=where)
            dest[:] = (vals.reshape(ct, width) if width > 1 else vals)[rows]
        return ids, mask, feats

    def read(self, i: int, layers: Sequence[int] | None = None) -> dict[str, Any]:
        """Sample ``i``: ``sample_id``, ``input_ids`` (int64), ``loss_mask`` (bool),
        ``hidden_states`` ``[T, n_layers, H]`` in the stored dtype (bit-exact)."""
        r = self.ref(i)
        try:
            ids, mask, feats = self.read_range(r.shard, r.start, r.stop, layers)
        except CorruptionError as e:
            raise CorruptionError(f"sample {r.sample_id!r} (index {r.index}): {e}") from None
        return self.sample_dict(r.sample_id, ids, mask, feats)

    def sample_dict(self, sample_id: str, ids: np.ndarray, mask: np.ndarray, feats: np.ndarray) -> dict[str, Any]:
        """The item format: ``feats`` is layer-major ``[n_layers, T, H]``; ``hidden_states`` is its
        ``[T, n_layers, H]`` view (no copy; ``reshape(T, -1)`` gives the drafter's concatenation)."""
        return {
            "sample_id": sample_id,
            "input_ids": torch.from_numpy(ids.astype(np.int64)),
            "loss_mask": torch.from_numpy(mask.astype(bool)),
            "hidden_states": codec.from_storage(feats, self.manifest.dtype).permute(1, 0, 2),
        }

    def iter_shard(self, shard_index: int, layers: Sequence[int] | None = None,
                   window_bytes: int = 256 << 20) -> Iterator[dict[str, Any]]:
        """The samples of one shard in order, read in large windows (whole runs of samples at once) so
        each chunk is fetched about once: the sequential path for loaders and scans."""
        layers = self.check_layers(layers)
        rec, off = self.commits[shard_index], self._offsets[shard_index]
        token_bytes = max(1, len(layers)) * self.manifest.hidden_size * codec.STORAGE_DTYPE[self.manifest.dtype].itemsize
        window = max(self.manifest.chunk_tokens, window_bytes // token_bytes)
        i = 0
        while i < rec.n_samples:
            j = i + 1
            while j < rec.n_samples and off[j + 1] - off[i] <= window:
                j += 1
            ids, mask, feats = self.read_range(rec.shard, int(off[i]), int(off[j]), layers)
            for s in range(i, j):
                a, b = int(off[s] - off[i]), int(off[s + 1] - off[i])
                yield self.sample_dict(rec.samples["sample_id"][s], ids[a:b], mask[a:b], feats[:, a:b])
            i = j

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for s in range(len(self.commits)):
            yield from self.iter_shard(s)

    def __repr__(self) -> str:
        return (f"Store({self.url!r}, samples={len(self)}, shards={len(self.commits)}, layers={self.layers}, "
                f"dtype={self.manifest.dtype})")


def read_chunk_into(path: str, dest: np.ndarray, where: str) -> None:
    """Read an uncompressed local chunk file straight into ``dest`` (contiguous) and check its CRC32C."""
    view = memoryview(dest.reshape(-1).view(np.uint8))
    try:
        with open(path, "rb", buffering=0) as f:
            got = f.readinto(view)
            tail = f.read(8)
    except FileNotFoundError:
        raise CorruptionError(f"{where}: chunk missing") from None
    if got != len(view) or len(tail) != 4:
        raise CorruptionError(f"{where}: chunk is {got + len(tail)} bytes, expected {len(view) + 4} (truncated?)")
    if codec.crc32c(dest) != int.from_bytes(tail, "little"):
        raise CorruptionError(f"{where}: checksum mismatch (corrupted chunk)")


def open_store(url: str, **storage_options: Any) -> Store:
    """Open a store read-only. ``storage_options`` go to fsspec (e.g. ``anon=True``, ``endpoint_url=...``)."""
    return Store(url, storage_options)
