"""The store's index: copies of commit records gathered into a few segment objects under ``index/``, so that
opening a store costs a listing and a handful of GETs instead of one GET per shard (docs/FORMAT.md, "Index").

Commit records stay the source of truth; the index only saves requests. Each entry remembers the size and
stamp (ETag on object stores, mtime on local disk) that the record object had when it was copied, and a
reader uses an entry only when the listing of ``commits/`` still shows that size and stamp. So:

- a shard committed after the index was written has no entry: its record is read (the listing finds it);
- a record rewritten since (``hsstore upgrade``, a merge re-run) lists another stamp: it is read again;
- an entry whose record is not listed is ignored: the index never invents a shard;
- a segment that fails its checksum or ends early is ignored with a warning: its records are read.

Writers add segments (``StoreWriter``: one per writer session, replaced whole as it grows); ``hsstore index``
(``compact``) rewrites everything listed into one segment that supersedes the others, and removes superseded
segments once the segment that superseded them is older than a grace period (a reader that listed them just
before still finds them; one that does not falls back to the records, slower but correct).
"""

from __future__ import annotations

import gzip
import json
import logging
import time
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Any

from . import codec, storage
from .commit import CommitRecord, list_records, read_records
from .errors import CorruptionError
from .manifest import now_iso

log = logging.getLogger(__name__)

INDEX_DIR = "index"
SEGMENT_SUFFIX = ".json.gz"
FORMAT = "hsstore-index"
VERSION = 1  # of the segment format; a reader ignores (with a warning) segments of a version it does not know
DEFAULT_GRACE_S = 3600.0


@dataclass
class Listed:
    """A record object as the listing of ``commits/`` shows it."""

    size: int
    stamp: str | None


@dataclass
class Segment:
    name: str
    kind: str  # "writer" (a writer session's records) or "compacted" (``hsstore index``)
    created_at: float  # Unix time, for the grace period before superseded segments are removed
    writer: str
    supersedes: dict[str, str | None]  # segment name -> the stamp it had when superseded
    entries: list[dict[str, Any]]  # {"shard", "size", "stamp", "crc32c", "record"}


@dataclass
class IndexUse:
    """How an open used the index: what ``info`` and the benchmarks report."""

    shards: int = 0
    indexed: int = 0  # records taken from the index
    fetched: int = 0  # records read one by one (not indexed, stale, or no usable index)
    segments: int = 0  # live segments read
    superseded: int = 0  # segments listed but superseded by another
    damaged: list[str] = field(default_factory=list)  # segments ignored: checksum, truncation, unknown version
    stale: list[str] = field(default_factory=list)  # shards whose entry no longer matched the record's listing


@dataclass
class Snapshot:
    """Every committed shard's record at one moment, and where each came from."""

    records: list[CommitRecord]  # sorted by shard name
    listed: dict[str, Listed]
    entries: dict[str, dict[str, Any]]  # shard -> an entry describing its current record (for ``compact``)
    segments: dict[str, Segment]  # readable segments (live and superseded) by name
    segment_stamps: dict[str, str | None]  # every segment object listed (damaged ones too) -> stamp
    use: IndexUse


# -- segments ------------------------------------------------------------------------------------------------
def segment_name(kind: str, tag: str) -> str:
    """``<kind>-<UTC time>-<tag>-<random>.json.gz``: unique per writer session or compaction."""
    return f"{kind}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{tag}-{uuid.uuid4().hex[:8]}{SEGMENT_SUFFIX}"


def entry(data: bytes, stamp: str | None, record: dict[str, Any] | None = None) -> dict[str, Any]:
    """The index entry of a record object's bytes ``data`` (``record``: its parsed JSON, when at hand)."""
    d = json.loads(data) if record is None else record
    return {"shard": d["shard"], "size": len(data), "stamp": stamp, "crc32c": codec.crc32c(data), "record": d}


def encode_segment(kind: str, writer: str, entries: list[dict[str, Any]],
                   supersedes: dict[str, str | None] | None = None) -> bytes:
    body = {"format": FORMAT, "version": VERSION, "kind": kind, "created_at": now_iso(), "created_unix": time.time(),
            "writer": writer, "supersedes": supersedes or {}, "entries": entries}
    # gzip's trailer holds the CRC-32 and length of the JSON: a flipped byte or a cut object fails to decode
    return gzip.compress(json.dumps(body, separators=(",", ":")).encode(), compresslevel=6, mtime=0)


def decode_segment(name: str, data: bytes) -> Segment:
    """A segment from its object's bytes; ``CorruptionError`` when damaged, cut short or of an unknown version."""
    try:
        body = json.loads(gzip.decompress(data))
        if body.get("format") != FORMAT:
            raise ValueError(f"format {body.get('format')!r}")
        if body.get("version") != VERSION:
            raise ValueError(f"segment version {body.get('version')!r}, this hsstore reads {VERSION}")
        entries = body["entries"]
        if not isinstance(entries, list) or not isinstance(body["supersedes"], dict):
            raise TypeError("entries / supersedes")
        return Segment(name, str(body["kind"]), float(body["created_unix"]), str(body["writer"]),
                       dict(body["supersedes"]), entries)
    except (OSError, EOFError, zlib.error, ValueError, TypeError, KeyError, AttributeError) as e:
        raise CorruptionError(f"index segment {INDEX_DIR}/{name}: unreadable ({type(e).__name__}: {e})") from None


def write_segment(fs, root: str, name: str, data: bytes) -> str | None:
    """Publish a segment (atomic: a rename on local disk, one PUT on object stores); returns its stamp."""
    return storage.put_atomic(fs, storage.join(root, INDEX_DIR, name), data)


class SegmentAppender:
    """A writer session's own segment: the records it committed, rewritten whole every ``every`` commits
    and at ``close``, so a reader sees at most one segment per session. Failing to write it never fails the
    writer (the records are committed; readers then read them one by one)."""

    def __init__(self, fs, root: str, tag: str, every: int = 64) -> None:
        self.fs, self.root, self.tag, self.every = fs, root, tag, max(1, int(every))
        self.name = segment_name("w", tag)
        self.entries: list[dict[str, Any]] = []
        self._written = 0

    def add(self, record: CommitRecord, stamp: str | None) -> None:
        """Note a published record (``stamp``: what ``commit.publish`` returned)."""
        self.entries.append(entry(record.to_json(), stamp))
        if len(self.entries) - self._written >= self.every:
            self.flush()

    def flush(self) -> None:
        if len(self.entries) == self._written:
            return
        try:
            write_segment(self.fs, self.root, self.name, encode_segment("writer", self.tag, list(self.entries)))
            self._written = len(self.entries)
        except Exception as e:  # the shards are committed either way
            log.warning("could not write index segment %s/%s (%s: %s); readers read these %d records one by one "
                        "until `hsstore index` runs", INDEX_DIR, self.name, type(e).__name__, e, len(self.entries))


# -- reading ------------------------------------------------------------------------------------------------
def listed_records(fs, root: str) -> dict[str, Listed]:
    """Shard name -> size and stamp of its commit record, from one (paged) listing of ``commits/``."""
    return {name: Listed(int(e.get("size") or 0), storage.stamp(e)) for name, e in list_records(fs, root).items()}


def read_segments(fs, root: str, use: IndexUse) -> tuple[dict[str, Segment], dict[str, str | None]]:
    """(readable segments by name, stamp of every segment object listed). Damaged ones are named in ``use``."""
    listing = {b: e for b, e in storage.list_detail(fs, storage.join(root, INDEX_DIR)).items()
               if b.endswith(SEGMENT_SUFFIX) and not b.startswith(".")}
    stamps = {b: storage.stamp(e) for b, e in listing.items()}
    names = sorted(listing)
    paths = [storage.join(root, INDEX_DIR, b) for b in names]
    blobs = storage.cat_many(fs, paths, [int(listing[b].get("size") or 0) for b in names])
    segments = {}
    for b, p in zip(names, paths):
        data = blobs[p]
        if isinstance(data, FileNotFoundError):  # removed since the listing (superseded): not needed
            log.debug("index segment %s gone since listed", b)
            continue
        try:
            if isinstance(data, Exception):
                raise CorruptionError(f"index segment {INDEX_DIR}/{b}: unreadable ({type(data).__name__}: {data})")
            segments[b] = decode_segment(b, data)
        except CorruptionError as e:
            log.warning("%s; ignored (its records are read from commits/; `hsstore index` rewrites the index)", e)
            use.damaged.append(b)
    return segments, stamps


def live_segments(segments: dict[str, Segment], stamps: dict[str, str | None]) -> list[Segment]:
    """Segments no readable segment supersedes in the version listed (a writer's segment rewritten after a
    compaction superseded it is live again: it holds records the compaction had not seen)."""
    gone = {name for s in segments.values() for name, st in s.supersedes.items() if stamps.get(name, 0) == st}
    return [s for name, s in sorted(segments.items()) if name not in gone]


def load(fs, root: str, use_index: bool = True) -> Snapshot:
    """Every committed shard's record: one listing of ``commits/``, the index's segments, and GETs (concurrent)
    of the records that no live segment holds in the version listed."""
    listed = listed_records(fs, root)
    use = IndexUse(shards=len(listed))
    segments, seg_stamps = read_segments(fs, root, use) if use_index else ({}, {})
    live = live_segments(segments, seg_stamps)
    use.segments, use.superseded = len(live), len(segments) - len(live)
    candidates: dict[str, list[dict[str, Any]]] = {}
    for seg in live:
        for e in seg.entries:
            if isinstance(e, dict) and e.get("shard") in listed:  # an entry without a listed record: ignored
                candidates.setdefault(e["shard"], []).append(e)
    found: dict[str, CommitRecord] = {}
    entries: dict[str, dict[str, Any]] = {}
    for name, cands in candidates.items():
        now = listed[name]
        for e in cands:
            if now.stamp is None or e.get("stamp") != now.stamp or e.get("size") != now.size:
                continue
            try:
                rec = CommitRecord.from_dict(e.get("record"), where=f"index entry of shard {name!r}")
            except CorruptionError as err:
                log.warning("%s; read from its commit record instead", err)
                continue
            if rec.shard == name:
                found[name], entries[name] = rec, e
                break
        else:
            use.stale.append(name)
    missing = sorted(set(listed) - set(found))
    for name, data in zip(missing, read_records(fs, root, missing, [listed[n].size for n in missing])):
        where = f"commit record of shard {name!r}"
        try:
            d = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CorruptionError(f"{where}: malformed commit record ({type(err).__name__}: {err})") from None
        found[name] = CommitRecord.from_dict(d, where=where)
        entries[name] = entry(data, listed[name].stamp, d)
    use.indexed, use.fetched = len(listed) - len(missing), len(missing)
    if use.stale:
        log.info("index: %d entr%s outdated (records rewritten since), read from commits/", len(use.stale),
                 "y" if len(use.stale) == 1 else "ies")
    return Snapshot([found[n] for n in sorted(found)], listed, entries, segments, seg_stamps, use)


# -- compaction ---------------------------------------------------------------------------------------------
@dataclass
class CompactResult:
    segment: str
    shards: int
    fetched: int  # records read one by one because no segment held them
    superseded: int  # segment objects the new one supersedes
    removed: list[str]  # superseded segments removed (past the grace period)
    damaged: list[str]


def compact(fs, root: str, grace_s: float = DEFAULT_GRACE_S) -> CompactResult:
    """``hsstore index``: one segment holding every listed record, superseding every segment listed; then
    remove segments superseded by a segment older than ``grace_s`` (0: also those superseded right now)."""
    snap = load(fs, root)
    name = segment_name("c", "index")
    entries = [snap.entries[n] for n in sorted(snap.entries)]
    write_segment(fs, root, name, encode_segment("compacted", "hsstore index", entries, dict(snap.segment_stamps)))
    now = time.time()
    mine = Segment(name, "compacted", now, "hsstore index", dict(snap.segment_stamps), [])
    removed = []
    for seg in [*snap.segments.values(), mine]:
        if now - seg.created_at < grace_s:
            continue
        for old, st in seg.supersedes.items():
            if old in removed or old == name or snap.segment_stamps.get(old, 0) != st:
                continue  # gone already, or rewritten since (a writer's segment that grew): keep
            try:
                fs.rm_file(storage.join(root, INDEX_DIR, old))
                removed.append(old)
            except FileNotFoundError:
                pass
    log.info("index: %d records in %s/%s; %d segment(s) superseded, %d removed", len(entries), INDEX_DIR, name,
             len(snap.segment_stamps), len(removed))
    return CompactResult(name, len(entries), snap.use.fetched, len(snap.segment_stamps), removed, snap.use.damaged)
