"""Host memory for loaded features and collated batches: one allocation rule for both.

Where memory comes from decides what the next step costs: shared memory in a DataLoader worker (the
hand-over to the main process then moves nothing), pinned memory when asked in the main process (an
asynchronous copy to the GPU can read it directly), else recycled buffers (fresh memory faults in page by
page, which costs as much as reading the bytes).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Sequence

import numpy as np
import torch
from torch.utils.data import get_worker_info

log = logging.getLogger(__name__)


def empty_host(shape: Sequence[int], dtype: torch.dtype, *, pin: bool = False, shared: bool | None = None,
               pool: "BufferPool | None" = None) -> torch.Tensor:
    """Uninitialised host memory of ``shape`` and ``dtype``.

    ``shared``: in shared memory (None: exactly when in a DataLoader worker). Otherwise ``pin``: pinned,
    from torch's caching host allocator (it recycles a block once its copy to the device is done), outside
    DataLoader workers and when an accelerator exists (else a warning, once). Otherwise from ``pool`` when
    given, else from torch."""
    numel = 1
    for s in shape:
        numel *= int(s)
    nbytes = numel * dtype.itemsize
    in_worker = get_worker_info() is not None
    if in_worker if shared is None else shared:
        raw = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(nbytes))
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
    ok = torch.accelerator.is_available() if hasattr(torch, "accelerator") else torch.cuda.is_available()
    if not ok and not _PIN_WARNED:
        log.warning("pin_memory=True but no accelerator is available: items are not pinned")
        _PIN_WARNED = True
    return ok


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
