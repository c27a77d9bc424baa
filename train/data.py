"""Feeding the trainer from the store: token-budget batches, per-sample anchors, read-ahead, DDP lockstep.

Why each piece is the way it is:

* **Anchors per sample, from a seed of (seed, epoch, sample_id).** The same sample gets the same
  anchors whatever the batching, the rank count, a restart, or whether its features came from the
  store or from a live target forward. Runs stay comparable, and resume needs no RNG state for them.
* **Every batch comes with the loader state after it.** A background thread reads ahead (and copies
  to the GPU), so the loader itself is always a few batches past the step being trained; saving the
  state that travelled with batch N makes a resume start exactly at batch N + 1.
* **Lockstep under DDP.** All ranks must run the same number of steps, but token-budget batches give
  ranks different batch counts. A rank whose share of the epoch is used up runs empty steps (zero
  gradient, still joining the all-reduce) until every rank is done, so every sample is trained
  exactly once per epoch and nothing deadlocks. The same tiny all-reduce sums the ranks' loss weights,
  so the loss is normalised over the global batch (``objective`` module doc) without another round trip.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from hsstore.loader.batching import TokenBatches, count_token_batches
from hsstore.distributed import World
from hsstore.errors import CorruptionError, StoreError
from hsstore.loader.dataset import HiddenStateDataset
from hsstore.loader.follow import Follow, FollowStopped
from hsstore.loader.options import Planning, Reading, Selection
from hsstore.loader.resume import merge_states
from hsstore.store.reader import Store

from .objective import block_targets, sample_anchors, selected_positions

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- anchors


def sample_seed(seed: int, epoch: int, sample_id: str) -> int:
    """A 63-bit seed that depends only on (seed, epoch, sample_id) (stable across processes and runs)."""
    digest = hashlib.blake2b(f"{seed}/{epoch}/{sample_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def add_anchors(batch: dict[str, Any], seed: int, epoch: int, n_max: int, block_size: int,
                gamma: float, key_lengths: Callable[[torch.Tensor, int], Any] | None = None) -> dict[str, Any]:
    """Set ``batch["anchors"]`` [B, A] (-1 padded), ``batch["weight_sum"]`` (the sum of the loss weights of
    these anchors, for the global normalisation under DDP: see ``lockstep``), and for logging
    ``batch["label_counts"]`` (labelled positions per draft position k = 1..S-1, for exact per-position
    accuracy across ranks), ``batch["num_anchors"]`` (real anchors) and ``batch["tokens"]`` (real tokens);
    ``batch["selected"]`` (the weighted positions, ``objective.selected_positions``) and, given a
    ``key_lengths`` (``DFlashDrafter.key_lengths``), ``batch["key_lengths"]``. CPU work, done on the
    read-ahead thread; the sums are plain Python numbers and the sizes known, so neither the step nor its
    logging waits for the GPU."""
    mask = batch["loss_mask"].bool()
    if "attention_mask" in batch:
        mask = mask & batch["attention_mask"].bool()
    rows = [sample_anchors(m, n_max, torch.Generator().manual_seed(sample_seed(seed, epoch, sid)))
            for m, sid in zip(mask, batch["sample_id"])]
    A = max((a.numel() for a in rows), default=0)
    anchors = torch.full((len(rows), A), -1, dtype=torch.long)
    for i, a in enumerate(rows):
        anchors[i, : a.numel()] = a
    _, w = block_targets(batch["input_ids"], mask, anchors, block_size, gamma)
    extra = {} if key_lengths is None else {"key_lengths": key_lengths(anchors, mask.shape[1])}
    return {**batch, **extra, "anchors": anchors, "selected": selected_positions(w),
            "num_anchors": int((anchors >= 0).sum()), "weight_sum": float(w.double().sum()),
            "label_counts": (w[:, :, 1:] > 0).sum((0, 1)).tolist(),
            "tokens": int(batch["attention_mask"].sum()) if "attention_mask" in batch else mask.numel()}


def empty_batch(num_taps: int, hidden: int, dtype: torch.dtype, device) -> dict[str, Any]:
    """A batch without anchors: the objective returns a zero loss that still touches every parameter."""
    return {"sample_id": [], "input_ids": torch.zeros(1, 2, dtype=torch.long, device=device),
            "loss_mask": torch.zeros(1, 2, dtype=torch.bool, device=device),
            "attention_mask": torch.ones(1, 2, dtype=torch.bool, device=device),
            "hidden_states": torch.zeros(1, 2, num_taps, hidden, dtype=dtype, device=device),
            "anchors": torch.zeros(1, 0, dtype=torch.long, device=device),
            "selected": torch.zeros(0, dtype=torch.long, device=device), "num_anchors": 0,
            "label_counts": None, "tokens": 0}


# ---------------------------------------------------------------------------------------------- the store source


class StoreBatches:
    """Token-budget batches of one or more stores for one rank: ``set_epoch``, iteration, and a JSON-able
    resume state. ``workers > 0`` reads through ``torchdata``'s ``StatefulDataLoader`` worker processes
    (spawned: forked workers can deadlock fsspec's event loops); ``0`` reads in this process, on the
    loader's own threads, which is usually enough. ``pin_memory`` applies to worker batches (the
    DataLoader pins them on its own thread); in-process batches are collated into pinned memory, and what is
    not pinned yet is pinned by ``read_ahead``."""

    def __init__(self, urls: Sequence[str | Store], *, layers: Sequence[int], token_budget: int | None = None,
                 seed: int, rank: int, world_size: int, workers: int = 0, weights: Sequence[float] | None = None,
                 storage_options: dict | None = None, cache_dir: str | None = None, pin_memory: bool = False,
                 partition: str = "global", cache_bytes: int | None = None, follow: Follow | None = None):
        extra = {} if cache_bytes is None else {"cache_bytes": int(cache_bytes)}
        self.dataset = HiddenStateDataset(list(urls), layers=list(layers), selection=Selection(weights=weights),
                                          planning=Planning(seed=seed, partition=partition),
                                          reading=Reading(cache_dir=cache_dir, **extra),
                                          # node: ranks per node from torchrun
                                          world=World.detect(rank, world_size, by_node=partition == "node"),
                                          storage_options=storage_options, follow=follow,
                                          share_metadata=world_size > 1)  # DDP: rank 0 reads URLs' records once
        # in-process batches are collated straight into pinned memory; worker batches are pinned by the
        # DataLoader's own thread
        self.batches = TokenBatches(self.dataset, token_budget=token_budget, pin_memory=pin_memory and workers == 0)
        self.token_budget, self.workers = token_budget, int(workers)
        self.loader = None
        if workers > 0:
            try:
                from torchdata.stateful_dataloader import StatefulDataLoader
            except ImportError as e:
                raise ValueError("--workers > 0 needs torchdata (pip install torchdata); use --workers 0") from e
            self.loader = StatefulDataLoader(self.batches, batch_size=None, num_workers=workers,
                                             multiprocessing_context="spawn", pin_memory=pin_memory)

    def set_epoch(self, epoch: int) -> None:
        self.batches.set_epoch(epoch)

    def _inner(self):
        return self.loader if self.loader is not None else self.batches

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.batches) if self.loader is None else from_workers(iter(self.loader))

    def state_dict(self) -> dict[str, Any]:
        return self._inner().state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._inner().load_state_dict(state)

    def load_merged(self, states: list[dict[str, Any]]) -> None:
        """Resume from the states of another world size / worker count: exactly once, new cut."""
        self.batches.load_state_dict(merge_states(states))

    def planned_steps(self, epochs: int, first: int = 0, grad_accum: int = 1) -> int:
        """Optimizer steps for epochs ``first`` .. ``epochs - 1``, from metadata only: per epoch, the batch count of
        the rank with the most batches (the others run empty steps, see the module doc), ``grad_accum`` batches a
        step (an epoch's last step takes the rest)."""
        t0 = time.perf_counter()
        ds, W = self.dataset, max(1, self.workers)
        total = 0
        for e in range(first, epochs):
            total += -(-max(sum(count_token_batches(ds.planned_lengths(e, ds.world.at(r, w, W)), self.token_budget)
                                for w in range(W)) for r in range(ds.world.world)) // grad_accum)
        log.info("planned %d steps for %d epoch(s) in %.1fs", total, epochs - first, time.perf_counter() - t0)
        return total


def from_workers(batches: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """The batches of DataLoader workers; a worker's refusal (a damaged sample, a fault of the store) raised as its
    own one line: the DataLoader re-raises it as "Caught X in DataLoader worker process N." with the worker's
    traceback after, so the line a person reads would name no shard."""
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except StoreError as e:
            raise type(e)(worker_error(e)) from None
        yield batch


def worker_error(e: BaseException) -> str:
    """The worker's own message of an error the DataLoader re-raised (its traceback's last line), else ``e``'s."""
    text = str(e)
    if not text.startswith("Caught "):
        return text
    last = [line for line in text.splitlines() if line.strip()][-1]
    _, sep, message = last.partition(f"{type(e).__name__}: ")
    return message if sep else text


# ---------------------------------------------------------------------------------------------- read-ahead


def to_device(batch: dict[str, Any], device: torch.device, non_blocking: bool = False) -> dict[str, Any]:
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor):
            if non_blocking and not v.is_pinned():
                v = v.pin_memory()
            v = v.to(device, non_blocking=non_blocking)
        out[k] = v
    return out


_DONE = object()


@dataclass
class ReadAheadStats:
    """Where a batch's time goes in ``read_ahead``, per batch in order, to tell a late loader from a slow step:
    ``read`` (the source producing it: loading and collation, on the read-ahead thread), ``prep`` (``prepare``:
    anchors and loss weights, same thread), ``copy`` (issuing the host->device copies, same thread; on CUDA
    ``copy_gpu``, the copies themselves on the side stream), ``wait`` (the consumer blocked for it: the step
    waited for the loader) and ``ready`` (batches already queued when the consumer asked: 0 means the
    pipeline ran dry)."""

    read: list[float] = field(default_factory=list)
    prep: list[float] = field(default_factory=list)
    copy: list[float] = field(default_factory=list)
    wait: list[float] = field(default_factory=list)
    ready: list[int] = field(default_factory=list)
    events: list[tuple[Any, Any]] = field(default_factory=list)

    def summary(self, skip: int = 0, count: int | None = None) -> dict[str, float]:
        """Mean milliseconds per batch of each part over batches ``skip .. skip + count`` (the batches the
        consumer took there; the first ones fill the pipeline). Reads the copies' CUDA events: call after the
        device has finished them."""
        end = None if count is None else skip + count

        def mean(xs) -> float:
            xs = xs[skip:end]
            return 1e3 * sum(xs) / len(xs) if xs else float("nan")

        out = {"read_ms": mean(self.read), "prep_ms": mean(self.prep), "copy_issue_ms": mean(self.copy),
               "wait_ms": mean(self.wait)}
        ready = self.ready[skip:end]
        out["ready_mean"] = sum(ready) / len(ready) if ready else float("nan")
        if self.events:
            out["copy_gpu_ms"] = mean([a.elapsed_time(b) / 1e3 for a, b in self.events])
        return out


def copy_on_side_stream(batch: dict[str, Any], device: torch.device, stream, stats: ReadAheadStats | None,
                        decode: Callable[[dict], dict] | None = None) -> tuple[dict[str, Any], Any, Any]:
    """(``batch`` on ``device``, the event its copies end with, its features' ``value_extremes`` on the host once
    that event has passed), the non-blocking copies issued on ``stream`` so that they overlap the consumer's step;
    with ``stats``, timed by CUDA events. ``decode``: the stored features decoded on the device after they crossed
    (an encoded store's bytes cross, a half to a quarter of bf16's), on the same stream, so that it overlaps the
    step too; the extremes are taken of the decoded values, which are what the step reads."""
    with torch.cuda.stream(stream):
        begin = torch.cuda.Event(enable_timing=True) if stats is not None else None
        if begin is not None:
            begin.record(stream)
        batch = to_device(batch, device, non_blocking=True)
        if decode is not None:
            batch = decode(batch)
        extremes = value_extremes(batch)
        if extremes is not None:  # to pinned host memory with the batch's copies: read after their event, this
            host = torch.empty(extremes.shape, dtype=extremes.dtype, pin_memory=True)  # thread never waits on it
            extremes = host.copy_(extremes, non_blocking=True)
        event = torch.cuda.Event(enable_timing=stats is not None)
        event.record(stream)
    if stats is not None:
        stats.events.append((begin, event))
    return batch, event, extremes


def hand_over_copy(batch: dict[str, Any], event, device: torch.device) -> None:
    """The consumer's stream waits for the batch's copies, and its tensors are recorded on that stream, so their
    memory is not reused before the step is done with them."""
    current = torch.cuda.current_stream(device)
    current.wait_event(event)
    for v in batch.values():
        if isinstance(v, torch.Tensor) and v.is_cuda:
            v.record_stream(current)


def received(batch: dict[str, Any], event, extremes: torch.Tensor | None, device: torch.device) -> None:
    """The consumer's side of a batch copied on the side stream: its value check, once its copies are done (begun a
    batch or more before: as a rule they are), then the hand-over (``hand_over_copy``)."""
    event.synchronize()
    refuse_non_finite(batch, extremes)
    hand_over_copy(batch, event, device)


def crossed(batch: dict[str, Any], device: torch.device, stream, stats: ReadAheadStats | None,
            decode: Callable[[dict], dict] | None) -> tuple[dict[str, Any], Any, Any]:
    """``read_ahead``'s batch where the consumer uses it, decoded there, the event its copies end with and its
    ``value_extremes`` (on the CPU: no event, the batch stays, decoded and value-checked on the read-ahead thread)."""
    if stream is not None:
        return copy_on_side_stream(batch, device, stream, stats, decode)
    batch = decode(batch) if decode is not None else batch
    extremes = value_extremes(batch)
    refuse_non_finite(batch, extremes)
    return batch, None, None


# ---------------------------------------------------------------------------------------------- values
FEATURE_KEYS = ("hidden_states", "final_hidden")  # the target's values a batch carries into the step
VALUE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)  # decoded values (stored codes: not yet)


def feature_values(batch: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """(key, tensor) of each decoded feature ``batch`` carries, none empty."""
    return [(k, t) for k in FEATURE_KEYS if isinstance(t := batch.get(k), torch.Tensor) and t.dtype in VALUE_DTYPES
            and t.numel()]


def value_extremes(batch: dict[str, Any]) -> torch.Tensor | None:
    """The largest and smallest value of each feature tensor of ``batch`` (``FEATURE_KEYS``), float32, on its device.

    Why: every tensor that enters training is value-checked, and a store's own statistics are a writer's claim
    (a received store may carry none, or clean ones beside NaN bytes); one NaN or infinity in a batch makes every
    weight NaN at that step. A maximum and a minimum reach any NaN or infinity, read the batch once each without a
    temporary its size, on the stream that made it, and ask nothing of the host."""
    parts = [r for _, t in feature_values(batch) for r in (t.amax(), t.amin())]
    return torch.stack(parts).float() if parts else None


def refuse_non_finite(batch: dict[str, Any], extremes: torch.Tensor | None) -> None:
    """Refuse ``batch`` when its ``extremes`` are not finite, naming its first sample whose features hold a NaN or
    an infinity (found on the host: this is the error's path only), before any step trains on it."""
    if extremes is None or bool(torch.isfinite(extremes).all()):
        return
    for k, t in feature_values(batch):
        rows = (~torch.isfinite(t.detach().cpu().float()).reshape(t.shape[0], -1).all(1)).nonzero().flatten()
        if not len(rows):
            continue
        first = int(rows[0])  # a padded batch's sample, or a packed batch's token
        if "cu_seqlens" in batch:
            first = int(torch.searchsorted(batch["cu_seqlens"].cpu(), torch.tensor(first), right=True)) - 1
        raise CorruptionError(f"sample {batch['sample_id'][first]!r}: its {k} hold a NaN or an "
                              "infinity as the trainer reads them (not what its record's statistics say, or the "
                              "record has none); refused before any step trained on it, nothing saved from it. "
                              "`hsstore verify` names every such sample")
    raise CorruptionError("a batch's features hold a NaN or an infinity as the trainer reads them; refused before "
                          "any step trained on it. `hsstore verify` names every such sample")


def read_ahead(source, prepare: Callable[[dict], dict], device: torch.device, depth: int = 2, *,
               stats: ReadAheadStats | None = None, threads: int | None = None,
               decode: Callable[[dict], dict] | None = None) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """Yield ``(batch on device, source state after it)`` while a thread reads, prepares (anchors) and,
    on CUDA, copies the next ``depth`` batches on a side stream (pinned memory, non-blocking copies; the
    consumer's stream waits for each batch's copy event and the batch's tensors are recorded on it, so their
    memory is not reused before the step is done with them). The consumer's only work per batch is that
    hand-over and the batch's value check (``refuse_non_finite``; on CUDA it waits for the batch's copies, begun a
    batch or more before, and reads two numbers a feature). Stops the thread when closed early.

    ``stats``: filled per batch (``ReadAheadStats``). ``threads``: torch's intra-op threads of the read-ahead
    thread (collation copies; the loader's reading threads, started from it, inherit the setting, as new
    threads take the last value set): fewer keeps them from competing with the consumer's thread, which
    launches the step's kernels (torch's own pin-memory thread runs with 1); threads started elsewhere meanwhile take
    it too, and the setting is undone when the thread ends. None: as the process has them. ``decode``: an encoded
    store's features decoded after the copy (``encodings.decode_batch``; ``crossed``), beside the step."""
    cuda = device.type == "cuda"
    q: queue.Queue = queue.Queue(maxsize=max(1, depth))
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        inherited = torch.get_num_threads()
        try:
            if threads:
                torch.set_num_threads(int(threads))  # this thread's (and threads started from it)
            stream = torch.cuda.Stream(device) if cuda else None
            it = iter(source)
            while True:
                t0 = time.perf_counter()
                batch = next(it, _DONE)
                if batch is _DONE:
                    return
                t1 = time.perf_counter()
                state = source.state_dict()
                batch = prepare(batch)
                t2 = time.perf_counter()
                batch, event, extremes = crossed(batch, device, stream, stats, decode)
                if stats is not None:
                    stats.read.append(t1 - t0)
                    stats.prep.append(t2 - t1)
                    stats.copy.append(time.perf_counter() - t2)
                if not put((batch, state, event, extremes)):
                    return
        except BaseException as e:  # re-raised in the consumer
            put(e)
        finally:
            if threads:
                torch.set_num_threads(inherited)  # what threads started later take, as before
            put(_DONE)

    thread = threading.Thread(target=produce, name="hsstore-train-read-ahead", daemon=True)
    thread.start()
    try:
        while True:
            ready = q.qsize()
            t = time.perf_counter()
            item = q.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            if stats is not None:
                stats.wait.append(time.perf_counter() - t)
                stats.ready.append(ready)
            batch, state, event, extremes = item
            if event is not None:
                received(batch, event, extremes, device)
            yield batch, state
    finally:
        stop.set()
        thread.join(timeout=30)


@dataclass
class Proposal:
    """A value rank 0 decides and every rank takes at the same step (the followed run's length): ``lockstep``
    carries ``value`` of the ``lead`` rank in its all-reduce (the others add 0) and sets ``agreed`` on all."""

    lead: bool
    value: float | None = None
    agreed: float | None = None


def lockstep(stream: Iterable[tuple[dict, dict]], world_size: int, group=None, interrupt=None,
             proposal: Proposal | None = None) -> Iterator[tuple[dict | None, dict | None]]:
    """Under DDP, yield until *every* rank is out of batches; a rank that is out yields ``(None, last state)``.
    One tiny all-reduce per step (on ``group``: a CPU/gloo group, so it never waits for the GPU); it also sums
    the batches' ``weight_sum`` (``add_anchors``) over the ranks into ``batch["global_weight_sum"]``, sets
    ``interrupt.agreed`` on every rank when any rank's ``interrupt.requested`` (a stop at the same step) and
    ``proposal.agreed`` to the lead rank's ``proposal.value``. A stream that stops with ``FollowStopped`` (a
    followed store's unhealthy arrival: every rank's stops at the same place) is out of batches; the error is
    raised once every rank is, so all of them stop at one step."""
    it = iter(stream)
    state, stopped = None, None
    try:
        while True:
            try:
                item = next(it, None) if stopped is None else None
            except FollowStopped as e:
                item, stopped = None, e
            total = 0.0 if item is None else float(item[0].get("weight_sum", 0.0))  # 0 for an empty step
            offer = proposal.value if proposal is not None and proposal.lead and proposal.value is not None else 0.0
            if world_size > 1:
                import torch.distributed as dist

                asked = float(interrupt is not None and interrupt.requested)
                t = torch.tensor([0.0 if item is None else 1.0, total, asked, offer], dtype=torch.float64)
                dist.all_reduce(t, group=group)  # [ranks with a batch, their weight sum, ranks asked to stop, offer]
                if t[2] > 0 and interrupt is not None:
                    interrupt.agreed = True
                offer = float(t[3])
                if t[0] == 0:
                    break
                total = float(t[1])
            elif item is None:
                break
            if proposal is not None and offer > 0:
                proposal.agreed = offer
            if item is None:
                yield None, state
            else:
                batch, state = item
                yield ({**batch, "global_weight_sum": total} if "weight_sum" in batch else batch), state
    finally:
        if hasattr(it, "close"):
            it.close()  # stops the read-ahead thread now, not at garbage collection
    if stopped is not None:
        raise stopped
