"""The extraction pipeline: token-budget batches -> target forward -> pinned host copy -> store writer.

The GPU must never wait on storage: taps are stacked and packed (padding dropped) on the GPU, copied
with ``non_blocking=True`` into one of two pinned host buffers, and handed to a thread that waits on
the copy's CUDA event and feeds the :class:`hsstore.StoreWriter` (which encodes and uploads in its own
threads), while the next batch's forward runs.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch

from hsstore.errors import SampleError

from .capture import run_tapped
from .tokenize import TokenizedSample

log = logging.getLogger(__name__)


def token_budget_batches(samples: Sequence[TokenizedSample], max_tokens: int, max_batch: int = 256,
                         ) -> list[list[TokenizedSample]]:
    """Batches of length-sorted samples whose padded size (batch x longest) stays within ``max_tokens``.

    Longest first, so an out-of-memory shows up in the first batch rather than hours in. A sample longer
    than the budget gets a batch of its own.
    """
    order = sorted(samples, key=lambda s: (-s.num_tokens, s.sample_id))
    batches: list[list[TokenizedSample]] = []
    current: list[TokenizedSample] = []
    for s in order:
        longest = current[0].num_tokens if current else s.num_tokens
        if current and ((len(current) + 1) * longest > max_tokens or len(current) >= max_batch):
            batches.append(current)
            current = []
        current.append(s)
    if current:
        batches.append(current)
    return batches


def pad_right(batch: Sequence[TokenizedSample], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` with right padding only: recurrent (Gated DeltaNet) layers
    would change real tokens' states under left padding; under right padding they cannot."""
    T = max(s.num_tokens for s in batch)
    ids = torch.full((len(batch), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), T), dtype=torch.long)
    for i, s in enumerate(batch):
        ids[i, : s.num_tokens] = torch.from_numpy(s.input_ids.astype("int64"))
        mask[i, : s.num_tokens] = 1
    return ids, mask


@dataclass
class ExtractStats:
    batches: int = 0
    tokens: int = 0
    slot_wait_s: float = 0.0  # the forward waited this long for the sink to free a host buffer (slow writer)


def host_buffer(numel: int, dtype: torch.dtype, alloc: Callable[[int], torch.Tensor] | None, pin: bool
                ) -> torch.Tensor:
    """A flat host buffer for ``numel`` values: pinned by torch, or ``alloc(nbytes)`` (e.g. a
    :meth:`hsstore.ProcessWriter.staging` buffer in shared memory) pinned in place for the GPU."""
    if alloc is None:
        return torch.empty(numel, dtype=dtype, pin_memory=pin)
    raw = alloc(numel * dtype.itemsize)
    if pin:
        err = torch.cuda.cudart().cudaHostRegister(raw.data_ptr(), raw.numel(), 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of a {raw.numel()}-byte staging buffer failed: {err}")
    return raw.view(dtype)


def unpin(buffers: Sequence[torch.Tensor | None]) -> None:
    for b in buffers:
        if b is not None:
            torch.cuda.cudart().cudaHostUnregister(b.data_ptr())


@dataclass
class _Staged:
    batch: list[TokenizedSample]
    host: torch.Tensor  # [n_tokens, L, H] packed features on the host
    finite: torch.Tensor  # [n_tokens] bool on the host: every feature of the token is finite
    event: torch.cuda.Event | None
    slot: int


def extract_batches(
    model: torch.nn.Module,
    layers: list[int],
    batches: Iterable[list[TokenizedSample]],
    sink: Callable[[TokenizedSample, torch.Tensor], None],
    pad_id: int,
    device: torch.device,
    on_batch: Callable[[list[TokenizedSample]], None] | None = None,
    staging_tokens: int = 0,
    host_alloc: Callable[[int], torch.Tensor] | None = None,
) -> ExtractStats:
    """Run the target over ``batches`` and call ``sink(sample, features [T, L, H])`` for every sample, in a
    background thread, overlapped with the next forward. ``features`` is only valid during the call and
    is checked finite on the device first (a sample with NaN/Inf raises ``SampleError`` naming it).
    ``staging_tokens``: size the two pinned buffers for this many tokens up front (the token budget).
    ``host_alloc(nbytes)``: where those buffers live (default: torch's pinned memory); with it, features
    go to the host buffers on CPU too. ``on_batch`` runs before a batch's buffer is reused."""
    cuda = device.type == "cuda"
    stats = ExtractStats()
    slots: list[torch.Tensor | None] = [None, None]
    free: queue.Queue[int] = queue.Queue()
    for i in range(len(slots)):
        free.put(i)
    staged: queue.Queue[_Staged | None] = queue.Queue(maxsize=1)
    errors: list[BaseException] = []

    def consume() -> None:
        while True:
            item = staged.get()
            if item is None:
                return
            try:
                if item.event is not None:
                    item.event.synchronize()
                off = 0
                for s in item.batch:
                    ok = item.finite[off:off + s.num_tokens]
                    if not bool(ok.all()):
                        bad = int((~ok).nonzero()[0, 0])
                        raise SampleError(f"sample {s.sample_id!r}: the target produced NaN/Inf features "
                                          f"(first at token {bad})")
                    sink(s, item.host[off:off + s.num_tokens])
                    off += s.num_tokens
                if on_batch:
                    on_batch(item.batch)
            except BaseException as e:  # surfaced in the producer at the next batch
                errors.append(e)
            finally:
                free.put(item.slot)

    worker = threading.Thread(target=consume, name="hsstore-extract-sink", daemon=True)
    worker.start()
    copy_stream = torch.cuda.Stream(device) if cuda else None
    try:
        for batch in batches:
            if errors:
                raise errors[0]
            ids, attn = pad_right(batch, pad_id)
            if cuda:
                ids, attn = ids.pin_memory().to(device, non_blocking=True), attn.pin_memory().to(device, non_blocking=True)
            feats = run_tapped(model, layers, ids, attn)  # [B, T, L, H] on device
            # GPU-side pack: drop padding before anything crosses PCIe
            packed = torch.cat([feats[i, : s.num_tokens] for i, s in enumerate(batch)], dim=0)
            # NaN/Inf check on the device (one pass at HBM speed) instead of on the host's cores
            finite = torch.isfinite(packed).flatten(1).all(dim=1)
            t = time.perf_counter()
            slot = free.get()
            stats.slot_wait_s += time.perf_counter() - t
            stats.batches += 1
            stats.tokens += packed.shape[0]
            if errors:
                raise errors[0]
            if cuda or host_alloc is not None:
                host = slots[slot]
                if host is None or host.numel() < packed.numel():
                    # sized for the largest batch the budget allows, once: pinning is slow and synchronising
                    if host is not None and cuda and host_alloc is not None:
                        unpin([host])
                    size = max(packed.numel(), staging_tokens * packed[0].numel())
                    host = slots[slot] = host_buffer(size, packed.dtype, host_alloc, pin=cuda)
                view = host[: packed.numel()].view(packed.shape)
            if not cuda and host_alloc is not None:
                view.copy_(packed)
                staged.put(_Staged(batch, view, finite, None, slot))
            elif cuda:
                event = torch.cuda.Event()
                copy_stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(copy_stream):
                    view.copy_(packed, non_blocking=True)
                    finite_host = finite.to("cpu", non_blocking=True)
                    packed.record_stream(copy_stream)
                    finite.record_stream(copy_stream)
                    event.record(copy_stream)
                staged.put(_Staged(batch, view, finite_host, event, slot))
            else:
                staged.put(_Staged(batch, packed, finite, None, slot))
            del feats, packed, finite
    finally:
        staged.put(None)
        worker.join()
        if cuda and host_alloc is not None:
            unpin(slots)
    if errors:
        raise errors[0]
    return stats
