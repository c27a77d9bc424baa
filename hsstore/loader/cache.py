"""A local disk cache of chunk objects of remote stores, capped in size, least-recently-used evicted.

Why chunks: committed chunk objects never change (shard names are unique, commits are final), so a
cached copy is valid forever and needs no revalidation; and the loader reads whole chunks, so a chunk
is also the unit that two reads (neighbouring units, a second epoch) share. Every chunk ends in its
CRC32C, so a cached copy is checked on every hit and dropped when it does not match.

Several processes (DataLoader workers, ranks on one node) may share one cache directory: files are
written to a temporary name and renamed, a hit refreshes the file's mtime (the LRU clock), and
eviction rescans the directory so it sees what other processes added. The cap is kept by whoever
writes; a file removed under a reader is a miss, never an error.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from typing import Any, Callable

from ..format import codec, names
from ..memory import pread_into
from .. import storage

log = logging.getLogger(__name__)

LOW_WATER = 0.9  # evict down to this fraction of the cap, so eviction (a directory scan) is not per write


class ChunkCache:
    """``cat(fs, paths, namespace)`` like ``fs.cat(paths, on_error="return")``, served from ``root`` when
    possible. ``max_bytes`` caps the bytes on disk (checked whenever this process writes)."""

    def __init__(self, root: str, max_bytes: int) -> None:
        self.root = os.path.abspath(root)
        self.max_bytes = int(max_bytes)
        self.hits = self.misses = self.evicted = 0
        self._lock = threading.Lock()
        self._index: dict[str, tuple[float, int]] | None = None  # path -> (mtime, size)
        self._total = 0
        self._last = 0.0
        self.pid = os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        return {"root": self.root, "max_bytes": self.max_bytes}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["root"], state["max_bytes"])

    def local_path(self, namespace: str, path: str) -> str:
        """Where the copy of remote object ``path`` is kept: under ``root`` always (``names.cache_path``
        refuses a path made of a store's names that would climb out of it)."""
        return names.cache_path(self.root, namespace, path)

    # -- reading -----------------------------------------------------------------------------------
    def get(self, namespace: str, path: str, expect: int | None = None) -> bytes | None:
        """The cached copy of ``path``, if intact and (``expect``: the payload CRC32C the commit record lists)
        the chunk the store holds there now; otherwise it is dropped."""
        local = self.local_path(namespace, path)
        try:
            with open(local, "rb") as f:
                blob = f.read()
        except (FileNotFoundError, IsADirectoryError):
            return None
        if not codec.chunk_ok(blob, expect):
            log.warning("chunk cache: dropping damaged or stale copy %s", local)
            self._remove(local)
            return None
        self._touch(local, len(blob))
        return blob

    def cat(self, fs, paths: list[str], namespace: str, expect: dict[str, int | None] | None = None,
            sizes: dict[str, int] | None = None) -> dict[str, Any]:
        """``expect``: path -> payload CRC32C from the commit record; a cached copy must match it. ``sizes``:
        path -> size from the record, for the reads (``storage.cat_verified``)."""
        out: dict[str, Any] = {}
        missing = []
        expect = expect or {}
        for p in paths:
            blob = self.get(namespace, p, expect.get(p))
            if blob is None:
                missing.append(p)
            else:
                out[p] = blob
        self.hits += len(out)
        self.misses += len(missing)
        if missing:
            fetched = storage.cat_verified(fs, missing, lambda _p, b: codec.chunk_ok(b), sizes=sizes)
            for p in missing:
                blob = fetched.get(p)
                out[p] = blob
                if isinstance(blob, (bytes, bytearray)) and codec.chunk_ok(blob, expect.get(p)):
                    self.put(namespace, p, bytes(blob))
        return out

    def cat_into(self, fs, targets: dict[str, list[Any]], namespace: str,
                 check: Callable[[str], str | None]) -> dict[str, Exception | str | None]:
        """``storage.cat_into`` served from the cache where it holds a copy that fills the buffers and passes
        ``check`` (a copy that does not is dropped); the rest is fetched into the buffers and cached from them."""
        out: dict[str, Exception | str | None] = {}
        missing: dict[str, list[Any]] = {}
        for p, bufs in targets.items():
            local = self.local_path(namespace, p)
            if self._read_into(local, bufs) and check(p) is None:
                out[p] = None
                self._touch(local, sum(memoryview(b).nbytes for b in bufs))
                continue
            if os.path.exists(local):
                log.warning("chunk cache: dropping damaged or stale copy %s", local)
                self._remove(local)
            missing[p] = bufs
        self.hits += len(out)
        self.misses += len(missing)
        if missing:
            for p, result in storage.cat_into(fs, missing, check).items():
                out[p] = result
                if result is None:
                    self.put(namespace, p, missing[p])
        return out

    @staticmethod
    def _read_into(local: str, bufs: list[Any]) -> bool:
        """Whether the file at ``local`` exists and fills ``bufs`` exactly."""
        want = sum(memoryview(b).nbytes for b in bufs)
        try:
            with open(local, "rb", buffering=0) as f:
                return os.fstat(f.fileno()).st_size == want and pread_into(f.fileno(), bufs, 0) == want
        except (FileNotFoundError, IsADirectoryError):
            return False

    def _touch(self, local: str, size: int) -> None:
        """A hit refreshes the copy's place in the LRU order (its mtime, for other processes too)."""
        try:
            os.utime(local)
        except FileNotFoundError:
            pass
        with self._lock:
            if self._index is not None:
                self._index[local] = (self._clock(), size)

    # -- writing and eviction ----------------------------------------------------------------------
    def put(self, namespace: str, path: str, blob: Any) -> None:
        """Keep ``blob`` (bytes, or a list of buffers written in turn) as the copy of ``path``."""
        parts = blob if isinstance(blob, list) else [blob]
        size = sum(memoryview(b).nbytes for b in parts)
        if size > self.max_bytes:
            return
        local = self.local_path(namespace, path)
        os.makedirs(os.path.dirname(local), exist_ok=True)
        tmp = f"{local}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "wb") as f:
                for b in parts:
                    f.write(memoryview(b).cast("B"))
            os.replace(tmp, local)
        except OSError as e:  # a full or read-only disk must not stop training: the read still succeeds
            log.warning("chunk cache: cannot write %s (%s)", local, e)
            self._remove(tmp)
            return
        with self._lock:
            index = self._scan() if self._index is None else self._index
            old = index.get(local)
            self._total += size - (old[1] if old else 0)
            index[local] = (self._clock(), size)
            if self._total > self.max_bytes:
                self._evict()

    def _clock(self) -> float:
        """Wall time, strictly increasing within this process (coarse mtimes must not tie the LRU order)."""
        self._last = max(time.time(), self._last + 1e-6)
        return self._last

    def _scan(self) -> dict[str, tuple[float, int]]:
        index: dict[str, tuple[float, int]] = {}
        for dirpath, _, files in os.walk(self.root):
            for name in files:
                if ".tmp-" in name:
                    continue
                p = os.path.join(dirpath, name)
                try:
                    st = os.stat(p)
                except FileNotFoundError:
                    continue
                index[p] = (st.st_mtime, st.st_size)
        self._index = index
        self._total = sum(s for _, s in index.values())
        return index

    def _evict(self) -> None:
        """Drop least recently used files until under the low-water mark (lock held)."""
        own = self._index or {}
        index = self._scan()
        for p, (t, s) in own.items():  # our own clock is finer than some filesystems' mtime
            if p in index:
                index[p] = (max(t, index[p][0]), index[p][1])
        target = int(self.max_bytes * LOW_WATER)
        for p, (_, size) in sorted(index.items(), key=lambda kv: kv[1][0]):
            if self._total <= target:
                break
            if self._remove(p):
                self.evicted += 1
            self._total -= size
            del index[p]

    @staticmethod
    def _remove(path: str) -> bool:
        try:
            os.remove(path)
            return True
        except FileNotFoundError:
            return False

    def size(self) -> int:
        """Bytes on disk now (all processes)."""
        with self._lock:
            self._scan()
            return self._total

    def __repr__(self) -> str:
        return f"ChunkCache({self.root!r}, max_bytes={self.max_bytes}, hits={self.hits}, misses={self.misses})"
