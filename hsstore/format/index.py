"""The store's index: copies of commit records gathered into a few segment objects under ``index/``, so that
opening a store costs a listing and a handful of GETs instead of one GET per shard (docs/FORMAT.md, "Index").

Commit records stay the source of truth; the index only saves requests. Each entry remembers the size, stamp
(ETag on object stores, mtime on local disk) and CRC32C that the record object had when it was copied; an entry
is the record's while it holds the same bytes, which the listing shows without a read through its size and
stamp (an ETag is the bytes' MD5; an mtime only a file time). A reader uses an entry unread while the listing
shows that size and stamp; a record listed with the entry's size but another stamp is read, as any record no
entry vouches for is, and its CRC32C then says whether the entry still holds it. So:

- a shard committed after the index was written has no entry: its record is read (the listing finds it);
- a record rewritten since (``hsstore upgrade``, a merge re-run) lists another stamp: it is read again, and the
  entry is outdated (``IndexUse.stale``) unless the bytes are the same;
- a store copied with ``cp -r`` lists new file times for the same bytes: its records are read once, and its
  entries count as the records' (``IndexUse.restamped``; ``verify`` does not call those shards unindexed, and
  ``hsstore index`` restamps them, so later opens read none);
- an entry whose record is not listed is ignored: the index never invents a shard;
- a segment that fails its checksum or ends early is ignored with a warning: its records are read.

Segments of version 2 (what this hsstore writes) hold the records as columns (what opening, ``info`` and the
loader's catalog read) plus each record's own bytes in zstd blocks, parsed only when a shard is read or checked
(``records.RecordTable``); version 1 segments (gzip'd JSON of whole records) are still read.

Writers add segments (``StoreWriter``: one per writer session, replaced whole as it grows); ``hsstore index``
(``compact``) rewrites everything listed into one segment that supersedes the others, and removes superseded
segments once the segment that superseded them is older than a grace period (a reader that listed them just
before still finds them; one that does not falls back to the records, slower but correct).
"""

from __future__ import annotations

import json
import logging
import struct
import time
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import codec, names, records
from ..io import door, listing, storage, transfer
from .commit import COMMITS_DIR, CommitRecord, commit_path, list_records, read_records
from ..errors import CorruptionError, StoreError
from .manifest import now_iso
from .records import RecordTable

log = logging.getLogger(__name__)

INDEX_DIR = "index"
SEGMENT_SUFFIX = ".idx"  # a version-2 segment's name ends so (older hsstore lists only SUFFIXES[1:]: ignores it)
SUFFIXES = (SEGMENT_SUFFIX, ".json.gz")  # version 1's: ".json.gz"
FORMAT = "hsstore-index"
VERSION = 2  # of the segment format written; a reader ignores (with a warning) segments of a version it does not know
READS = (1, 2)
MAGIC = b"HSSIDX2\n"  # a version-2 segment's first bytes (version 1: gzip's 1f 8b)
DEFAULT_GRACE_S = 3600.0
V1_MAX_EXPANSION = 32  # gzip'd JSON records: well above what a writer's segment reaches (docs/PERFORMANCE.md)
LIST_SPLIT = 1000  # parallel listing: one range per this many shards known from the index (one LIST page each)


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
    table: RecordTable  # its entries (a version-1 segment's converted)
    version: int = VERSION


@dataclass
class IndexUse:
    """How an open used the index: what ``info`` and the benchmarks report."""

    shards: int = 0
    indexed: int = 0  # records taken from the index
    fetched: int = 0  # records read one by one (not indexed, stale, or no usable index)
    segments: int = 0  # live segments read
    superseded: int = 0  # segments listed but superseded by another
    damaged: list[str] = field(default_factory=list)  # segments ignored: checksum, truncation, unknown version
    why: dict[str, str] = field(default_factory=dict)  # damaged segment -> why (a refused name is named)
    stale: list[str] = field(default_factory=list)  # shards whose entries hold other bytes than their records
    restamped: list[str] = field(default_factory=list)  # listed with another stamp, same bytes as their entry


@dataclass
class Snapshot:
    """Every committed shard's record at one moment, and where each came from."""

    table: RecordTable  # sorted by shard name; its stamps are the listed ones
    listed: dict[str, Listed]
    segments: dict[str, Segment]  # readable segments (live and superseded) by name
    segment_stamps: dict[str, str | None]  # every segment object listed (damaged ones too) -> stamp
    use: IndexUse
    origin: "Origin | None" = None
    damaged: dict[str, str] = field(default_factory=dict)  # shard -> why its listed record does not parse


@dataclass
class Origin:
    """Which live segment each row of a snapshot's table came from (-1: read from ``commits/``)."""

    codes: np.ndarray  # int32 [rows]
    segments: list[str]

    def of(self, row: int) -> str | None:
        k = int(self.codes[row])
        return None if k < 0 else self.segments[k]

    @property
    def records(self) -> records.Records:
        return records.Records(self.table)


# -- segments ------------------------------------------------------------------------------------------------
def segment_name(kind: str, tag: str) -> str:
    """``<kind>-<UTC time>-<tag>-<random>.idx``: unique per writer session or compaction."""
    return f"{kind}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{tag}-{uuid.uuid4().hex[:8]}{SEGMENT_SUFFIX}"


def table_of(items: list[tuple[bytes, str | None]]) -> RecordTable:
    """The table of record objects' bytes (each with its stamp), parsed with every check."""
    parsed = []
    for data, st in items:
        rec = CommitRecord.from_json(data, where="commit record")
        parsed.append((rec, data, st, codec.crc32c(data)))
    return records.from_records(parsed)


def encode_segment(kind: str, writer: str, table: RecordTable, supersedes: dict[str, str | None] | None = None,
                   repack: bool = True) -> bytes:
    """A version-2 segment (docs/FORMAT.md, "Index"): magic, header length, JSON header, the zstd'd columns,
    the zstd'd record blocks, CRC32C of all before it. ``repack``: rebuild the blocks in row order (a table
    gathered from several segments)."""
    if repack or table.trimmed():  # (a reader bounds each block by its rows: a trimmed block is rebuilt)
        blocks, block, offset = records.pack(records.raws(table))
        table = RecordTable(**{**table.__dict__, "blocks": blocks, "block": block, "offset": offset,
                               "_starts": None, "_block_sizes": None})
    desc, arrays = records.table_header(table)
    columns = records.compress(b"".join(a.tobytes() for a in arrays))
    header = {"format": FORMAT, "version": VERSION, "kind": kind, "created_at": now_iso(),
              "created_unix": time.time(), "writer": writer, "supersedes": supersedes or {}, "table": desc,
              "columns_bytes": len(columns), "blocks_bytes": [len(b) for b in table.blocks]}
    hb = json.dumps(header, separators=(",", ":")).encode()
    body = b"".join([MAGIC, struct.pack("<I", len(hb)), hb, columns, *table.blocks])
    return body + struct.pack("<I", codec.crc32c(body))


def decode_segment(name: str, data: bytes) -> Segment:
    """A segment from its object's bytes; ``CorruptionError`` when damaged, cut short or of an unknown version."""
    try:
        if bytes(data[:2]) == b"\x1f\x8b":
            return _decode_v1(name, data)
        if bytes(data[:len(MAGIC)]) != MAGIC:
            raise ValueError(f"starts with {bytes(data[:8])!r}: neither a version-1 nor a version-2 segment")
        if len(data) < len(MAGIC) + 8 or struct.unpack("<I", data[-4:])[0] != codec.crc32c(data[:-4]):
            raise ValueError("checksum mismatch (damaged or cut short)")
        (hl,) = struct.unpack("<I", data[len(MAGIC):len(MAGIC) + 4])
        pos = len(MAGIC) + 4
        header = door.load_json(bytes(data[pos:pos + hl]), f"index segment {INDEX_DIR}/{name}: header")
        pos += hl
        if header.get("format") != FORMAT:
            raise ValueError(f"format {header.get('format')!r}")
        if header.get("version") not in READS:
            raise ValueError(f"segment version {header.get('version')!r}, this hsstore reads {READS}")
        cb = int(header["columns_bytes"])
        declared = sum(int(np.prod(shape)) * np.dtype(dt).itemsize for _, dt, shape in header["table"]["arrays"])
        columns = records.decompress(bytes(data[pos:pos + cb]), declared, where=f"{INDEX_DIR}/{name}: columns")
        pos += cb
        blocks = []
        for n in header["blocks_bytes"]:
            blocks.append(bytes(data[pos:pos + int(n)]))
            pos += int(n)
        if pos != len(data) - 4:
            raise ValueError("length does not add up")
        _check_supersedes(name, header["supersedes"])
        table = records.table_from(header["table"], columns, blocks)
        return Segment(name, str(header["kind"]), float(header["created_unix"]), str(header["writer"]),
                       dict(header["supersedes"]), table, int(header["version"]))
    except CorruptionError:
        raise
    except StoreError as e:  # a name refused
        raise CorruptionError(str(e)) from None
    except Exception as e:  # any damage the checksum missed must not escape as anything but "damaged"
        raise CorruptionError(f"index segment {INDEX_DIR}/{name}: unreadable ({type(e).__name__}: {e})") from None


def _check_supersedes(name: str, supersedes: Any) -> None:
    """A segment's ``supersedes`` names other segments of ``index/``: each must be one segment name
    (``names.part``, a segment suffix), never a path (``hsstore index`` removes what it names)."""
    if not isinstance(supersedes, dict):
        raise TypeError("supersedes")
    for old in supersedes:
        names.part(old, "superseded segment name", f"index segment {INDEX_DIR}/{name}")
        if not old.endswith(SUFFIXES) or old.startswith("."):
            raise CorruptionError(f"index segment {INDEX_DIR}/{name}: superseded segment name {old!r} refused "
                                  "(not an index segment name)")


def check_segment_head(key: str, head: bytes, size: int) -> None:
    """A large segment's first bytes, read before the rest is asked for (``door.read_many``'s ``check_head``): a
    version-2 segment's magic and header, whose lengths must add up to the ``size`` listed; ``CorruptionError``
    otherwise, so junk planted in ``index/`` costs its first bytes, not all of them at whatever rate its server
    keeps to. (A version-1 segment, gzip, says its length only at its end.)"""
    name = key.rsplit("/", 1)[-1]
    where = f"index segment {INDEX_DIR}/{name}"
    if bytes(head[:2]) == b"\x1f\x8b":
        return
    if bytes(head[:len(MAGIC)]) != MAGIC or len(head) < len(MAGIC) + 4:
        raise CorruptionError(f"{where}: starts with {bytes(head[:8])!r}, not a segment (its other "
                              f"{size - len(head):,} bytes not read)")
    (hl,) = struct.unpack("<I", head[len(MAGIC):len(MAGIC) + 4])
    pos = len(MAGIC) + 4
    if pos + hl > len(head):
        raise CorruptionError(f"{where}: a header of {hl:,} bytes, past the first {len(head):,} (not read further)")
    try:
        header = door.load_json(bytes(head[pos:pos + hl]), f"{where}: header")
        total = pos + hl + int(header["columns_bytes"]) + sum(int(n) for n in header["blocks_bytes"]) + 4
    except CorruptionError:
        raise
    except Exception as e:  # any other shape: not a segment
        raise CorruptionError(f"{where}: unreadable header ({type(e).__name__}: {e})") from None
    if total != size:
        raise CorruptionError(f"{where}: its header adds up to {total:,} bytes, the listing says {size:,} (the rest "
                              "not read)")


def gunzip_bounded(name: str, data: bytes) -> bytes:
    """A version-1 segment's JSON, decompressed at most ``V1_MAX_EXPANSION`` times its size (gzip reaches ~1000x:
    a 3 MB hostile segment would otherwise become gigabytes before ``json.loads``), and refused when it differs
    from the size its gzip trailer declares."""
    limit = V1_MAX_EXPANSION * len(data) + 4096
    d = zlib.decompressobj(wbits=31)  # gzip framing
    out = d.decompress(data, limit)
    if d.unconsumed_tail or not d.eof:
        raise CorruptionError(f"index segment {INDEX_DIR}/{name}: gzip of {len(data):,} bytes expands past "
                              f"{limit:,} bytes (a version-1 segment holds JSON records: refused)")
    if len(data) < 4 or len(out) % (1 << 32) != struct.unpack("<I", data[-4:])[0]:
        raise CorruptionError(f"index segment {INDEX_DIR}/{name}: gzip length differs from its trailer's")
    return out


def _decode_v1(name: str, data: bytes) -> Segment:
    """A version-1 segment: gzip'd JSON whose entries hold whole records (gzip's trailer: CRC-32 and length)."""
    body = door.load_json(gunzip_bounded(name, data), f"index segment {INDEX_DIR}/{name}")
    if body.get("format") != FORMAT:
        raise ValueError(f"format {body.get('format')!r}")
    if body.get("version") != 1:
        raise ValueError(f"segment version {body.get('version')!r} in a gzip'd segment, this hsstore reads {READS}")
    entries = body["entries"]
    if not isinstance(entries, list):
        raise TypeError("entries")
    _check_supersedes(name, body["supersedes"])
    items = []
    for e in entries:  # an unusable entry is skipped: its record is read from commits/
        try:
            rec = CommitRecord.from_dict(e["record"], where=f"index entry of shard {e.get('shard')!r}")
            if rec.shard != e["shard"]:
                raise CorruptionError(f"index entry of shard {e['shard']!r} holds shard {rec.shard!r}")
            items.append((rec, rec.to_json(), e.get("stamp"), int(e["crc32c"]), int(e["size"])))
        except (CorruptionError, TypeError, KeyError, ValueError) as err:
            log.warning("index segment %s/%s: %s; read from its commit record instead", INDEX_DIR, name, err)
    return Segment(name, str(body["kind"]), float(body["created_unix"]), str(body["writer"]),
                   dict(body["supersedes"]), records.from_records(items), 1)


def write_segment(fs, root: str, name: str, data: bytes) -> str | None:
    """Publish a segment (atomic: a rename on local disk, one PUT on object stores); returns its stamp. One
    larger than readers take (``door.INDEX_SEGMENT_CAP``) is refused: they would ignore it."""
    if len(data) > door.INDEX_SEGMENT_CAP:
        raise StoreError(f"index segment {INDEX_DIR}/{name}: {len(data):,} bytes, over the {door.INDEX_SEGMENT_CAP:,} "
                         "readers take; not written (readers read the commit records)")
    return transfer.put_atomic(fs, storage.join(root, INDEX_DIR, name), data, root)


class SegmentAppender:
    """A writer session's own segment: the records it committed, rewritten whole every ``every`` commits
    and at ``close``, so a reader sees at most one segment per session. Failing to write it never fails the
    writer (the records are committed; readers then read them one by one)."""

    def __init__(self, fs, root: str, tag: str, every: int = 64) -> None:
        self.fs, self.root, self.tag, self.every = fs, root, tag, max(1, int(every))
        self.name = segment_name("w", tag)
        self.entries: list[tuple[CommitRecord, bytes, str | None, int]] = []
        self._written = 0

    def add(self, record: CommitRecord, stamp: str | None) -> None:
        """Note a published record (``stamp``: what ``commit.publish`` returned)."""
        data = record.to_json()
        self.entries.append((record, data, stamp, codec.crc32c(data)))
        if len(self.entries) - self._written >= self.every:
            self.flush()

    def flush(self) -> None:
        if len(self.entries) == self._written:
            return
        try:
            data = encode_segment("writer", self.tag, records.from_records(self.entries), repack=False)
            write_segment(self.fs, self.root, self.name, data)
            self._written = len(self.entries)
        except Exception as e:  # the shards are committed either way
            log.warning("could not write index segment %s/%s (%s: %s); readers read these %d records one by one "
                        "until `hsstore index` runs", INDEX_DIR, self.name, type(e).__name__, e, len(self.entries))


# -- reading ------------------------------------------------------------------------------------------------
def listed_records(fs, root: str, known: list[str] | None = None) -> dict[str, Listed]:
    """Shard name -> size and stamp of its commit record, from one listing of ``commits/``. ``known`` (sorted
    shard names, from the index) cuts it into ranges that a backend listing ranges concurrently lists so (S3;
    ``listing.list_detail_split``; the others list it whole); the listing is the same either way."""
    splits = [f"{n}.json" for n in (known or [])[LIST_SPLIT - 1:-1:LIST_SPLIT]]  # LIST_SPLIT keys a range: a page
    if splits:
        listed = listing.list_detail_split(fs, storage.join(root, COMMITS_DIR), splits)
        listed = {b[: -len(".json")]: e for b, e in listed.items() if b.endswith(".json") and not b.startswith(".")}
    else:
        listed = list_records(fs, root)
    return {name: Listed(int(e.get("size") or 0), listing.stamp(e)) for name, e in listed.items()}


def read_segments(fs, root: str, use: IndexUse) -> tuple[dict[str, Segment], dict[str, str | None]]:
    """(readable segments by name, stamp of every segment object listed). Damaged ones are named in ``use``."""
    listed = {b: e for b, e in listing.list_detail(fs, storage.join(root, INDEX_DIR)).items()
               if b.endswith(SUFFIXES) and not b.startswith(".")}
    stamps = {b: listing.stamp(e) for b, e in listed.items()}
    names = sorted(listed)
    total = sum(int(e.get("size") or 0) for e in listed.values())
    if total > door.INDEX_TOTAL_CAP:  # read at once, they would take that much memory: a hostile index costs none
        log.warning("index segments of %s: %d listed, %s bytes in all, over the bound of %s; ignored (records are "
                    "read from commits/; `hsstore index` compacts the index)", root, len(names), f"{total:,}",
                    f"{door.INDEX_TOTAL_CAP:,}")
        use.damaged.extend(names)
        use.why.update({b: f"the index's {total:,} bytes exceed {door.INDEX_TOTAL_CAP:,}" for b in names})
        return {}, stamps
    keys = [f"{INDEX_DIR}/{b}" for b in names]
    blobs = door.read_many(fs, root, keys, sizes={k: listed[b].get("size") or None for k, b in zip(keys, names)},
                           bound=door.INDEX_SEGMENT_CAP, check_head=check_segment_head)
    segments = {}
    for b, k in zip(names, keys):
        data = blobs[k]
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
            use.why[b] = str(e)
    return segments, stamps


def live_segments(segments: dict[str, Segment], stamps: dict[str, str | None]) -> list[Segment]:
    """Segments no readable segment supersedes in the version listed (a writer's segment rewritten after a
    compaction superseded it is live again: it holds records the compaction had not seen)."""
    gone = {name for s in segments.values() for name, st in s.supersedes.items()
            if name in stamps and stamps[name] == st}
    return [s for name, s in sorted(segments.items()) if name not in gone]


def usable_entries(live: list[Segment], listed: dict[str, Listed]) -> tuple[dict[str, tuple[int, int]], set[str]]:
    """(shard -> (segment number in ``live``, row) of the entry readers use, shards that have entries but none
    that matches the listing). An entry is used only when its record is listed with the size and stamp it
    recorded: the index never invents a shard and never serves a record rewritten since."""
    found: dict[str, tuple[int, int]] = {}
    seen: set[str] = set()
    for k, seg in enumerate(live):
        t = seg.table
        for row, (name, st, size) in enumerate(zip(t.shard.tolist(), t.stamp.tolist(), t.size.tolist())):
            now = listed.get(name)
            if now is None or name in found:  # not listed (never invented), or taken from an earlier segment
                continue
            seen.add(name)
            if now.stamp is not None and st == now.stamp and size == now.size:
                found[name] = (k, row)
    return found, seen - set(found)


def entry_checksums(live: list[Segment], listed: dict[str, Listed], shards: set[str]) -> dict[str, set[int]]:
    """Shard -> the CRC32Cs of its entries whose size its listing shows (of ``shards``, those no entry matched by
    stamp): a record read with one of them holds the bytes that entry was copied from."""
    out: dict[str, set[int]] = {}
    for seg in live:
        t = seg.table
        for name, size, crc in zip(t.shard.tolist(), t.size.tolist(), t.crc32c.tolist()):
            if name in shards and listed[name].size == size:
                out.setdefault(name, set()).add(int(crc))
    return out


def load(fs, root: str, use_index: bool = True) -> Snapshot:
    """Every committed shard's record: the index's segments, one listing of ``commits/`` (ranges of it
    concurrently on object stores), and GETs (concurrent) of the records that no live segment holds in the
    version listed."""
    use = IndexUse()
    segments, seg_stamps = read_segments(fs, root, use) if use_index else ({}, {})
    live = live_segments(segments, seg_stamps)
    known = sorted({n for s in live for n in s.table.shard.tolist()}) if live else None
    listed = listed_records(fs, root, known)
    use.shards = len(listed)
    use.segments, use.superseded = len(live), len(segments) - len(live)
    found, stale = usable_entries(live, listed)
    vouched = entry_checksums(live, listed, stale)
    missing = sorted(set(listed) - set(found))
    fetched, damaged = [], {}
    for name, data in zip(missing, read_records(fs, root, missing, [listed[n].size for n in missing])):
        try:  # a record that does not parse is held aside, named with its field: readers refuse the store
            rec = parse_listed(name, data)
        except CorruptionError as e:
            damaged[name] = str(e)
            continue
        crc = codec.crc32c(data)
        if crc in vouched.get(name, ()):  # another stamp, the same bytes (a copied store)
            use.restamped.append(name)
        fetched.append((rec, data, listed[name].stamp, crc))
    use.stale = sorted(stale - set(use.restamped))
    parts, origin = [], []
    for k, seg in enumerate(live):
        rows = sorted(r for kk, r in found.values() if kk == k)
        if rows:
            parts.append(seg.table if rows == list(range(len(seg.table))) else seg.table.take(np.array(rows)))
            origin.append(np.full(len(rows), k, np.int32))
    parts.append(records.from_records(fetched))
    origin.append(np.full(len(fetched), -1, np.int32))
    table = records.concat(parts)
    codes = np.concatenate(origin)
    shards = table.shard.tolist()
    order = sorted(range(len(shards)), key=shards.__getitem__)
    if order != list(range(len(shards))):
        table = table.take(np.array(order, np.int64))
        codes = codes[np.array(order, np.int64)]
    use.indexed, use.fetched = len(listed) - len(missing), len(missing)
    if use.stale:
        log.info("index: %d entr%s outdated (records rewritten since), read from commits/", len(use.stale),
                 "y" if len(use.stale) == 1 else "ies")
    if use.restamped:
        log.info("index: %d record(s) listed with other file times than their entries but the same bytes (a copied "
                 "store), read from commits/; `hsstore index` restamps them", len(use.restamped))
    return Snapshot(table, listed, segments, seg_stamps, use, Origin(codes, [s.name for s in live]), damaged)


def parse_listed(name: str, data: bytes) -> CommitRecord:
    """The record object ``commits/<name>.json`` parsed with every check; it must name its own shard."""
    where = f"commit record {commit_path(name)}"
    rec = CommitRecord.from_json(data, where=where)
    if rec.shard != name:
        raise CorruptionError(f"{where}: field 'shard' names shard {rec.shard!r}")
    return rec


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
    if snap.damaged:  # nothing is written over a record that does not parse
        raise CorruptionError(snap.damaged[min(snap.damaged)])
    table, junk = checked_table(fs, root, snap)
    name = segment_name("c", "index")
    write_segment(fs, root, name, encode_segment("compacted", "hsstore index", table, dict(snap.segment_stamps)))
    now = time.time()
    mine = Segment(name, "compacted", now, "hsstore index", dict(snap.segment_stamps), records.from_records([]))
    removed = []
    for seg in [*snap.segments.values(), mine]:
        if now - seg.created_at < grace_s:
            continue
        for old, st in seg.supersedes.items():
            if old in removed or old == name or old not in snap.segment_stamps or snap.segment_stamps[old] != st:
                continue  # gone already, never listed, or rewritten since (a writer's segment that grew): keep
            try:  # only segments listed in index/ (decode_segment refused any other name): never a path
                fs.rm_file(names.path(fs, root, f"{INDEX_DIR}/{old}", "superseded segment", f"store {root!r}"))
                removed.append(old)
            except FileNotFoundError:
                pass
    log.info("index: %d records in %s/%s; %d segment(s) superseded, %d removed", len(snap.table), INDEX_DIR, name,
             len(snap.segment_stamps), len(removed))
    damaged = snap.use.damaged + sorted(set(junk.values()) - set(snap.use.damaged))
    return CompactResult(name, len(table), snap.use.fetched + len(junk), len(snap.segment_stamps), removed, damaged)


def checked_table(fs, root: str, snap: Snapshot) -> tuple[RecordTable, dict[str, str]]:
    """``snap.table`` with every row taken from a segment parsed and checked against its columns
    (``records.matches``); a row that fails (a block with a valid checksum and junk in it) is replaced by its
    record read from ``commits/``, and named. Returns (table, shard -> segment of each row replaced): what
    ``compact`` writes, so no entry it has not parsed and checked is copied into the new segment."""
    t, origin = snap.table, snap.origin
    blocks = records.BlockCache()
    junk: dict[str, str] = {}
    for i in (np.flatnonzero(origin.codes >= 0).tolist() if origin is not None else []):
        raw = t.raw(i, blocks)
        try:
            rec = CommitRecord.from_json(raw, where="index entry")
            ok = rec.shard == t.shard[i] and records.matches(t, i, rec, raw)
        except StoreError:
            ok = False
        if not ok:
            junk[t.shard[i]] = origin.of(i)
    if not junk:
        return t, junk
    for shard, seg in sorted(junk.items()):
        log.warning("index segment %s/%s: the entry of shard %r does not parse or disagrees with its columns; "
                    "skipped, its commit record is read instead", INDEX_DIR, seg, shard)
    names_ = sorted(junk)
    fetched = []
    for shard, data in zip(names_, read_records(fs, root, names_, [snap.listed[n].size for n in names_])):
        fetched.append((parse_listed(shard, data), data, snap.listed[shard].stamp, codec.crc32c(data)))
    keep = np.array([i for i, n in enumerate(t.shard.tolist()) if n not in junk], np.int64)
    table = records.concat([t.take(keep), records.from_records(fetched)])
    shards = table.shard.tolist()
    return table.take(np.array(sorted(range(len(shards)), key=shards.__getitem__), np.int64)), junk
