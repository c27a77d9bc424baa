"""The extraction pipeline: token-budget batches -> target forward -> pinned host copy -> store writer.

The GPU must never wait on storage: taps are stacked and packed (padding dropped) on the GPU, copied
with ``non_blocking=True`` into one of two pinned host buffers, and handed to a thread that waits on
the copy's CUDA event and feeds the :class:`hsstore.StoreWriter` (which encodes and uploads in its own
threads), while the next batch's forward runs. For fp8 stores the packed features are quantised on
the GPU before the copy, so PCIe and host memory carry half the bytes.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch

from hsstore.format import encodings, health
from hsstore.format.encodings import Encoded
from hsstore.errors import SampleError
from hsstore.loader.batching import TokenBudget

from .capture import run_tapped
from .sample import TokenizedSample

log = logging.getLogger(__name__)


def token_budget_batches(samples: Sequence[TokenizedSample], token_budget: int, max_batch: int = 256,
                         ) -> list[list[TokenizedSample]]:
    """Batches of length-sorted samples within ``token_budget`` (the loader's rule, ``TokenBudget``: batch x
    longest, padding counted), at most ``max_batch`` each.

    Longest first, so an out-of-memory shows up in the first batch rather than hours in. A sample longer
    than the budget gets a batch of its own.
    """
    budget = TokenBudget(token_budget, "pad", max_batch)
    batches: list[list[TokenizedSample]] = []
    for s in sorted(samples, key=lambda s: (-s.num_tokens, s.sample_id)):
        if budget.add(s.num_tokens):
            batches.append([])
        batches[-1].append(s)
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


def unpin(buffers: Sequence[torch.Tensor]) -> None:
    for b in buffers:
        torch.cuda.cudart().cudaHostUnregister(b.data_ptr())


@dataclass
class _Staged:
    batch: list[TokenizedSample]
    host: list[torch.Tensor]  # on the host: [n_tokens, L, H] packed features, or encoded values (and fp8's scales)
    finite: torch.Tensor  # [n_tokens] bool on the host: every feature of the token is finite
    event: torch.cuda.Event | None
    slot: int
    stats: torch.Tensor | None = None  # [samples, features, 5] on the host (health.batch_stats); None: off


def extract_batches(
    model: torch.nn.Module,
    layers: list[int],
    batches: Iterable[list[TokenizedSample]],
    sink: Callable[[TokenizedSample, Any, Any], None],
    pad_id: int,
    device: torch.device,
    on_batch: Callable[[list[TokenizedSample]], None] | None = None,
    staging_tokens: int = 0,
    encoding: str = "raw",
    host_alloc: Callable[[int], torch.Tensor] | None = None,
    final_hidden: bool = False,
    record_stats: bool = True,
) -> ExtractStats:
    """Run the target over ``batches`` and call ``sink(sample, features [T, L, H], feature_stats)`` for every
    sample (``feature_stats``: its ``[features, 5]`` value statistics from the device, or None), in a
    background thread, overlapped with the next forward. ``features`` is only valid during the call and
    is checked finite on the device first (a sample with NaN/Inf raises ``SampleError`` naming it).
    ``staging_tokens``: size the two pinned buffers for this many tokens up front (the token budget).
    ``encoding``: other than ``raw``, features are :class:`hsstore.format.encodings.Encoded` (fp8: e4m3fn values,
    per-token-per-layer scales; a block encoding: its row bytes), encoded on the device after the finiteness check.
    ``host_alloc(nbytes)``: where the host buffers live (default: torch's pinned memory); with it, features
    go to the host buffers on CPU too. ``on_batch`` runs before a batch's buffers are reused.
    ``final_hidden``: the features hold one more slot, the final norm's output (same forward).
    ``record_stats=False``: no value statistics computed (``feature_stats`` is None; a benchmark of their cost)."""
    stats = ExtractStats()
    staging = _HostStaging(device, staging_tokens, host_alloc)
    staged: queue.Queue[_Staged | None] = queue.Queue(maxsize=1)
    errors: list[BaseException] = []
    quantise = encoding != "raw"
    worker = threading.Thread(target=_consume, args=(staged, staging.free, errors, sink, on_batch, quantise),
                              name="hsstore-extract-sink", daemon=True)
    worker.start()
    try:
        for batch in batches:
            _raise_first(errors)
            parts, finite, values = _forward_packed(model, layers, batch, pad_id, device, final_hidden, encoding,
                                                    record_stats)
            slot = _free_slot(staging.free, stats)
            stats.batches += 1
            stats.tokens += parts[0].shape[0]
            _raise_first(errors)
            staged.put(staging.stage(batch, parts, finite, slot, values))
            del parts, finite, values
    finally:
        staged.put(None)
        worker.join()
        staging.release()
    _raise_first(errors)
    return stats


def _raise_first(errors: list[BaseException]) -> None:
    """The sink thread's first error, raised in the producer: it stops the forward at the next batch."""
    if errors:
        raise errors[0]


def _forward_packed(model: torch.nn.Module, layers: list[int], batch: list[TokenizedSample], pad_id: int,
                    device: torch.device, final_hidden: bool, encoding: str = "raw", record_stats: bool = True,
                    ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor | None]:
    """One batch's features on the device, padding dropped before anything crosses PCIe: ``[packed]`` (or the
    encoded ``[values]``, fp8's ``[values, scales]``), ``finite [n_tokens]`` and each sample's value statistics
    ``[samples, features, 5]`` (``health.batch_stats`` of what the store will hold: the encoded values, whose
    small entries round to zero; None without ``record_stats``). Checking finiteness and counting here is a few
    passes at HBM speed instead of passes on the host's cores; the consumer refuses NaN/Inf rows from it."""
    packed = packed_features(model, layers, batch, pad_id, device, final_hidden)
    finite = torch.isfinite(packed).flatten(1).all(dim=1)
    enc = encodings.get(encoding)
    parts = [t for t in enc.encode(packed) if t is not None] if enc.quantised else [packed]
    lengths = [s.num_tokens for s in batch]
    values = None
    if record_stats:
        if enc.row_scale:  # fp8: each token's sums scaled, the product never made
            values = health.batch_stats(parts[0], lengths, parts[1])
        else:  # what a reader decodes (a block encoding's zeros depend on its scales)
            values = health.batch_stats(enc.decode(parts[0], None, packed.shape[-1]) if enc.quantised else packed,
                                        lengths)
    return parts, finite, values


def packed_features(model: torch.nn.Module, layers: list[int], batch: list[TokenizedSample], pad_id: int,
                    device: torch.device, final_hidden: bool = False) -> torch.Tensor:
    """One batch's features on the device, ``[tokens, taps (+ final_hidden), H]``, the samples' real tokens
    one after another (padding dropped): extraction's forward, and the compile check's eager reference."""
    ids, _ = pad_right(batch, pad_id)
    if device.type == "cuda":
        ids = ids.pin_memory().to(device, non_blocking=True)
    # [B, T, L, H] on device; with final_hidden one more slot, the final norm's output. No padding mask:
    # under a causal decoder a right pad never reaches a real token, and without one SDPA runs its fused
    # causal kernel and the recurrent layers skip their masking pass (faster, equal features: docs/PERFORMANCE.md)
    feats = run_tapped(model, layers, ids, None, final_hidden=True) if final_hidden else \
        run_tapped(model, layers, ids, None)
    return torch.cat([feats[i, : s.num_tokens] for i, s in enumerate(batch)], dim=0)


def _free_slot(free: queue.Queue[int], stats: ExtractStats) -> int:
    """A host buffer the sink has finished with; the time waited is the writer being slower than the GPU."""
    t = time.perf_counter()
    slot = free.get()
    stats.slot_wait_s += time.perf_counter() - t
    return slot


@dataclass
class _HostStaging:
    """The two host buffer slots a batch's features are copied into (pinned, or ``host_alloc``'s shared memory)
    while the next forward runs, and the side stream that copies them."""

    device: torch.device
    staging_tokens: int
    host_alloc: Callable[[int], torch.Tensor] | None
    slots: list[list[torch.Tensor]] = field(default_factory=lambda: [[], []])
    free: queue.Queue[int] = field(default_factory=queue.Queue)
    copy_stream: torch.cuda.Stream | None = None

    def __post_init__(self) -> None:
        for i in range(len(self.slots)):
            self.free.put(i)
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(self.device)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def stage(self, batch: list[TokenizedSample], parts: list[torch.Tensor], finite: torch.Tensor, slot: int,
              values: torch.Tensor | None = None) -> _Staged:
        """Hand a batch to the sink: on the CPU without ``host_alloc`` as it is; else copied into ``slot``'s
        buffers (on CUDA asynchronously on the copy stream, with an event the sink waits on). ``values``: the
        samples' statistics, a few hundred bytes, copied beside ``finite``."""
        if not self.cuda and self.host_alloc is None:
            return _Staged(batch, parts, finite, None, slot, values)
        views = self._views(slot, parts)
        if not self.cuda:
            for view, part in zip(views, parts):
                view.copy_(part)
            return _Staged(batch, views, finite, None, slot, values)
        event = torch.cuda.Event()
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            for view, part in zip(views, parts):
                view.copy_(part, non_blocking=True)
                part.record_stream(self.copy_stream)
            finite_host = finite.to("cpu", non_blocking=True)
            finite.record_stream(self.copy_stream)
            values_host = values.to("cpu", non_blocking=True) if values is not None else None
            if values is not None:
                values.record_stream(self.copy_stream)
            event.record(self.copy_stream)
        return _Staged(batch, views, finite_host, event, slot, values_host)

    def _views(self, slot: int, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Views of ``slot``'s buffers shaped like ``parts``; a buffer is (re)allocated only when too small, sized
        for the largest batch the budget allows, once: pinning is slow and synchronising."""
        hosts = self.slots[slot]
        views = []
        for j, part in enumerate(parts):
            if len(hosts) <= j or hosts[j].numel() < part.numel():
                if len(hosts) > j and self.cuda and self.host_alloc is not None:
                    unpin(hosts[j:j + 1])
                size = max(part.numel(), self.staging_tokens * part[0].numel())
                hosts[j:j + 1] = [host_buffer(size, part.dtype, self.host_alloc, pin=self.cuda)]
            views.append(hosts[j][: part.numel()].view(part.shape))
        return views

    def release(self) -> None:
        """Unregister ``host_alloc``'s buffers from CUDA (torch's own pinned buffers free themselves)."""
        if self.cuda and self.host_alloc is not None:
            unpin([h for hosts in self.slots for h in hosts])


def _consume(staged: queue.Queue[_Staged | None], free: queue.Queue[int], errors: list[BaseException],
             sink: Callable[[TokenizedSample, Any, Any], None],
             on_batch: Callable[[list[TokenizedSample]], None] | None, quantise: bool) -> None:
    """The sink thread: deliver each staged batch, then give its slot back; an error is kept for the producer
    (which raises it at its next batch) and the slot still freed, so the producer never waits forever."""
    while True:
        item = staged.get()
        if item is None:
            return
        try:
            _deliver(item, sink, quantise)
            if on_batch:
                on_batch(item.batch)
        except BaseException as e:  # surfaced in the producer at the next batch
            errors.append(e)
        finally:
            free.put(item.slot)


def _deliver(item: _Staged, sink: Callable[[TokenizedSample, Any, Any], None], quantise: bool) -> None:
    """Wait for the batch's copy, then ``sink`` each sample's slice, refusing one with a NaN/Inf feature."""
    if item.event is not None:
        item.event.synchronize()
    off = 0
    for k, s in enumerate(item.batch):
        ok = item.finite[off:off + s.num_tokens]
        if not bool(ok.all()):
            bad = int((~ok).nonzero()[0, 0])
            raise SampleError(f"sample {s.sample_id!r}: the target produced NaN/Inf features "
                              f"(first at token {bad})")
        parts = [h[off:off + s.num_tokens] for h in item.host]
        values = item.stats[k].numpy() if item.stats is not None else None
        sink(s, Encoded(*parts) if quantise else parts[0], values)
        off += s.num_tokens
