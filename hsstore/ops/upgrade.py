"""``hsstore upgrade``: rewrite commit records of format version 1 so that their checksums identify every
chunk (format version 2), then the manifest's version; and add feature statistics (``format/health.py``) to
records written before them, computed from the shard's data.

Version 1 records list each chunk object's whole CRC32C, which is the same constant for every valid chunk
(payload + its own CRC32C), so a valid chunk at the wrong path passed every check. Version 2 lists the
payload's CRC32C, the value the chunk ends with. A record is rewritten only after its shard passed all of
``verify``'s checks, every chunk's own CRC32C included, in the same read that gives the new checksums.

Safe to interrupt and re-run: each record is replaced whole and atomically (a rename on local disk, one PUT
on object stores), so every record is the old or the new one; records already at version 2 are skipped;
a record that changed since the store was opened is left alone. The chunks are bound as they are now: a
chunk already in the wrong place that no other check notices (loss-mask sums, shapes) stays there.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Callable

from ..format import commit, health, index
from ..io import storage, transfer
from ..format.manifest import FORMAT_VERSION, read_manifest
from ..io.storage import MANIFEST_FILE
from ..store.reader import Store
from ..format.report import Problem, VerifyReport
from .verify import check_committed_shard

log = logging.getLogger(__name__)


@dataclass
class UpgradeResult:
    rewritten: int = 0
    current: int = 0  # records already of the current version
    refused: list[Problem] = field(default_factory=list)  # why shards were left as they were
    manifest_upgraded: bool = False


def upgrade(store: Store, progress: Callable[[int], None] | None = None) -> UpgradeResult:
    """Rewrite every older commit record of ``store`` whose shard checks out; then, when no older record is
    left, the manifest's ``format_version`` (so hsstore from before refuses the store instead of reporting
    every chunk as corrupt). ``progress`` gets the bytes read."""
    result = UpgradeResult()
    # the rewritten records, as one index segment: entries of the older versions are stale from now on
    # (their size and stamp differ from the listing's), this segment's are current
    appender = index.SegmentAppender(store.fs, store.root, "upgrade")
    try:
        _upgrade_records(store, result, appender, progress)
    finally:
        appender.flush()
    if not result.refused and store.manifest.format_version < FORMAT_VERSION:
        result.manifest_upgraded = _upgrade_manifest(store)
    return result


def _upgrade_records(store: Store, result: UpgradeResult, appender: index.SegmentAppender, progress) -> None:
    for rec in store.commits:
        if rec.binds_chunks and health.has_stats(rec):
            result.current += 1
            continue
        report = VerifyReport(shards=1)
        tails: dict[str, int] = {}
        check_committed_shard(store, rec, report, progress, tails)
        if report.problems:
            result.refused += report.problems
            continue
        files = {k: {**e, "crc32c": tails[k]} if commit.is_chunk_key(k) and not rec.binds_chunks else e
                 for k, e in rec.files.items()}
        new = dataclasses.replace(rec, files=files, format_version=FORMAT_VERSION,
                                  stats={**rec.stats, "features": shard_feature_stats(store, rec)})
        (now,) = commit.load_commits(store.fs, store.root, [rec.shard])
        if now != rec:  # replaced since the store was opened (another upgrade, by hand): not ours to overwrite
            if now.binds_chunks and health.has_stats(now):
                result.current += 1
            else:
                result.refused.append(Problem(rec.shard, "commit record changed while upgrading; run again",
                                              commit.commit_path(rec.shard)))
            continue
        appender.add(new, commit.publish(store.fs, store.root, new))
        result.rewritten += 1
        log.debug("upgraded the commit record of shard %s", rec.shard)


def shard_feature_stats(store: Store, rec: commit.CommitRecord) -> dict:
    """A shard's ``stats["features"]`` computed from its data (every feature of every sample, read and checked)."""
    m = store.manifest
    off = rec.offsets
    per_sample = []
    for i in range(rec.n_samples):
        a, b = int(off[i]), int(off[i + 1])
        scales = store.new_scales(len(m.all_features), b - a)
        _, _, bits = store.read_range(rec.shard, a, b, m.all_features, scales_out=scales)
        per_sample.append(health.bits_stats(bits, m.dtype, scales, m.encoding, m.hidden_size))
    return health.shard_stats(m.all_features, rec.samples["length"], m.hidden_size, per_sample)


def _upgrade_manifest(store: Store) -> bool:
    """Raise the manifest's version when every record (those committed since opening too) is current."""
    known = {c.shard for c in store.commits}
    later = [n for n in commit.list_committed(store.fs, store.root) if n not in known]
    if not all(c.binds_chunks for c in commit.load_commits(store.fs, store.root, later)):
        return False  # an older writer is still adding to the store: a re-run finishes the job
    path = storage.join(store.root, MANIFEST_FILE)
    now = read_manifest(store.fs, store.root, store.url)
    if now.to_json() != store.manifest.to_json():
        return False
    transfer.put_atomic(store.fs, path, dataclasses.replace(now, format_version=FORMAT_VERSION).to_json().encode())
    return True
