"""The loader's resume state: where an epoch stands, as a dataclass, and its plain-dict form.

A slot's emission order is a pure function of the epoch plan (``plan`` module), so a position is one
count per slot. The dict form (``LoaderState.to_dict``) is the public one: ``HiddenStateDataset.state_dict``
returns it, ``torchdata``'s ``StatefulDataLoader`` snapshots it per worker, trainers save it as JSON
(which turns the slot keys into strings). Every dict ever written must keep loading, so ``from_dict``
reads version 1 as it was first written::

    {"hsstore_loader": 1, "config": {...}, "epoch": 1, "done": None, "phase": 0, "world": [2, 1],
     "counts": {"0": 5}, "skipped": {}}

A node-partitioned dataset (``partition="node"``) adds ``"nodes": N``, the node count of the phase (its
config then holds ``"partition": "node"``); a state without it is a global plan's. Epoch 0 of a following
dataset (``loader.follow``) adds ``"follow": {"journal": ID, "joins": K, "done_joins": J}``: its counts are over
the joins of that journal in order (K of them entered), ``done`` covers the entries of its first J joins, and its
config names the journal instead of a catalog.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping

import numpy as np

from ..distributed import World
from ..errors import StoreError

log = logging.getLogger(__name__)

STATE_KEY = "hsstore_loader"  # marks a loader state inside a larger checkpoint dict; its value is the version
STATE_VERSION = 1
MAX_DONE_BYTES = 1 << 27  # the bitmap of consumed entries of an epoch of 1e9 entries (a state holds one bit each)


class LoaderStateError(StoreError, ValueError):
    """A resume state does not fit this dataset (other stores, filters, seed, or an incomplete merge)."""


@dataclass
class LoaderState:
    """One epoch's position over the slots (rank x worker) of one phase.

    A *phase* is one cut of the epoch's remaining entries into slots: it starts at the epoch start and
    anew whenever a run resumes with another world size or worker count. ``done`` holds what earlier
    phases consumed (a packed bitmap over the epoch's entries, ``pack_done``)."""

    config: dict[str, Any]  # the plan's identity (``Planner.config``): a state only fits the same plan
    epoch: int
    done: str | None = None
    phase: int = 0
    world: tuple[int, int] | None = None  # (ranks, workers) of the phase; None: nothing handed out yet
    counts: dict[int, int] = field(default_factory=dict)  # slot -> entries handed out in this phase
    skipped: dict[int, int] = field(default_factory=dict)  # slot -> corrupt samples skipped
    nodes: int | None = None  # node count of the phase (``partition="node"`` only; None: a global plan)
    follow: dict[str, Any] | None = None  # epoch 0 of a following dataset: journal id, joins entered, joins done covers

    def reader(self, slot: int) -> World:
        """The reader that slot ``slot`` of this state's phase was (its world: ranks x workers, nodes)."""
        ranks, workers = self.world
        return World.of_slot(slot, ranks, workers, self.nodes or 1)

    def to_dict(self) -> dict[str, Any]:
        """The public, JSON-able form (a fresh dict: the caller may keep or change it)."""
        out = {STATE_KEY: STATE_VERSION, "config": dict(self.config), "epoch": self.epoch, "done": self.done,
               "phase": self.phase, "world": list(self.world) if self.world is not None else None,
               "counts": dict(self.counts), "skipped": dict(self.skipped)}
        if self.nodes is not None:  # written only by node-partitioned plans: older readers see what they know
            out["nodes"] = self.nodes
        if self.follow is not None:
            out["follow"] = dict(self.follow)
        return out

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> "LoaderState":
        """One state dict as ``to_dict`` wrote it, also after a JSON round trip (string slot keys). A state is
        data from elsewhere (a run folder being resumed): one that is not this shape is a ``LoaderStateError``."""
        try:
            if not isinstance(state[STATE_KEY], int) or state[STATE_KEY] > STATE_VERSION:
                raise LoaderStateError(f"loader state version {state[STATE_KEY]!r} is not one this hsstore reads")
            world, done = state.get("world"), state.get("done")
            if done is not None and not isinstance(done, str):
                raise TypeError(f"done is a {type(done).__name__}")
            if done:  # checked now, where the state is loaded (its epoch's size is known only when it is planned)
                _bitmap(done, MAX_DONE_BYTES, keep=False)
            return cls(config=dict(state["config"]), epoch=int(state["epoch"]), done=done,
                       phase=int(state["phase"]), world=(int(world[0]), int(world[1])) if world else None,
                       counts={int(k): int(v) for k, v in (state.get("counts") or {}).items()},
                       skipped={int(k): int(v) for k, v in (state.get("skipped") or {}).items()},
                       nodes=int(state["nodes"]) if state.get("nodes") is not None else None,
                       follow=_follow_of(state.get("follow")))
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            if isinstance(e, LoaderStateError):
                raise
            raise LoaderStateError(f"not an hsstore loader state ({type(e).__name__}: {str(e)[:200]})") from None

    @classmethod
    def find(cls, obj: Any) -> "LoaderState":
        """The state in ``obj``: a state dict, or one state or several (merged) anywhere inside a
        checkpoint, e.g. a ``StatefulDataLoader.state_dict()`` with per-worker states."""
        found = [cls.from_dict(s) for s in _find_states(obj)]
        if not found:
            raise LoaderStateError(f"not an hsstore loader state (no {STATE_KEY!r} key found)")
        return found[0] if len(found) == 1 else _merge(found)


@dataclass
class SlotProgress:
    """A live slot's position in its epoch, read by ``state_dict`` (in the process that iterates)."""

    epoch: int
    done: str | None
    phase: int
    world: World
    nodes: int | None = None  # the plan's node count (None: a global plan)
    count: int = 0
    skipped: int = 0
    follow: dict[str, Any] | None = None  # epoch 0 of a following dataset (``LoaderState.follow``)
    recent: deque = field(default_factory=lambda: deque(maxlen=256))  # emission positions of recent items

    def state(self, config: dict[str, Any], pending: int = 0) -> LoaderState:
        """``pending``: the last ``pending`` items handed out are not consumed yet (a resume repeats them)."""
        count = self.count
        if pending:
            if pending > len(self.recent):
                raise ValueError(f"cannot un-consume {pending} items (only the last {len(self.recent)} are tracked)")
            count = self.recent[-pending]
        slot = self.world.slot
        return LoaderState(config, self.epoch, self.done, self.phase, (self.world.world, self.world.workers),
                           {slot: count}, {slot: self.skipped} if self.skipped else {}, self.nodes,
                           dict(self.follow) if self.follow is not None else None)


def log_recut(epoch: str, world: World, old: tuple[int, int], what: str = "the remaining samples") -> None:
    """The line a resume on another world size or worker count says: what is left of ``epoch`` is cut anew."""
    log.info("resuming epoch %s on %d rank(s) x %d worker(s) from a state of %d x %d: re-cutting %s", epoch,
             world.world, world.workers, *old, what)


def _follow_of(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping) or not isinstance(value.get("journal"), str):
        raise LoaderStateError(f"loader state: malformed follow position {value!r}")
    return {"journal": value["journal"], "joins": int(value.get("joins", 0)),
            "done_joins": int(value.get("done_joins", 0))}


def _find_states(obj: Any) -> Iterator[Mapping[str, Any]]:
    if isinstance(obj, Mapping):
        if STATE_KEY in obj:
            yield obj
            return
        for v in obj.values():
            yield from _find_states(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _find_states(v)


def _merge(found: list[LoaderState]) -> LoaderState:
    live = [s for s in found if s.world is not None] or found[:1]
    base = live[0]
    follow = dict(base.follow) if base.follow is not None else None
    for s in live[1:]:
        for k in ("config", "epoch", "done", "phase", "world", "nodes"):
            if getattr(s, k) != getattr(base, k):
                raise LoaderStateError(f"states disagree on {k!r} ({getattr(s, k)!r} vs {getattr(base, k)!r}): "
                                       "they are not from one run at one step")
        theirs = s.follow or {}
        if (follow is None) != (s.follow is None) or (follow is not None and any(
                theirs.get(k) != follow.get(k) for k in ("journal", "done_joins"))):
            raise LoaderStateError(f"states disagree on 'follow' ({s.follow!r} vs {base.follow!r}): they are not "
                                   "from one run at one step")
        if follow is not None:  # slots enter joins at their own pace
            follow["joins"] = max(follow["joins"], theirs["joins"])
    counts: dict[int, int] = {}
    skipped: dict[int, int] = {}
    for s in live:
        for slot, c in s.counts.items():
            if slot in counts and counts[slot] != c:
                raise LoaderStateError(f"two states give slot {slot} different positions ({counts[slot]} vs {c})")
            counts[slot] = c
        skipped.update(s.skipped)
    return dataclasses.replace(base, counts=counts, skipped=skipped, follow=follow)


def merge_states(states: Iterable[Any]) -> dict[str, Any]:
    """One resume state from the states of all ranks and workers of a run.

    Accepts ``HiddenStateDataset.state_dict()`` results, ``StatefulDataLoader.state_dict()`` results
    (per-worker states are found inside), or lists of them, e.g. the ``all_gather_object`` of every
    rank's loader state. Load the result with ``dataset.load_state_dict`` before building the loader.
    """
    found = [LoaderState.from_dict(s) for s in _find_states(list(states))]
    if not found:
        raise LoaderStateError("no hsstore loader state found in what was given")
    return _merge(found).to_dict()


def pack_done(done: np.ndarray | None) -> str | None:
    """A bitmap of consumed entries as short text (JSON-able); None when nothing is consumed."""
    if done is None or not done.any():
        return None
    return base64.b64encode(zlib.compress(np.packbits(done).tobytes())).decode()


def unpack_done(text: str | None, n: int) -> np.ndarray | None:
    """The bitmap ``pack_done`` made of an epoch of ``n`` entries: decompressed to at most its ``ceil(n / 8)`` bytes
    (a state from elsewhere may hold a zlib bomb), else a ``LoaderStateError``."""
    if not text:
        return None
    return np.unpackbits(np.frombuffer(_bitmap(text, (n + 7) // 8, n), np.uint8), count=n).astype(bool)


def _bitmap(text: str, want: int, n: int | None = None, keep: bool = True) -> bytes:
    """The bytes of a packed bitmap, decompressed to at most ``want`` (piece by piece, kept only when ``keep``);
    larger is refused, never decompressed past the bound."""
    got, parts = 0, []
    try:
        z = zlib.decompressobj()
        data = base64.b64decode(text, validate=True)
        while data and got <= want:
            piece = z.decompress(data, min(want + 1 - got, 1 << 20))
            got += len(piece)
            if keep:
                parts.append(piece)
            data = z.unconsumed_tail
    except (ValueError, zlib.error) as e:  # binascii.Error is a ValueError
        raise LoaderStateError(f"loader state: its bitmap of consumed entries is not readable ({e})") from None
    if got > want or not z.eof:
        epoch = f"an epoch of {n:,} entries" if n is not None else f"an epoch of {8 * want:,} entries, the most one has"
        raise LoaderStateError(f"loader state: its bitmap of consumed entries is larger than the {want:,} bytes of "
                               f"{epoch}; refused unread")
    return b"".join(parts)
