"""``hsstore verify``: re-read every committed byte and check it against its commit record.

Checks, per committed shard: every listed file exists with its size and CRC32C (a chunk: its own CRC32C,
and that it is the one the commit record lists for its path); every chunk the
arrays' shapes imply is listed; array shapes and dtypes agree with the manifest and the offsets;
``input_ids``/``loss_mask`` agree with the per-sample columns; in fp8 stores every layer has its scale
array, whose scales are finite and positive. Problems name the shard, the file and the samples whose
tokens the file holds.
"""

from __future__ import annotations

import io
import json
import logging
import tarfile
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import zarr

from . import assets, codec, fp8, layout, shard, storage, wds
from .errors import FetchError, StoreError
from .reader import Store

log = logging.getLogger(__name__)
BATCH_BYTES = 256 << 20


@dataclass
class Problem:
    shard: str
    message: str
    file: str | None = None
    samples: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        where = f"shard {self.shard}" + (f", file {self.file}" if self.file else "")
        who = ""
        if self.samples:
            shown = ", ".join(self.samples[:5]) + (f", ... ({len(self.samples)} samples)" if len(self.samples) > 5 else "")
            who = f" [samples: {shown}]"
        return f"{where}: {self.message}{who}"


@dataclass
class VerifyReport:
    shards: int = 0
    files: int = 0
    bytes: int = 0
    problems: list[Problem] = field(default_factory=list)
    uncommitted: list[str] = field(default_factory=list)
    assets: int = 0  # asset files listed and checked; 0: the store has none (train and show need them)
    # shards whose commit records (format version 1) list checksums that cannot tell one valid chunk from
    # another: checked as far as they go, not problems; `hsstore upgrade` re-derives them
    weak_records: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def samples_in_file(rec: shard.CommitRecord, key: str) -> list[str]:
    """Sample ids whose tokens live in a file (a chunk of a token-major array; metadata: all samples)."""
    ids = rec.samples["sample_id"]
    parts = key.split("/")
    if shard.is_chunk_key(key):  # shards/<name>/<array>/c/<k>[/0]
        if parts[2] == "offsets":
            return list(ids)
        chunk_tokens = rec.chunk_tokens
        k = int(parts[4])
        lo, hi = k * chunk_tokens, (k + 1) * chunk_tokens
        off = rec.offsets
        return [ids[i] for i in range(rec.n_samples) if off[i] < hi and off[i + 1] > lo]
    return list(ids)


def verify(store: Store, progress: Callable[[int], None] | None = None) -> VerifyReport:
    report = VerifyReport(shards=len(store.commits))
    fs, root = store.fs, store.root
    lay = layout.get(store.manifest.layout)
    for rec in store.commits:
        if rec.weak_checksums:
            report.weak_records.append(rec.shard)
        check_committed_shard(store, rec, report, progress)
    try:
        entries = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(storage.join(root, shard.SHARDS_DIR), detail=False)]
    except FileNotFoundError:
        entries = []
    on_disk = {n for n in map(lay.shard_of, entries) if n is not None}
    committed = {c.shard for c in store.commits}
    report.uncommitted = sorted(n for n in on_disk - committed if not n.startswith("."))
    check_assets(store, report)
    return report


def check_assets(store: Store, report: VerifyReport) -> None:
    """Every asset file against ``assets/index.json`` (size, CRC32C); a missing one is a problem."""
    for name in assets.asset_names(store.fs, store.root):
        key = f"{assets.ASSETS_DIR}/{name}"
        try:
            data = assets.read_asset(store.fs, store.root, name, store.url)
        except FileNotFoundError:
            report.problems.append(Problem("(assets)", "listed in assets/index.json but missing", key))
            continue
        except StoreError as e:
            report.problems.append(Problem("(assets)", str(e), key))
            continue
        report.assets += 1
        report.files += 1
        report.bytes += len(data)


def check_committed_shard(store: Store, rec: shard.CommitRecord, report: VerifyReport, progress=None,
                          tails: dict[str, int] | None = None) -> None:
    """Every check of one committed shard: its record against the manifest, then its files through the
    layout (``tails``: see :func:`check_zarr_shard`)."""
    _check_record(store, rec, report)
    try:  # a shard merged by reference: its files are checked where its record says they are
        shard_fs, shard_root, _ = store.shard_location(rec.shard)
    except Exception as e:
        report.problems.append(Problem(rec.shard, f"location {rec.location!r} cannot be opened: "
                                                  f"{type(e).__name__}: {e}"))
        return
    layout.get(store.manifest.layout).check_shard(store, shard_fs, shard_root, rec, report, progress, tails)


def check_zarr_shard(store: Store, fs, root: str, rec: shard.CommitRecord, report: VerifyReport, progress,
                     tails: dict[str, int] | None = None) -> None:
    """``tails`` (``hsstore upgrade``): filled with the CRC32C each intact chunk ends with, read in the same pass."""
    _check_files(fs, root, rec, report, progress, tails)
    _check_arrays(store, rec, report)


def _check_record(store: Store, rec: shard.CommitRecord, report: VerifyReport) -> None:
    m = store.manifest
    if rec.shard in store.manifest_mismatch:
        report.problems.append(Problem(rec.shard, "written under another manifest: manifest.json was changed "
                                                  "after this shard was committed (layers, dtype, hashes, codec "
                                                  "or chunk grid)", "manifest.json"))
    if sorted(rec.layers, key=_slot_order) != [str(l) for l in m.slots]:
        report.problems.append(Problem(rec.shard, f"commit record layers {sorted(rec.layers, key=_slot_order)} "
                                                  f"differ from the manifest's {m.slots}"))
    if rec.chunk_tokens != m.chunk_tokens:
        report.problems.append(Problem(rec.shard, f"chunk_tokens {rec.chunk_tokens} differs from the manifest's "
                                                  f"{m.chunk_tokens}"))


def _slot_order(key: str) -> tuple:
    """Commit-record slot keys in manifest order: layer ids by value, then named features (``final_hidden``)."""
    return (0, int(key), "") if key.lstrip("-").isdigit() else (1, 0, key)


def _check_files(fs, root: str, rec: shard.CommitRecord, report: VerifyReport, progress,
                 tails: dict[str, int] | None = None) -> None:
    keys = list(rec.files)
    batch: list[str] = []
    size = 0
    for i, key in enumerate(keys):
        batch.append(key)
        size += rec.files[key]["size"]
        if size >= BATCH_BYTES or i == len(keys) - 1:
            paths = [storage.join(root, k) for k in batch]
            key_of = dict(zip(paths, batch))
            try:
                blobs = storage.cat_verified(fs, paths, lambda p, b: shard.check_file(rec, key_of[p], b) is None)
            except Exception as e:
                raise FetchError(f"shard {rec.shard}: cannot read files: {type(e).__name__}: {e}") from None
            for k, p in zip(batch, paths):
                data = blobs.get(p)
                failure = storage.fetch_failure(data)
                if failure:  # unreachable is not "missing": verify cannot tell, so it stops
                    raise FetchError(f"shard {rec.shard}, file {k}: read failed after retries ({failure})")
                if data is None or isinstance(data, Exception):
                    report.problems.append(Problem(rec.shard, "file missing" + (f" (referenced store {rec.location!r})"
                                                                                if rec.location else ""),
                                                   k, samples_in_file(rec, k)))
                    continue
                report.files += 1
                report.bytes += len(data)
                wrong = shard.check_file(rec, k, data)
                if wrong:
                    report.problems.append(Problem(rec.shard, wrong, k, samples_in_file(rec, k)))
                elif tails is not None and shard.is_chunk_key(k):
                    tails[k] = codec.chunk_tail(data)  # checked against its payload just now
                if progress:
                    progress(len(data))
            batch, size = [], 0


def _check_arrays(store: Store, rec: shard.CommitRecord, report: VerifyReport) -> None:
    m, name = store.manifest, rec.shard
    base = shard.shard_path(name)
    try:
        g = store._group(name)
    except Exception as e:
        report.problems.append(Problem(name, f"shard group cannot be opened: {e}", f"{base}/zarr.json"))
        return
    for l in m.slots:
        key = f"{base}/{shard.layer_array(l)}"
        try:
            a = g[shard.layer_array(l)]
        except Exception:
            report.problems.append(Problem(name, f"array for layer {l} missing", key))
            continue
        if a.shape != (rec.n_tokens, m.hidden_size):
            report.problems.append(Problem(name, f"layer {l} shape {a.shape} != (tokens {rec.n_tokens}, hidden "
                                                 f"{m.hidden_size}) implied by offsets", key))
        want = shard.layer_attributes(m, l)["hsstore_dtype"]
        if a.dtype != codec.storage_dtype(m.dtype, m.encoding) or a.attrs.get("hsstore_dtype") != want:
            report.problems.append(Problem(name, f"layer {l} dtype {a.dtype}/{a.attrs.get('hsstore_dtype')} "
                                                 f"!= {want} (manifest dtype {m.dtype}, encoding {m.encoding})", key))
        _check_chunks_listed(rec, key, a, report)
        if m.encoding == fp8.ENCODING:
            _check_scales(g, rec, l, report)
    try:
        ids, mask, offsets = (g[n][:] for n in ("input_ids", "loss_mask", "offsets"))
    except Exception as e:
        report.problems.append(Problem(name, f"token arrays unreadable: {type(e).__name__}: {e}"))
        return
    if not np.array_equal(offsets, rec.offsets):
        report.problems.append(Problem(name, "offsets array disagrees with the commit record's lengths",
                                       f"{base}/offsets"))
        return
    if ids.shape[0] != rec.n_tokens or mask.shape[0] != rec.n_tokens:
        report.problems.append(Problem(name, f"input_ids/loss_mask hold {ids.shape[0]}/{mask.shape[0]} tokens, "
                                             f"offsets say {rec.n_tokens}"))
        return
    sums = np.add.reduceat(mask.astype(np.int64), offsets[:-1]) if rec.n_samples else np.zeros(0)
    bad = [rec.samples["sample_id"][i] for i in np.nonzero(sums != np.asarray(rec.samples["loss_tokens"]))[0]]
    if bad:
        report.problems.append(Problem(name, "loss_mask sums disagree with the commit record", f"{base}/loss_mask", bad))


def _check_scales(g: zarr.Group, rec: shard.CommitRecord, layer: int, report: VerifyReport) -> None:
    """An fp8 layer's scale array: present, ``[tokens]`` float32, every chunk committed, every scale finite
    and positive (a bad scale silently scales a whole row)."""
    name = shard.scale_array(layer)
    key = f"{shard.shard_path(rec.shard)}/{name}"
    try:
        a = g[name]
    except Exception:
        report.problems.append(Problem(rec.shard, f"scale array of layer {layer} missing", key))
        return
    if a.shape != (rec.n_tokens,) or a.dtype != fp8.SCALE_DTYPE:
        report.problems.append(Problem(rec.shard, f"layer {layer} scales {a.dtype} {a.shape} != float32 "
                                                  f"(tokens {rec.n_tokens},)", key))
        return
    _check_chunks_listed(rec, key, a, report)
    try:
        scales = a[:]
    except Exception as e:
        report.problems.append(Problem(rec.shard, f"layer {layer} scales unreadable: {type(e).__name__}: {e}", key))
        return
    bad = np.flatnonzero(~(np.isfinite(scales) & (scales > 0)))
    if bad.size:
        tokens = np.searchsorted(rec.offsets, bad, side="right") - 1
        who = [rec.samples["sample_id"][i] for i in np.unique(tokens)]
        report.problems.append(Problem(rec.shard, f"layer {layer}: {bad.size} scales not finite and positive", key,
                                       who))


def _check_chunks_listed(rec: shard.CommitRecord, key: str, a: zarr.Array, report: VerifyReport) -> None:
    n_chunks = -(-a.shape[0] // a.chunks[0]) if a.shape[0] else 0
    missing = [k for k in range(n_chunks) if shard.chunk_key(key, k, a.ndim) not in rec.files]
    if missing:
        report.problems.append(Problem(rec.shard, f"chunks {missing[:5]} of {n_chunks} not in the commit record", key))


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

    def drain(self) -> None:
        while self.read(16 << 20):
            pass


def check_tar_shard(store: Store, fs, root: str, rec: shard.CommitRecord, report: VerifyReport, progress,
                    tails: dict[str, int] | None = None) -> None:
    """One streaming pass over a wds shard's tar: its size and CRC32C; every member's name (safe, and
    the one the commit record lists at that offset), size and CRC32C; ``.npy`` dtypes and shapes against
    the lengths; ``loss_mask`` sums and sample ids against the commit record. Nothing is extracted.
    Every checksum here is of the object's own bytes, so it identifies the data (``tails``: none to fill)."""
    m, name = store.manifest, rec.shard
    key = wds.tar_path(name)
    want = rec.files.get(key)
    members = rec.members or {}
    if want is None or set(members) != set(wds.expected_members(rec, m.slots)):
        report.problems.append(Problem(name, "commit record does not list the tar and each of its members "
                                             f"({len(members)} members listed)", key, list(rec.samples["sample_id"])))
        return
    ids = rec.samples["sample_id"]
    dtype = codec.STORAGE_DTYPE[m.dtype]
    seen: set[str] = set()
    try:
        with fs.open(storage.join(root, key), "rb") as f:
            reader = _CrcReader(f, progress)
            with tarfile.open(fileobj=reader, mode="r|") as tf:
                for info in tf:
                    try:
                        wds.check_member(info, name)
                    except StoreError as e:
                        report.problems.append(Problem(name, str(e), key))
                        continue
                    entry = members.get(info.name)
                    if entry is None:
                        report.problems.append(Problem(name, f"member {info.name!r} is not in the commit record", key))
                        continue
                    i = int(info.name.split(".", 1)[0])
                    who = [ids[i]]
                    data = tf.extractfile(info).read()
                    seen.add(info.name)
                    if [info.offset_data, len(data)] != entry[:2] or codec.crc32c(data) != entry[2]:
                        report.problems.append(Problem(name, f"member {info.name!r}: offset/size/CRC32C differ from "
                                                             "the commit record (corrupted bytes)", key, who))
                        continue
                    _check_member_content(rec, info.name, data, i, dtype, m.hidden_size, key, report)
            reader.drain()
    except FileNotFoundError:
        report.problems.append(Problem(name, "file missing", key, list(ids)))
        return
    except (tarfile.TarError, OSError, EOFError) as e:
        report.problems.append(Problem(name, f"tar unreadable: {type(e).__name__}: {e}", key, list(ids)))
        return
    report.files += 1
    report.bytes += reader.size
    if reader.size != want["size"]:
        report.problems.append(Problem(name, f"size {reader.size} != committed {want['size']} (truncated or rewritten)",
                                       key, list(ids)))
    elif reader.crc != want["crc32c"]:
        report.problems.append(Problem(name, "checksum mismatch (corrupted bytes)", key, list(ids)))
    missing = sorted(set(members) - seen)
    if missing:
        report.problems.append(Problem(name, f"members missing from the tar: {missing[:5]}", key,
                                       sorted({ids[int(n.split('.', 1)[0])] for n in missing})))


def _check_member_content(rec, member: str, data: bytes, i: int, dtype, hidden: int, key: str,
                          report: VerifyReport) -> None:
    sid, T = rec.samples["sample_id"][i], rec.samples["length"][i]
    if member.endswith(".json"):
        try:
            ok = json.loads(data).get("sample_id") == sid
        except (ValueError, AttributeError):
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
    elif member.endswith(".loss_mask.npy") and int(a.sum()) != rec.samples["loss_tokens"][i]:
        report.problems.append(Problem(rec.shard, "loss_mask sum disagrees with the commit record", key, [sid]))
