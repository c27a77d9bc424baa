"""A local disk cache of chunk objects of remote stores, capped in size, least-recently-used evicted.

Why chunks: committed chunk objects never change (shard names are unique, commits are final), so a
cached copy is valid forever and needs no revalidation; and the loader reads whole chunks, so a chunk
is also the unit that two reads (neighbouring units, a second epoch) share.

The cache holds hidden states of stores its user may read and others may not, and what it serves is
trained on, so it is private and checked:
- its folder is the user's own (refused when owned by someone else or when it is a link), folders 0700 and
  files 0600, every file opened through the door (``hsstore.io.door``: no link followed, regular files only);
- each copy ends with a keyed digest (HMAC-SHA256 under a key kept in the cache folder, 0600) of the object's
  name and bytes, written when the copy is made. CRC32C is linear: a planted file with four bytes adjusted
  passes it. A copy is served only when its digest matches (and the chunk's CRC32C the record's), so a file
  placed or changed by anyone without the key is a miss, dropped and fetched again.

Several processes (DataLoader workers, ranks on one node) may share one cache directory: files are
written to a temporary name and renamed, a hit refreshes the file's mtime (the LRU clock), and
eviction rescans the directory so it sees what other processes added. The cap is kept by whoever
writes; a file removed under a reader is a miss, never an error.

Which copies stay when the cap is reached: least recently used first, except those made or used since
``keep_since`` (the loader's: when the dataset was built). A loader reads the same chunks every epoch in a new
order, so every copy of the run is needed again, and LRU would evict each one before the next epoch comes back
to it; instead, a copy that finds no room is not kept, the cache holds what the first epoch filled it with,
and every later epoch fetches only what the cap could not hold (``Reading.cache_bytes``: the loader logs the
size a node's part needs). After a restart, an earlier process's copies count as this run's once used again, so
the first epoch may still evict some of them for others, as LRU would.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import secrets
import stat
import time
import uuid
from typing import Any, Callable

import fsspec

from ..format import codec, names
from ..io.memory import pread_into
from ..io import door, sinks, storage
from ..errors import CorruptionError, StoreError
from ..locks import ProcessLock

log = logging.getLogger(__name__)

LOW_WATER = 0.9  # evict down to this fraction of the cap, so eviction (a directory scan) is not per write
RESCAN_S = 10.0  # a full cache of copies kept since ``keep_since`` is scanned again at most this often
KEY_FILE = ".hsstore-cache-key"  # the digest key: 32 random bytes, 0600
DIGEST = 32  # bytes of HMAC-SHA256 after each copy
_LOCAL = fsspec.filesystem("file")  # the cache's own folder, read through the door as a local root


def copy_size(size: int) -> int:
    """Bytes on disk of the cached copy of an object of ``size`` bytes (its digest follows it)."""
    return int(size) + DIGEST


class ChunkCache:
    """``cat(fs, root, keys, namespace)`` like ``door.read_many``, served from ``root`` when possible.
    ``max_bytes`` caps the bytes on disk (checked whenever this process writes). ``keep_since`` (a time): copies
    made or used since then are never evicted for another; one that finds no room is not kept (``declined``:
    how many; see the module doc). None: least recently used first, whenever it was used."""

    def __init__(self, root: str, max_bytes: int, keep_since: float | None = None) -> None:
        self.root = os.path.abspath(root)
        self.max_bytes = int(max_bytes)
        self.keep_since = keep_since
        self.hits = self.misses = self.evicted = self.declined = 0
        self._full_at = -math.inf  # when a scan last found nothing to evict for a new copy (keep_since)
        self._lock = ProcessLock()
        self._index: dict[str, tuple[float, int]] | None = None  # path -> (mtime, size)
        self._total = 0
        self._last = 0.0
        self.pid = os.getpid()
        # the folder as checked, held open: every read, write and removal goes through this descriptor
        # (``/proc/self/fd/N``), so a folder swapped for a link later is never written or emptied
        self._fd = _open_cache_folder(self.root)
        proc = f"/proc/self/fd/{self._fd}"
        self._base = proc if os.path.isdir(proc) else self.root
        self._key = _private_key(self.root, self._base)

    def __del__(self) -> None:
        fd, self._fd = getattr(self, "_fd", -1), -1
        if fd >= 0 and getattr(self, "pid", None) == os.getpid():
            try:
                os.close(fd)
            except OSError:
                pass

    def __getstate__(self) -> dict[str, Any]:
        return {"root": self.root, "max_bytes": self.max_bytes, "keep_since": self.keep_since}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["root"], state["max_bytes"], state.get("keep_since"))

    def cache_key(self, namespace: str, path: str) -> str:
        """Where (relative to ``root``) the copy of remote object ``path`` is kept (``names.cache_key`` refuses
        a path made of a store's names that would climb out of it)."""
        return names.cache_key(self.root, namespace, path)

    def local_path(self, namespace: str, path: str) -> str:
        return os.path.join(self.root, self.cache_key(namespace, path))

    def _digest(self, key: str, parts: list[Any]) -> bytes:
        h = hmac.new(self._key, key.encode() + b"\0", hashlib.sha256)
        for b in parts:
            h.update(memoryview(b).cast("B"))  # hashlib releases the GIL on large buffers
        return h.digest()

    # -- reading -----------------------------------------------------------------------------------
    def get(self, namespace: str, path: str, expect: int | None = None, bound: int | None = None) -> bytes | None:
        """The cached copy of ``path``, if its digest is this cache's, it is intact and (``expect``: the payload
        CRC32C the commit record lists) the chunk the store holds there now; otherwise it is dropped."""
        key = self.cache_key(namespace, path)
        try:
            blob = door.read(_LOCAL, self._base, key, bound=(bound or self.max_bytes) + DIGEST)
        except FileNotFoundError:
            return None
        except (CorruptionError, OSError) as e:
            log.warning("chunk cache: %s; dropped", e)
            self._remove(os.path.join(self._base, key))
            return None
        data, mac = memoryview(blob)[:-DIGEST], blob[-DIGEST:]
        if len(blob) < DIGEST + 4 or not hmac.compare_digest(mac, self._digest(key, [data])) \
                or not codec.chunk_ok(data, expect):
            log.warning("chunk cache: dropping damaged, stale or foreign copy %s", key)
            self._remove(os.path.join(self._base, key))
            return None
        self._touch(key, len(blob))
        return bytes(data)

    def cat(self, fs, root: str, keys: list[str], namespace: str, expect: dict[str, int | None] | None = None,
            sizes: dict[str, int] | None = None, bound: Callable[[str], int] | None = None) -> dict[str, Any]:
        """Objects ``keys`` of the store at ``(fs, root)``: key -> bytes (or the read's exception). ``expect``:
        key -> payload CRC32C from the commit record; a cached copy must match it. ``sizes``/``bound``: the
        record's sizes and each chunk's bound, for the reads (``door.read_many``)."""
        out: dict[str, Any] = {}
        missing = []
        expect = expect or {}
        for k in keys:
            blob = self.get(namespace, storage.join(root, k), expect.get(k), bound(k) if bound else None)
            if blob is None:
                missing.append(k)
            else:
                out[k] = blob
        self.hits += len(out)
        self.misses += len(missing)
        if missing:
            sizes = sizes if sizes is not None else {k: door.size_of(fs, root, k) for k in missing}
            fetched = door.read_many(fs, root, missing, sizes=sizes, bound=bound or self.max_bytes,
                                     ok=lambda _k, b: codec.chunk_ok(b))
            for k in missing:
                blob = fetched.get(k)
                out[k] = blob
                if isinstance(blob, (bytes, bytearray)) and codec.chunk_ok(blob, expect.get(k)):
                    self.put(namespace, storage.join(root, k), bytes(blob))
        return out

    def cat_into(self, fs, root: str, targets: dict[str, list[Any]], namespace: str,
                 check: Callable[[str], str | None]) -> dict[str, Exception | str | None]:
        """``door.fill`` served from the cache where it holds a copy that fills the buffers, carries this
        cache's digest and passes ``check`` (a copy that does not is dropped); the rest is fetched into the
        buffers and cached from them."""
        out: dict[str, Exception | str | None] = {}
        missing: dict[str, list[Any]] = {}
        for k, bufs in targets.items():
            key = self.cache_key(namespace, storage.join(root, k))
            got = self._read_into(key, bufs)
            if got and check(k) is None:
                out[k] = None
                self._touch(key, sum(memoryview(b).nbytes for b in bufs) + DIGEST)
                continue
            if got is not None:
                log.warning("chunk cache: dropping damaged, stale or foreign copy %s", key)
                self._remove(os.path.join(self._base, key))
            missing[k] = bufs
        self.hits += len(out)
        self.misses += len(missing)
        if missing:
            for k, result in door.fill(fs, root, missing, check).items():
                out[k] = result
                if result is None:
                    self.put(namespace, storage.join(root, k), missing[k])
        return out

    def _read_into(self, key: str, bufs: list[Any]) -> bool | None:
        """Whether the copy at ``key`` fills ``bufs`` exactly and carries its digest (None: there is none)."""
        want = sum(memoryview(b).nbytes for b in bufs)
        mac = bytearray(DIGEST)
        try:
            with door.opened(self._base, key) as (fd, n):
                if n != want + DIGEST or pread_into(fd, [*bufs, mac], 0) != n:
                    return False
        except FileNotFoundError:
            return None
        except (CorruptionError, OSError):
            return False
        return hmac.compare_digest(bytes(mac), self._digest(key, bufs))

    def _touch(self, key: str, size: int) -> None:
        """A hit refreshes the copy's place in the LRU order (its mtime, for other processes too)."""
        local = os.path.join(self._base, key)
        try:
            os.utime(local, follow_symlinks=False)
        except (FileNotFoundError, NotImplementedError):
            pass
        with self._lock:
            if self._index is not None:
                self._index[local] = (self._clock(), size)

    # -- writing and eviction ----------------------------------------------------------------------
    def put(self, namespace: str, path: str, blob: Any) -> None:
        """Keep ``blob`` (bytes, or a list of buffers written in turn) as the copy of ``path``, with its digest."""
        parts = blob if isinstance(blob, list) else [blob]
        key = self.cache_key(namespace, path)
        size = copy_size(sum(memoryview(b).nbytes for b in parts))
        if size > self.max_bytes or not self._room(size):
            return
        local = os.path.join(self._base, key)
        tmp = f"{local}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            _makedirs_private(self._base, os.path.dirname(key))
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as f:
                for b in parts:
                    f.write(memoryview(b).cast("B"))
                f.write(self._digest(key, parts))
            os.replace(tmp, local)
        except OSError as e:  # a full or read-only disk must not stop training: the read still succeeds
            log.warning("chunk cache: cannot write %s (%s)", os.path.join(self.root, key), e)
            self._remove(tmp)
            return
        with self._lock:
            index = self._scan() if self._index is None else self._index
            old = index.get(local)
            self._total += size - (old[1] if old else 0)
            index[local] = (self._clock(), size)
            if self._total > self.max_bytes:
                self._evict()
            if self._total > self.max_bytes and self.keep_since is not None:  # another process filled it meanwhile
                self._drop_new(local, size)

    def _room(self, size: int) -> bool:
        """Whether a new copy of ``size`` bytes may be kept: always under LRU (eviction follows the write); with
        ``keep_since``, only where it fits once copies older than that are evicted (else it is declined)."""
        if self.keep_since is None:
            return True
        with self._lock:
            if self._index is None:
                self._scan()
            if self._total + size <= self.max_bytes:
                return True
            if time.monotonic() - self._full_at >= RESCAN_S:  # not on every miss of a full cache
                self._evict(size)
                if self._total + size > self.max_bytes:
                    self._full_at = time.monotonic()
            if self._total + size <= self.max_bytes:
                return True
            self.declined += 1
            return False

    def _drop_new(self, local: str, size: int) -> None:
        """Remove the copy just written at ``local`` (lock held): over the cap with nothing older to evict."""
        if self._remove(local):
            self._total -= size
        self._index.pop(local, None)
        self.declined += 1

    def _clock(self) -> float:
        """Wall time, strictly increasing within this process (coarse mtimes must not tie the LRU order)."""
        self._last = max(time.time(), self._last + 1e-6)
        return self._last

    def _scan(self) -> dict[str, tuple[float, int]]:
        index: dict[str, tuple[float, int]] = {}
        for dirpath, _, files in os.walk(self._base):
            if dirpath == self._base:  # only copies, under a namespace folder: never the key, nor anything else
                continue
            for name in files:
                if ".tmp-" in name or name.startswith("."):
                    continue
                p = os.path.join(dirpath, name)
                try:
                    st = os.lstat(p)
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    index[p] = (st.st_mtime, st.st_size)
        self._index = index
        self._total = sum(s for _, s in index.values())
        return index

    def _evict(self, room: int = 0) -> None:
        """Drop least recently used files until under the low-water mark with ``room`` bytes more to spare (lock
        held); with ``keep_since``, only copies last used before it."""
        own = self._index or {}
        index = self._scan()
        for p, (t, s) in own.items():  # our own clock is finer than some filesystems' mtime
            if p in index:
                index[p] = (max(t, index[p][0]), index[p][1])
        target = int(self.max_bytes * LOW_WATER) - room
        for p, (t, size) in sorted(index.items(), key=lambda kv: kv[1][0]):
            if self._total <= target or (self.keep_since is not None and t >= self.keep_since):
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


def _open_cache_folder(path: str) -> int:
    """A descriptor of the cache folder ``path``, made (0700) when missing, after the checks a private folder
    needs: itself not a link and the user's own (made 0700), every folder above it safe from other users (none
    owned by another user but root, none writable by others without the sticky bit: there another user could
    swap the cache folder for a link), and a folder that holds anything is a cache already (its key file there):
    eviction must never delete a user's files."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    _check_parents(path)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    try:
        fd = sinks.open_exact_folder(path)
    except OSError:
        raise StoreError(f"chunk cache {path!r}: refused (a link or not a folder; give a folder of your own)") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise StoreError(f"chunk cache {path!r}: refused (owned by uid {st.st_uid}, not by this user: another "
                             "user could read or plant the cached hidden states)")
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.fchmod(fd, 0o700)
        entries = [e for e in os.listdir(fd) if ".tmp-" not in e]
        if entries and KEY_FILE not in entries:
            shown = ", ".join(sorted(entries)[:3]) + (", ..." if len(entries) > 3 else "")
            raise StoreError(f"chunk cache {path!r}: refused (a folder holding other files ({shown}) and no "
                             f"{KEY_FILE}: not a chunk cache, and eviction would delete them; give a new or empty "
                             "folder)")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_parents(path: str) -> None:
    """Refuse a cache below a folder that another user could change: owned by someone else than this user or root,
    or writable by everyone without the sticky bit (``/tmp`` itself, sticky, is fine)."""
    me = os.geteuid()
    parent = os.path.dirname(os.path.abspath(path))
    while True:
        try:
            st = os.stat(parent)
        except FileNotFoundError:
            st = None
        if st is not None:
            if st.st_uid not in (me, 0):
                raise StoreError(f"chunk cache {path!r}: refused ({parent} belongs to uid {st.st_uid}: that user "
                                 "could swap the cache folder for a link; give a folder of your own)")
            if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
                raise StoreError(f"chunk cache {path!r}: refused ({parent} is writable by other users without the "
                                 "sticky bit: they could swap the cache folder for a link; give a folder of your own)")
        up = os.path.dirname(parent)
        if up == parent:
            return
        parent = up


def _makedirs_private(root: str, rel: str) -> None:
    """``root/rel`` made folder by folder with mode 0700 (``os.makedirs`` applies its mode to the last one only),
    none of them a link."""
    path = root
    for part in [p for p in rel.split("/") if p]:
        path = os.path.join(path, part)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode):
                raise OSError(f"{path} is not a folder (a link?)") from None


def _private_key(root: str, base: str) -> bytes:
    """The cache's digest key: read from ``.hsstore-cache-key`` in the cache folder (``base``: the folder as
    opened; 0600, made once, exclusively). Its presence marks the folder as a cache."""
    path = os.path.join(base, KEY_FILE)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
    for _ in range(50):  # another process may be writing it this instant
        try:
            fd, st = door.open_beneath(base, KEY_FILE, f"chunk cache {root!r}")
        except CorruptionError as e:
            raise StoreError(str(e)) from None
        try:
            if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
                raise StoreError(f"chunk cache {root!r}: {KEY_FILE} refused (not this user's, or readable by others)")
            key = os.pread(fd, 64, 0)
        finally:
            os.close(fd)
        if len(key) == 32:
            return key
        time.sleep(0.01)
    raise StoreError(f"chunk cache {root!r}: {KEY_FILE} is not a 32-byte key (remove it to start a new cache)")
