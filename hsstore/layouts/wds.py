"""The WebDataset layout: one shard is one tar object of per-sample ``.npy`` members.

Layout under the store prefix (see docs/FORMAT.md)::

    shards/<name>.tar              members, per sample i (key = i as 6+ digits, no dots):
        <key>.json                 the sample's columns (sample_id, source, ...), shard, dtype, layers
        <key>.input_ids.npy        [T] int32
        <key>.loss_mask.npy        [T] uint8
        <key>.layer_<LLL>.npy      [T, hidden] per tapped layer; bf16 as its uint16 bits
    commits/<name>.json            written last; ``members`` indexes every member (offset, size, CRC32C)

Why: the plain ``webdataset`` library (or ``tarfile`` + ``np.load``) reads a shard with no hsstore code.
hsstore itself never scans a tar: the commit record's member index gives each member's byte range, so
a read fetches only the requested layers' members (range reads, neighbours coalesced) and checks each
one's tar header (name, regular file, size) and CRC32C. Nothing is ever extracted to disk. Write, read and
``verify``'s check live here; ``layout.get("wds")`` is this module.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import io
import json
import logging
import posixpath
import tarfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from ..format import admission, codec, health
from ..io import door, storage, transfer
from ..io.backends import backend_for
from ..format.commit import SAMPLE_COLUMNS, SHARDS_DIR, CommitRecord, layer_array, sample_offsets
from ..errors import CorruptionError, FetchError, StoreError
from ..format.manifest import Manifest, now_iso
from ..io.memory import pread_fold, row_parts, scatter_rows, scratch
from ..format.report import Problem, VerifyReport

if TYPE_CHECKING:
    from .source import ShardSource

log = logging.getLogger(__name__)

BLOCK = tarfile.BLOCKSIZE  # 512: every member is one ustar header block, then its data padded to blocks
IDS_DTYPE, MASK_DTYPE = np.dtype("<i4"), np.dtype("|u1")


def tar_path(name: str) -> str:
    return f"{SHARDS_DIR}/{name}.tar"


def shard_of(entry: str) -> str | None:
    """The shard an entry of ``shards/`` belongs to (None: not a shard's tar)."""
    return entry[:-len(".tar")] if entry.endswith(".tar") else None


def store_objects() -> dict[str, bytes]:
    """Objects written with the manifest when a store is created: none (a tar needs no parent metadata)."""
    return {}


def sample_key(i: int) -> str:
    """WebDataset groups members by the name before the first dot: a key holds no dots."""
    return f"{i:06d}"


def member_name(i: int, part: str) -> str:
    return f"{sample_key(i)}.{part}"


def layer_part(layer: int) -> str:
    return f"{layer_array(layer)}.npy"


@functools.lru_cache(maxsize=256)
def npy_header(descr: str, shape: tuple[int, ...]) -> bytes:
    """The ``.npy`` header numpy writes for a C-ordered array (data then starts 64-byte aligned)."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": descr, "fortran_order": False, "shape": shape})
    return buf.getvalue()


def check_member(info: tarfile.TarInfo, shard: str) -> None:
    """Refuse what a tar may carry that a shard never does: names outside the shard, links, devices."""
    name = info.name
    parts = name.replace("\\", "/").split("/")
    if posixpath.isabs(name) or name.startswith("\\") or ".." in parts or (len(name) > 1 and name[1] == ":"):
        raise CorruptionError(f"shard {shard!r}, member {name!r}: path outside the shard (refused)")
    if not info.isreg():
        raise CorruptionError(f"shard {shard!r}, member {name!r}: {member_kind(info)} member refused (a shard holds "
                              "regular files only)")


def member_kind(info: tarfile.TarInfo) -> str:
    return ("regular file" if info.isreg() else "symlink" if info.issym() else "hard link" if info.islnk()
            else "fifo" if info.isfifo() else "device" if info.isdev() else "directory" if info.isdir()
            else f"type {info.type!r}")


def tail_problem(rest: bytes) -> str | None:
    """Why the bytes after a tar's last listed member are not the zero blocks its writer ends it with (None: they
    are). Anything else there is a member tar tools and WebDataset would read (a link, a FIFO, a size of
    petabytes) that no commit record lists."""
    body = rest.lstrip(b"\0")
    if not body:
        return None
    at = (len(rest) - len(body)) // BLOCK * BLOCK
    try:
        info = tarfile.TarInfo.frombuf(rest[at:at + BLOCK], "utf-8", "surrogateescape")
    except tarfile.TarError:
        return "bytes after the last listed member that are not the end-of-archive zero blocks"
    return (f"a member after the last listed one, {info.name[:200]!r} ({member_kind(info)}, {info.size:,} bytes "
            "claimed), which the commit record does not list (refused)")


def check_header(block: bytes, name: str, size: int, shard: str) -> None:
    """The tar header in front of a member read by range must be the one the commit record names."""
    try:
        info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
    except tarfile.TarError as e:
        raise CorruptionError(f"shard {shard!r}, member {name!r}: no valid tar header at its recorded offset "
                              f"({e})") from None
    check_member(info, shard)
    if info.name != name or info.size != size:
        raise CorruptionError(f"shard {shard!r}, member {info.name!r} ({info.size} bytes) found where the commit "
                              f"record puts member {name!r} ({size} bytes)")


# -- writing -----------------------------------------------------------------------------------------

@dataclass
class TarObject:
    """A tar as parts (headers, views of the shard buffers, padding): written locally without joining."""

    chunks: list
    crc32c: int
    size: int

    def __len__(self) -> int:
        return self.size

    def parts(self) -> list:
        return [memoryview(c).cast("B") if isinstance(c, np.ndarray) else c for c in self.chunks]

    def tobytes(self) -> bytes:
        return b"".join(self.parts())


class TarBuilder:
    """Members appended in order; records each member's data offset, size and CRC32C."""

    def __init__(self) -> None:
        self.chunks: list = []
        self.pos = 0
        self.members: dict[str, list[int]] = {}

    def add(self, name: str, pieces: Sequence[Any]) -> int:
        pieces = [np.ascontiguousarray(p).reshape(-1).view(np.uint8) if isinstance(p, np.ndarray) else p
                  for p in pieces]
        size = sum(len(p) for p in pieces)
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime = size, 0o644, 0  # mtime 0: a shard's bytes depend on its data only
        self.chunks.append(info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape"))
        crc = None
        for p in pieces:
            crc = codec.crc32c(p, crc)
        self.chunks.extend(pieces)
        self.chunks.append(b"\0" * (-size % BLOCK))
        self.members[name] = [self.pos + BLOCK, size, int(crc if crc is not None else 0)]
        self.pos += BLOCK + size + (-size % BLOCK)
        return size

    def add_npy(self, name: str, a: np.ndarray) -> int:
        return self.add(name, [npy_header(np.lib.format.dtype_to_descr(a.dtype), a.shape), a])

    def finish(self) -> TarObject:
        end = 2 * BLOCK
        end += -(self.pos + end) % tarfile.RECORDSIZE  # as tarfile pads an archive
        self.chunks.append(b"\0" * end)
        crc = None
        for c in self.chunks:
            crc = codec.crc32c(c, crc)
        return TarObject(self.chunks, int(crc), self.pos + end)


def write_shard(fs, root: str, name: str, writer: str, manifest: Manifest, features: dict[int, np.ndarray],
                input_ids: np.ndarray, loss_mask: np.ndarray, samples: dict[str, list],
                stats: dict[str, Any] | None = None, scales: dict | None = None) -> CommitRecord:
    """Write one shard as a tar (one object, fsynced locally) and return its unpublished commit record."""
    if scales is not None:  # the manifest check refuses wds + fp8 first; this guards direct callers
        raise ValueError(f"shard {name!r}: the wds layout holds raw features only (no fp8 scales)")
    offsets = sample_offsets(name, samples, int(input_ids.shape[0]))
    tar = TarBuilder()
    layer_bytes = {l: 0 for l in manifest.all_features}
    ids, mask = input_ids.astype(IDS_DTYPE, copy=False), loss_mask.astype(MASK_DTYPE, copy=False)
    for i in range(len(offsets) - 1):
        a, b = int(offsets[i]), int(offsets[i + 1])
        tar.add(member_name(i, "json"), [json_member(samples, i, name, manifest)])
        tar.add_npy(member_name(i, "input_ids.npy"), ids[a:b])
        tar.add_npy(member_name(i, "loss_mask.npy"), mask[a:b])
        for l in manifest.all_features:
            layer_bytes[l] += tar.add_npy(member_name(i, layer_part(l)), features[l][a:b])
    obj = tar.finish()
    transfer.put_many(fs, {storage.join(root, tar_path(name)): obj}, root)
    return CommitRecord(
        shard=name, writer=writer, n_samples=len(offsets) - 1, n_tokens=int(offsets[-1]), samples=samples,
        layers={str(l): {"stored_bytes": layer_bytes[l], "raw_bytes": int(features[l].nbytes)}
                for l in manifest.all_features},
        files={tar_path(name): {"size": len(obj), "crc32c": obj.crc32c}}, chunk_tokens=manifest.chunk_tokens,
        stats=stats or {}, created_at=now_iso(), members=tar.members,
        manifest_key=manifest.shard_key())


# -- reading -----------------------------------------------------------------------------------------

@dataclass
class _Job:
    name: str
    dest: list[np.ndarray]  # destination rows: contiguous pieces, filled in turn (``memory.row_parts``)
    rows: slice  # rows of the member's array to take
    descr: str
    shape: tuple[int, ...]
    offset: int
    size: int
    crc: int

    @property
    def header(self) -> bytes:
        return npy_header(self.descr, self.shape)


def _member(rec: CommitRecord, name: str) -> list[int]:
    entry = (rec.members or {}).get(name)
    if entry is None:
        raise CorruptionError(f"shard {rec.shard!r}: the commit record lists no member {name!r}")
    if not (isinstance(entry, list) and len(entry) == 3
            and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in entry)):
        raise CorruptionError(f"shard {rec.shard!r}: the commit record's entry of member {name!r} is not "
                              "[offset, size, crc32c]")
    return entry


def _tar_size(rec: CommitRecord) -> int:
    entry = rec.files.get(tar_path(rec.shard))
    if entry is None:
        raise CorruptionError(f"shard {rec.shard!r}: the commit record does not list {tar_path(rec.shard)}")
    return entry["size"]


def file_bound(manifest: Manifest, rec: CommitRecord, key: str) -> int:
    """The tar's bound: the size a tar of the record's members takes (``tar_layout``, from the samples' lengths,
    never from the offsets the record lists); 0 when the record cannot say (nothing of it may be read)."""
    if key != tar_path(rec.shard):
        return 0
    try:
        return tar_layout(rec, manifest)[1]
    except CorruptionError:
        return 0


def json_member(samples: dict[str, list], i: int, shard: str, manifest: Manifest) -> bytes:
    """Sample ``i``'s ``.json`` member: its columns, the shard's name, the manifest's dtype and layers, as compact
    JSON, so its bytes follow from a commit record and its manifest alone."""
    meta = {c: samples[c][i] for c in SAMPLE_COLUMNS}
    meta.update(shard=shard, dtype=manifest.dtype, layers=list(manifest.layers))
    return json.dumps(meta, separators=(",", ":")).encode()


def tar_layout(rec: CommitRecord, m: Manifest) -> tuple[dict[str, tuple[int, int]], int]:
    """(member name -> (data offset, size) in tar order, the tar's size) of the tar the writer makes for ``rec``
    (``TarBuilder``: one ustar header block per member, data padded to blocks, two end blocks, padding to a tar
    record): computed from the samples' lengths and the manifest (``_member_bounds``), so a member offset or a
    header size forged to a terabyte never sizes a read. Kept on the record (parsed once per shard)."""
    got = getattr(rec, "_tar_layout", None)
    if got is not None and got[0] is m:
        return got[1]
    sizes = _member_bounds(rec, m)
    out, pos = {}, 0
    for name in expected_members(rec, m.all_features):
        size = sizes[name]
        out[name] = (pos + BLOCK, size)
        pos += BLOCK + size + (-size % BLOCK)
    end = 2 * BLOCK
    end += -(pos + end) % tarfile.RECORDSIZE
    rec._tar_layout = (m, (out, pos + end))
    return out, pos + end


def _check_jobs(rec: CommitRecord, m: Manifest, jobs: list["_Job"]) -> None:
    """Refuse, before any buffer is sized or byte read, a member whose listed offset and size are not where and
    what the writer's tar puts it (``tar_layout``), or a tar of another listed size (a forged record)."""
    layout, total = tar_layout(rec, m)
    tar_size = _tar_size(rec)
    for job in jobs:
        want = len(job.header) + int(np.prod(job.shape)) * np.dtype(job.descr).itemsize
        if (job.offset, job.size) != layout.get(job.name) or job.size != want or tar_size != total:
            at, n = layout.get(job.name, (0, want))
            raise CorruptionError(f"shard {rec.shard!r}, member {job.name!r}: the commit record lists {job.size:,} "
                                  f"bytes at offset {job.offset:,} of a {tar_size:,}-byte tar; its samples' tar "
                                  f"holds it as {n:,} bytes at offset {at:,} of {total:,} (forged or damaged record; "
                                  "run hsstore verify)")


def check_extent(src: ShardSource, rec: CommitRecord) -> None:
    """Refuse a record whose members are not where and what the tar of its samples' lengths puts them
    (``layout_problem``): its lengths are then not the boundaries its tar holds. From the record alone, once per
    record object."""
    if getattr(rec, "_extent_ok", False):
        return
    why = layout_problem(rec, src.manifest)
    if why:
        raise CorruptionError(f"shard {rec.shard!r}, file {tar_path(rec.shard)}: {why}")
    rec._extent_ok = True


def layout_problem(rec: CommitRecord, m: Manifest) -> str | None:
    """Why the record's tar and members are not those the writer makes of its samples (None: they are): every
    member listed, each at the offset and of the size ``tar_layout`` gives it, the tar of its size."""
    key = tar_path(rec.shard)
    want = rec.files.get(key)
    members = rec.members or {}
    if want is None or set(members) != set(expected_members(rec, m.all_features)):
        return f"commit record does not list the tar and each of its members ({len(members)} members listed)"
    try:
        layout, total = tar_layout(rec, m)
    except CorruptionError as e:
        return str(e)
    moved = [n for n, (at, size) in layout.items() if members[n][:2] != [at, size]]
    if moved:  # the record's offsets are not where the writer's tar puts them: never followed
        n = moved[0]
        return (f"member {n!r}: the commit record lists {members[n][1]:,} bytes at offset {members[n][0]:,}, its "
                f"samples' tar holds it as {layout[n][1]:,} at {layout[n][0]:,} ({len(moved)} member(s) moved; "
                "forged or damaged record, the tar is not read)")
    if want["size"] != total:  # another size than its members and tar's framing take: never streamed
        return f"refused ({want['size']:,} bytes listed, a tar of its members is {total:,})"
    return _columns_problem(rec, m)


def _columns_problem(rec: CommitRecord, m: Manifest) -> str | None:
    """Why the record's columns are not those its tar's ``.json`` members hold (None: they are): each member's
    listed size and CRC32C against the bytes the record's columns make (``json_member``). Readers never read
    those members, so an id or column edited in the record is refused here, from the record alone."""
    for i in range(rec.n_samples):
        name = member_name(i, "json")
        data = json_member(rec.samples, i, rec.shard, m)
        if list(rec.members[name][1:3]) != [len(data), codec.crc32c(data)]:
            return (f"member {name!r}: sample {rec.samples['sample_id'][i]!r}'s columns in the commit record are not "
                    "those its tar holds (forged or damaged record, the tar is not read)")
    return None


def read_into(src: ShardSource, rec: CommitRecord, start: int, stop: int, layers: Sequence[int], ids: np.ndarray,
              mask: np.ndarray, feats: np.ndarray, carry: dict | None = None, scales: np.ndarray | None = None,
              ) -> None:
    """Tokens ``start:stop`` of a tar shard into ``ids``, ``mask`` and layer-major ``feats``: only the
    members of the requested layers of the overlapping samples are read; each is checked (tar header,
    ``.npy`` header, CRC32C). ``carry`` is unused: samples never straddle members. ``scales``: always
    None (wds stores hold raw features; the manifest check refuses fp8)."""
    if carry is not None:
        carry.clear()
    m = src.manifest
    off = rec.offsets
    H, fdescr = m.hidden_size, np.lib.format.dtype_to_descr(codec.STORAGE_DTYPE[m.dtype])
    jobs: list[_Job] = []
    feature_starts: list[int] = []  # data offsets of every feature member of these samples, asked for or not
    first = int(np.searchsorted(off, start, side="right") - 1)
    for i in range(first, rec.n_samples):
        a, b = int(off[i]), int(off[i + 1])
        if a >= stop:
            break
        lo, hi = max(start, a), min(stop, b)
        rows, dst = slice(lo - a, hi - a), slice(lo - start, hi - start)
        parts = [("input_ids.npy", [ids[dst]], IDS_DTYPE.str, (b - a,)),
                 ("loss_mask.npy", [mask[dst]], MASK_DTYPE.str, (b - a,))]
        parts += [(layer_part(l), row_parts(feats[j], dst.start, dst.stop), fdescr, (b - a, H))
                  for j, l in enumerate(layers)]
        for part, dest, descr, shape in parts:
            name = member_name(i, part)
            jobs.append(_Job(name, dest, rows, descr, shape, *_member(rec, name)))
        feature_starts += [_member(rec, member_name(i, layer_part(l)))[0] for l in m.all_features]
    _read_members(src, rec, jobs, feature_starts)


def read_loss_mask(src: ShardSource, rec: CommitRecord) -> np.ndarray:
    """A shard's loss_mask whole: its samples' ``.loss_mask.npy`` members and nothing else of the tar, each
    checked as ``read_into`` checks it (where the record's samples put it, tar header, ``.npy`` header, CRC32C)."""
    off, mask = rec.offsets, np.empty(rec.n_tokens, MASK_DTYPE)
    jobs: list[_Job] = []
    for i in range(rec.n_samples):
        a, b = int(off[i]), int(off[i + 1])
        name = member_name(i, "loss_mask.npy")
        jobs.append(_Job(name, [mask[a:b]], slice(0, b - a), MASK_DTYPE.str, (b - a,), *_member(rec, name)))
    starts = [_member(rec, member_name(i, layer_part(l)))[0] for i in range(rec.n_samples)
              for l in src.manifest.all_features]
    _read_members(src, rec, jobs, starts)
    return mask


def _read_members(src: ShardSource, rec: CommitRecord, jobs: list[_Job], feature_starts: list[int]) -> None:
    """The jobs' members of the shard's tar, checked against where the record's samples put them first, read
    from the local file or by byte range (``feature_starts``: every feature member's data offset, which a range
    never reads through)."""
    _check_jobs(rec, src.manifest, jobs)
    fs, root, url = src.locate(rec.shard)  # another store's, for a shard merged by reference
    if backend_for(fs).local_paths:
        _read_local(root, rec, jobs)
    else:
        _read_remote(fs, root, _spans(jobs, sorted(feature_starts)), rec, url)


def chunk_files(manifest: Manifest, rec: CommitRecord, spans: Sequence[tuple[int, int]], layers: Sequence[int]
                ) -> dict[str, int]:
    """None: a chunk cache does not serve tars (``layout_spec``'s declaration), so no read leaves a copy."""
    return {}


def _finish(job: _Job, npy: bytes | np.ndarray, data: np.ndarray, crc: int, shard: str) -> None:
    """Check a member read (``npy``: its first bytes, ``data``: its array bytes) and copy the rows."""
    if crc != job.crc:
        raise CorruptionError(f"shard {shard!r}, member {job.name!r}: checksum mismatch (corrupted bytes)")
    head = job.header
    if bytes(npy[:len(head)]) != head:
        raise CorruptionError(f"shard {shard!r}, member {job.name!r}: .npy header is not the expected "
                              f"{job.descr} {list(job.shape)} array")
    if data is not None and job.dest:
        width = job.shape[1] if len(job.shape) > 1 else 1
        vals = data.view(job.dest[0].dtype)
        scatter_rows(job.dest, (vals.reshape(-1, width) if width > 1 else vals)[job.rows])


def _read_at(fd: int, offset: int, buf: np.ndarray, crc: int | None = None) -> int:
    """Copy ``buf.nbytes`` bytes of the tar open as ``fd`` from ``offset`` into ``buf`` with ``preadv`` (the
    kernel's copy out of the page cache is the only one, each block checksummed while in cache,
    ``memory.pread_fold``); a short file is corruption. Returns the CRC32C of ``crc``'s bytes followed by these
    (``codec.crc32c``)."""
    n, flat = buf.nbytes, buf.reshape(-1).view(np.uint8)
    got, folded = pread_fold(fd, flat, offset, codec.crc32c, crc)
    if got != n:
        raise EOFError(f"file ends {n - got} bytes early")
    return codec.crc32c(flat, crc) if folded is None else folded  # nothing folded: an empty buffer's


def _read_local(root: str, rec: CommitRecord, jobs: list[_Job]) -> None:
    """The jobs' members from the local tar, opened through the door (a regular file beneath the root, no link
    followed) and of the size the record lists."""
    shard, key = rec.shard, tar_path(rec.shard)
    try:
        with door.opened(root, key, bound=_tar_size(rec)) as (fd, size):  # cut short: members before the cut read
            if size == 0:
                raise CorruptionError(f"shard {shard!r}, file {key}: empty (truncated)")
            _read_jobs(fd, jobs, shard)
    except FileNotFoundError:
        raise CorruptionError(f"shard {shard!r}, file {key}: missing") from None
    except door.Refused as e:
        raise CorruptionError(f"shard {shard!r}, file {key}: refused ({e.why})") from None


def _read_jobs(src: int, jobs: list[_Job], shard: str) -> None:
    for job in jobs:
        where = f"shard {shard!r}, member {job.name!r}"
        head = np.empty(BLOCK + len(job.header), np.uint8)
        n_data = job.size - len(job.header)
        whole = job.rows.stop - job.rows.start == job.shape[0] and len(job.dest) == 1 and job.dest[0].nbytes == n_data
        with contextlib.ExitStack() as stack:
            data = job.dest[0] if whole else stack.enter_context(scratch(n_data))  # reused: no fresh pages per read
            try:
                _read_at(src, job.offset - BLOCK, head)
                check_header(head[:BLOCK].tobytes(), job.name, job.size, shard)
                crc = _read_at(src, job.offset + len(job.header), data, codec.crc32c(head[BLOCK:]))
            except EOFError as e:
                raise CorruptionError(f"{where}: truncated tar ({e})") from None
            _finish(job, head[BLOCK:], None if whole else data.view(np.uint8), crc, shard)


def _spans(jobs: list[_Job], feature_starts: list[int]) -> list[tuple[int, int, list[_Job]]]:
    """Byte ranges to fetch: each job's tar header + member, neighbours merged unless a feature member
    (``feature_starts``: sorted data offsets) that was not asked for lies between them (small json
    members are read through)."""
    jobs = sorted(jobs, key=lambda j: j.offset)
    spans: list[tuple[int, int, list[_Job]]] = []
    for j in jobs:
        lo, hi = j.offset - BLOCK, j.offset + j.size
        if spans:
            s_lo, s_hi, group = spans[-1]
            k = bisect.bisect_left(feature_starts, s_hi)
            if k == len(feature_starts) or feature_starts[k] >= lo:  # nothing unwanted in between
                spans[-1] = (s_lo, hi, group + [j])
                continue
        spans.append((lo, hi, [j]))
    return spans


def _read_remote(fs, root: str, spans: list[tuple[int, int, list[_Job]]], rec: CommitRecord, url: str) -> None:
    """Fetch the spans by byte range and finish their members. A span whose bytes fail a check (length, tar
    header, CRC32C) is fetched again, with backoff, up to ``transfer.FETCH_ATTEMPTS`` times in all before it
    is called corrupt: a body cut or damaged in transit looks complete to the HTTP client. A request that
    fails after the client's retries is a ``FetchError`` (never skipped as corrupt by the loader)."""
    todo = list(spans)
    for attempt in range(1, transfer.FETCH_ATTEMPTS + 1):
        blobs = _fetch(fs, root, todo, rec, url)
        failed = []
        for span, blob in zip(todo, blobs):
            try:
                _finish_span(span, blob, rec)
            except CorruptionError as e:
                if attempt == transfer.FETCH_ATTEMPTS or isinstance(blob, FileNotFoundError):
                    raise
                failed.append(span)
                first = e
        if not failed:
            return
        log.warning("%d range(s) of %s failed their checks, fetching again (attempt %d of %d): %s",
                    len(failed), tar_path(rec.shard), attempt + 1, transfer.FETCH_ATTEMPTS, first)
        time.sleep(transfer.FETCH_BACKOFF_S * 2 ** (attempt - 1))
        todo = failed


def _fetch(fs, root: str, spans: list[tuple[int, int, list[_Job]]], rec: CommitRecord, url: str) -> list:
    try:
        blobs = door.read_ranges(fs, root, tar_path(rec.shard), [(s[0], s[1]) for s in spans], size=_tar_size(rec))
    except Exception as e:
        raise FetchError(f"shard {rec.shard!r} of store {url!r}: read failed: {type(e).__name__}: {e}") from None
    for blob in blobs:
        failure = transfer.fetch_failure(blob)
        if failure:
            raise FetchError(f"shard {rec.shard!r} of store {url!r}, file {tar_path(rec.shard)}: read failed after "
                             f"retries ({failure})")
    return blobs


def _finish_span(span: tuple[int, int, list[_Job]], blob, rec: CommitRecord) -> None:
    lo, hi, group = span
    if isinstance(blob, FileNotFoundError):
        raise CorruptionError(f"shard {rec.shard!r}, file {tar_path(rec.shard)}: missing")
    if len(blob) != hi - lo:
        raise CorruptionError(f"shard {rec.shard!r}, file {tar_path(rec.shard)}: truncated tar "
                              f"({len(blob)} of {hi - lo} bytes at offset {lo})")
    buf = np.frombuffer(blob, np.uint8)
    for job in group:
        a = job.offset - lo
        check_header(bytes(buf[a - BLOCK:a]), job.name, job.size, rec.shard)
        npy = buf[a:a + job.size]
        _finish(job, npy, npy[len(job.header):], codec.crc32c(npy), rec.shard)


def expected_members(rec: CommitRecord, layers: Sequence[int]) -> list[str]:
    """Every member a shard's tar holds, in order."""
    parts = ["json", "input_ids.npy", "loss_mask.npy"] + [layer_part(l) for l in layers]
    return [member_name(i, p) for i in range(rec.n_samples) for p in parts]


# -- checking (verify) --------------------------------------------------------------------------------

class _CrcReader:
    """A file wrapper that checksums and counts what is read through it (one pass over a tar)."""

    def __init__(self, f, progress) -> None:
        self.f, self.progress, self.crc, self.size = f, progress, None, 0

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        if data:
            self.crc = codec.crc32c(data, self.crc)
            self.size += len(data)
            if self.progress:
                self.progress(len(data))
        return data

    def read_exact(self, n: int) -> bytes:
        """``n`` bytes (fewer only at the end of the stream), in pieces of at most 16 MiB."""
        parts, got = [], 0
        while got < n:
            piece = self.read(min(n - got, 16 << 20))
            if not piece:
                break
            parts.append(piece)
            got += len(piece)
        return b"".join(parts)

    def drain(self) -> None:
        while self.read(16 << 20):
            pass


def check_shard(src: ShardSource, rec: CommitRecord, report: VerifyReport, progress: Callable[[int], None] | None,
                tails: dict[str, int] | None = None) -> None:
    """One streaming pass over a wds shard's tar: its size and CRC32C; every member's name (safe, and
    the one the commit record lists at that offset), size and CRC32C; ``.npy`` dtypes and shapes against
    the lengths; ``loss_mask`` sums and sample ids against the commit record. Nothing is extracted.
    Every checksum here is of the object's own bytes, so it identifies the data (``tails``: none to fill)."""
    m, name = src.manifest, rec.shard
    fs, root, _ = src.locate(name)  # another store's, for a shard merged by reference
    key = tar_path(name)
    ids = rec.samples["sample_id"]
    why = layout_problem(rec, m)  # the admission's extent rule: reported with the record's (verify), not followed
    if why:
        report.problems.append(Problem(name, why, key, list(ids)))
        return
    want = rec.files[key]
    layout, total = tar_layout(rec, m)
    before = len(report.problems)
    try:
        with door.stream(fs, root, key, size=want["size"], where=f"shard {name!r}") as f:
            reader, seen, tally = _scan_members(f, progress, rec, m, layout, report)
    except FileNotFoundError:
        report.problems.append(Problem(name, "file missing", key, list(ids)))
        return
    except door.Refused as e:
        report.problems.append(Problem(name, f"refused ({e.why})", key, list(ids)))
        return
    except OSError as e:
        report.problems.append(Problem(name, f"tar unreadable: {type(e).__name__}: {e}", key, list(ids)))
        return
    report.files += 1
    report.bytes += reader.size
    if reader.size != want["size"]:
        report.problems.append(Problem(name, f"size {reader.size} != committed {want['size']} (truncated or rewritten)",
                                       key, list(ids)))
    elif reader.crc != want["crc32c"]:
        # readers take each sample's members by byte range: the samples hit are those whose members failed (named
        # above); damage elsewhere in the tar (headers, padding) costs no sample
        hit = sorted({sid for p in report.problems[before:] for sid in p.samples})
        report.problems.append(Problem(name, "checksum mismatch (corrupted bytes" + (
            ")" if hit else ", in the tar's headers or padding: every member verifies, no sample is damaged)"),
            key, hit))
    health.report_values(tally, m.hidden_size, report, key)
    missing = [n for n in layout if n not in seen]
    if missing:
        report.problems.append(Problem(name, f"members missing or unreadable from {missing[0]!r} on "
                                             f"({len(missing)} of {len(layout)}): {missing[:5]}", key,
                                       sorted({ids[int(n.split('.', 1)[0])] for n in missing})))


def _scan_members(f, progress: Callable[[int], None] | None, rec: CommitRecord, m: Manifest,
                  layout: dict[str, tuple[int, int]], report: VerifyReport,
                  ) -> tuple[_CrcReader, set[str], health.ValueTally]:
    """``check_shard``'s one pass over the tar stream ``f``, member by member where ``layout`` (``tar_layout``)
    puts them: each one's tar header (a regular file, its name, the size its array takes: what a header
    declares never sizes a read), its bytes against the record's CRC32C and its content; then the end of the
    archive, up to the tar's listed size. A header that is not the expected one ends the pass (what follows it
    is reported unread). Returns the stream's reader (size, CRC32C), the members seen whole and the features'
    value tally."""
    name, key, members, ids = rec.shard, tar_path(rec.shard), rec.members or {}, rec.samples["sample_id"]
    dtype = codec.STORAGE_DTYPE[m.dtype]
    tally = health.ValueTally(rec, m.all_features, m.dtype)
    features = {layer_part(l): l for l in m.all_features}
    seen: set[str] = set()
    reader = _CrcReader(f, progress)
    for member, (at, size) in layout.items():
        i = int(member.split(".", 1)[0])
        who = [ids[i]]
        head = reader.read_exact(BLOCK)
        try:
            if len(head) < BLOCK:
                raise CorruptionError(f"shard {name!r}, member {member!r}: the tar ends before its header")
            check_header(head, member, size, name)
        except CorruptionError as e:
            report.problems.append(Problem(name, f"{e} (refused; the members after it are not checked)", key, who))
            break
        data = reader.read_exact(size)
        reader.read_exact(-size % BLOCK)
        if len(data) < size:
            break
        seen.add(member)
        if codec.crc32c(data) != members[member][2]:
            report.problems.append(Problem(name, f"member {member!r}: CRC32C differs from the commit record "
                                                 "(corrupted bytes)", key, who))
            continue
        _check_member_content(rec, member, data, i, dtype, m.hidden_size, key, report)
        feature = features.get(member.split(".", 1)[1])
        if feature is not None:
            T = rec.samples["length"][i]
            rows = np.frombuffer(data, np.uint8, offset=len(data) - T * m.hidden_size * dtype.itemsize)
            tally.add(feature, int(rec.offsets[i]), rows.view(dtype).reshape(T, m.hidden_size))
    else:  # every member seen: what follows must be the end of the archive (at most its blocks and a record)
        why = tail_problem(reader.read_exact(2 * BLOCK + tarfile.RECORDSIZE))
        if why:
            report.problems.append(Problem(name, why, key))
    reader.drain()
    return reader, seen, tally


JSON_MEMBER_CAP = 64 << 10  # a sample's .json member: its ids and columns


def _member_bounds(rec: CommitRecord, m: Manifest) -> dict[str, int]:
    """Member name -> the size it must have: a ``.npy`` member exactly its header plus the array of the record's
    length, a ``.json`` member at most ``JSON_MEMBER_CAP`` (and what the record lists). A record listing anything
    else is refused here, before the tar is opened."""
    fdescr = np.lib.format.dtype_to_descr(codec.STORAGE_DTYPE[m.dtype])
    out = {}
    for i, T in enumerate(rec.samples["length"]):
        parts = [("input_ids.npy", IDS_DTYPE.str, (T,)), ("loss_mask.npy", MASK_DTYPE.str, (T,))]
        parts += [(layer_part(l), fdescr, (T, m.hidden_size)) for l in m.all_features]
        for part, descr, shape in parts:
            out[member_name(i, part)] = len(npy_header(descr, shape)) + int(np.prod(shape)) * np.dtype(descr).itemsize
        jname = member_name(i, "json")
        out[jname] = _member(rec, jname)[1]
        if out[jname] > JSON_MEMBER_CAP:
            raise CorruptionError(f"member {jname!r}: {out[jname]:,} bytes listed, more than a sample's JSON takes")
    for n, size in out.items():
        if _member(rec, n)[1] != size:
            raise CorruptionError(f"member {n!r}: the commit record lists {_member(rec, n)[1]:,} bytes, its array "
                                  f"takes {size:,} (forged or damaged record)")
    return out


def _check_member_content(rec, member: str, data: bytes, i: int, dtype, hidden: int, key: str,
                          report: VerifyReport) -> None:
    sid, T = rec.samples["sample_id"][i], rec.samples["length"][i]
    if member.endswith(".json"):
        try:
            ok = door.load_json(data, f"member {member!r}").get("sample_id") == sid
        except (CorruptionError, AttributeError):
            ok = False
        if not ok:
            report.problems.append(Problem(rec.shard, f"member {member!r} does not name sample {sid!r}", key, [sid]))
        return
    want = {"input_ids.npy": (np.dtype("<i4"), (T,)), "loss_mask.npy": (np.dtype("|u1"), (T,))}.get(
        member.split(".", 1)[1], (dtype, (T, hidden)))
    try:
        a = np.load(io.BytesIO(data), allow_pickle=False)
    except ValueError as e:
        report.problems.append(Problem(rec.shard, f"member {member!r} is not a .npy array ({e})", key, [sid]))
        return
    if (a.dtype, a.shape) != want:
        report.problems.append(Problem(rec.shard, f"member {member!r}: {a.dtype} {list(a.shape)}, expected "
                                                  f"{want[0]} {list(want[1])}", key, [sid]))
    elif member.endswith(".loss_mask.npy"):
        bad = admission.loss_mask_problem(rec, a, key, range(i, i + 1))
        if bad:
            report.problems.append(bad)
