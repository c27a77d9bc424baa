"""``hsstore verify``: re-read every committed byte and check it against its commit record.

Checks, per committed shard: every listed file exists with its size and CRC32C; every chunk the
arrays' shapes imply is listed; array shapes and dtypes agree with the manifest and the offsets;
``input_ids``/``loss_mask`` agree with the per-sample columns. Problems name the shard, the file and
the samples whose tokens the file holds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import zarr

from . import codec, shard, storage
from .errors import FetchError
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

    @property
    def ok(self) -> bool:
        return not self.problems


def samples_in_file(rec: shard.CommitRecord, key: str) -> list[str]:
    """Sample ids whose tokens live in a file (a chunk of a token-major array; metadata: all samples)."""
    ids = rec.samples["sample_id"]
    parts = key.split("/")
    if len(parts) >= 5 and parts[3] == "c":  # shards/<name>/<array>/c/<k>[/0]
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
    for rec in store.commits:
        _check_record(store, rec, report)
        _check_files(fs, root, rec, report, progress)
        _check_arrays(store, rec, report)
    try:
        on_disk = {p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(storage.join(root, shard.SHARDS_DIR), detail=False)}
    except FileNotFoundError:
        on_disk = set()
    committed = {c.shard for c in store.commits}
    report.uncommitted = sorted(n for n in on_disk - committed if not n.startswith(".") and n != "zarr.json")
    return report


def _check_record(store: Store, rec: shard.CommitRecord, report: VerifyReport) -> None:
    m = store.manifest
    if rec.shard in store.manifest_mismatch:
        report.problems.append(Problem(rec.shard, "written under another manifest: manifest.json was changed "
                                                  "after this shard was committed (layers, dtype, hashes, codec "
                                                  "or chunk grid)", "manifest.json"))
    if sorted(rec.layers, key=int) != [str(l) for l in m.layers]:
        report.problems.append(Problem(rec.shard, f"commit record layers {sorted(rec.layers, key=int)} "
                                                  f"differ from the manifest's {list(m.layers)}"))
    if rec.chunk_tokens != m.chunk_tokens:
        report.problems.append(Problem(rec.shard, f"chunk_tokens {rec.chunk_tokens} differs from the manifest's "
                                                  f"{m.chunk_tokens}"))


def _check_files(fs, root: str, rec: shard.CommitRecord, report: VerifyReport, progress) -> None:
    keys = list(rec.files)
    batch: list[str] = []
    size = 0
    for i, key in enumerate(keys):
        batch.append(key)
        size += rec.files[key]["size"]
        if size >= BATCH_BYTES or i == len(keys) - 1:
            paths = [storage.join(root, k) for k in batch]
            want_of = {p: rec.files[k] for k, p in zip(batch, paths)}
            try:
                blobs = storage.cat_verified(fs, paths, lambda p, b: len(b) == want_of[p]["size"]
                                             and codec.crc32c(b) == want_of[p]["crc32c"])
            except Exception as e:
                raise FetchError(f"shard {rec.shard}: cannot read files: {type(e).__name__}: {e}") from None
            for k, p in zip(batch, paths):
                data = blobs.get(p)
                want = rec.files[k]
                failure = storage.fetch_failure(data)
                if failure:  # unreachable is not "missing": verify cannot tell, so it stops
                    raise FetchError(f"shard {rec.shard}, file {k}: read failed after retries ({failure})")
                if data is None or isinstance(data, Exception):
                    report.problems.append(Problem(rec.shard, "file missing", k, samples_in_file(rec, k)))
                    continue
                report.files += 1
                report.bytes += len(data)
                if len(data) != want["size"]:
                    report.problems.append(Problem(rec.shard, f"size {len(data)} != committed {want['size']} "
                                                              "(truncated or rewritten)", k, samples_in_file(rec, k)))
                elif codec.crc32c(data) != want["crc32c"]:
                    report.problems.append(Problem(rec.shard, "checksum mismatch (corrupted bytes)", k,
                                                   samples_in_file(rec, k)))
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
    for l in m.layers:
        key = f"{base}/{shard.layer_array(l)}"
        try:
            a = g[shard.layer_array(l)]
        except Exception:
            report.problems.append(Problem(name, f"array for layer {l} missing", key))
            continue
        if a.shape != (rec.n_tokens, m.hidden_size):
            report.problems.append(Problem(name, f"layer {l} shape {a.shape} != (tokens {rec.n_tokens}, hidden "
                                                 f"{m.hidden_size}) implied by offsets", key))
        if a.dtype != codec.STORAGE_DTYPE[m.dtype] or a.attrs.get("hsstore_dtype") != m.dtype:
            report.problems.append(Problem(name, f"layer {l} dtype {a.dtype}/{a.attrs.get('hsstore_dtype')} "
                                                 f"!= manifest {m.dtype}", key))
        _check_chunks_listed(rec, key, a, report)
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


def _check_chunks_listed(rec: shard.CommitRecord, key: str, a: zarr.Array, report: VerifyReport) -> None:
    n_chunks = -(-a.shape[0] // a.chunks[0]) if a.shape[0] else 0
    missing = [k for k in range(n_chunks) if f"{key}/c/{k}/0" not in rec.files]
    if missing:
        report.problems.append(Problem(rec.shard, f"chunks {missing[:5]} of {n_chunks} not in the commit record", key))
