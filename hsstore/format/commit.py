"""The commit record: what makes a shard visible, and what it promises about the shard's files.

Layout-independent names under the store prefix (see docs/FORMAT.md)::

    shards/<name>...               the shard's files, as its layout writes them (layouts/zarr.py, layouts/wds.py)
    commits/<name>.json            its commit record, written last; readers see only shards that have one

A commit record lists every file of its shard with size and CRC32C, so ``verify`` can name the file
(and so the samples) at fault without trusting anything else in the shard. For a zarr chunk that checksum
is its payload's (the CRC32C the chunk ends with), so the record binds each chunk's data to its path: a
valid chunk in the wrong place is caught by the same comparison that catches a flipped byte.
"""

from __future__ import annotations

import dataclasses
import json
import os
import posixpath
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import codec
from ..io import door, listing, storage, transfer
from ..errors import CorruptionError, StoreError
from .manifest import FORMAT_VERSION, MAX_TEXT, is_int

SHARDS_DIR = "shards"
COMMITS_DIR = "commits"
SAMPLE_COLUMNS = ("sample_id", "source", "length", "loss_tokens", "thinking_tokens", "flags")
# records of this format version on list a chunk's payload CRC32C; version 1 listed the whole object's,
# which is the same constant for every valid chunk (CRC-32C's residue) and so identified no data
CONTENT_CHECKSUMS = 2


def layer_array(layer: int | str) -> str:
    """A feature's name in a shard, in every layout (a Zarr array, a tar member's part): ``layer_<LLL>`` for a
    layer id, the feature's own name (``final_hidden``) otherwise."""
    return layer if isinstance(layer, str) else f"layer_{layer:03d}"


def commit_path(name: str) -> str:
    return f"{COMMITS_DIR}/{name}.json"


def is_chunk_key(key: str) -> bool:
    """Whether a store-relative key is a Zarr chunk object, ``shards/<name>/<array>/c/<k>[/0]`` (which ends
    with its payload's CRC32C); metadata and tars are not."""
    parts = key.split("/", 4)
    return len(parts) == 5 and parts[0] == SHARDS_DIR and parts[3] == "c"


def sample_offsets(name: str, samples: dict[str, list], n_tokens: int) -> np.ndarray:
    """``[samples + 1]`` token offsets from the sample lengths, which must cover the shard's tokens."""
    offsets = np.concatenate([[0], np.cumsum(np.asarray(samples["length"], dtype=np.int64))]).astype(np.int64)
    if offsets[-1] != n_tokens:
        raise ValueError(f"shard {name}: sample lengths sum to {offsets[-1]}, arrays hold {n_tokens} tokens")
    return offsets


@dataclass
class CommitRecord:
    """Everything ``info`` needs and everything ``verify`` checks, for one shard."""

    shard: str
    writer: str
    n_samples: int
    n_tokens: int
    samples: dict[str, list]
    layers: dict[str, dict[str, int]]
    files: dict[str, dict[str, int]]
    chunk_tokens: int
    stats: dict[str, Any] = field(default_factory=dict)
    created_at: str = ""
    format_version: int = FORMAT_VERSION
    location: str | None = None  # another store holding this shard's files (a merge by reference); None: here
    # wds layout only: tar member name -> [offset of its data in the tar, its size, CRC32C of its bytes]
    members: dict[str, list[int]] | None = None
    manifest_key: str = ""  # Manifest.shard_key() of the manifest it was written under ("" in older stores)

    def to_json(self) -> bytes:
        d = dataclasses.asdict(self)
        for optional in ("location", "members"):  # absent when unused: records stay as hsstore 0.1 wrote them
            if d[optional] is None:
                del d[optional]
        return json.dumps(d, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> "CommitRecord":
        return cls.from_dict(door.load_json(data, f"{where}: malformed commit record"), where)

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "CommitRecord":
        """A record from its parsed JSON (a record file's, or an index entry's copy), with every check."""
        fields = _field_problem(cls, d)
        if fields:
            raise CorruptionError(f"{where}: malformed commit record ({fields})")
        version = d["format_version"]
        rec = cls(**d)
        if version > FORMAT_VERSION:
            raise StoreError(f"{where}: format version {version}, this hsstore reads up to {FORMAT_VERSION}; "
                             "upgrade hsstore")
        why = _type_problem(rec)
        if why:
            raise CorruptionError(f"{where}: malformed commit record ({why})")
        cols = rec.samples
        if set(cols) != set(SAMPLE_COLUMNS) or any(len(cols[c]) != rec.n_samples for c in SAMPLE_COLUMNS):
            raise CorruptionError(f"{where}: field 'samples': its columns do not match n_samples={rec.n_samples}")
        if sum(cols["length"]) != rec.n_tokens:
            raise CorruptionError(f"{where}: field 'samples.length': lengths sum to {sum(cols['length'])}, "
                                  f"n_tokens says {rec.n_tokens}")
        return rec

    @property
    def offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(np.asarray(self.samples["length"], dtype=np.int64))])

    @property
    def binds_chunks(self) -> bool:
        """Whether the record's chunk checksums identify each chunk's data (format version 2 on)."""
        return self.format_version >= CONTENT_CHECKSUMS

    @property
    def weak_checksums(self) -> bool:
        """A record of format version 1 that lists chunks: a valid chunk at the wrong path passes its checks
        (``hsstore upgrade`` re-derives the checksums)."""
        return not self.binds_chunks and any(map(is_chunk_key, self.files))

    def chunk_checksum(self, key: str) -> int | None:
        """The payload CRC32C the chunk object at ``key`` must end with (None: the record's version lists none).
        The reader compares it with the tail it checks anyway: no second pass over the bytes."""
        if self.format_version < CONTENT_CHECKSUMS:
            return None
        entry = self.files.get(key)
        if entry is None:
            raise CorruptionError(f"shard {self.shard!r}, file {key}: not listed in the commit record")
        return entry["crc32c"]


def _field_problem(cls, d: Any) -> str | None:
    """What keeps parsed JSON ``d`` from being a record's fields, naming the field (None: nothing): every required
    field present, none unknown, ``format_version`` (required: its rules say what the checksums mean) a
    positive integer."""
    if not isinstance(d, dict):
        return f"a JSON {type(d).__name__}, not an object"
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - set(known), key=str)
    if unknown:
        return f"field {str(unknown[0])[:64]!r}: not a field of a commit record"
    required = [n for n, f in known.items() if f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING] + ["format_version"]
    missing = [n for n in required if n not in d]
    if missing:
        return f"field {missing[0]!r}: missing"
    version = d["format_version"]
    if not is_int(version) or version < 1:
        return f"field 'format_version': {str(version)[:64]!r} is not a positive integer"
    return None


def _count(x: Any) -> bool:
    return is_int(x) and 0 <= x < 1 << 62


def _text(x: Any) -> bool:
    return isinstance(x, str) and len(x) <= MAX_TEXT


def _type_problem(rec: CommitRecord) -> str | None:
    """What in a parsed record is not of its type (None: all is): every count a non-negative integer (never a
    bool), every name a short string, every file entry ``{size, crc32c}``; readers size buffers from these."""
    for name in ("shard", "writer", "created_at", "manifest_key"):
        if not _text(getattr(rec, name)):
            return f"field {name!r} must be a string"
    for name in ("n_samples", "n_tokens", "chunk_tokens"):
        if not _count(getattr(rec, name)):
            return f"field {name!r} must be a non-negative integer"
    if not rec.chunk_tokens:
        return "field 'chunk_tokens' must be positive"
    if rec.location is not None and not _text(rec.location):
        return "field 'location' must be a string"
    for name in ("stats", "samples"):
        if not isinstance(getattr(rec, name), dict):
            return f"field {name!r} must be an object"
    if rec.members is not None and not isinstance(rec.members, dict):
        return "field 'members' must be an object"
    if not isinstance(rec.files, dict) or not all(
            isinstance(e, dict) and _count(e.get("size")) and is_int(e.get("crc32c")) and 0 <= e["crc32c"] < 1 << 32
            for e in rec.files.values()):
        return "field 'files' must map each key to {size, crc32c} integers"
    if not isinstance(rec.layers, dict) or not all(
            isinstance(e, dict) and {"stored_bytes", "raw_bytes"} <= set(e) and all(_count(v) for v in e.values())
            for e in rec.layers.values()):
        return "field 'layers' must map each feature to its byte counts (stored_bytes, raw_bytes)"
    cols = rec.samples
    kinds = {"sample_id": _text, "source": _text, "length": _count, "loss_tokens": _count,
             "thinking_tokens": _count,
             "flags": lambda f: isinstance(f, list) and all(_text(x) for x in f)}
    for name, ok in kinds.items():
        if not isinstance(cols.get(name), list) or not all(map(ok, cols[name])):
            return (f"field 'samples.{name}' must be a list of "
                    f"{'strings' if name in ('sample_id', 'source') else 'values'}")
    return None


def check_file(rec: CommitRecord, key: str, data) -> str | None:
    """Why an object read back differs from what ``rec`` lists for ``key`` (None: it matches), in one pass
    over its bytes. A chunk: its own CRC32C, then that the record lists it (version 1: lists the residue)."""
    want = rec.files[key]
    if len(data) != want["size"]:
        return f"size {len(data)} != committed {want['size']} (truncated or rewritten)"
    corrupt = "checksum mismatch (corrupted bytes)"
    if is_chunk_key(key):
        if not codec.chunk_ok(data):
            return corrupt
        if rec.binds_chunks:
            return None if codec.chunk_tail(data) == want["crc32c"] else codec.MISPLACED
        return None if want["crc32c"] == codec.CHUNK_RESIDUE else corrupt
    return None if codec.crc32c(data) == want["crc32c"] else corrupt


def same_files(a: CommitRecord, b: CommitRecord) -> bool:
    """Whether two records of one shard list the same objects: keys and sizes, and checksums wherever both
    mean the same (a version-1 chunk checksum identifies no data, so it is not compared with a version-2 one)."""
    if a.files.keys() != b.files.keys():
        return False
    for key, ea in a.files.items():
        eb = b.files[key]
        if ea["size"] != eb["size"]:
            return False
        if ea["crc32c"] != eb["crc32c"] and not (a.binds_chunks != b.binds_chunks and is_chunk_key(key)):
            return False
    return True


def publish(fs, root: str, record: CommitRecord) -> str | None:
    """Make a written shard visible to readers: the commit record is the last object written. Returns the
    record object's stamp (``listing.stamp``) when the filesystem tells, for the store's index."""
    return transfer.put_atomic(fs, storage.join(root, commit_path(record.shard)), record.to_json(), root)


def resolve_location(store_url: str, location: str) -> str:
    """The URL of a commit record's ``location``: absolute (``s3://...``, ``/path``) as is, otherwise relative
    to the store's own URL (``../other`` is a sibling store), so stores moved together keep working."""
    if "://" in location or location.startswith("/"):
        return location
    scheme, sep, path = store_url.rpartition("://")
    joined = posixpath.normpath(posixpath.join(path, location))
    if sep and joined.startswith(".."):
        raise CorruptionError(f"location {location!r} climbs above the bucket of {store_url!r}")
    return f"{scheme}{sep}{joined}" if sep else joined


def relative_location(store_url: str, target_url: str) -> str:
    """How a store at ``store_url`` names another store in a commit record's ``location``: relative when both
    are on one local disk or in one bucket (the pair can be moved or mirrored together), else absolute."""
    s_scheme, s_sep, s_path = store_url.rpartition("://")
    t_scheme, t_sep, t_path = target_url.rpartition("://")
    if not s_sep and not t_sep:  # local paths
        return os.path.relpath(os.path.abspath(t_path), os.path.abspath(s_path))
    if s_sep and t_sep and s_scheme == t_scheme and s_path.split("/", 1)[0] == t_path.split("/", 1)[0]:
        return posixpath.relpath("/" + t_path.strip("/"), "/" + s_path.strip("/"))
    return target_url if t_sep else os.path.abspath(t_path)


def list_committed(fs, root: str) -> list[str]:
    """Names of committed shards, sorted (the store's sample order follows this order)."""
    return sorted(list_records(fs, root))


def list_records(fs, root: str) -> dict[str, dict[str, Any]]:
    """Shard name -> listing entry (size, stamp: ``listing.stamp``) of its commit record: one paged LIST."""
    return {base[: -len(".json")]: e for base, e in listing.list_detail(fs, storage.join(root, COMMITS_DIR)).items()
            if base.endswith(".json") and not base.startswith(".")}


def load_commits(fs, root: str, names: list[str], sizes: list[int] | None = None) -> list[CommitRecord]:
    """The commit records of shards ``names``, read concurrently (``transfer.cat_many``; ``sizes`` from a
    listing make each one a single ranged GET)."""
    return [CommitRecord.from_json(data, where=f"commit record of shard {n!r}")
            for n, data in zip(names, read_records(fs, root, names, sizes))]


def read_records(fs, root: str, names: list[str], sizes: list[int] | None = None) -> list[bytes]:
    """The bytes of the commit records of shards ``names``, read concurrently through the door (each at most
    ``door.RECORD_CAP`` bytes, and exactly the size a listing gave, ``sizes``); an unreadable one raises."""
    keys = [commit_path(n) for n in names]
    if sizes is None:
        blobs = {}
        for k in keys:
            try:
                blobs[k] = door.read(fs, root, k, bound=door.RECORD_CAP)
            except (OSError, StoreError) as e:
                blobs[k] = e
    else:
        blobs = door.read_many(fs, root, keys, sizes={k: n or None for k, n in zip(keys, sizes)},
                               bound=door.RECORD_CAP)
    out = []
    for n, k in zip(names, keys):
        data = blobs[k]
        if isinstance(data, door.Refused):
            raise CorruptionError(f"commit record of shard {n!r} ({k}): refused, {data.why}")
        if isinstance(data, Exception):
            raise CorruptionError(f"commit record of shard {n!r} unreadable: {type(data).__name__}: {data}")
        out.append(data)
    return out
