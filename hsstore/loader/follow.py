"""Following stores while they are written: epoch 0 takes shards as they commit (``HiddenStateDataset(...,
follow=Follow(journal))``; ``hsstore train --follow``).

Why a journal: every rank and DataLoader worker must hand out one epoch-0 plan, and what has arrived depends on
when one looks. So one reader, the *leader* (rank 0), looks: it polls each store with a backoff (a listing of
``writers/``, then one of ``commits/``, and GETs of the new records only), checks the new shards' feature health
(``format/health.py``, the rule ``train`` has for a store) and appends what joins epoch 0 to the journal, a folder
every reader can read (the trainer's OUT, which its checkpoints need shared anyway). Entries, in order:

- ``join``: the new shards' commit records (an index segment per store);
- ``stop``: a shard whose features train nothing, named with the feature (nothing after it is planned unless
  the readers allow unhealthy data); or the follower's deadline (``Follow.deadline_s``), which ends the run that
  wrote it: the same command run again follows on;
- ``end``: every writer of every store finished (``format/sessions.py``): no shard will come.

Readers plan from the journal alone. Join k is planned as an epoch of its own (its samples, weights applied, in a
seeded order of read units, cut over nodes, ranks and workers, a shuffle pool within each slot), and a slot's
epoch 0 is its part of join 0, then of join 1, ...: every sample that joins is handed out exactly once whatever
the timing. A resume state is the slot counts over that concatenation plus the journal's id; another world size
folds what was consumed into ``done`` and re-cuts the rest of every join, as for any epoch. Epochs 1.. are
ordinary epochs of the store the journal holds (every joined shard, in store order): the plan of a run started on
the finished store. Join 0 of an already finished store is the whole store with the ordinary seed: following a
finished store is training on it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
import uuid
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import numpy as np

from .. import env
from ..io import door, storage, transfer
from ..locks import ProcessLock
from ..errors import CorruptionError, StoreError
from ..format import codec, commit, health, index, records, sessions
from ..format.commit import CommitRecord
from ..format.manifest import now_iso
from ..redaction import recordable_url
from ..store.reader import Store
from ..terminal import escape
from .epochs import EpochPart, PlanInputs
from .plan import Catalog, Planner, SlotPlan
from .resume import LoaderState, LoaderStateError, SlotProgress, log_recut, pack_done, unpack_done

if TYPE_CHECKING:
    from ..distributed import World

log = logging.getLogger(__name__)

FORMAT = "hsstore-follow"
VERSION = 1
JOURNAL_FILE = "journal.json"
KINDS = ("join", "stop", "end")
READ_POLL = (0.05, 1.0)  # readers waiting for the journal's next entry (a local stat)
REPORT_S = 60.0  # while nothing arrives, what epoch 0 waits for is said this often


class FollowStopped(StoreError):
    """A following reader reached the journal's stop entry: an arrived shard's features train nothing."""


def poll_seconds() -> tuple[float, float]:
    """Seconds of a following reader's first pause after an arrival and of its longest pause while nothing
    arrives (``env.FOLLOW_POLL_S``)."""
    longest = max(env.FOLLOW_POLL_MIN_S, env.FOLLOW_POLL_S.get())
    return min(env.FOLLOW_POLL_FIRST_S, longest), longest


@dataclass(frozen=True)
class Follow:
    """How a dataset follows its stores. ``journal``: a folder every reader of the job can read (created by the
    leader); ``lead``: the reader of rank 0, worker 0 polls the stores and writes the journal (False: someone else
    runs the ``Leader``, as the trainer does in rank 0's own process); ``allow_unhealthy``: a shard whose features
    train nothing joins anyway (logged) instead of stopping epoch 0; ``poll_s``: (first, longest) pause between
    looks at the stores, doubling while nothing arrives; ``deadline_s``: epoch 0 stops (a stop entry saying what
    joined and what the stores hold) once nothing has arrived for this long while the stores are not finished
    (None: it waits until they are)."""

    journal: str
    lead: bool = True
    allow_unhealthy: bool = False
    poll_s: tuple[float, float] = field(default_factory=poll_seconds)
    report_s: float = REPORT_S
    deadline_s: float | None = None

    def first_epoch(self, inputs: PlanInputs, stores: Sequence[Store], world: "World") -> "JournalEpoch":
        """Epoch 0's source (``epochs.LiveStores``), made where the dataset is built: the leader's journal first (rank
        0), before any reader looks for it."""
        if self.lead and world.rank == 0:
            Journal.create(self.journal, [s.url for s in stores])
        return JournalEpoch(self, stores, inputs)


def join_seed(seed: int, k: int) -> int:
    """The plan seed of join ``k`` (join 0: the run's own, so a finished store's single join is its epoch 0)."""
    if k == 0:
        return int(seed)
    return int.from_bytes(hashlib.blake2b(f"{seed}/follow/{k}".encode(), digest_size=4).digest(), "little")


# -- the journal ---------------------------------------------------------------------------------------------
@dataclass
class Entry:
    """One journal entry (``<k>.json``; a join's records in ``<k>.s<store>.idx``)."""

    index: int
    kind: str
    t: float  # when the leader wrote it (Unix time)
    stores: list[int] = field(default_factory=list)  # stores with a segment (joins)
    shards: int = 0
    samples: int = 0
    tokens: int = 0
    expected_tokens: int | None = None  # what the stores will hold once finished (writers' plans), if known
    why: str | None = None  # stop: the one line naming the shard (and the feature)
    shard: str | None = None  # stop: the unhealthy shard (None: a fault no option lets through)
    deadline: float | None = None  # stop: the deadline (s) it was written at; it ends only the run that wrote it

    @classmethod
    def parse(cls, d: Any, where: str) -> "Entry":
        if not isinstance(d, dict) or d.get("format") != FORMAT or d.get("kind") not in KINDS:
            raise CorruptionError(f"{where}: not a follow journal entry")
        try:
            e = cls(**{k: v for k, v in d.items() if k != "format"})
        except TypeError as err:
            raise CorruptionError(f"{where}: malformed journal entry ({err})") from None
        if not isinstance(e.stores, list):
            raise CorruptionError(f"{where}: malformed journal entry (its stores are not a list)")
        ints = [e.index, e.shards, e.samples, e.tokens, *e.stores]
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in ints) or not isinstance(
                e.t, (int, float)) or (e.expected_tokens is not None and not isinstance(e.expected_tokens, int)) or not all(
                x is None or isinstance(x, str) for x in (e.why, e.shard)) or not (
                e.deadline is None or (isinstance(e.deadline, (int, float)) and not isinstance(e.deadline, bool))):
            raise CorruptionError(f"{where}: malformed journal entry (a field of the wrong type)")
        return e


class Journal:
    """The epoch-0 journal of a following job: a local (or shared) folder, append-only, one writer (the leader)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.path.abspath(os.fspath(path))
        self.fs = storage.resolve(self.path)[0]
        head = door.read_json(self.fs, self.path, JOURNAL_FILE, where=f"follow journal {self.path}")
        if not isinstance(head, dict) or head.get("format") != FORMAT or not isinstance(head.get("id"), str):
            raise CorruptionError(f"{self.path}/{JOURNAL_FILE}: not a follow journal")
        if not isinstance(head.get("version"), int) or head["version"] > VERSION:
            raise CorruptionError(f"{self.path}/{JOURNAL_FILE}: journal version {head.get('version')!r}, this "
                                  f"hsstore reads {VERSION}")
        stores = head.get("stores", [])
        if not isinstance(stores, list) or not all(isinstance(u, str) for u in stores):
            raise CorruptionError(f"{self.path}/{JOURNAL_FILE}: not a follow journal (its stores are not a list of "
                                  "URLs)")
        self.id: str = head["id"]
        self.stores: list[str] = stores
        self._entries: list[Entry] = []
        # threads of one process share a journal (the trainer's loop and its read-ahead, the leader and the loop): an
        # entry is kept only at its own place, whoever read it first (``_keep``)
        self._lock = ProcessLock()

    @classmethod
    def create(cls, path: str | os.PathLike, stores: Sequence[str]) -> "Journal":
        """The journal at ``path`` for these store URLs: a new one, or the one there (refused when it follows other
        stores: its joins name their shards)."""
        path = os.path.abspath(os.fspath(path))
        urls = [recordable_url(str(u)) for u in stores]
        if os.path.exists(os.path.join(path, JOURNAL_FILE)):
            j = cls(path)
            if j.stores != urls:
                raise StoreError(f"{path} holds the follow journal of stores {j.stores}, not {urls}: give another "
                                 "folder (for the trainer: another --out)")
            return j
        fs = storage.resolve(path)[0]
        head = {"format": FORMAT, "version": VERSION, "id": uuid.uuid4().hex, "stores": urls, "created": now_iso()}
        transfer.put_atomic(fs, os.path.join(path, JOURNAL_FILE), json.dumps(head, indent=1).encode(),
                            os.path.dirname(path))
        return cls(path)

    @classmethod
    def wait_for(cls, path: str | os.PathLike, timeout_s: float = 600.0) -> "Journal":
        """The journal at ``path`` once its leader has created it (other ranks and workers may look first)."""
        head = os.path.join(os.path.abspath(os.fspath(path)), JOURNAL_FILE)
        deadline, delay = time.monotonic() + timeout_s, READ_POLL[0]
        while not os.path.exists(head):
            if time.monotonic() > deadline:
                raise StoreError(f"no follow journal at {path} after {timeout_s:.0f}s (its leader, rank 0, creates it)")
            time.sleep(delay)
            delay = min(READ_POLL[1], delay * 2)
        return cls(path)

    @staticmethod
    def _name(k: int) -> str:
        return f"{k:06d}.json"

    def entry(self, k: int) -> Entry | None:
        """Entry ``k``, or None while it is not written."""
        if k < len(self._entries):
            return self._entries[k]
        if k > len(self._entries):  # entries are read in order
            if self.entry(k - 1) is None:
                return None
        name = self._name(k)
        try:
            data = door.read(self.fs, self.path, name, bound=door.JSON_CAP, where=f"follow journal {self.path}")
        except FileNotFoundError:
            return None
        e = Entry.parse(door.load_json(data, f"{self.path}/{name}"), f"{self.path}/{name}")
        if e.index != k:
            raise CorruptionError(f"{self.path}/{name}: holds entry {e.index}")
        return self._keep(e)

    def _keep(self, e: Entry) -> Entry:
        """Entry ``e`` as this journal holds it: kept as entry ``e.index`` unless another thread read it meanwhile
        (then that copy; keeping both would put entry k at k + 1, and a reader would take join k twice and k + 1
        never)."""
        with self._lock:
            if e.index == len(self._entries):
                self._entries.append(e)
            return self._entries[e.index]

    def entries(self) -> list[Entry]:
        """Every entry written so far."""
        k = len(self._entries)
        while self.entry(k) is not None:
            k += 1
        return list(self._entries)

    def wait(self, k: int, stop: threading.Event | None = None) -> Entry | None:
        """Entry ``k``, waiting for it (a stat with a backoff); None when ``stop`` is set first."""
        delay = READ_POLL[0]
        while True:
            e = self.entry(k)
            if e is not None:
                return e
            if stop is not None and stop.is_set():
                return None
            time.sleep(delay)
            delay = min(READ_POLL[1], delay * 2)

    def tables(self, e: Entry) -> dict[int, records.RecordTable]:
        """A join's records by store index, sorted by shard name."""
        out = {}
        for si in e.stores:
            name = f"{e.index:06d}.s{si}.idx"
            data = door.read(self.fs, self.path, name, bound=door.INDEX_SEGMENT_CAP,
                             where=f"follow journal {self.path}")
            out[si] = index.decode_segment(name, data).table
        return out

    def append(self, kind: str, tables: dict[int, records.RecordTable] | None = None, **fields) -> Entry:
        """Write the next entry (a join's segments first, then the entry: a reader that sees it can read them)."""
        k = len(self.entries())
        for si, t in (tables or {}).items():
            transfer.put_atomic(self.fs, os.path.join(self.path, f"{k:06d}.s{si}.idx"),
                                index.encode_segment("follow", f"join {k}", t), os.path.dirname(self.path))
        e = Entry(k, kind, time.time(), sorted(tables or {}), **fields)
        # a field older readers do not know is written only where it says something: their journals stay readable
        body = {"format": FORMAT, **{k: v for k, v in e.__dict__.items() if k != "deadline" or v is not None}}
        transfer.put_atomic(self.fs, os.path.join(self.path, self._name(k)), json.dumps(body).encode(),
                            os.path.dirname(self.path))
        return self._keep(e)  # another thread may have read it already, once its file was there

    def outcome(self, since: float = -float("inf")) -> Entry | None:
        """The end or stop entry that ends epoch 0 so far (None while it goes on). A deadline's stop ends only the
        run that wrote it: one written before ``since`` (when this run's reader or leader started) does not."""
        return next((e for e in reversed(self.entries()) if e.kind == "end" or (
            e.kind == "stop" and (e.deadline is None or e.t >= since))), None)


# -- the journal is believed where the stores agree --------------------------------------------------------------
def _same_record(jt: records.RecordTable, i: int, jcache, st: records.RecordTable, j: int, scache) -> bool:
    """Whether row ``i`` of a journal's table is row ``j`` of the store's: the same columns and record bytes (or,
    where the store's row comes from a version-1 index segment, which holds its record serialised again, the same
    parsed record)."""
    a, b = jt.row_of(i), st.row_of(j)
    if jt.feature_stats is None or st.feature_stats is None:
        a.pop("feature_stats", None), b.pop("feature_stats", None)
    ra, rb = jt.raw(i, jcache), st.raw(j, scache)
    if ra == rb:
        return a == b
    a.pop("raw_size"), b.pop("raw_size")
    try:
        return a == b and CommitRecord.from_json(ra, "journal") == CommitRecord.from_json(rb, "store")
    except CorruptionError:
        return False


def check_join(journal: Journal, e: Entry, tables: dict[int, records.RecordTable], stores: Sequence[Store]) -> None:
    """Refuse (``CorruptionError``, one line) a join whose records are not the stores' own: each shard it names
    committed in its store, its copy of the record (columns and bytes) the store's, its counts theirs. A journal
    is a folder of the run, received with it or edited since; what it names decides which samples train and
    where their features are read, so it is believed only where the commit records agree. Costs no request:
    the stores' records are in memory (opened before the journal is read)."""
    where = f"follow journal {journal.path}, join {e.index}"
    counts = (sum(len(t) for t in tables.values()), sum(int(t.n_samples.sum()) for t in tables.values()),
              sum(int(t.n_tokens.sum()) for t in tables.values()))
    if counts != (e.shards, e.samples, e.tokens):
        raise CorruptionError(f"{where}: its entry counts {e.shards} shard(s), {e.samples} sample(s), {e.tokens} "
                              f"token(s); its records hold {counts[0]}, {counts[1]}, {counts[2]}")
    for si, t in tables.items():
        if si >= len(stores):
            raise CorruptionError(f"{where}: names store {si}; the run follows {len(stores)}")
        st = stores[si].table
        rows = {n: j for j, n in enumerate(st.shard.tolist())}
        jcache, scache = records.BlockCache(), records.BlockCache()
        for i, name in enumerate(t.shard.tolist()):
            j = rows.get(name)
            if j is None:
                raise CorruptionError(f"{where}: names shard {escape(name)!r}, which store "
                                      f"{recordable_url(stores[si].url)!r} has not committed (a journal of another "
                                      "store, or changed since it was written: give another --out)")
            if not _same_record(t, i, jcache, st, j, scache):
                raise CorruptionError(f"{where}: its record of shard {escape(name)!r} is not the one store "
                                      f"{recordable_url(stores[si].url)!r} committed (the journal was changed since it "
                                      "was written: give another --out)")


# -- the leader ------------------------------------------------------------------------------------------------
def _stop_line(url: str, rec: CommitRecord, bad: list[health.Unhealthy]) -> str:
    return (f"store {recordable_url(url)!r}: shard {rec.shard!r} arrived with features that train nothing ({bad[0]}; "
            f"{len(bad)} in the shard): is the extraction going wrong? Epoch 0 stopped; the checkpoints so far are "
            "kept (`hsstore verify` names them; --allow-unhealthy trains on them anyway)")


class Leader:
    """Rank 0's look at the stores: ``poll`` appends what joined epoch 0 to the journal (``run``: every
    ``poll_s``, doubling while nothing arrives, until the end); what epoch 0 waits for, and since when, is logged
    every ``report_s`` while nothing arrives, a writer that went silent or whose end record is not believed as soon
    as it is seen. A journal taken up again is checked against the stores first (``check_join``)."""

    def __init__(self, journal: Journal, stores: Sequence[Store], follow: Follow) -> None:
        self.journal, self.follow = journal, follow
        self.urls = [s.url for s in stores]
        self.places = [(s.fs, s.root) for s in stores]
        self.hidden = stores[0].manifest.hidden_size
        self.known: list[set[str]] = [set() for _ in stores]
        self.samples = self.tokens = self.shards = 0
        self.tokens_by_shard: list[dict[str, int]] = [{} for _ in stores]
        self.counts: list[dict[str, tuple[int, int]]] = [{} for _ in stores]  # shard -> (samples, tokens), joined
        self.expected_tokens: int | None = None
        self.waiting: list[str] = []
        self._writer_cache: list[dict] = [{} for _ in stores]
        self._dead_told: set[str] = set()
        for e in journal.entries():
            if e.kind == "join":
                tables = journal.tables(e)
                check_join(journal, e, tables, stores)  # a journal taken up again is believed where the stores agree
                for si, t in tables.items():
                    self._joined(si, t)
                self.samples, self.tokens, self.shards = self.samples + e.samples, self.tokens + e.tokens, (
                    self.shards + e.shards)
            self.expected_tokens = e.expected_tokens if e.kind == "join" else self.expected_tokens
        self.last_arrival = time.time()
        self.since = self.last_arrival
        self._reported = self.last_arrival
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def _joined(self, si: int, t: records.RecordTable) -> None:
        names = t.shard.tolist()
        self.known[si].update(names)
        self.tokens_by_shard[si].update(zip(names, t.n_tokens.tolist()))
        self.counts[si].update(zip(names, zip(t.n_samples.tolist(), t.n_tokens.tolist())))

    @property
    def done(self) -> bool:
        out = self.journal.outcome(self.since)
        return out is not None and (out.kind == "end" or not self.follow.allow_unhealthy or out.shard is None)

    def poll(self) -> bool:
        """One look at every store; True when something was appended to the journal."""
        if self.done:
            return False
        tables, finished, stop, bad_shard = {}, True, None, None
        samples = tokens = shards = 0
        expected: int | None = 0
        for si, (url, (fs, root)) in enumerate(zip(self.urls, self.places)):
            writers = sessions.read_writers(fs, root, self._writer_cache[si])  # before the listing: see finished
            listed = commit.list_records(fs, root)
            new = sorted(set(listed) - self.known[si])
            items = []
            if new:
                blobs = commit.read_records(fs, root, new, [int(listed[n].get("size") or 0) or None for n in new])
                for name, data in zip(new, blobs):
                    rec = CommitRecord.from_json(data, where=f"store {recordable_url(url)!r}, commit record of "
                                                             f"shard {name!r}")
                    if rec.shard != name:
                        raise CorruptionError(f"store {url!r}: commit record of shard {name!r} names {rec.shard!r}")
                    bad = health.record_problems(rec, self.hidden)
                    if bad and not self.follow.allow_unhealthy:
                        stop, bad_shard = _stop_line(url, rec, bad), rec.shard
                        break
                    if bad:
                        log.warning("%s (training anyway: --allow-unhealthy)", _stop_line(url, rec, bad).split(
                            ": is the")[0])
                    items.append((rec, data, None, codec.crc32c(data)))
            if stop is not None:
                break
            if items:
                t = records.from_records(items)
                tables[si] = t
                shards += len(items)
                samples += int(t.n_samples.sum())
                tokens += int(t.n_tokens.sum())
                names = t.shard.tolist()
                self.tokens_by_shard[si].update(zip(names, t.n_tokens.tolist()))
            # what is committed, from the records: end records are believed only where they agree with it
            arrived = dict(zip(t.shard.tolist(), zip(t.n_samples.tolist(), t.n_tokens.tolist()))) if items else {}
            shown = {n: self.counts[si].get(n) or arrived[n] for n in listed if n in self.counts[si] or n in arrived}
            exp = writers.expected_tokens(self.tokens_by_shard[si])
            expected = None if exp is None or expected is None else expected + exp
            if not writers.finished(shown):
                finished = False
                self._tell(url, writers, shown)
        if stop is not None:
            self.journal.append("stop", why=stop, shard=bad_shard)
            log.debug("epoch 0 stops (every reader raises it, the one line a user sees): %s", stop)
            return True
        appended = False
        if tables:
            for si, t in tables.items():
                self._joined(si, t)
            self.samples, self.tokens, self.shards = self.samples + samples, self.tokens + tokens, self.shards + shards
            self.expected_tokens = expected
            e = self.journal.append("join", tables, shards=shards, samples=samples, tokens=tokens,
                                    expected_tokens=expected)
            log.info("epoch 0: join %d, %d new shard(s), %d sample(s) (%d so far%s)", e.index, shards, samples,
                     self.samples, "" if expected is None or not self.tokens else
                     f", about {min(1.0, self.tokens / max(1, expected)):.0%} of the tokens the writers plan")
            self.last_arrival = self._reported = time.time()
            appended = True
        if finished:
            self.journal.append("end", shards=self.shards, samples=self.samples, tokens=self.tokens)
            log.info("epoch 0: every writer finished; %d shard(s), %d sample(s) joined in all", self.shards,
                     self.samples)
            return True
        deadline = self.follow.deadline_s
        if not appended and deadline is not None and time.time() - self.last_arrival >= deadline:
            why = self._deadline_line(deadline, expected)
            self.journal.append("stop", why=why, deadline=float(deadline))
            log.debug("epoch 0 stops at its deadline (every reader raises it, the one line a user sees): %s", why)
            return True
        return appended

    def _deadline_line(self, deadline: float, expected: int | None) -> str:
        """What epoch 0 trained and what the stores hold when it stops at its deadline (one line)."""
        held = sum(n for counts in self.counts for n, _ in counts.values())
        plan = "" if expected is None else f"; the writers plan about {expected:,} token(s), {self.tokens:,} joined"
        first = self.waiting[0] if self.waiting else "the stores' listing"
        more = f" (and {len(self.waiting) - 1} more)" if len(self.waiting) > 1 else ""
        return (f"epoch 0 stopped at its deadline: nothing arrived for {deadline:g}s and the stores are not finished; "
                f"it trained the {self.samples} sample(s) that joined, of the {held} the stores hold{plan}; waiting "
                f"for {first}{more}. The checkpoints are kept: the same command goes on following")

    def _tell(self, url: str, writers: sessions.Writers, listed: dict[str, tuple[int, int]]) -> None:
        """What epoch 0 waits for: a newly silent writer at once (a warning), everything every ``report_s``."""
        now = time.time()
        self.waiting = writers.waiting_for(listed, now)
        for s in writers.states(now, listed):
            if s.state in ("dead", "failed", "disputed") and s.record.key not in self._dead_told:
                self._dead_told.add(s.record.key)
                log.warning("store %r: %s; epoch 0 waits for it", recordable_url(url), s.describe(listed))
        if now - self._reported >= self.follow.report_s:
            self._reported = now
            since = time.strftime("%H:%M:%S", time.localtime(self.last_arrival))
            log.info("epoch 0 waits for store %r since %s (%.0fs, %d sample(s) joined): %s", recordable_url(url),
                     since, now - self.last_arrival, self.samples, "; ".join(self.waiting) or "its listing")

    def run(self) -> None:
        first, longest = self.follow.poll_s
        delay = first
        while not self._stop.is_set() and not self.done:
            try:
                got = self.poll()
            except CorruptionError as e:  # a record that will not parse does not heal by waiting
                self.journal.append("stop", why=str(e))
                log.debug("epoch 0 stops (every reader raises it, the one line a user sees): %s", e)
                return
            except Exception as e:  # a network fault: look again later
                log.warning("epoch 0: looking at the stores failed (%s: %s); trying again in %.0fs",
                            type(e).__name__, e, delay)
                got = False
            delay = first if got else min(longest, delay * 2)
            self._stop.wait(delay)

    def start(self) -> "Leader":
        self._thread = threading.Thread(target=self._run_logged, name="hsstore-follow-leader", daemon=True)
        self._thread.start()
        return self

    def _run_logged(self) -> None:
        try:
            self.run()
        except BaseException as e:  # the journal could not be written: readers wait; say why
            self.error = e
            log.error("epoch 0's leader stopped: %s: %s", type(e).__name__, e)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)


# -- the plan of epoch 0 -------------------------------------------------------------------------------------------
@dataclass
class JoinPart:
    """Join ``k`` as the readers plan it: the stores holding the join's shards alone, their catalog and its planner."""

    k: int
    stores: list[Store]
    catalog: Catalog
    planner: Planner
    entries: int

    @property
    def view(self) -> "JoinPart":
        """Deprecated: the join's stores and catalog are this part's own (``stores``, ``catalog``)."""
        warnings.warn("JoinPart.view is deprecated: the part holds the join's stores and catalog itself "
                      "(JoinPart.stores, JoinPart.catalog)", DeprecationWarning, stacklevel=2)
        return self


class FollowPlan:
    """Epoch 0 of a following dataset, from its journal (one per process; made again in each worker). ``stores``:
    the dataset's stores (a join's stores are theirs, holding the join's shards alone)."""

    def __init__(self, journal: Journal, stores: Sequence[Store], inputs: PlanInputs) -> None:
        self.journal, self.stores, self.inputs = journal, list(stores), inputs
        self.started = time.time()  # a deadline's stop written before ends an earlier run, not this one
        self._parts: dict[int, JoinPart] = {}
        self._sizes: dict[int, int] = {}  # join -> entries
        self._done: dict[tuple, np.ndarray | None] = {}
        self._lock = ProcessLock()

    def config(self) -> dict[str, Any]:
        """What a resume state of epoch 0 must agree on (``LoaderState.config``)."""
        return {"follow": self.journal.id, **self.inputs.settings()}

    def part(self, k: int) -> JoinPart:
        got = self._parts.get(k)
        if got is not None:
            return got
        e = self.journal.entry(k)
        if e is None or e.kind != "join":
            raise LoaderStateError(f"follow journal {self.journal.path}: entry {k} is not a join")
        tables = self.journal.tables(e)
        stores = [Store(s.url, s.storage_options, allow_locations=s.allow_locations,
                        loaded=(s.manifest, tables.get(si, _empty_table()), index.IndexUse()))
                  for si, s in enumerate(self.stores)]
        catalog = self.inputs.catalog(stores)
        planner = self.inputs.planner(catalog, seed=join_seed(self.inputs.planning.seed, k))
        n = len(planner.epoch_order(0, self.inputs.nodes)) if len(catalog) else 0
        part = JoinPart(k, stores, catalog, planner, n)
        with self._lock:  # the trainer's loop plans joins while its read-ahead reads them
            self._sizes[k] = n
            self._parts = {j: v for j, v in self._parts.items() if j >= k - 1}  # the join being read, and the last
            self._parts[k] = part
        return part

    def entries(self, k: int) -> int:
        if k not in self._sizes:
            self.part(k)
        return self._sizes[k]

    def joins(self) -> list[int]:
        """Indices of the join entries written so far."""
        return [e.index for e in self.journal.entries() if e.kind == "join"]

    def base(self, k: int) -> int:
        """The first epoch-0 entry id of join ``k`` (entries of join 0, then of join 1, ...)."""
        return sum(self.entries(j) for j in self.joins() if j < k)

    def done_of(self, done: str | None, done_joins: int, k: int) -> str | None:
        """``done`` (a bitmap over the entries of the joins before ``done_joins``) cut to join ``k``."""
        if not done or k >= done_joins:
            return None
        key = (done, done_joins)
        bits = self._done.get(key)
        if bits is None:
            bits = unpack_done(done, self.base(done_joins))
            self._done = {key: bits}
        a = self.base(k)
        return pack_done(bits[a:a + self.entries(k)])

    def slot_plan(self, k: int, done: str | None, done_joins: int, phase: int, world: "World") -> SlotPlan:
        """``world``'s part of join ``k``. The slots of a node take the join's cut in an order rotated by ``k``: a
        join's few samples (the remainder of an even cut) go to other slots each time, never always to the same."""
        part = self.part(k)
        if not part.entries:
            return SlotPlan(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))
        return part.planner.slot_plan(0, self.done_of(done, done_joins, k), phase, rotated(world, k))

    def fold(self, state: LoaderState) -> tuple[str | None, int]:
        """(done, joins it covers) after the phase recorded in ``state``: what every old slot consumed, joined to
        what earlier phases did."""
        R, W = state.world
        missing = [s for s in range(R * W) if s not in state.counts]
        if missing:
            raise LoaderStateError(f"resume state covers slots {sorted(state.counts)} of {R} rank(s) x {W} "
                                   f"worker(s); slots {missing[:8]} are missing (merge the states of all of them)")
        follow = state.follow or {}
        done_joins = int(follow.get("done_joins", 0))
        reach = max(done_joins, int(follow.get("joins", 0)))
        joins = [j for j in self.joins() if j < reach]
        span = reach if not joins else max(joins) + 1
        total = self.base(span)
        bits = np.zeros(total, bool)
        old = unpack_done(state.done, self.base(done_joins)) if state.done else None
        if old is not None:
            bits[:len(old)] = old
        for s in range(R * W):
            left, reader = state.counts[s], state.reader(s)
            for j in joins:
                if left <= 0:
                    break
                plan = self.slot_plan(j, state.done, done_joins, state.phase, reader)
                take = plan.entries[:left]
                bits[self.base(j) + take] = True
                left -= len(plan)
        return pack_done(bits), span


def rotated(world: "World", k: int) -> "World":
    """The slot of ``world``'s node whose part of join ``k`` this reader takes: its place among the node's ranks x
    workers moved on by ``k``."""
    per = world.ranks_per_node * world.workers
    place = (world.rank % world.ranks_per_node) * world.workers + world.worker
    moved = (place + k) % per
    return world.at(world.node * world.ranks_per_node + moved // world.workers, moved % world.workers)


def _empty_table() -> records.RecordTable:
    return records.from_records([])


def epoch0_lengths(plan: FollowPlan, world: "World", upto: int | None = None) -> list[np.ndarray]:
    """Deprecated: ``HiddenStateDataset.planned_lengths(0, world)`` (``JournalEpoch.planned``, join by join)."""
    warnings.warn("epoch0_lengths is deprecated: HiddenStateDataset.planned_lengths(0, world) gives them "
                  "(JournalEpoch.planned, join by join)", DeprecationWarning, stacklevel=2)
    out = []
    for k in plan.joins():
        if upto is not None and k >= upto:
            break
        sp = plan.slot_plan(k, None, 0, 0, world)
        cat = plan.part(k).catalog
        out.append((cat.stop - cat.start)[sp.rows] if len(sp) else np.zeros(0, np.int64))
    return out


# -- epoch 0 as the dataset's epoch source -------------------------------------------------------------------------
class JournalEpoch:
    """Epoch 0 of stores being written, planned from the follow journal (``epochs.LiveEpoch``): a part per join, in
    journal order. It travels with the dataset to DataLoader workers; each process plans from the journal itself
    (``plan``). ``stores``: the dataset's, as it holds them (as opened; as epoch 0 took them once it ended)."""

    def __init__(self, options: Follow, stores: Sequence[Store], inputs: PlanInputs) -> None:
        self.options, self.stores, self.inputs = options, list(stores), inputs
        self._plan: tuple[int, FollowPlan] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_plan": None}  # a follower's plan is read from its journal again where it is used

    def plan(self) -> FollowPlan:
        """This process's plan of epoch 0 from the journal."""
        if self._plan is None or self._plan[0] != os.getpid():
            self._plan = (os.getpid(), FollowPlan(Journal.wait_for(self.options.journal), self.stores, self.inputs))
        return self._plan[1]

    def config(self) -> dict[str, Any]:
        return self.plan().config()

    def initial_state(self) -> LoaderState:
        plan = self.plan()
        return LoaderState(plan.config(), 0, nodes=self.inputs.nodes,
                           follow={"journal": plan.journal.id, "joins": 0, "done_joins": 0})

    @staticmethod
    def parts_of(plan: FollowPlan, world: "World") -> Iterator[EpochPart]:
        """``world``'s part of each join written so far (a fresh plan)."""
        for k in plan.joins():
            part = plan.part(k)
            yield EpochPart(part.stores, part.catalog, plan.slot_plan(k, None, 0, 0, world))

    def planned(self, world: "World") -> Iterator[EpochPart]:
        return self.parts_of(self.plan(), world)

    def rank_counts(self, resume: LoaderState | None, world: "World") -> list[int]:
        """What joined so far, from the start of epoch 0."""
        plan = self.plan()
        return [sum(len(plan.slot_plan(k, None, 0, 0, world.at(r))) for k in plan.joins()) for r in range(world.world)]

    def start(self, resume: LoaderState | None, world: "World") -> tuple[SlotProgress, "JoinParts"]:
        """Where slot ``world`` starts epoch 0 (as ``epochs.StoreEpoch.start``, over the journal's joins), and its
        parts; the reader of rank 0, worker 0 leads when the follow options say so."""
        plan = self.plan()
        done, phase, count, skipped = None, 0, 0, 0
        follow = {"journal": plan.journal.id, "joins": 0, "done_joins": 0}
        if resume is not None:
            done, phase, follow = resume.done, resume.phase, dict(resume.follow)
            same = resume.world == (world.world, world.workers) and resume.nodes == self.inputs.nodes
            if resume.world is not None and same:
                if world.slot not in resume.counts:
                    raise LoaderStateError(f"resume state has no position for rank {world.rank} worker "
                                           f"{world.worker} (it covers slots {sorted(resume.counts)})")
                count, skipped = resume.counts[world.slot], resume.skipped.get(world.slot, 0)
            elif resume.world is not None:
                log_recut("0 (following)", world, resume.world, "the remaining samples of every join")
                done, span = plan.fold(resume)
                phase, follow = phase + 1, {**follow, "joins": span, "done_joins": span}
        progress = SlotProgress(0, done, phase, world, self.inputs.nodes, count, skipped, follow=follow)
        leader = Leader(plan.journal, self.stores, self.options).start() if (
            self.options.lead and world.slot == 0) else None
        return progress, JoinParts(plan, progress, leader, self.options.allow_unhealthy)

    def final_stores(self) -> list[Store]:
        """Epochs 1..: every joined shard, in store order, once epoch 0 has ended (``epochs.LiveEpoch``)."""
        journal = self.plan().journal
        out = journal.outcome()
        if out is None or out.kind != "end":
            raise StoreError(f"epoch 0 of {', '.join(repr(s.url) for s in self.stores)} has not ended (follow journal "
                             f"{journal.path}: {'stopped: ' + str(out.why) if out else 'writers still writing'}); "
                             "epochs after it read every shard")
        self.stores = joined_stores(journal, self.stores)
        return self.stores


class JoinParts:
    """One slot's parts of epoch 0 (``epochs.EpochParts``): its part of each join in journal order, waiting for the
    next entry when it has caught up; the end entry ends them, a stop entry raises ``FollowStopped`` (unless unhealthy
    data is allowed). ``close`` stops the wait and the leader."""

    def __init__(self, plan: FollowPlan, progress: SlotProgress, leader: Leader | None,
                 allow_unhealthy: bool) -> None:
        self.plan, self.progress, self.leader, self.allow_unhealthy = plan, progress, leader, allow_unhealthy
        self.k = 0
        self._stop = threading.Event()

    def __iter__(self) -> "JoinParts":
        return self

    def __next__(self) -> EpochPart:
        p = self.progress
        while True:
            e = self.plan.journal.wait(self.k, self._stop)
            if e is None:
                raise StopIteration
            if e.kind == "end":
                raise StopIteration
            if e.kind == "stop":
                if self.allow_unhealthy and e.shard is not None:  # an unhealthy arrival, allowed now
                    self.k += 1
                    continue
                if e.deadline is not None and e.t < self.plan.started:  # an earlier run's deadline: go on following
                    self.k += 1
                    continue
                raise FollowStopped(e.why)
            p.follow["joins"] = max(p.follow.get("joins", 0), self.k + 1)
            plan = self.plan.slot_plan(self.k, p.done, p.follow.get("done_joins", 0), p.phase, p.world)
            part = self.plan.part(self.k)
            self.k += 1
            return EpochPart(part.stores, part.catalog, plan)

    def close(self) -> None:
        self._stop.set()
        if self.leader is not None:
            self.leader.stop()


def joined_stores(journal: Journal, stores: Sequence[Store]) -> list[Store]:
    """``stores`` as epoch 0 followed them: every joined shard, in store order (what epochs 1.. read)."""
    parts: list[list[records.RecordTable]] = [[] for _ in stores]
    for e in journal.entries():
        if e.kind == "join":
            for si, t in journal.tables(e).items():
                parts[si].append(t)
    out = []
    for si, s in enumerate(stores):
        t = records.concat(parts[si]) if parts[si] else _empty_table()
        names = t.shard.tolist()
        order = sorted(range(len(names)), key=names.__getitem__)
        if order != list(range(len(names))):
            t = t.take(np.array(order, np.int64))
        out.append(Store(s.url, s.storage_options, loaded=(s.manifest, t, index.IndexUse(shards=len(t))),
                         allow_locations=s.allow_locations))
    return out


def final_stores(ds: Any, journal: Journal) -> list[Store]:
    """Deprecated: ``joined_stores(journal, ds.stores)``."""
    warnings.warn("final_stores(ds, journal) is deprecated: joined_stores(journal, stores)", DeprecationWarning,
                  stacklevel=2)
    return joined_stores(journal, ds.stores)
