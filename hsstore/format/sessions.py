"""Writer sessions: who writes a store, and whether each writer finished (docs/FORMAT.md, "Writer sessions").

A commit record says that its shard is there, never that no more are coming. A reader that trains while the
store is written (``--follow``) must know when it is complete, and a writer that crashed or was killed must not
pass for one that finished. So every ``StoreWriter`` session records itself under ``writers/``: a session
record when it opens (rewritten as its heartbeat while it writes) and an end record once it closed cleanly,
every shard committed. A killed writer leaves a session record whose heartbeat stops; a failed one rewrites it
with the error. ``Writers.finished`` is the rule a follower ends epoch 0 by.

A writer's word is not taken as fact. An end record is believed only where it agrees with what the store holds:
the shards committed under its session, their samples and tokens, what its session planned, and a session
record that has not beaten since (``end_verdict``). A writer tag names one writer at a time: a session claims its
tag's slot (``writers/<tag>.slot``) atomically before it writes, so two identical jobs into one store cannot both
write (``claim_slot``).
"""

from __future__ import annotations

import logging
import math
import re
import socket
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping

from .. import env
from ..io import destination, door, listing, storage, transfer
from ..errors import CorruptionError, StoreError
from ..terminal import escape
from .manifest import MAX_TEXT, is_int, now_iso

log = logging.getLogger(__name__)

WRITERS_DIR = "writers"
FORMAT = "hsstore-writer"
VERSION = 1
SESSION_SUFFIX = ".json"
END_SUFFIX = ".end.json"
SLOT_SUFFIX = ".slot"  # not ``.json``: readers that predate slots list only ``.json`` objects and never see one
RECORD_CAP = 4 << 20  # a session record lists its job's writer tags: 1e5 ranks fit
READ_GROUP_BYTES = 4 * RECORD_CAP  # writer records held at once by one poll, read a group at a time
STALE_BEATS = 4  # a session that missed this many heartbeats is reported as dead (a follower keeps waiting)
# An end record is believed once its session has stayed silent this long after it: a writer that still runs beats
# within one beat, so an end planted beside it is caught before it is believed (the second beat covers a slow PUT).
SETTLE_BEATS = 2
CLAIM_TRIES = 5
_SHARD_SEQ = re.compile(r"-[0-9]{5,}$")  # a shard is named ``<session key>-<sequence>``


def heartbeat_s() -> float:
    """Seconds between a writer's heartbeats (``env.WRITER_HEARTBEAT_S``)."""
    return env.WRITER_HEARTBEAT_S.get()


def session_key(tag: str, session: str) -> str:
    """A session's name: its shards are named ``<key>-<sequence>``, its records ``writers/<key>.json`` and
    ``writers/<key>.end.json``."""
    return f"{tag}-{session}"


@dataclass
class SessionRecord:
    """``writers/<key>.json``: a writer session as it opened, rewritten at every heartbeat."""

    writer: str  # the writer tag (extraction: rank00003)
    session: str
    host: str
    pid: int
    started: str
    started_unix: float
    heartbeat_unix: float
    heartbeat_s: float
    committed: int = 0  # shards committed so far
    expects: list[str] = field(default_factory=list)  # writer tags of its job (extraction: every rank's)
    planned_samples: int | None = None  # what the session means to write (extraction: the samples still to do)
    planned_tokens: int | None = None
    failed: str | None = None  # why it stopped without finishing (None while it runs)

    @property
    def key(self) -> str:
        return session_key(self.writer, self.session)

    def to_json(self) -> bytes:
        import json

        return json.dumps({"format": FORMAT, "version": VERSION, **asdict(self)}, separators=(",", ":")).encode()


@dataclass
class SlotRecord:
    """``writers/<tag>.slot``: the session that holds a writer tag (``claim_slot``). Created only where none is,
    replaced only by the one taker of a holder that no longer writes."""

    writer: str
    session: str
    host: str
    pid: int
    claimed_unix: float
    heartbeat_s: float  # the session's beat: a holder whose session record never appeared is dead after 4 of them

    def to_json(self) -> bytes:
        import json

        return json.dumps({"format": FORMAT, "version": VERSION, "kind": "slot", **asdict(self)},
                          separators=(",", ":")).encode()


@dataclass
class EndRecord:
    """``writers/<key>.end.json``: the session closed cleanly, after every one of its ``shards`` was committed."""

    writer: str
    session: str
    ended: str
    ended_unix: float
    shards: int
    samples: int
    tokens: int

    def to_json(self) -> bytes:
        import json

        return json.dumps({"format": FORMAT, "version": VERSION, "kind": "end", **asdict(self)},
                          separators=(",", ":")).encode()


def _text(x: Any) -> bool:
    return isinstance(x, str) and len(x) <= MAX_TEXT


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _count(x: Any) -> bool:
    return is_int(x) and 0 <= x < 1 << 62


_KINDS = {"SessionRecord": None, "EndRecord": "end", "SlotRecord": "slot"}


def _parse(cls, d: Any, where: str):
    """A record of ``cls`` from parsed JSON, every field of its type (it comes from the store: untrusted)."""
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise CorruptionError(f"{where}: not a writer record (format {FORMAT!r})")
    if not is_int(d.get("version")) or d["version"] > VERSION:
        raise CorruptionError(f"{where}: writer record version {d.get('version')!r}, this hsstore reads {VERSION}")
    if d.get("kind") != _KINDS[cls.__name__]:
        raise CorruptionError(f"{where}: a writer record of kind {d.get('kind')!r} where one of kind "
                              f"{_KINDS[cls.__name__]!r} belongs")
    body = {k: v for k, v in d.items() if k not in ("format", "version", "kind")}
    try:
        rec = cls(**body)
    except TypeError as e:
        raise CorruptionError(f"{where}: malformed writer record ({e})") from None
    ok = _text(rec.writer) and _text(rec.session)
    if isinstance(rec, SessionRecord):
        ok = ok and _text(rec.host) and _count(rec.pid) and _text(rec.started) and _num(rec.started_unix) and (
            _num(rec.heartbeat_unix) and _num(rec.heartbeat_s) and rec.heartbeat_s > 0 and _count(rec.committed)
            and isinstance(rec.expects, list) and all(map(_text, rec.expects))
            and (rec.planned_samples is None or _count(rec.planned_samples))
            and (rec.planned_tokens is None or _count(rec.planned_tokens))
            and (rec.failed is None or _text(rec.failed)))
    elif isinstance(rec, SlotRecord):
        ok = ok and _text(rec.host) and _count(rec.pid) and _num(rec.claimed_unix) and _num(rec.heartbeat_s) and (
            rec.heartbeat_s > 0)
    else:
        ok = ok and _text(rec.ended) and _num(rec.ended_unix) and all(
            _count(v) for v in (rec.shards, rec.samples, rec.tokens))
    if not ok:
        raise CorruptionError(f"{where}: malformed writer record (a field of the wrong type)")
    return rec


# -- writing --------------------------------------------------------------------------------------------------
def write_session(fs, root: str, rec: SessionRecord) -> None:
    transfer.put_atomic(fs, storage.join(root, WRITERS_DIR, rec.key + SESSION_SUFFIX), rec.to_json(), root)


def write_end(fs, root: str, rec: EndRecord) -> None:
    transfer.put_atomic(fs, storage.join(root, WRITERS_DIR, session_key(rec.writer, rec.session) + END_SUFFIX),
                        rec.to_json(), root)


def new_session(tag: str, session: str, *, host: str, pid: int, expects: list[str] | None = None,
                planned_samples: int | None = None, planned_tokens: int | None = None,
                beat_s: float | None = None) -> SessionRecord:
    now = time.time()
    return SessionRecord(tag, session, host, int(pid), now_iso(), now, now, float(beat_s or heartbeat_s()),
                         expects=sorted(set(expects or [tag])), planned_samples=planned_samples,
                         planned_tokens=planned_tokens)


# -- the writer slot: one writer per tag ---------------------------------------------------------------------
class SlotHeld(StoreError):
    """Another session that still writes holds this writer tag: a second writer of it would store every one of
    its samples again (two identical ``extract`` commands resume from the same committed ids)."""


def slot_key(tag: str) -> str:
    return f"{WRITERS_DIR}/{tag}{SLOT_SUFFIX}"


def _read_object(fs, root: str, key: str) -> bytes | None:
    """A small writer object's bytes (None: there is none)."""
    try:
        return door.read(fs, root, key, bound=door.JSON_CAP, where=key)
    except FileNotFoundError:
        return None


def _read_record(fs, root: str, key: str, cls):
    """The record of ``cls`` at ``key``, or None when it is missing or damaged."""
    data = _read_object(fs, root, key)
    if data is None:
        return None
    try:
        return _parse(cls, door.load_json(data, key), key)
    except CorruptionError:
        return None


def holder_gone(fs, root: str, held: SlotRecord, now: float) -> str | None:
    """Why the session holding a slot no longer writes, or None while it may. A writer's liveness is its heartbeat:
    its session record, rewritten every beat, must not have been silent for ``STALE_BEATS`` beats (the rule a
    follower reports a dead writer by, the only one that holds across machines); on the holder's own machine a
    process that is gone frees the tag at once, so re-running a killed job there is not refused. An end record
    frees it only when the session has not beaten since (a planted one beside a live writer does not)."""
    key = session_key(held.writer, held.session)
    rec = _read_record(fs, root, f"{WRITERS_DIR}/{key}{SESSION_SUFFIX}", SessionRecord)
    end = _read_record(fs, root, f"{WRITERS_DIR}/{key}{END_SUFFIX}", EndRecord)
    if end is not None and (rec is None or rec.heartbeat_unix <= end.ended_unix):
        return "it ended"
    if rec is not None and rec.failed is not None:
        return "it stopped on an error"
    if held.host == socket.gethostname() and not destination.pid_alive(held.pid):
        return f"its process {held.pid} on this machine is gone"
    last, beat = (rec.heartbeat_unix, rec.heartbeat_s) if rec is not None else (held.claimed_unix, held.heartbeat_s)
    if now - last > STALE_BEATS * beat:
        return f"no heartbeat for {now - last:.0f}s"
    return None


def _held_line(url: str, held: SlotRecord, now: float) -> str:
    return (f"store {url!r}: writer {escape(held.writer)} is being written by another session now (session "
            f"{escape(held.session)}, host {escape(held.host)}, pid {held.pid}, claimed {now - held.claimed_unix:.0f}s "
            "ago): a second writer of the same tag (the same rank of the same job) would store its samples twice. "
            "Wait for it to finish (the same command then resumes), or stop it; one killed on another machine frees "
            f"the tag after {STALE_BEATS * held.heartbeat_s:.0f}s without a heartbeat (nothing was written)")


def _read_slot(fs, root: str, tag: str) -> tuple[bytes | None, SlotRecord | None]:
    """(bytes, record) of a tag's slot: (None, None) when there is none, (bytes, None) when it does not parse or
    names another tag or a session name hsstore does not make (it names the records read next)."""
    key = slot_key(tag)
    data = _read_object(fs, root, key)
    if data is None:
        return None, None
    try:
        held = _parse(SlotRecord, door.load_json(data, key), key)
    except CorruptionError:
        return data, None
    return data, held if held.writer == tag and held.session.isalnum() else None


def check_slot(fs, root: str, url: str, tag: str) -> None:
    """Refuse (``SlotHeld``) before any work when a session that still writes holds ``tag`` (a job's early,
    cheap look; the claim at the writer's start is what holds)."""
    held = _read_slot(fs, root, tag)[1]
    now = time.time()
    if held is not None and holder_gone(fs, root, held, now) is None:
        raise SlotHeld(_held_line(url, held, now))


def claim_slot(fs, root: str, url: str, rec: SessionRecord) -> None:
    """Make ``rec``'s session the one writer of its tag before it writes anything, or raise ``SlotHeld``.

    The slot is created only where there is none: ``O_CREAT | O_EXCL`` on local disk (through ``sinks``, no link
    followed), a conditional PUT (``If-None-Match: *``) on S3. A slot whose holder no longer writes
    (``holder_gone``: it ended, failed, its process is gone, or its heartbeat stopped) is taken over by exactly
    one taker (``destination.take_over``); a slot is never removed, so a session that ended leaves it to the
    next. A slot that does not parse is looked at again (a claim being written); one that stays so is named."""
    key = slot_key(rec.writer)
    path = storage.join(root, key)
    mine = SlotRecord(rec.writer, rec.session, rec.host, rec.pid, time.time(), rec.heartbeat_s).to_json()
    for _ in range(CLAIM_TRIES):
        if destination.create_exclusive(fs, path, mine, root):
            return
        data, held = _read_slot(fs, root, rec.writer)
        if data is None:
            continue  # gone meanwhile
        if held is None:
            time.sleep(0.2)
            continue
        now = time.time()
        why = holder_gone(fs, root, held, now)
        if why is None:
            raise SlotHeld(_held_line(url, held, now))
        if destination.take_over(fs, root, path, held.session, lambda: _read_object(fs, root, key) == data,
                                 lambda: transfer.put_atomic(fs, path, mine, root), mine):
            log.info("store %r: writer %s: took over its slot from session %s (%s)", url, rec.writer,
                     escape(held.session), why)
            return
    raise SlotHeld(f"store {url!r}: could not claim {key}: it does not parse, or other writers keep taking it; "
                   f"if no writer {rec.writer} runs, remove {key} and {key}.*.takeover (nothing was written)")


# -- reading and the rule -------------------------------------------------------------------------------------
def by_session(listed: Iterable[str]) -> dict[str, list[str]]:
    """Committed shard names grouped by the session key they are named under (``<key>-<sequence>``)."""
    out: dict[str, list[str]] = {}
    for n in listed:
        m = _SHARD_SEQ.search(n)
        if m is not None:
            out.setdefault(n[:m.start()], []).append(n)
    return out


def end_verdict(rec: SessionRecord, end: EndRecord, shards: list[str] | None,
                counts: Mapping[str, tuple[int, int]] | None, now: float) -> tuple[str, str] | None:
    """None when ``end`` is believed; else (state, why): ``disputed`` when it disagrees with the store, or
    ``ending`` while it agrees but is younger than ``SETTLE_BEATS`` beats of its session. ``shards``: the
    committed shards named under its session (None: not known, not checked); ``counts``: shard -> (samples, tokens) from their records (None:
    only their number is known). Agreement: its shards are the ones committed, their samples and tokens are its
    own, it wrote what its session planned, and its session record counts no more shards and has not beaten
    after it (a writer that still runs beats on; an end planted beside it is caught then)."""
    if shards is not None and len(shards) != end.shards:
        return "disputed", f"its end record counts {end.shards} shard(s), {len(shards)} are committed under its name"
    if shards is not None and counts is not None:
        samples = sum(counts[n][0] for n in shards if n in counts)
        tokens = sum(counts[n][1] for n in shards if n in counts)
        if (samples, tokens) != (end.samples, end.tokens):
            return "disputed", (f"its end record says {end.samples} sample(s), {end.tokens} token(s); its committed "
                                f"shards hold {samples}, {tokens}")
    if rec.planned_samples is not None and rec.planned_samples != end.samples:
        return "disputed", f"it planned {rec.planned_samples} sample(s), its end record says {end.samples}"
    if rec.committed > end.shards:
        return "disputed", f"its session record counts {rec.committed} shard(s), its end record {end.shards}"
    if rec.heartbeat_unix > end.ended_unix:
        return "disputed", f"it beat {rec.heartbeat_unix - end.ended_unix:.0f}s after its end record: it still runs"
    settle = SETTLE_BEATS * rec.heartbeat_s
    if now < end.ended_unix + settle:
        return "ending", f"its end is believed once it has stayed silent {settle:g}s after it"
    return None


@dataclass
class SessionState:
    """One session as a follower sees it: ``state`` is ``ended`` (its end record is believed), ``ending`` (it
    agrees, too young to believe), ``disputed`` (it disagrees with the store), ``replaced`` (a later session of
    its writer tag ended: a re-run did its remaining work), ``failed``, ``dead`` (its heartbeat stopped) or
    ``open``."""

    record: SessionRecord
    end: EndRecord | None
    state: str
    silent_s: float  # seconds since its last heartbeat (0 once ended)
    why: str | None = None  # ending, disputed: what the end record is held to

    def committed(self, listed: Iterable[str] | None) -> int:
        """This session's shards committed: those ``listed`` in ``commits/`` (the authority; its heartbeat's count
        lags a shard behind between beats), else what its last heartbeat said."""
        if listed is None:
            return self.record.committed
        return len(by_session(listed).get(self.record.key, []))

    def describe(self, listed: Iterable[str] | None = None) -> str:
        """One line, every string from the store escaped (a newline in a host name must not make a line);
        ``listed``: the shards ``commits/`` lists now, which its counts come from."""
        r = self.record
        who = (f"writer {escape(r.writer)} (session {escape(r.session)}, host {escape(r.host)}, pid {r.pid}, "
               f"started {escape(r.started)})")
        if self.state == "ended":
            return f"{who}: ended, {self.end.shards} shard(s), {self.end.samples} sample(s)"
        if self.state == "ending":
            return f"{who}: ended, {self.end.shards} shard(s), {self.end.samples} sample(s); {self.why}"
        if self.state == "disputed":
            return (f"{who}: its end record is not believed ({self.why}): a writer still running, or a record not "
                    "its own? Epoch 0 waits for its writer to stop and a re-run of its job to finish the store")
        if self.state == "replaced":
            return f"{who}: stopped, and a later session of {escape(r.writer)} ended"
        if self.state == "failed":
            return f"{who}: stopped on an error ({escape(r.failed)}); re-run its job to finish the store"
        planned = f" of {r.planned_samples} planned sample(s)" if r.planned_samples is not None else ""
        if self.state == "dead":
            return (f"{who}: no heartbeat for {self.silent_s:.0f}s (it beats every {r.heartbeat_s:g}s): killed or "
                    f"crashed? {self.committed(listed)} shard(s) committed{planned}; re-run its job (the same command "
                    "resumes) to finish the store")
        return (f"{who}: writing, {self.committed(listed)} shard(s) committed{planned}, last heartbeat "
                f"{self.silent_s:.0f}s ago")


def _counts_of(listed: Iterable[str] | Mapping[str, tuple[int, int]] | None
               ) -> tuple[dict[str, list[str]] | None, Mapping[str, tuple[int, int]] | None]:
    """(shards by session, shard -> (samples, tokens) or None) of what a caller knows is committed."""
    if listed is None:
        return None, None
    return by_session(listed), listed if isinstance(listed, Mapping) else None


@dataclass
class Writers:
    """Every writer session of a store, read from ``writers/`` at one moment. The rules take what is committed as
    ``listed``: shard names (their number is checked against end records), or shard -> (samples, tokens) from
    their commit records (their sums are checked too: what a follower passes)."""

    sessions: dict[str, SessionRecord]
    ends: dict[str, EndRecord]
    damaged: dict[str, str] = field(default_factory=dict)  # object -> why it was not read
    read_at: float = 0.0

    def states(self, now: float | None = None, listed: Iterable[str] | Mapping[str, tuple[int, int]] | None = None
               ) -> list[SessionState]:
        now = time.time() if now is None else now
        shards, counts = _counts_of(listed)
        verdicts: dict[str, tuple[str, str] | None] = {}
        latest_end: dict[str, float] = {}  # writer tag -> start of its latest session whose end is believed
        for key, s in self.sessions.items():
            if key in self.ends:
                verdicts[key] = end_verdict(s, self.ends[key], None if shards is None else shards.get(key, []),
                                            counts, now)
                if verdicts[key] is None:
                    latest_end[s.writer] = max(latest_end.get(s.writer, -math.inf), s.started_unix)
        out = []
        for key, s in sorted(self.sessions.items()):
            end = self.ends.get(key)
            silent, why = max(0.0, now - s.heartbeat_unix), None
            if end is not None and verdicts[key] is None:
                state, silent = "ended", 0.0
            elif latest_end.get(s.writer, -math.inf) > s.heartbeat_unix:
                state = "replaced"
            elif end is not None:
                state, why = verdicts[key]
            elif s.failed is not None:
                state = "failed"
            elif silent > STALE_BEATS * s.heartbeat_s:
                state = "dead"
            else:
                state = "open"
            out.append(SessionState(s, end, state, silent, why))
        return out

    def expected_missing(self) -> list[str]:
        """Writer tags some session's job expects that no session with an end record has (a rank not started yet;
        whether its end is believed is ``states``')."""
        ended = {self.sessions[k].writer for k in self.ends if k in self.sessions}
        expected = {t for s in self.sessions.values() for t in s.expects}
        return sorted(expected - ended)

    def finished(self, listed: Iterable[str] | Mapping[str, tuple[int, int]], now: float | None = None) -> bool:
        """Whether no more shards will come: every session ended (its end record believed, ``end_verdict``) or was
        replaced, every writer its jobs expect ended, and no record is unreadable. A store without writer records
        (written before they existed) is finished, as readers always took it to be."""
        if self.damaged:  # a record that cannot be read may be an open writer's
            return False
        if not self.sessions and not self.ends:
            return True
        return (all(s.state in ("ended", "replaced") for s in self.states(now, listed))
                and not self.expected_missing())

    def waiting_for(self, listed: Iterable[str] | Mapping[str, tuple[int, int]], now: float | None = None
                    ) -> list[str]:
        """One line per thing a follower waits for (empty once ``finished``), store strings escaped."""
        lines = [s.describe(listed) for s in self.states(now, listed) if s.state not in ("ended", "replaced")]
        started = {s.writer for s in self.sessions.values()}
        lines += [f"writer {escape(t)}: expected by its job, not started yet" for t in self.expected_missing()
                  if t not in started]
        lines += [f"{WRITERS_DIR}/{escape(n)}: {escape(why)} (fix or remove it)" for n, why in sorted(self.damaged.items())]
        return lines

    def expected_tokens(self, tokens_by_shard: dict[str, int]) -> int | None:
        """Tokens the store will hold when finished: those committed, plus what open sessions still plan to write
        (None when an open session did not say what it plans)."""
        total = sum(tokens_by_shard.values())
        mine = by_session(tokens_by_shard)
        for s in self.states():
            if s.state in ("ended", "replaced"):
                continue
            if s.record.planned_tokens is None:
                return None
            done = sum(tokens_by_shard[n] for n in mine.get(s.record.key, []))
            total += max(0, s.record.planned_tokens - done)
        return total


def _own_name(n: str, rec) -> bool:
    """Whether object ``writers/<n>`` is the one ``rec`` belongs in: a record under another session's name would
    speak for that session."""
    key = session_key(rec.writer, rec.session)
    return n == key + (END_SUFFIX if isinstance(rec, EndRecord) else SESSION_SUFFIX)


def _groups_by_size(names: list[str], sizes: dict[str, int], budget: int = READ_GROUP_BYTES) -> list[list[str]]:
    """``names`` in order, in groups whose sizes sum to at most ``budget`` (one name at least): a poll holds one
    group's bytes at a time, however many records a store lists."""
    groups: list[list[str]] = []
    total = budget
    for n in names:
        if total + sizes[n] > budget:
            groups.append([])
            total = 0
        groups[-1].append(n)
        total += sizes[n]
    return groups


def read_writers(fs, root: str, known: dict[str, tuple[str | None, Any]] | None = None) -> Writers:
    """The store's writer records: one listing of ``writers/``, then GETs of the objects not in ``known`` (object
    name -> (stamp, parsed record) of an earlier read: what a follower polling every few seconds re-reads is only
    what changed). A damaged record is named, not raised: a follower waits rather than stopping."""
    listed = listing.list_detail(fs, storage.join(root, WRITERS_DIR))
    names = sorted(n for n in listed if n.endswith(SESSION_SUFFIX) and not n.startswith("."))
    known = known if known is not None else {}
    out = Writers({}, {}, read_at=time.time())
    todo = [n for n in names if known.get(n, (None,))[0] is None or known[n][0] != listing.stamp(listed[n])]
    for group in _groups_by_size(todo, {n: listed[n].get("size") or RECORD_CAP for n in todo}):
        blobs = door.read_many(fs, root, [f"{WRITERS_DIR}/{n}" for n in group],
                               sizes={f"{WRITERS_DIR}/{n}": listed[n].get("size") or None for n in group},
                               bound=RECORD_CAP)
        for n in group:
            key = f"{WRITERS_DIR}/{n}"
            data = blobs.pop(key, None)
            try:
                if isinstance(data, Exception) or data is None:
                    raise CorruptionError(f"{key}: unreadable ({type(data).__name__}: {data})")
                d = door.load_json(data, key)
                rec = _parse(EndRecord if n.endswith(END_SUFFIX) else SessionRecord, d, key)
                if not _own_name(n, rec):
                    raise CorruptionError(f"{key}: names session {session_key(rec.writer, rec.session)!r}, not "
                                          "its own (a record under another name would speak for that session)")
            except CorruptionError as e:  # kept as read: an unchanged damaged record is not read again each poll
                rec = e
            known[n] = (listing.stamp(listed[n]), rec)
    for n in names:
        rec = known[n][1]
        if isinstance(rec, CorruptionError):
            out.damaged[n] = str(rec)
            continue
        if isinstance(rec, EndRecord):
            out.ends[session_key(rec.writer, rec.session)] = rec
        else:
            out.sessions[rec.key] = rec
    return out
