"""Every committed shard's commit record as an open store holds it: columns for what opening, ``info`` and the
loader's catalog read (per shard: name, sample count, token count, bytes; per sample: id, source, length, loss and
thinking tokens, flags), and each record's own bytes, parsed into a :class:`CommitRecord` only when that shard is
read or checked.

Why: a 1e5-shard store holds ~1e6 samples and hundreds of MB of record JSON; parsed whole, that is seconds and GBs
of small Python objects per open (docs/PERFORMANCE.md, "Design choices"); as columns it is a few numpy arrays, and a
record's files, chunk checksums and tar members are parsed when its shard is touched. The record bytes are kept
zstd-compressed in blocks (an index segment's blocks as they were read, records read one by one compressed here),
decompressed a block at a time.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np
from numcodecs import Zstd

from . import codec
from .commit import CommitRecord
from ..errors import CorruptionError
from ..locks import ProcessLock

BLOCK_RECORDS = 256  # records per compressed block at most, and about BLOCK_BYTES of them: what one lazy parse
BLOCK_BYTES = 1 << 20  # decompresses (~1 ms)
PARSED_CACHE = 512  # parsed records kept (a loader touches few shards at a time; verify walks them in order)
_ZSTD = Zstd(level=3)


def compress(data: bytes) -> bytes:
    return bytes(_ZSTD.encode(data))


# What the bytes of record metadata (an index segment's columns, a block of records) may expand to at most: well
# above what a writer's store reaches (docs/PERFORMANCE.md, "Design choices"); a few kB of hostile zstd can
# declare gigabytes.
MAX_EXPANSION = 128


def decompress(data: bytes, nbytes: int | None = None, where: str = "record block") -> bytes:
    """Zstd-compressed record metadata, refused (``CorruptionError``, before allocating) unless its frame declares
    ``nbytes`` (what the segment's header or columns say it holds; None: not known) and at most
    ``MAX_EXPANSION`` times its compressed size."""
    limit = MAX_EXPANSION * len(data) + 4096
    want = codec.zstd_content_size(data) if nbytes is None else nbytes
    if want is None or want > limit:
        raise CorruptionError(f"{where}: {len(data):,} compressed bytes that declare "
                              f"{'no size' if want is None else f'{want:,} bytes'}, at most {limit:,} allowed")
    return codec.decode_bounded(_ZSTD, data, want, where).tobytes()


# -- columns ------------------------------------------------------------------------------------------------
@dataclass
class Strings:
    """A column of strings as one UTF-8 blob and offsets: a million Python strings cost ~60 MB and a second."""

    blob: np.ndarray  # uint8
    off: np.ndarray  # int64 [n + 1]

    @classmethod
    def of(cls, values: Sequence[str]) -> "Strings":
        enc = [v.encode() for v in values]
        off = np.zeros(len(enc) + 1, np.int64)
        np.cumsum([len(b) for b in enc], out=off[1:])
        return cls(np.frombuffer(b"".join(enc), np.uint8).copy(), off)

    def __len__(self) -> int:
        return len(self.off) - 1

    def __getitem__(self, i: int) -> str:
        return self.blob[self.off[i]:self.off[i + 1]].tobytes().decode()

    def slice(self, a: int, b: int) -> list[str]:
        o = self.off
        return [self.blob[o[k]:o[k + 1]].tobytes().decode() for k in range(a, b)]

    def tolist(self) -> list[str]:
        raw, o = self.blob.tobytes(), self.off.tolist()
        return [raw[o[k]:o[k + 1]].decode() for k in range(len(o) - 1)]

    def take(self, idx: np.ndarray) -> "Strings":
        lens = self.off[idx + 1] - self.off[idx]
        off = np.zeros(len(idx) + 1, np.int64)
        np.cumsum(lens, out=off[1:])
        pos = np.repeat(self.off[idx] - off[:-1], lens) + np.arange(off[-1], dtype=np.int64)
        return Strings(self.blob[pos], off)


@dataclass
class Codes:
    """A dictionary-encoded column (writers, sources, flag sets: few distinct values)."""

    codes: np.ndarray  # int32
    values: list  # JSON values (str, None, or a tuple of flags)

    @classmethod
    def of(cls, values: Sequence) -> "Codes":
        lookup: dict = {}
        codes = np.fromiter((lookup.setdefault(v, len(lookup)) for v in values), np.int32, len(values))
        return cls(codes, list(lookup))

    def __len__(self) -> int:
        return len(self.codes)

    def __getitem__(self, i: int):
        return self.values[self.codes[i]]

    def tolist(self) -> list:
        return [self.values[c] for c in self.codes.tolist()]


def _concat_codes(parts: list[Codes]) -> Codes:
    lookup: dict = {}
    out = []
    for p in parts:
        remap = np.array([lookup.setdefault(v, len(lookup)) for v in p.values] or [0], np.int32)
        out.append(remap[p.codes])
    return Codes(np.concatenate(out) if out else np.zeros(0, np.int32), list(lookup))


def _concat_strings(parts: list[Strings]) -> Strings:
    offs, base = [np.zeros(1, np.int64)], 0
    for p in parts:
        offs.append(p.off[1:] + base)
        base += int(p.off[-1])
    return Strings(np.concatenate([p.blob for p in parts]) if parts else np.zeros(0, np.uint8), np.concatenate(offs))


# -- the table ------------------------------------------------------------------------------------------------
SHARD_INTS = ("size", "raw_size", "n_samples", "n_tokens", "stored_bytes", "format_version", "chunk_tokens")
SAMPLE_INTS = ("length", "loss_tokens", "thinking_tokens")
# a record's stats["features"] totals; the last two count samples whose feature is all zero / has a non-finite value
FEATURE_STATS = ("count", "sum", "sumsq", "absmax", "zeros", "nonfinite", "zero_samples", "nonfinite_samples")


@dataclass
class RecordTable:
    """Commit records of many shards, in one order (a segment's, or the store's: by shard name)."""

    shard: Strings
    stamp: Strings  # the record object's stamp when indexed ("" for none)
    crc32c: np.ndarray  # uint32: of the record object's bytes
    ints: dict[str, np.ndarray]  # SHARD_INTS, int64 [n]
    writer: Codes
    manifest_key: Codes
    location: Codes  # None: the shard's files are in this store
    slots: list[str]  # feature keys of the ``layer_stored`` / ``layer_raw`` columns (the index's ``slots`` key)
    layer_stored: np.ndarray  # int64 [n, len(slots)]
    layer_raw: np.ndarray
    skipped: dict[int, dict[str, list[str]]]  # row -> the record's stats["skipped"], where it has one
    first: np.ndarray  # int64 [n + 1]: each shard's first sample in the sample columns
    samples: dict[str, np.ndarray]  # SAMPLE_INTS, int64 [N]
    sample_id: Strings
    source: Codes
    flags: Codes  # values: tuples of flag names
    # the records' bytes: zstd blocks; shard row -> (block, offset within the decompressed block)
    blocks: list[bytes]
    block: np.ndarray  # int32 [n]
    offset: np.ndarray  # int64 [n]
    # per shard and slot the record's feature statistics (``FEATURE_STATS``), NaN where a record has none; None:
    # a table read from an index segment written before they existed (every record then reads as having none)
    feature_stats: np.ndarray | None = None  # float64 [n, len(slots), len(FEATURE_STATS)]
    _starts: np.ndarray | None = field(default=None, repr=False)
    # each block's decompressed size, kept by ``take`` and ``concat``: rows taken away (a record gone from
    # commits/) must not shrink the bound a block is decompressed to (None: every row of every block is here)
    _block_sizes: np.ndarray | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.shard)

    @property
    def n_samples(self) -> np.ndarray:
        return self.ints["n_samples"]

    @property
    def n_tokens(self) -> np.ndarray:
        return self.ints["n_tokens"]

    @property
    def size(self) -> np.ndarray:
        return self.ints["size"]

    @property
    def starts(self) -> np.ndarray:
        """Each sample's first token within its shard (int64 [N])."""
        if self._starts is None:
            length = self.samples["length"]
            cs = np.zeros(len(length) + 1, np.int64)
            np.cumsum(length, out=cs[1:])
            self._starts = cs[:-1] - np.repeat(cs[self.first[:-1]], np.diff(self.first))
        return self._starts

    def offsets(self, i: int) -> np.ndarray:
        """``[n_samples + 1]`` token offsets of shard row ``i`` (``CommitRecord.offsets``)."""
        a, b = int(self.first[i]), int(self.first[i + 1])
        return np.concatenate([self.starts[a:b], [int(self.n_tokens[i])]]).astype(np.int64)

    def sample_columns(self, i: int) -> dict[str, list]:
        """Shard row ``i``'s ``CommitRecord.samples``, from the columns."""
        a, b = int(self.first[i]), int(self.first[i + 1])
        return {"sample_id": self.sample_id.slice(a, b), "source": [self.source[k] for k in range(a, b)],
                "length": self.samples["length"][a:b].tolist(), "loss_tokens": self.samples["loss_tokens"][a:b].tolist(),
                "thinking_tokens": self.samples["thinking_tokens"][a:b].tolist(),
                "flags": [list(self.flags[k]) for k in range(a, b)]}

    def block_bytes(self, b: int) -> int:
        """Decompressed size of block ``b``: its records one after the other (``pack``), so the end of the last."""
        if self._block_sizes is not None:
            return int(self._block_sizes[b])
        rows = np.flatnonzero(self.block == b)
        return int((self.offset[rows] + self.ints["raw_size"][rows]).max()) if len(rows) else 0

    def block_sizes(self) -> np.ndarray:
        """``block_bytes`` of every block (int64)."""
        if self._block_sizes is not None:
            return self._block_sizes
        sizes = np.zeros(len(self.blocks), np.int64)
        if len(self.block):
            np.maximum.at(sizes, self.block, self.offset + self.ints["raw_size"])
        return sizes

    def trimmed(self) -> bool:
        """Whether rows were taken out of a block (its size is then not what the remaining columns say)."""
        return self._block_sizes is not None and not np.array_equal(
            self._block_sizes, RecordTable(**{**self.__dict__, "_block_sizes": None}).block_sizes())

    def decompress_block(self, b: int) -> bytes:
        """Block ``b``'s records' bytes, bounded by what the columns say it holds."""
        return decompress(self.blocks[b], self.block_bytes(b), where=f"record block {b}")

    def raw(self, i: int, cache: "BlockCache | None" = None) -> bytes:
        """Shard row ``i``'s record bytes (as in ``commits/``)."""
        b = int(self.block[i])
        data = cache.get(self, b) if cache is not None else self.decompress_block(b)
        o = int(self.offset[i])
        return data[o:o + int(self.ints["raw_size"][i])]

    def take(self, idx: np.ndarray) -> "RecordTable":
        """Rows ``idx`` in that order."""
        idx = np.asarray(idx, np.int64)
        counts = np.diff(self.first)[idx]
        first = np.zeros(len(idx) + 1, np.int64)
        np.cumsum(counts, out=first[1:])
        sidx = np.repeat(self.first[idx] - first[:-1], counts) + np.arange(first[-1], dtype=np.int64)
        where = {int(r): k for k, r in enumerate(idx.tolist())}
        return RecordTable(
            self.shard.take(idx), self.stamp.take(idx), self.crc32c[idx], {k: v[idx] for k, v in self.ints.items()},
            Codes(self.writer.codes[idx], self.writer.values), Codes(self.manifest_key.codes[idx],
                                                                     self.manifest_key.values),
            Codes(self.location.codes[idx], self.location.values), list(self.slots), self.layer_stored[idx],
            self.layer_raw[idx], {where[r]: v for r, v in self.skipped.items() if r in where}, first,
            {k: v[sidx] for k, v in self.samples.items()}, self.sample_id.take(sidx),
            Codes(self.source.codes[sidx], self.source.values), Codes(self.flags.codes[sidx], self.flags.values),
            self.blocks, self.block[idx], self.offset[idx],
            feature_stats=None if self.feature_stats is None else self.feature_stats[idx],
            _block_sizes=self.block_sizes())

    def row_of(self, i: int) -> dict[str, Any]:
        """What the columns say of shard row ``i``, in the terms of ``record_row`` (``verify`` compares them)."""
        return {"shard": self.shard[i], "crc32c": int(self.crc32c[i]), **{k: int(v[i]) for k, v in self.ints.items()},
                "writer": self.writer[i], "manifest_key": self.manifest_key[i], "location": self.location[i],
                "layers": {s: [int(self.layer_stored[i, j]), int(self.layer_raw[i, j])] for j, s in
                           enumerate(self.slots) if self.layer_stored[i, j] >= 0},
                "skipped": self.skipped.get(i, {}), "samples": self.sample_columns(i),
                **({} if self.feature_stats is None else {"feature_stats": {
                    s: self.feature_stats[i, j].tolist() for j, s in enumerate(self.slots)
                    if not np.isnan(self.feature_stats[i, j, 0])}})}


def record_row(rec: CommitRecord, data: bytes, crc: int, size: int | None = None) -> dict[str, Any]:
    """The columns' view of one record (``data``: its object's bytes, ``crc``: their CRC32C; ``size``: its
    object's size when ``data`` is not those bytes but the record serialised again, from a version-1 segment)."""
    return {"shard": rec.shard, "crc32c": crc, "size": len(data) if size is None else size, "raw_size": len(data),
            "n_samples": rec.n_samples, "n_tokens": rec.n_tokens,
            "stored_bytes": sum(int(f["size"]) for f in rec.files.values()), "format_version": rec.format_version,
            "chunk_tokens": rec.chunk_tokens, "writer": rec.writer, "manifest_key": rec.manifest_key,
            "location": rec.location,
            "layers": {k: [int(v["stored_bytes"]), int(v["raw_bytes"])] for k, v in rec.layers.items()},
            "skipped": rec.stats.get("skipped", {}) if isinstance(rec.stats, dict) else {},
            "samples": {k: [list(x) for x in v] if k == "flags" else list(v) for k, v in rec.samples.items()},
            "feature_stats": record_feature_stats(rec)}


def record_feature_stats(rec: CommitRecord) -> dict[str, list[float]]:
    """A record's per-feature totals (``FEATURE_STATS``) as the columns hold them; {} for a record without any,
    and for statistics that are not numbers (``verify`` compares them with the data and names them)."""
    feats = rec.stats.get("features") if isinstance(rec.stats, dict) else None
    out = {}
    for k, e in (feats.items() if isinstance(feats, dict) else ()):
        if str(k) not in rec.layers:  # the columns hold a slot per feature the record lists, no other
            continue
        try:
            vals = [float(e[f]) for f in FEATURE_STATS]
        except (KeyError, TypeError, ValueError):
            continue
        if all(np.isfinite(vals)):
            out[str(k)] = vals
    return out


def matches(t: RecordTable, i: int, rec: CommitRecord, raw: bytes) -> bool:
    """Whether row ``i``'s columns say what ``rec`` (parsed from ``raw``, the row's own record bytes) says: an
    index entry's bytes are used only when they do (a block with a valid checksum may still hold junk)."""
    want = record_row(rec, raw, int(t.crc32c[i]), int(t.size[i]))
    if t.feature_stats is None:  # a segment from before feature statistics: it cannot say them
        want.pop("feature_stats")
    return t.row_of(i) == want


def matches_object(t: RecordTable, i: int, rec: CommitRecord, data: bytes) -> bool:
    """Whether row ``i``'s columns say what the record object ``data`` (parsed: ``rec``) in ``commits/`` says."""
    row = t.row_of(i)
    want = record_row(rec, data, codec.crc32c(data), len(data))
    row.pop("raw_size"), want.pop("raw_size")  # a version-1 segment's row holds the record serialised again
    if t.feature_stats is None:
        want.pop("feature_stats")
    return row == want


def from_records(items: Sequence[tuple]) -> RecordTable:
    """A table of parsed records, in that order: (record, its object's bytes, its stamp, their CRC32C) each, or
    with a fifth item, the object's size (see ``record_row``)."""
    rows = [record_row(r, d, c, *rest) for r, d, _, c, *rest in items]
    slots: list[str] = []
    for row in rows:
        for k in row["layers"]:
            if k not in slots:
                slots.append(k)
    stored = np.full((len(rows), len(slots)), -1, np.int64)
    raw = np.full((len(rows), len(slots)), -1, np.int64)
    for i, row in enumerate(rows):
        for j, s in enumerate(slots):
            if s in row["layers"]:
                stored[i, j], raw[i, j] = row["layers"][s]
    feature_stats = np.full((len(rows), len(slots), len(FEATURE_STATS)), np.nan)
    for i, row in enumerate(rows):
        for j, s in enumerate(slots):
            if s in row["feature_stats"]:
                feature_stats[i, j] = row["feature_stats"][s]
    first = np.zeros(len(rows) + 1, np.int64)
    np.cumsum([len(r["samples"]["length"]) for r in rows], out=first[1:])
    col = lambda k: [x for r in rows for x in r["samples"][k]]  # noqa: E731
    blocks, block, offset = pack([it[1] for it in items])
    return RecordTable(
        Strings.of([r["shard"] for r in rows]), Strings.of([it[2] or "" for it in items]),
        np.array([r["crc32c"] for r in rows], np.uint32),
        {k: np.array([r[k] for r in rows], np.int64) for k in SHARD_INTS},
        Codes.of([r["writer"] for r in rows]), Codes.of([r["manifest_key"] for r in rows]),
        Codes.of([r["location"] for r in rows]), slots, stored, raw,
        {i: r["skipped"] for i, r in enumerate(rows) if r["skipped"]}, first,
        {k: np.array(col(k), np.int64) for k in SAMPLE_INTS}, Strings.of(col("sample_id")), Codes.of(col("source")),
        Codes.of([tuple(f) for f in col("flags")]), blocks, block, offset, feature_stats=feature_stats)


def pack(raws: Sequence[bytes]) -> tuple[list[bytes], np.ndarray, np.ndarray]:
    """Record bytes in order -> (zstd blocks, each record's block, its offset in the decompressed block)."""
    blocks, block, offset = [], np.zeros(len(raws), np.int32), np.zeros(len(raws), np.int64)
    part: list[bytes] = []
    pos = 0
    for i, d in enumerate(raws):
        if part and (len(part) >= BLOCK_RECORDS or pos >= BLOCK_BYTES):
            blocks.append(compress(b"".join(part)))
            part, pos = [], 0
        block[i], offset[i] = len(blocks), pos
        part.append(d)
        pos += len(d)
    if part:
        blocks.append(compress(b"".join(part)))
    return blocks, block, offset


def raws(t: RecordTable) -> list[bytes]:
    """Every record's bytes in row order, each block decompressed once (rows gathered from several segments
    interleave their blocks)."""
    out: list[bytes] = [b""] * len(t)
    size = t.ints["raw_size"]
    for b in np.unique(t.block).tolist():
        data = t.decompress_block(b)
        for i in np.flatnonzero(t.block == b).tolist():
            o = int(t.offset[i])
            out[i] = data[o:o + int(size[i])]
    return out


def concat(parts: list[RecordTable]) -> RecordTable:
    """Tables one after the other (their slots joined: a slot a part lacks reads -1)."""
    parts = [p for p in parts if len(p)] or parts[:1]
    if not parts:
        return from_records([])
    if len(parts) == 1:
        return parts[0]
    slots: list[str] = []
    for p in parts:
        slots += [s for s in p.slots if s not in slots]

    def widen(p: RecordTable, a: np.ndarray) -> np.ndarray:
        out = np.full((len(p), len(slots)), -1, np.int64)
        for j, s in enumerate(p.slots):
            out[:, slots.index(s)] = a[:, j]
        return out

    firsts, base = [np.zeros(1, np.int64)], 0
    skipped, rows = {}, 0
    blocks, block = [], []
    for p in parts:
        firsts.append(p.first[1:] + base)
        base += int(p.first[-1])
        skipped.update({rows + r: v for r, v in p.skipped.items()})
        rows += len(p)
        block.append(p.block + len(blocks))
        blocks += p.blocks
    cat = lambda f: np.concatenate([f(p) for p in parts])  # noqa: E731

    def widen_stats(p: RecordTable) -> np.ndarray:
        out = np.full((len(p), len(slots), len(FEATURE_STATS)), np.nan)
        if p.feature_stats is not None:
            for j, s in enumerate(p.slots):
                out[:, slots.index(s)] = p.feature_stats[:, j]
        return out

    return RecordTable(
        _concat_strings([p.shard for p in parts]), _concat_strings([p.stamp for p in parts]), cat(lambda p: p.crc32c),
        {k: cat(lambda p: p.ints[k]) for k in SHARD_INTS}, _concat_codes([p.writer for p in parts]),
        _concat_codes([p.manifest_key for p in parts]), _concat_codes([p.location for p in parts]), slots,
        cat(lambda p: widen(p, p.layer_stored)), cat(lambda p: widen(p, p.layer_raw)), skipped, np.concatenate(firsts),
        {k: cat(lambda p: p.samples[k]) for k in SAMPLE_INTS}, _concat_strings([p.sample_id for p in parts]),
        _concat_codes([p.source for p in parts]), _concat_codes([p.flags for p in parts]), blocks,
        np.concatenate(block).astype(np.int32), cat(lambda p: p.offset),
        feature_stats=None if all(p.feature_stats is None for p in parts) else cat(widen_stats),
        _block_sizes=np.concatenate([p.block_sizes() for p in parts]))


# -- serialised form (index segments of version 2, open_shared's broadcast) -------------------------------------
def table_header(t: RecordTable) -> tuple[dict[str, Any], list[np.ndarray]]:
    """(JSON-able description, arrays in order) of a table; ``table_from`` inverts it given the arrays' bytes."""
    arrays: list[tuple[str, np.ndarray]] = [
        ("shard.blob", t.shard.blob), ("shard.off", t.shard.off), ("stamp.blob", t.stamp.blob),
        ("stamp.off", t.stamp.off), ("crc32c", t.crc32c), *((f"int.{k}", t.ints[k]) for k in SHARD_INTS),
        ("writer", t.writer.codes), ("manifest_key", t.manifest_key.codes), ("location", t.location.codes),
        ("layer_stored", t.layer_stored), ("layer_raw", t.layer_raw), ("first", t.first),
        *((f"sample.{k}", t.samples[k]) for k in SAMPLE_INTS), ("sample_id.blob", t.sample_id.blob),
        ("sample_id.off", t.sample_id.off), ("source", t.source.codes), ("flags", t.flags.codes),
        ("block", t.block), ("offset", t.offset),
        *([("feature_stats", t.feature_stats)] if t.feature_stats is not None else [])]
    desc = {"rows": len(t), "slots": t.slots, "writer": t.writer.values, "manifest_key": t.manifest_key.values,
            "location": t.location.values, "source": t.source.values, "flags": [list(f) for f in t.flags.values],
            "skipped": {str(r): v for r, v in t.skipped.items()},
            "arrays": [[name, a.dtype.str, list(a.shape)] for name, a in arrays]}
    return desc, [np.ascontiguousarray(a) for _, a in arrays]


def table_from(desc: dict[str, Any], buf: bytes, blocks: list[bytes]) -> RecordTable:
    """The table ``table_header`` described, its arrays' bytes concatenated in ``buf``; checks every shape."""
    a: dict[str, np.ndarray] = {}
    pos = 0
    for name, dtype, shape in desc["arrays"]:
        dt = np.dtype(dtype)
        n = int(np.prod(shape)) if shape else 1
        nbytes = n * dt.itemsize
        if pos + nbytes > len(buf):
            raise ValueError(f"array {name} runs past the table")
        a[name] = np.frombuffer(buf, dt, n, pos).reshape(shape)
        pos += nbytes
    if pos != len(buf):
        raise ValueError("table longer than its arrays")
    n, slots = int(desc["rows"]), list(desc["slots"])
    first = a["first"]
    per_shard = [a["crc32c"], a["writer"], a["manifest_key"], a["location"], a["block"], a["offset"],
                 *(a[f"int.{k}"] for k in SHARD_INTS)]
    if (any(len(x) != n for x in per_shard) or a["layer_stored"].shape != (n, len(slots))
            or a["layer_raw"].shape != (n, len(slots)) or len(first) != n + 1 or len(a["shard.off"]) != n + 1
            or len(a["stamp.off"]) != n + 1 or np.any(np.diff(first) != a["int.n_samples"])):
        raise ValueError("per-shard columns disagree in length")
    N = int(first[-1]) if n else 0
    if (any(len(a[f"sample.{k}"]) != N for k in SAMPLE_INTS) or len(a["source"]) != N or len(a["flags"]) != N
            or len(a["sample_id.off"]) != N + 1):
        raise ValueError("per-sample columns disagree in length")
    for codes, values in (("writer", "writer"), ("manifest_key", "manifest_key"), ("location", "location"),
                          ("source", "source"), ("flags", "flags")):
        if not isinstance(desc[values], list):
            raise ValueError(f"{values} values are not a list")
        if len(a[codes]) and (a[codes].min() < 0 or a[codes].max() >= len(desc[values])):
            raise ValueError(f"{codes} codes out of range")
    # the values a record would hold there: text (or none, for a location), flag sets of text
    for values in ("writer", "manifest_key", "location", "source"):
        if not all(v is None or isinstance(v, str) for v in desc[values]):
            raise ValueError(f"{values} values must be text")
    if not all(isinstance(f, list) and all(isinstance(x, str) for x in f) for f in desc["flags"]):
        raise ValueError("flags values must be lists of text")
    if not isinstance(desc["slots"], list) or not all(isinstance(s, (int, str)) and not isinstance(s, bool)
                                                      for s in desc["slots"]):
        raise ValueError("slots must be layer ids or feature names")
    if not isinstance(desc["skipped"], dict):
        raise ValueError("skipped must be an object")
    if n and (a["block"].min() < 0 or a["block"].max() >= len(blocks)):
        raise ValueError("block numbers out of range")
    stats = a.get("feature_stats")  # absent in segments written before feature statistics
    if stats is not None and (stats.dtype != np.float64 or stats.shape != (n, len(slots), len(FEATURE_STATS))):
        raise ValueError("feature statistics disagree in shape")
    return RecordTable(
        Strings(a["shard.blob"], a["shard.off"]), Strings(a["stamp.blob"], a["stamp.off"]), a["crc32c"],
        {k: a[f"int.{k}"] for k in SHARD_INTS}, Codes(a["writer"], list(desc["writer"])),
        Codes(a["manifest_key"], list(desc["manifest_key"])), Codes(a["location"], list(desc["location"])), slots,
        a["layer_stored"], a["layer_raw"], {int(r): v for r, v in desc["skipped"].items()}, first,
        {k: a[f"sample.{k}"] for k in SAMPLE_INTS}, Strings(a["sample_id.blob"], a["sample_id.off"]),
        Codes(a["source"], list(desc["source"])), Codes(a["flags"], [tuple(f) for f in desc["flags"]]), blocks,
        a["block"], a["offset"], feature_stats=stats)


# -- records, parsed on access ------------------------------------------------------------------------------
class BlockCache:
    """The last decompressed blocks (a scan in shard order decompresses each block once)."""

    def __init__(self, size: int = 2) -> None:
        self.size, self.items = size, OrderedDict()

    def get(self, table: RecordTable, b: int) -> bytes:
        key = (id(table.blocks), b)
        data = self.items.get(key)
        if data is None:
            data = self.items[key] = table.decompress_block(b)
            while len(self.items) > self.size:
                self.items.popitem(last=False)
        else:
            self.items.move_to_end(key)
        return data


class Records(Sequence[CommitRecord]):
    """``Store.commits``: the records of a table as a sequence of :class:`CommitRecord`, each parsed (with
    every check of ``CommitRecord.from_json``) when first asked for and kept among the last ``PARSED_CACHE``.
    Thread-safe: the loader's and a store's read-ahead threads ask for records."""

    def __init__(self, table: RecordTable, where: str = "",
                 fallback: "Callable[[int, str], CommitRecord] | None" = None) -> None:
        """``fallback(row, why)``: the record of a row whose own bytes do not parse or disagree with its columns
        (a junk index entry), from elsewhere (``Store``: from ``commits/``), or raise."""
        self.table, self.where, self.fallback = table, where, fallback
        self._parsed: OrderedDict[int, CommitRecord] = OrderedDict()
        self._blocks = BlockCache()
        self._lock = ProcessLock()

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"shard index {i} out of range ({n} shards)")
        i = int(i) % n
        with self._lock:
            rec = self._parsed.get(i)
            if rec is not None:
                self._parsed.move_to_end(i)
                return rec
            raw = self.table.raw(i, self._blocks)
        name = self.table.shard[i]
        where = f"commit record of shard {name!r}{self.where}"
        try:
            rec = CommitRecord.from_json(raw, where=where)
            if rec.shard != name:
                raise CorruptionError(f"{where}: holds shard {rec.shard!r}")
            if not self._bound(i, rec, raw):
                raise CorruptionError(f"{where}: differs from what its columns say")
        except CorruptionError as e:
            if self.fallback is None:
                raise
            rec = self.fallback(i, str(e))
        with self._lock:
            self._parsed[i] = rec
            if len(self._parsed) > PARSED_CACHE:
                self._parsed.popitem(last=False)
        return rec

    def _bound(self, i: int, rec: CommitRecord, raw: bytes) -> bool:
        """Whether row ``i``'s bytes are the record its columns were made from, and its columns say what that
        record says (``matches``: ~15% of a parse, once per shard): the index is an accelerator, never an
        authority, so a sample length, id or count forged in its columns never decides what is read. A row
        that holds the record object's own bytes is first checked by their CRC32C (~1 us)."""
        t = self.table
        if int(t.ints["raw_size"][i]) == int(t.size[i]) and codec.crc32c(raw) != int(t.crc32c[i]):
            return False
        return matches(t, i, rec, raw)

    def __iter__(self) -> Iterator[CommitRecord]:
        return (self[i] for i in range(len(self)))

    def __eq__(self, other) -> bool:
        if isinstance(other, (Records, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __getstate__(self) -> dict:
        return {"table": self.table, "where": self.where}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["table"], state["where"])

    def __repr__(self) -> str:
        return f"Records({len(self)} shards)"
