"""Host memory for loaded features and collated batches: one allocation rule for both.

Where memory comes from decides what the next step costs: shared memory in a DataLoader worker (the
hand-over to the main process then moves nothing), pinned memory when asked in the main process (an
asynchronous copy to the GPU can read it directly), else recycled buffers (fresh memory faults in page by
page, which costs as much as reading the bytes).

Shared memory is recycled too (``SharedRing``): a fresh segment per item is the workers' limit (creating, faulting
in and handing over a new segment is several times slower than writing into a segment already mapped:
docs/PERFORMANCE.md, "Loader"). A segment is rewritten only once every copy handed to the consumer is gone, which
the consumer reports through counters in a small shared control segment (see ``SharedRing``).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import sys
import weakref
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from ..locks import ProcessLock

if TYPE_CHECKING:  # torch is imported where a tensor is made: store commands that read bytes never load it
    import torch

log = logging.getLogger(__name__)


def machine_bytes() -> int:
    """This machine's physical memory in bytes (0: unknown)."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 0


def check_fits(nbytes: int, what: str,
               why: str = "the store's metadata claims more than it can hold; run hsstore verify") -> None:
    """Refuse, before allocating, a buffer that store metadata (or a config: ``why`` says which) sizes beyond this
    machine's memory (a record claiming 1e12 tokens, a manifest with hidden_size 2**40): one ``StoreError`` line
    naming ``what`` instead of numpy's ``MemoryError`` traceback, or the kernel's OOM killer for an allocation it
    overcommitted."""
    limit = machine_bytes()
    if nbytes < 0 or (limit and nbytes > limit):
        from ..errors import StoreError

        raise StoreError(f"{what}: needs {nbytes:,} bytes, more than this machine's {limit:,} bytes of memory "
                         f"({why})")


def pread_into(fd: int, bufs: Sequence[Any], offset: int) -> int:
    """Read file ``fd`` from ``offset`` into the contiguous buffers ``bufs`` in turn with ``preadv`` (no
    intermediate bytes, no mapping), resumed after short reads; returns the bytes read, fewer than the
    buffers hold only when the file ends first (the caller decides what a short read means)."""
    views = [memoryview(b).cast("B") for b in bufs]
    views = [v for v in views if len(v)]
    total = 0
    while views:
        got = os.preadv(fd, views, offset + total)
        if got == 0:
            break
        total += got
        while views and got >= len(views[0]):
            got -= len(views[0])
            views.pop(0)
        if views and got:
            views[0] = views[0][got:]
    return total


READ_BLOCK = 1 << 20  # bytes pread_fold reads before folding them in: well inside a core's L2 cache


def pread_fold(fd: int, flat: "np.ndarray | Sequence[np.ndarray]", offset: int, fold, state=None,
               block: int | None = None):
    """``pread_into`` of the contiguous bytes ``flat`` (or of several such parts in turn: the file's bytes in order),
    ``block`` bytes at a time (default ``READ_BLOCK``), with ``state = fold(block, state)`` after each block (a
    CRC32C of the bytes): the check reads each block while it is still in cache instead of reading a whole chunk
    back from memory. Returns (bytes read, state); fewer bytes only where the file ends first. (A checksum over a
    cold buffer runs at half the speed of one over a hot block: PERFORMANCE.md, "Loader".)"""
    got, block = 0, block or READ_BLOCK
    for part in [flat] if isinstance(flat, np.ndarray) else flat:
        done, n = 0, part.nbytes
        while done < n:
            k = pread_into(fd, [part[done:done + block]], offset + got + done)
            if k == 0:
                return got + done, state
            state = fold(part[done:done + k], state)
            done += k
        got += done
    return got, state


class Rows:
    """Rows ``0..n`` of one feature's destination held in pieces: ``parts``, arrays of whole rows (``[k, H]``, or
    ``[k]`` for per-row values), each C-contiguous, one after another. Why: a read range holds several samples,
    and the loader reads each sample's rows straight into its slot of the batch it belongs to (``TokenBatches``),
    so the rows of one range land in several places."""

    def __init__(self, parts: Sequence[np.ndarray]) -> None:
        self.parts = [p for p in parts if len(p)]
        self.starts = np.cumsum([0] + [len(p) for p in self.parts])
        if not self.parts or any(not p.flags.c_contiguous or p.dtype != self.parts[0].dtype
                                 or p.shape[1:] != self.parts[0].shape[1:] for p in self.parts):
            raise ValueError("Rows: parts must be C-contiguous arrays of one dtype and row shape")

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def dtype(self) -> np.dtype:
        return self.parts[0].dtype

    @property
    def row_shape(self) -> tuple[int, ...]:
        return self.parts[0].shape[1:]

    def take(self, lo: int, hi: int) -> list[np.ndarray]:
        """The pieces that hold rows ``lo:hi``, in order (views)."""
        out = []
        first = int(np.searchsorted(self.starts, lo, side="right")) - 1
        for i in range(max(0, first), len(self.parts)):
            a, b = int(self.starts[i]), int(self.starts[i + 1])
            if a >= hi:
                break
            out.append(self.parts[i][max(lo, a) - a:min(hi, b) - a])
        return out


def row_parts(dest: "np.ndarray | Rows", lo: int, hi: int) -> list[np.ndarray]:
    """Rows ``lo:hi`` of a destination (an array, or ``Rows``) as contiguous pieces in order."""
    return dest.take(lo, hi) if isinstance(dest, Rows) else [dest[lo:hi]]


def scatter_rows(parts: Sequence[np.ndarray], rows: np.ndarray) -> None:
    """Copy ``rows`` (in order) into the pieces ``parts`` that hold them (``row_parts``)."""
    at = 0
    for p in parts:
        p[...] = rows[at:at + len(p)]
        at += len(p)


_SCRATCH: list[np.ndarray] = []  # free partial-chunk buffers, shared by all threads of this process
_SCRATCH_LOCK = ProcessLock()


@contextlib.contextmanager
def scratch(nbytes: int):
    """A byte buffer for one partial chunk or tar member, reused across threads and the loader's per-epoch thread
    pools (both layouts' read paths): fresh memory costs more to fault in than the read (docs/PERFORMANCE.md,
    "Loader"), so none is dropped."""
    with _SCRATCH_LOCK:
        fits = [i for i, b in enumerate(_SCRATCH) if b.nbytes >= nbytes]
        buf = _SCRATCH.pop(min(fits, key=lambda i: _SCRATCH[i].nbytes)) if fits else None
    if buf is None:
        buf = np.empty(nbytes, np.uint8)
    try:
        yield buf[:nbytes]
    finally:
        with _SCRATCH_LOCK:
            _SCRATCH.append(buf)


def empty_host(shape: Sequence[int], dtype: torch.dtype, *, pin: bool = False, shared: bool | None = None,
               pool: "BufferPool | None" = None) -> torch.Tensor:
    """Uninitialised host memory of ``shape`` and ``dtype``.

    ``shared``: in shared memory (None: exactly when in a DataLoader worker). Otherwise ``pin``: pinned,
    from torch's caching host allocator (it recycles a block once its copy to the device is done), outside
    DataLoader workers and when an accelerator exists (else a warning, once). Otherwise from ``pool`` when
    given, else from torch. ``pool`` also sizes a worker's ``SharedRing``."""
    import torch
    from torch.utils.data import get_worker_info

    numel = 1
    for s in shape:
        numel *= int(s)
    nbytes = numel * dtype.itemsize
    check_fits(nbytes, f"a host buffer of shape {list(shape)} ({dtype})")
    in_worker = get_worker_info() is not None
    if in_worker if shared is None else shared:  # workers: recycled segments (hand items over with hand_over)
        ring = shared_ring(pool.max_bytes if pool is not None else 0) if in_worker else None
        raw = ring.take(nbytes) if ring is not None else _new_segment(nbytes)
    elif pin and not in_worker and can_pin():
        raw = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    elif pool is not None:
        raw = torch.from_numpy(pool.take(nbytes))
    else:
        return torch.empty(tuple(int(s) for s in shape), dtype=dtype)
    return raw.view(dtype).view(tuple(int(s) for s in shape))


_PIN_WARNED = False


def can_pin() -> bool:
    """Whether pinned memory is available (an accelerator exists); warns once when it is not."""
    global _PIN_WARNED
    import torch

    ok = torch.accelerator.is_available() if hasattr(torch, "accelerator") else torch.cuda.is_available()
    if not ok and not _PIN_WARNED:
        log.warning("pin_memory=True but no accelerator is available: items are not pinned")
        _PIN_WARNED = True
    return ok


class BufferPool:
    """Recycles unit buffers once no item views them any more.

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
        self.lock = ProcessLock()
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


def _new_segment(nbytes: int) -> torch.Tensor:
    """A fresh shared-memory segment as a flat uint8 tensor (torch's sharing strategy decides its kind)."""
    import torch

    return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(nbytes))


def _counters(control: torch.UntypedStorage) -> np.ndarray:
    """The control segment as ``[segments, 2]`` int64: per segment number, copies handed over and copies released."""
    import torch

    return torch.empty(0, dtype=torch.uint8).set_(control).view(torch.int64).numpy().reshape(-1, 2)


def _use_count(storage: torch.UntypedStorage) -> int | None:
    import torch

    fn = getattr(torch._C, "_storage_Use_Count", None)
    return None if fn is None else int(fn(storage._cdata))


class SharedRing:
    """A DataLoader worker's shared-memory segments, reused for later items once the consumer is done.

    Torch hands a shared storage over by its file descriptor, and the receiver maps it anew unless it
    still holds that segment (``torch.multiprocessing.reductions.rebuild_storage_fd`` caches live mappings
    by inode), so a reused segment costs the consumer at most a mapping, and the worker nothing: its pages
    are already faulted in.

    Release protocol (one writer per counter, so no lock spans processes): each segment has a number, its row in a
    small control segment that this worker creates, holding two counters. Pickling an item that views a
    segment (``hand_over``'s ``_Leased``, in the worker) adds one to *handed over*; unpickling it in the
    consumer registers a finalizer on the received storage that adds one to *released* when that storage
    dies. Torch preserves a storage's Python object while any tensor views it (PyObject preservation,
    torch >= 2.0), so that is when the last tensor, view or copy-free wrapper of it is gone. A segment is
    taken again only when both counters are equal *and* nothing in this worker refers to it (its use
    count is the ring's own); an item still queued or being pickled counts in the latter. A copy that is
    never unpickled keeps its segment busy for good, and a worker that finds no free segment allocates a
    fresh one: it never waits. Forwarding a received item to a third process without copying it is not
    covered (the consumer's release would free a segment that process still maps).
    """

    GRAIN = 16 << 20
    MAX_SEGMENTS = 512

    def __init__(self, max_bytes: int) -> None:
        import torch

        self.max_bytes, self.pid = int(max_bytes), os.getpid()
        self.control = torch.UntypedStorage._new_shared(self.MAX_SEGMENTS * 16)
        self.counts = _counters(self.control)
        self.counts[:] = 0
        self.segments: dict[int, tuple[torch.UntypedStorage, int]] = {}  # segment number -> (storage, idle use count)
        self.seg_of: dict[int, int] = {}  # segment address -> segment number
        self.lock = ProcessLock()
        self.reused = self.allocated = 0
        self.usable = _use_count(self.control) is not None

    def _free(self, seg: int) -> bool:
        storage, idle = self.segments[seg]
        return _use_count(storage) <= idle and self.counts[seg, 0] == self.counts[seg, 1]

    def take(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of shared memory as a flat uint8 tensor: a free segment when there is one."""
        # size classes: 1 MiB steps below GRAIN, powers of two above (units vary in size from epoch to epoch,
        # and a larger segment costs no memory for pages never written)
        import torch

        size = max(1, -(-nbytes // (1 << 20))) << 20 if nbytes < self.GRAIN else 1 << (nbytes - 1).bit_length()
        with self.lock:
            best = None
            if self.usable:
                for seg, (st, _) in self.segments.items():
                    if st.nbytes() >= size and (best is None or st.nbytes() < self.segments[best][0].nbytes()) \
                            and self._free(seg):
                        best = seg
            if best is not None:
                self.reused += 1  # the view is made under the lock: the segment is claimed
                return torch.empty(0, dtype=torch.uint8).set_(self.segments[best][0], 0, (nbytes,))
            self.allocated += 1
            fresh = torch.UntypedStorage._new_shared(size)
            total = sum(st.nbytes() for st, _ in self.segments.values())
            seg = None
            if self.usable and total + size <= self.max_bytes and len(self.segments) < self.MAX_SEGMENTS:
                seg = min(set(range(self.MAX_SEGMENTS)) - set(self.segments))
            elif self.usable:  # full: replace the largest free segment, if any, so that sizes keep up
                free = [s for s in self.segments if self._free(s)]
                if free:
                    seg = max(free, key=lambda s: self.segments[s][0].nbytes())
                    del self.seg_of[self.segments.pop(seg)[0].data_ptr()]
            if seg is not None:
                self.counts[seg] = 0  # a new segment: no copies of it out yet
                self.segments[seg] = (fresh, _use_count(fresh))
                self.seg_of[fresh.data_ptr()] = seg
            return torch.empty(0, dtype=torch.uint8).set_(fresh, 0, (nbytes,))

    def leases(self, item: dict[str, Any]) -> list[tuple[int, str]]:
        """(segment number, key of a tensor viewing it) for each ring segment that ``item``'s tensors view."""
        import torch

        out: dict[int, str] = {}
        for k, v in item.items():
            if isinstance(v, torch.Tensor) and v.device.type == "cpu":
                seg = self.seg_of.get(v.untyped_storage().data_ptr())
                if seg is not None:
                    out.setdefault(seg, k)
        return sorted(out.items())


_RING: SharedRing | None = None
_RING_LOCK = ProcessLock()
DEFAULT_RING_BYTES = 1 << 30


def shared_ring(max_bytes: int = 0) -> SharedRing:
    """This process's ``SharedRing`` (one per DataLoader worker), keeping at least ``max_bytes`` (and
    ``DEFAULT_RING_BYTES``) of segments between uses."""
    global _RING
    with _RING_LOCK:
        if _RING is None or _RING.pid != os.getpid():  # a forked child starts its own
            _RING = SharedRing(max(DEFAULT_RING_BYTES, max_bytes))
        _RING.max_bytes = max(_RING.max_bytes, int(max_bytes))
        return _RING


def hand_over(item: dict[str, Any]) -> dict[str, Any]:
    """``item`` ready to leave a DataLoader worker: when its tensors view this worker's ring segments,
    a dict that counts each copy handed over and, once unpickled, each copy released (``SharedRing``).
    Unpickled, it is a plain dict. Elsewhere ``item`` itself."""
    ring = _RING
    if ring is None or ring.pid != os.getpid() or not isinstance(item, dict):
        return item
    leases = ring.leases(item)
    return _Leased(item, ring, leases) if leases else item


class _Leased(dict):
    """An item viewing ring segments, as it is pickled in its worker (see ``SharedRing``)."""

    def __init__(self, item: dict[str, Any], ring: SharedRing, leases: list[tuple[int, str]]) -> None:
        super().__init__(item)
        self._ring, self._leases = ring, leases

    def __copy__(self) -> "_Leased":  # DataLoader's default_convert copies every dict it hands over
        return _Leased(self, self._ring, self._leases)

    def __deepcopy__(self, memo) -> dict[str, Any]:  # the tensors are copied: nothing is leased
        return copy.deepcopy(dict(self), memo)

    def __reduce__(self):
        """Pickling is handing over: counted (a copy never unpickled keeps its segment busy, never freed early)."""
        ring = self._ring
        if ring.pid != os.getpid():  # pickled again elsewhere (a forked copy): a plain dict
            return (dict, (dict(self),))
        with ring.lock:
            for seg, _ in self._leases:
                ring.counts[seg, 0] += 1
        return (_received, (dict(self), ring.control, self._leases))


_RELEASE_LOCK = ProcessLock()


def _received(item: dict[str, Any], control: torch.UntypedStorage, leases: list[tuple[int, str]]) -> dict[str, Any]:
    """Consumer side of a hand-over: release each leased segment when the storage received for it dies."""
    pid = os.getpid()
    # the counters' numpy view is made here, not in the finalizer: a finalizer may run inside a torch.compile
    # trace (a collection during tracing), where a torch call fails and the release would be lost
    counts = _counters(control)
    for seg, key in leases:
        fin = weakref.finalize(item[key].untyped_storage(), _release, counts, control, seg, pid)
        fin.atexit = False
    return item


def _release(counts: np.ndarray, control: torch.UntypedStorage, seg: int, pid: int) -> None:
    """One copy of segment ``seg`` released (``control`` is held so that ``counts``' memory stays mapped)."""
    if os.getpid() != pid:  # a forked copy of the consumer dropping its inherited references
        return
    with _RELEASE_LOCK:
        counts[seg, 1] += 1
