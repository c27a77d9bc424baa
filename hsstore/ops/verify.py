"""``hsstore verify``: re-read every committed byte and check it against its commit record.

First the admission's store-wide rules (``format/admission.py``: what every reader refuses), then per committed
shard: the admission's rules of its record, then its files through its layout's
``check_shard`` (layouts/zarr.py: every listed file's size and CRC32C, each chunk bound to its path, every
chunk the arrays' shapes imply listed, shapes and dtypes against the manifest and the offsets,
``input_ids``/``loss_mask`` against the per-sample columns, fp8 scales finite and positive; layouts/wds.py: one
streaming pass over the tar, every member against the record). Then the entries of ``shards/`` that no
commit record covers, and the assets. Problems name the shard, the file and the samples whose tokens the
file holds.
"""

from __future__ import annotations

import logging
from typing import Callable

from ..format import assets, codec, commit, index, records
from ..layouts import base as layout
from ..io import listing, storage
from ..format.commit import SHARDS_DIR, CommitRecord
from ..errors import StoreError
from ..store.reader import Store
from ..format.report import Problem, VerifyReport

log = logging.getLogger(__name__)


def verify(store: Store, progress: Callable[[int], None] | None = None) -> VerifyReport:
    """The index is checked first: when an entry readers would use is not its record (a junk block), that is
    reported as an index problem and the shards are checked from the records themselves (``commits/``), so a
    bad index never passes for bad data."""
    report = VerifyReport(shards=len(store.commits) + len(store.damaged))
    if check_index(store, report):
        log.warning("store %r: the index disagrees with the commit records (reported); checking the shards "
                    "from the records", store.url)
        store = Store(store.url, store.storage_options, use_index=False, allow_locations=store.allow_locations)
    fs, root = store.fs, store.root
    lay = layout.get(store.manifest.layout)
    report.problems += [b.problem() for b in store.breaches()]  # the admission's store-wide rules
    for i in range(len(store.commits)):
        try:
            rec = store.commits[i]
        except StoreError as e:  # a record its columns cannot stand for: named, not followed
            report.problems.append(Problem(store.table.shard[i], str(e), commit.commit_path(store.table.shard[i])))
            continue
        if rec.weak_checksums:
            report.weak_records.append(rec.shard)
        check_committed_shard(store, rec, report, progress)
    entries = listing.list_names(fs, storage.join(root, SHARDS_DIR))
    on_disk = {n for n in map(lay.shard_of, entries) if n is not None}
    committed = set(store.table.shard.tolist()) | set(store.damaged)
    report.uncommitted = sorted(n for n in on_disk - committed if not n.startswith("."))
    check_assets(store, report)
    return report



def check_index(store: Store, report: VerifyReport) -> bool:
    """The index against the commit records, each read again (concurrently): an entry that readers would use
    (its record listed with the size and stamp it recorded) must hold that record (byte for byte in a
    version-2 segment; equal once parsed in a version-1 one) and columns that say what the record says (opening,
    ``info`` and the loader read the columns); a damaged segment is a problem. Outdated entries (records
    rewritten since) and entries of records no longer listed are counted, not problems: readers ignore them."""
    fs, root = store.fs, store.root
    listed = index.listed_records(fs, root)
    use = index.IndexUse(shards=len(listed))
    segments, stamps = index.read_segments(fs, root, use)
    for name in use.damaged:
        report.problems.append(Problem("(index)", "index segment damaged or unreadable (ignored by readers, who read "
                                                  "the records instead); `hsstore index` rewrites the index"
                                                  + (f": {use.why[name]}" if name in use.why else ""),
                                       f"{index.INDEX_DIR}/{name}"))
    live = index.live_segments(segments, stamps)
    used = []  # (segment, row) of every entry a reader would use, in any live segment
    for seg in live:
        t = seg.table
        for row, (name, st, size) in enumerate(zip(t.shard.tolist(), t.stamp.tolist(), t.size.tolist())):
            now = listed.get(name)
            if now is not None and now.stamp is not None and (size, st) == (now.size, now.stamp):
                used.append((seg, row))
    names = sorted({seg.table.shard[row] for seg, row in used})
    data = dict(zip(names, commit.read_records(fs, root, names, [listed[n].size for n in names]))) if names else {}
    blocks = records.BlockCache()
    bad_entries = False
    for seg, row in used:
        t = seg.table
        shard = t.shard[row]
        blob = data[shard]
        try:
            rec = CommitRecord.from_json(blob, where="commit record")
            raw = t.raw(row, blocks)
            same = (int(t.crc32c[row]) == codec.crc32c(blob)
                    and (raw == blob if seg.version >= 2 else CommitRecord.from_json(raw, "index entry") == rec)
                    and t.row_of(row) == records.record_row(rec, raw, int(t.crc32c[row]), int(t.size[row])))
        except StoreError:  # a malformed entry (or record: reported with the shard)
            same = False
        if not same:
            bad_entries = True
            report.problems.append(Problem(shard, "index entry differs from the shard's commit record although "
                                                  "it records the record's size and stamp (readers would use the "
                                                  "entry); `hsstore index` rewrites it", f"{index.INDEX_DIR}/{seg.name}"))
    report.index = {"segments": len(live), "superseded": len(segments) - len(live), "damaged": len(use.damaged),
                    "entries_checked": len(used),
                    "indexed_shards": len(names), "unindexed_shards": len(listed) - len(names),
                    "orphan_entries": sum(1 for seg in live for n in seg.table.shard.tolist() if n not in listed)}
    return bad_entries


def check_assets(store: Store, report: VerifyReport) -> None:
    """Every asset file against ``assets/index.json`` (size, CRC32C); a missing one is a problem."""
    for name in assets.asset_names(store.fs, store.root):
        key = f"{assets.ASSETS_DIR}/{name}"
        try:
            size = assets.check_asset(store.fs, store.root, name, store.url)
        except FileNotFoundError:
            report.problems.append(Problem("(assets)", "listed in assets/index.json but missing", key))
            continue
        except StoreError as e:
            report.problems.append(Problem("(assets)", str(e), key))
            continue
        report.assets += 1
        report.files += 1
        report.bytes += size


def check_committed_shard(store: Store, rec: CommitRecord, report: VerifyReport, progress=None,
                          tails: dict[str, int] | None = None) -> None:
    """Every check of one committed shard: its record against the manifest, then its files through the
    layout (``tails``: see :func:`hsstore.layouts.zarr.check_shard`)."""
    bad = store.shard_breaches(rec)  # the admission's rules of the shard: reported, and its files not followed
    report.problems += [b.problem() for b in bad]
    if bad:
        return
    try:  # a shard merged by reference: its files are checked where its record says they are
        store.shard_location(rec.shard)
    except Exception as e:
        report.problems.append(Problem(rec.shard, f"location {rec.location!r} cannot be opened: "
                                                  f"{type(e).__name__}: {e}"))
        return
    layout.get(store.manifest.layout).check_shard(store.source, rec, report, progress, tails)
