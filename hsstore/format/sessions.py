"""Writer sessions: who writes a store, and whether each writer finished (docs/FORMAT.md, "Writer sessions").

A commit record says that its shard is there, never that no more are coming. A reader that trains while the
store is written (``--follow``) must know when it is complete, and a writer that crashed or was killed must not
pass for one that finished. So every ``StoreWriter`` session records itself under ``writers/``: a session
record when it opens (rewritten as its heartbeat while it writes) and an end record once it closed cleanly,
every shard committed. A killed writer leaves a session record whose heartbeat stops; a failed one rewrites it
with the error. ``Writers.finished`` is the rule a follower ends epoch 0 by.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from .. import env
from ..io import door, listing, storage, transfer
from ..errors import CorruptionError
from ..terminal import escape
from .manifest import MAX_TEXT, is_int, now_iso

WRITERS_DIR = "writers"
FORMAT = "hsstore-writer"
VERSION = 1
SESSION_SUFFIX = ".json"
END_SUFFIX = ".end.json"
RECORD_CAP = 4 << 20  # a session record lists its job's writer tags: 1e5 ranks fit
STALE_BEATS = 4  # a session that missed this many heartbeats is reported as dead (a follower keeps waiting)


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


def _parse(cls, d: Any, where: str):
    """A record of ``cls`` from parsed JSON, every field of its type (it comes from the store: untrusted)."""
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise CorruptionError(f"{where}: not a writer record (format {FORMAT!r})")
    if not is_int(d.get("version")) or d["version"] > VERSION:
        raise CorruptionError(f"{where}: writer record version {d.get('version')!r}, this hsstore reads {VERSION}")
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


# -- reading and the rule -------------------------------------------------------------------------------------
@dataclass
class SessionState:
    """One session as a follower sees it: ``state`` is ``ended``, ``replaced`` (a later session of its writer
    tag ended: a re-run did its remaining work), ``failed``, ``dead`` (its heartbeat stopped) or ``open``."""

    record: SessionRecord
    end: EndRecord | None
    state: str
    silent_s: float  # seconds since its last heartbeat (0 once ended)

    def describe(self) -> str:
        r = self.record
        # the record's strings escaped: a host or writer name with a newline must not start a line of its own
        who = escape(f"writer {r.writer} (session {r.session}, host {r.host}, pid {r.pid}, started {r.started})")
        if self.state == "ended":
            return f"{who}: ended, {self.end.shards} shard(s), {self.end.samples} sample(s)"
        if self.state == "replaced":
            return f"{who}: stopped, and a later session of {r.writer} ended"
        if self.state == "failed":
            return f"{who}: stopped on an error ({escape(r.failed)}); re-run its job to finish the store"
        planned = f" of {r.planned_samples} planned sample(s)" if r.planned_samples is not None else ""
        if self.state == "dead":
            return (f"{who}: no heartbeat for {self.silent_s:.0f}s (it beats every {r.heartbeat_s:g}s): killed or "
                    f"crashed? {r.committed} shard(s) committed{planned}; re-run its job (the same command resumes) "
                    "to finish the store")
        return f"{who}: writing, {r.committed} shard(s) committed{planned}, last heartbeat {self.silent_s:.0f}s ago"


@dataclass
class Writers:
    """Every writer session of a store, read from ``writers/`` at one moment."""

    sessions: dict[str, SessionRecord]
    ends: dict[str, EndRecord]
    damaged: dict[str, str] = field(default_factory=dict)  # object -> why it was not read
    read_at: float = 0.0

    def states(self, now: float | None = None) -> list[SessionState]:
        now = time.time() if now is None else now
        latest_end: dict[str, float] = {}  # writer tag -> start of its latest ended session
        for key, s in self.sessions.items():
            if key in self.ends:
                latest_end[s.writer] = max(latest_end.get(s.writer, -math.inf), s.started_unix)
        out = []
        for key, s in sorted(self.sessions.items()):
            end = self.ends.get(key)
            silent = max(0.0, now - s.heartbeat_unix)
            if end is not None:
                state, silent = "ended", 0.0
            elif latest_end.get(s.writer, -math.inf) > s.heartbeat_unix:
                state = "replaced"
            elif s.failed is not None:
                state = "failed"
            elif silent > STALE_BEATS * s.heartbeat_s:
                state = "dead"
            else:
                state = "open"
            out.append(SessionState(s, end, state, silent))
        return out

    def expected_missing(self) -> list[str]:
        """Writer tags some session's job expects that no ended session has (a rank not started yet)."""
        ended = {self.sessions[k].writer for k in self.ends if k in self.sessions}
        expected = {t for s in self.sessions.values() for t in s.expects}
        return sorted(expected - ended)

    def unseen(self, listed: set[str]) -> list[str]:
        """Ended sessions whose committed shards the listing ``listed`` (shard names) does not show yet."""
        out = []
        for key, end in self.ends.items():
            prefix = key + "-"
            if sum(1 for n in listed if n.startswith(prefix)) < end.shards:
                out.append(key)
        return sorted(out)

    def finished(self, listed: set[str], now: float | None = None) -> bool:
        """Whether no more shards will come: every session ended or was replaced, every writer its jobs expect
        ended, the listing shows every shard the ended sessions committed, and no record is unreadable. A store
        without writer records (written before they existed) is finished, as readers always took it to be."""
        if self.damaged:  # a record that cannot be read may be an open writer's
            return False
        if not self.sessions and not self.ends:
            return True
        return (all(s.state in ("ended", "replaced") for s in self.states(now)) and not self.expected_missing()
                and not self.unseen(listed))

    def waiting_for(self, listed: set[str], now: float | None = None) -> list[str]:
        """One line per thing a follower waits for (empty once ``finished``)."""
        lines = [s.describe() for s in self.states(now) if s.state not in ("ended", "replaced")]
        started = {s.writer for s in self.sessions.values()}
        lines += [f"writer {t}: expected by its job, not started yet" for t in self.expected_missing()
                  if t not in started]
        lines += [f"session {k}: ended, its shards not all listed yet" for k in self.unseen(listed)]
        lines += [f"{WRITERS_DIR}/{n}: {why} (fix or remove it)" for n, why in sorted(self.damaged.items())]
        return [escape(line) for line in lines]  # tags, keys and names are the store's strings

    def expected_tokens(self, tokens_by_shard: dict[str, int]) -> int | None:
        """Tokens the store will hold when finished: those committed, plus what open sessions still plan to write
        (None when an open session did not say what it plans)."""
        total = sum(tokens_by_shard.values())
        for s in self.states():
            if s.state in ("ended", "replaced"):
                continue
            if s.record.planned_tokens is None:
                return None
            prefix = s.record.key + "-"
            done = sum(t for n, t in tokens_by_shard.items() if n.startswith(prefix))
            total += max(0, s.record.planned_tokens - done)
        return total


def read_writers(fs, root: str, known: dict[str, tuple[str | None, Any]] | None = None) -> Writers:
    """The store's writer records: one listing of ``writers/``, then GETs of the objects not in ``known`` (object
    name -> (stamp, parsed record) of an earlier read: what a follower polling every few seconds re-reads is only
    what changed). A damaged record is named, not raised: a follower waits rather than stopping."""
    listed = listing.list_detail(fs, storage.join(root, WRITERS_DIR))
    names = sorted(n for n in listed if n.endswith(SESSION_SUFFIX) and not n.startswith("."))
    known = known if known is not None else {}
    out = Writers({}, {}, read_at=time.time())
    todo = [n for n in names if known.get(n, (None,))[0] is None or known[n][0] != listing.stamp(listed[n])]
    blobs = door.read_many(fs, root, [f"{WRITERS_DIR}/{n}" for n in todo],
                           sizes={f"{WRITERS_DIR}/{n}": listed[n].get("size") or None for n in todo},
                           bound=RECORD_CAP) if todo else {}
    for n in names:
        key = f"{WRITERS_DIR}/{n}"
        if n in todo:
            data = blobs.get(key)
            try:
                if isinstance(data, Exception) or data is None:
                    raise CorruptionError(f"{key}: unreadable ({type(data).__name__}: {data})")
                d = door.load_json(data, key)
                rec = _parse(EndRecord if n.endswith(END_SUFFIX) else SessionRecord, d, key)
            except CorruptionError as e:
                out.damaged[n] = str(e)
                continue
            known[n] = (listing.stamp(listed[n]), rec)
        rec = known[n][1]
        if isinstance(rec, EndRecord):
            out.ends[session_key(rec.writer, rec.session)] = rec
        else:
            out.sessions[rec.key] = rec
    return out
