"""Batching for training: token-budget batches, padded (with attention masks) or packed (cu_seqlens).

Samples vary from a few hundred to several thousand tokens, so a fixed batch *count* either wastes the
GPU on short batches or overflows it on long ones; a token budget keeps the step cost roughly constant.

    loader = StatefulDataLoader(TokenBatches(dataset, token_budget=16384), batch_size=None, num_workers=2)

``TokenBatches`` keeps the dataset's resume state exact: items it holds for the next batch are reported
as not consumed, so a resumed run rebuilds the same batches.

Its batches are planned before their samples are read (``BatchSlots``: the same rule over the plan's lengths),
and the loader reads each sample straight into its slot of its batch: the features are written once on the
host, by the read that checks them, and never copied again before the GPU (a dataset that cannot plan ahead has
its items read into unit buffers, then collated).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from ..locks import ProcessLock
from ..io.memory import BufferPool, can_pin, empty_host, hand_over

MODES = ("pad", "pack")
POOLED_BATCHES = 4  # unpinned batches recycled in the main process: the one in use and those read ahead


class TokenBudget:
    """The token-budget rule, fed one sample length at a time: ``pad``, sequences x longest <= ``token_budget``
    (padding counts); ``pack``, the sum of lengths <= ``token_budget``; at most ``max_items`` per batch. A sample
    longer than the budget is a batch of its own (never dropped). The one copy of the rule: the loader's
    batches, their count before an epoch, and extraction's forward batches (``extract.forward``) all use it."""

    def __init__(self, token_budget: int, mode: str = "pad", max_items: int | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.token_budget, self.mode, self.max_items = int(token_budget), mode, max_items
        self.items = self.longest = self.total = 0

    def add(self, length: int) -> bool:
        """Count a sample of ``length`` tokens in; True when it starts a new batch (the first, or the last is full)."""
        cost = (self.items + 1) * max(self.longest, length) if self.mode == "pad" else self.total + length
        new = (not self.items or cost > self.token_budget
               or (self.max_items is not None and self.items >= self.max_items))
        if new:
            self.items = self.longest = self.total = 0
        self.items, self.longest, self.total = self.items + 1, max(self.longest, length), self.total + length
        return new


def token_batches(items: Iterable[dict[str, Any]], token_budget: int, mode: str = "pad",
                  max_items: int | None = None) -> Iterator[list[dict[str, Any]]]:
    """Group items greedily, in arrival order, into lists within a token budget (:class:`TokenBudget`)."""
    budget = TokenBudget(token_budget, mode, max_items)
    batch: list[dict[str, Any]] = []
    for item in items:
        if budget.add(int(item["input_ids"].shape[0])) and batch:
            yield batch
            batch = []
        batch.append(item)
    if batch:
        yield batch


def count_token_batches(lengths: Iterable[int], token_budget: int, mode: str = "pad",
                        max_items: int | None = None) -> int:
    """How many batches ``token_batches`` makes of samples with these token counts, in this order (with
    ``HiddenStateDataset.planned_lengths``: an epoch's steps, before reading it)."""
    budget = TokenBudget(token_budget, mode, max_items)
    return sum(budget.add(int(T)) for T in lengths)


def _padded_tokens(items: Sequence[dict[str, Any]], pad_id: int) -> dict[str, Any]:
    """A padded batch's token arrays: ``sample_id``, ``input_ids``, ``loss_mask``, ``attention_mask``, ``lengths``."""
    B = len(items)
    lengths = torch.tensor([int(x["input_ids"].shape[0]) for x in items], dtype=torch.int64)
    T = int(lengths.max())
    ids = torch.full((B, T), pad_id, dtype=torch.int64)
    mask = torch.zeros((B, T), dtype=torch.bool)
    for b, x in enumerate(items):
        n = int(lengths[b])
        ids[b, :n] = x["input_ids"]
        mask[b, :n] = x["loss_mask"]
    attention = torch.arange(T)[None, :] < lengths[:, None]
    return {"sample_id": [x["sample_id"] for x in items], "input_ids": ids, "loss_mask": mask,
            "attention_mask": attention, "lengths": lengths}


def _packed_tokens(items: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A packed batch's token arrays: ``sample_id``, ``input_ids``, ``loss_mask``, ``position_ids``, ``cu_seqlens``,
    ``max_seqlen``."""
    lengths = [int(x["input_ids"].shape[0]) for x in items]
    cu = torch.zeros(len(items) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
    return {"sample_id": [x["sample_id"] for x in items],
            "input_ids": torch.cat([x["input_ids"] for x in items]),
            "loss_mask": torch.cat([x["loss_mask"] for x in items]),
            "position_ids": torch.cat([torch.arange(n) for n in lengths]), "cu_seqlens": cu,
            "max_seqlen": max(lengths)}


def collate_padded(items: Sequence[dict[str, Any]], pad_id: int = 0, pin_memory: bool = False,
                   pool: BufferPool | None = None) -> dict[str, Any]:
    """Right-padded batch: ``input_ids``/``loss_mask``/``attention_mask`` ``[B, T]``, ``hidden_states``
    ``[B, T, L, H]`` (padding zeroed), ``lengths`` ``[B]``, ``sample_id`` list; items of fp8 stores add
    ``hidden_scales`` ``[B, T, L]`` (padding 1). Right padding: left padding would change nothing here,
    but the drafter's masks assume real tokens come first. ``pin_memory``: features go straight into
    pinned memory (outside DataLoader workers), ready for an asynchronous copy to the GPU; else ``pool``
    (a ``memory.BufferPool``) recycles the features' memory of batches no longer held."""
    out = _padded_tokens(items, pad_id)
    lengths = out["lengths"]
    B, T = out["input_ids"].shape
    hs0 = items[0]["hidden_states"]
    hidden = empty_host((B, T) + tuple(hs0.shape[1:]), hs0.dtype, pin=pin_memory, pool=pool)
    scales = (empty_host((B, T, hs0.shape[1]), torch.float32, pin=pin_memory, pool=pool)
              if "hidden_scales" in items[0] else None)
    for b, x in enumerate(items):
        n = int(lengths[b])
        hidden[b, :n].copy_(x["hidden_states"])
        if n < T:
            hidden[b, n:].zero_()
        if scales is not None:
            scales[b, :n].copy_(x["hidden_scales"])
            scales[b, n:].fill_(1.0)
    out["hidden_states"] = hidden
    if "final_hidden" in items[0]:  # the final norm's output [B, T, H], padding zeroed
        final = empty_host((B, T, hs0.shape[-1]), hs0.dtype, pin=pin_memory, pool=pool)
        for b, x in enumerate(items):
            final[b, :int(lengths[b])].copy_(x["final_hidden"])
            final[b, int(lengths[b]):].zero_()
        out["final_hidden"] = final
    if scales is not None:
        out["hidden_scales"] = scales
    return out


def collate_packed(items: Sequence[dict[str, Any]], pin_memory: bool = False,
                   pool: BufferPool | None = None) -> dict[str, Any]:
    """Packed batch for varlen attention: ``input_ids``/``loss_mask``/``position_ids`` ``[N]``,
    ``hidden_states`` ``[N, L, H]`` (fp8 stores: and ``hidden_scales`` ``[N, L]``), ``cu_seqlens`` int32
    ``[B + 1]`` (sample b is ``cu_seqlens[b]:cu_seqlens[b + 1]``), ``max_seqlen`` int, ``sample_id`` list.
    ``pin_memory`` and ``pool`` as in ``collate_padded``."""
    out = _packed_tokens(items)
    cu = out["cu_seqlens"]
    N = int(cu[-1])
    hs0 = items[0]["hidden_states"]
    hidden = empty_host((N,) + tuple(hs0.shape[1:]), hs0.dtype, pin=pin_memory, pool=pool)
    scales = (empty_host((N, hs0.shape[1]), torch.float32, pin=pin_memory, pool=pool)
              if "hidden_scales" in items[0] else None)
    for b, x in enumerate(items):
        hidden[int(cu[b]):int(cu[b + 1])].copy_(x["hidden_states"])
        if scales is not None:
            scales[int(cu[b]):int(cu[b + 1])].copy_(x["hidden_scales"])
    out["hidden_states"] = hidden
    if "final_hidden" in items[0]:  # the final norm's output [N, H]
        out["final_hidden"] = torch.cat([x["final_hidden"] for x in items])
    if scales is not None:
        out["hidden_scales"] = scales
    return out


Placed = tuple[torch.Tensor, "torch.Tensor | None"]  # a sample's features [F, T, H] (each feature contiguous), scales


class BatchSlots:
    """The batches ``TokenBatches`` will make of a slot's samples still to come, planned from their lengths by the
    same rule (``TokenBudget``), and each sample's slot in them. The loader reads a sample's features straight into
    its slot (``place``, on its reader threads; every chunk checked there before the sample is handed out), so a
    batch whose samples came as planned is handed out as it lies (``take``): its features are not copied again on
    the host. A batch's memory is made when its first sample is placed and let go when it is taken.

    Features are kept feature-major, padded ``[F, B, T, H]``, packed ``[F, N, H]`` (fp8 scales ``[F, B, T]`` /
    ``[F, N]``): a sample's rows of one feature are contiguous, as in the store's chunks, so one read fills them.
    ``hidden_states`` is a permuted view, ``[B, T, L, H]`` / ``[N, L, H]`` as ``collate_*`` give it, and dense: a
    copy to the GPU moves it in one piece (a ``reshape`` there makes it contiguous); ``final_hidden`` is the last
    feature, contiguous."""

    def __init__(self, lengths: np.ndarray, first: int, budget: TokenBudget,
                 features: tuple[int, int, torch.dtype, bool, bool],
                 alloc: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]) -> None:
        self.first, self.pad, self.alloc = int(first), budget.mode == "pad", alloc
        self.n_features, self.hidden, self.dtype, self.scaled, self.final = features
        self.lengths = np.asarray(lengths, np.int64)
        starts = [i for i, n in enumerate(self.lengths.tolist()) if budget.add(n)]
        self.bounds = np.array(starts + [len(self.lengths)], np.int64)
        self.batch_of = np.repeat(np.arange(len(starts)), np.diff(self.bounds))
        # a sample's row in a padded batch, or its first token in a packed one
        within = np.arange(len(self.lengths)) - self.bounds[self.batch_of]
        ends = np.cumsum(self.lengths)
        self.offset = within if self.pad else ends - self.lengths - (ends - self.lengths)[self.bounds[self.batch_of]]
        self.made: dict[int, Placed] = {}
        self.lock = ProcessLock()
        self.next = 0  # the batch ``take`` hands out next

    def _make(self, k: int) -> Placed:
        lens = self.lengths[self.bounds[k]:self.bounds[k + 1]]
        rows = (len(lens), int(lens.max())) if self.pad else (int(lens.sum()),)
        feats = self.alloc((self.n_features, *rows, self.hidden), self.dtype)
        return feats, (self.alloc((self.n_features, *rows), torch.float32) if self.scaled else None)

    def _slot(self, i: int, k: int, made: Placed) -> Placed:
        n, at = int(self.lengths[i]), int(self.offset[i])
        feats, scales = made
        if self.pad:
            return feats[:, at, :n], None if scales is None else scales[:, at, :n]
        return feats[:, at:at + n], None if scales is None else scales[:, at:at + n]

    def place(self, position: int) -> Placed:
        """The memory of the sample at plan ``position``: its features ``[F, T, H]`` and fp8 scales ``[F, T]``."""
        i = position - self.first
        k = int(self.batch_of[i])
        with self.lock:
            made = self.made.get(k)
            if made is None:
                made = self.made[k] = self._make(k)
        return self._slot(i, k, made)

    def take(self, items: Sequence[dict[str, Any]], pad_id: int) -> dict[str, Any] | None:
        """The next planned batch, when ``items`` (the next batch by arrival) are its samples, each in its slot;
        else None, and the caller collates ``items`` by copying (the arrivals left the plan: a corrupt sample
        skipped)."""
        k = self.next
        self.next += 1
        with self.lock:
            made = self.made.pop(k, None)
        if made is None or len(items) != self.bounds[k + 1] - self.bounds[k]:
            return None
        i0 = int(self.bounds[k])
        for j, x in enumerate(items):
            want = self._slot(i0 + j, k, made)[0]
            got = x["hidden_states"]
            if got.data_ptr() != want.data_ptr() or got.shape[0] != want.shape[1]:
                return None
        feats, scales = made
        layers = self.n_features - (1 if self.final else 0)
        if self.pad:
            out = _padded_tokens(items, pad_id)
            T = feats.shape[2]
            for b, n in enumerate(out["lengths"].tolist()):
                if n < T:  # as bytes: a bf16 fill is an element loop, zeroing bytes a memset
                    feats[:, b, n:].view(torch.uint8).zero_()
                    if scales is not None:
                        scales[:, b, n:].fill_(1.0)
            out["hidden_states"] = feats[:layers].permute(1, 2, 0, 3)
            if scales is not None:
                out["hidden_scales"] = scales.permute(1, 2, 0)
        else:
            out = _packed_tokens(items)
            out["hidden_states"] = feats[:layers].permute(1, 0, 2)
            if scales is not None:
                out["hidden_scales"] = scales.permute(1, 0)
        if self.final:
            out["final_hidden"] = feats[layers]
        return out


class TokenBatches(IterableDataset):
    """A ``HiddenStateDataset`` batched by token budget (use ``DataLoader(..., batch_size=None)``).

    Resumable: ``state_dict`` is the dataset's, minus the items held for the next batch.
    ``pin_memory``: in-process iteration reads features straight into pinned batches (the read that checks them
    is then the only host copy before the GPU); DataLoader workers ignore it (use the DataLoader's). Unpinned
    batches of the main process reuse the memory of batches no longer held (``POOLED_BATCHES`` of them, beside
    what the read-ahead holds): a fresh batch is faulted in page by page, which cost three times the collate
    itself. Samples go straight into their batches (``BatchSlots``) when the dataset plans ahead
    (``HiddenStateDataset``, but not a following epoch 0); otherwise, and after a corrupt sample is skipped, items
    are collated by copy (``collate_padded``, ``collate_packed``)."""

    def __init__(self, dataset, token_budget: int, mode: str = "pad", max_items: int | None = None,
                 pad_id: int = 0, pin_memory: bool = False) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.dataset, self.token_budget, self.mode = dataset, int(token_budget), mode
        self.max_items, self.pad_id, self.pin_memory = max_items, pad_id, bool(pin_memory)
        self._held = 0
        self._buffers: BufferPool | None = None

    def _pool(self, per_token: int, ahead: int = 0) -> BufferPool:
        """This process's pool of batch memory, sized for ``POOLED_BATCHES`` batches of ``per_token`` feature bytes
        a token, and ``ahead`` bytes more (batches placed before their turn: the read-ahead's window)."""
        if self._buffers is None or self._buffers.pid != os.getpid():
            grain = BufferPool.GRAIN  # the pool's size classes
            self._buffers = BufferPool(ahead + POOLED_BATCHES * -(-self.token_budget * per_token // grain) * grain)
        return self._buffers

    def _slots(self, it: Any, pin: bool) -> BatchSlots | None:
        """``BatchSlots`` for the iterator ``it`` of the dataset, placing its samples (None: it cannot plan
        ahead)."""
        ds = self.dataset
        if not (hasattr(it, "place") and getattr(ds, "can_place", lambda: False)()):
            return None
        features = ds.feature_layout()
        F, H, dtype, scaled, _ = features
        pool = None if pin else self._pool(F * (H * dtype.itemsize + (4 if scaled else 0)), ds.window_bytes())

        def alloc(shape: tuple[int, ...], dt: torch.dtype) -> torch.Tensor:
            return empty_host(shape, dt, pin=pin, pool=pool)  # in a worker: its shared ring, sized by the pool

        slots = BatchSlots(it.lengths(), it.first(), TokenBudget(self.token_budget, self.mode, self.max_items),
                           features, alloc)
        it.place(slots.place)
        return slots

    def __getstate__(self) -> dict[str, Any]:  # a worker's copy: its own memory, never this process's pool
        return {**self.__dict__, "_buffers": None}

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.dataset.state_dict(pending=self._held)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)

    def _counted(self, it: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for item in it:
            self._held += 1
            yield item

    def __iter__(self) -> Iterator[dict[str, Any]]:
        pin = False
        if get_worker_info() is not None:
            self.dataset.share_memory = False  # items are copied into the (shared) batch anyway
        elif self.pin_memory:
            pin = can_pin()
        self._held = 0
        it = iter(self.dataset)
        slots = self._slots(it, pin)
        for batch in token_batches(self._counted(it), self.token_budget, self.mode, self.max_items):
            self._held -= len(batch)  # what is still held: the item that did not fit, if any
            out = slots.take(batch, self.pad_id) if slots is not None else None
            if out is None:
                x = batch[0]
                per_token = sum(x[k][0].nbytes for k in ("hidden_states", "hidden_scales", "final_hidden") if k in x)
                pool = None if pin or get_worker_info() is not None else self._pool(per_token)
                out = (collate_packed(batch, pin, pool) if self.mode == "pack"
                       else collate_padded(batch, self.pad_id, pin, pool))
            yield hand_over(out)  # in a worker: its shared segment is reused once the consumer drops it

    def __repr__(self) -> str:
        return f"TokenBatches({self.dataset!r}, token_budget={self.token_budget}, mode={self.mode!r})"
