"""``HiddenStateDataset``'s options, grouped by the question each answers: which samples and features to read
(``Selection``), how an epoch is planned (``Planning``: order, rank cut, read units, shuffle pool) and how the
planned units are read (``Reading``: read-ahead, memory, cache, corruption). Who reads is the fourth part, a
``hsstore.distributed.World``. Each group checks its own values when it is made, so a bad option fails where it
is written, before a store is opened.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

from .plan import EVEN_MODES, PARTITIONS, Filters

DEFAULT_UNIT_BYTES = 256 << 20
DEFAULT_SHUFFLE_BYTES = 1 << 30
DEFAULT_CACHE_BYTES = 64 << 30
DEFAULT_REMOTE_RATE = 2.5e9  # bytes/s per slot the remote read-ahead aims for: what a fast GPU's drafter step reads
DEFAULT_READ_AHEAD_BYTES = 4 << 30  # at most this much read ahead per slot, however slow the requests


@dataclass(frozen=True)
class Selection:
    """What to read: which samples (filters on commit-record columns; no feature bytes are read to decide),
    how often each store's samples come per epoch, and which features besides the layers.

    ``weights``: per store; 2.0 = each sample twice per epoch, 0.5 = a seeded half each epoch (a
    ``{url: weight}`` mapping given as the dataset's stores is the other spelling). ``where`` receives each
    sample's columns as a dict (sample_id, source, length, loss_tokens, thinking_tokens, flags), once, when the
    dataset is built. ``final_hidden``: also the final norm's output (stores written with it)."""

    weights: tuple[float, ...] | None = None
    sources: Iterable[str] | str | None = None
    min_loss_tokens: int = 0
    min_length: int = 0
    max_length: int | None = None
    where: Callable[[dict[str, Any]], bool] | None = None
    final_hidden: bool = False

    def __post_init__(self) -> None:
        if self.weights is not None:
            object.__setattr__(self, "weights", tuple(float(w) for w in self.weights))
        if self.sources is not None:
            object.__setattr__(self, "sources", frozenset([self.sources] if isinstance(self.sources, str)
                                                          else self.sources))

    def filters(self) -> Filters:
        return Filters(self.sources, int(self.min_loss_tokens), int(self.min_length), self.max_length, self.where)


@dataclass(frozen=True)
class Planning:
    """How an epoch is planned (the ``loader.dataset`` module doc, steps 1-5); a resume state must agree on it.

    ``even``: None (exactly once, rank counts may differ by one), "drop" (each rank gets N // world entries; up
    to world - 1 are skipped that epoch) or "repeat" (each rank gets ceil(N / world); up to world - 1 seen
    twice); ``True`` means "drop". For equal *step* counts with token batching, also stop all ranks at the
    minimum step count. ``unit_bytes``: one read (bytes of the requested features), rounded to whole chunks.
    ``shuffle_bytes``: the shuffle pool per slot, in bytes of loaded units (memory per worker).
    ``partition``: "global" (every epoch one global permutation cut into rank ranges) or "node" (each node
    keeps a fixed share of the read units for the whole run, shuffled within every epoch: with a chunk cache
    holding the share, epochs 2.. fetch nothing remote; a resume with another node count re-partitions what
    is left)."""

    shuffle: bool = True
    seed: int = 0
    even: bool | str | None = None
    partition: str = "global"
    unit_bytes: int = DEFAULT_UNIT_BYTES
    shuffle_bytes: int = DEFAULT_SHUFFLE_BYTES

    def __post_init__(self) -> None:
        even = "drop" if self.even is True else self.even
        if even not in (None, False) and even not in EVEN_MODES:
            raise ValueError(f"even must be None, True or one of {EVEN_MODES}, got {self.even!r}")
        if self.partition not in PARTITIONS:
            raise ValueError(f"partition must be one of {PARTITIONS}, got {self.partition!r}")
        object.__setattr__(self, "even", even or None)
        object.__setattr__(self, "shuffle", bool(self.shuffle))
        object.__setattr__(self, "seed", int(self.seed))
        object.__setattr__(self, "shuffle_bytes", int(self.shuffle_bytes))

    def unit_tokens(self, token_bytes: int, chunk_tokens: int) -> int:
        """Tokens of one read unit: ``unit_bytes`` of features, in whole chunks (at least one)."""
        return max(1, -(-max(1, self.unit_bytes // token_bytes) // chunk_tokens)) * chunk_tokens


@dataclass(frozen=True)
class Reading:
    """How the planned units are read; changes nothing of what an epoch hands out.

    ``prefetch``: units read ahead, concurrently, per slot (on remote stores, at least). ``remote_rate``:
    remote stores' read-ahead grows until that many bytes/s per slot can arrive, sized from the fastest request
    time seen by ``read_ahead_units``, capped by ``read_ahead_bytes`` and the connections a read may use
    (``HSSTORE_METADATA_CONCURRENCY``); 0: a fixed ``prefetch``. ``cache_dir``/``cache_bytes``: a local LRU disk
    cache of remote chunks, shared by workers. ``skip_corrupt``: skip (count and log) samples whose chunks fail
    their checksum or are gone instead of raising ``CorruptionError``; a read that fails after retries
    (``FetchError``) is always raised, so an epoch is never silently short. ``dequantise``: encoded stores' items are
    decoded here, on the host, into the manifest dtype (default: as stored, e4m3fn ``hidden_states`` plus float32
    ``hidden_scales``, or a block encoding's row bytes, a half to a quarter of the bytes to move; the trainer
    decodes on the GPU). ``pin_memory``: items in
    pinned memory (main process only)."""

    prefetch: int = 4
    pin_memory: bool = False
    cache_dir: str | None = None
    cache_bytes: int = DEFAULT_CACHE_BYTES
    skip_corrupt: bool = False
    dequantise: bool = False
    remote_rate: float = DEFAULT_REMOTE_RATE
    read_ahead_bytes: int = DEFAULT_READ_AHEAD_BYTES

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefetch", max(1, int(self.prefetch)))
        object.__setattr__(self, "cache_bytes", int(self.cache_bytes))
        object.__setattr__(self, "remote_rate", float(self.remote_rate))
        object.__setattr__(self, "read_ahead_bytes", int(self.read_ahead_bytes))
        for name in ("pin_memory", "skip_corrupt", "dequantise"):
            object.__setattr__(self, name, bool(getattr(self, name)))

    def max_prefetch(self, unit_bytes: int) -> int:
        """The most units a remote read-ahead may hold (``read_ahead_bytes`` of units, at least ``prefetch``)."""
        return max(self.prefetch, self.read_ahead_bytes // max(1, unit_bytes))
