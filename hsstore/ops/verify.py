"""``hsstore verify``: re-read every committed byte and check it against its commit record.

Per committed shard: its record against the manifest (here), then its files through its layout's
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

import numpy as np

from ..format import assets, codec, commit, index, names, records
from ..layouts import base as layout
from ..io import listing, storage
from ..format.commit import SHARDS_DIR, CommitRecord
from ..errors import StoreError
from ..store.reader import Store
from ..terminal import lookalike_refusal, visible_key
from ..format.report import Problem, VerifyReport

log = logging.getLogger(__name__)


def verify(store: Store, progress: Callable[[int], None] | None = None) -> VerifyReport:
    """The index is checked first: when an entry readers would use is not its record (a junk block), that is
    reported as an index problem and the shards are checked from the records themselves (``commits/``), so a
    bad index never passes for bad data."""
    report = VerifyReport(shards=len(store.commits))
    if check_index(store, report):
        log.warning("store %r: the index disagrees with the commit records (reported); checking the shards "
                    "from the records", store.url)
        store = Store(store.url, store.storage_options, use_index=False, allow_locations=store.allow_locations)
    fs, root = store.fs, store.root
    lay = layout.get(store.manifest.layout)
    for rec in store.commits:
        if rec.weak_checksums:
            report.weak_records.append(rec.shard)
        check_committed_shard(store, rec, report, progress)
    entries = listing.list_names(fs, storage.join(root, SHARDS_DIR))
    on_disk = {n for n in map(lay.shard_of, entries) if n is not None}
    committed = {c.shard for c in store.commits}
    report.uncommitted = sorted(n for n in on_disk - committed if not n.startswith("."))
    check_unique_ids(store, report)
    check_lookalike_ids(store, report)
    check_assets(store, report)
    return report


def _check_names(store: Store, rec: CommitRecord, report: VerifyReport) -> bool:
    """Every name in the record that readers refuse (``names``: shard name, file keys, ``location``) as a
    problem naming it; False when there is one (the shard's files are then not followed)."""
    bad = names.record_problems(rec)
    for key, why in bad:
        report.problems.append(Problem(rec.shard, f"unsafe name, not followed: {why}", key))
    if rec.shard in store.bad_locations:
        report.problems.append(Problem(rec.shard, f"location not followed: {store.bad_locations[rec.shard]}",
                                       "location"))
        return False
    return not bad


def check_unique_ids(store: Store, report: VerifyReport) -> None:
    """Every sample id once: a repeated one is served twice per epoch and breaks resume and merge (which key on
    ids). Named with the shards that hold it (at most a few of them listed)."""
    ids = store.table.sample_id.tolist()
    if len(set(ids)) == len(ids):
        return
    first = store.table.first
    where: dict[str, list[str]] = {}
    for i, sid in enumerate(ids):
        where.setdefault(sid, []).append(i)
    repeated = {sid: rows for sid, rows in where.items() if len(rows) > 1}
    for sid, rows in list(repeated.items())[:20]:
        shards = sorted({store.table.shard[int(np.searchsorted(first, r, side="right") - 1)] for r in rows})
        report.problems.append(Problem(shards[0], f"sample id {sid!r} is held {len(rows)} times (shards "
                                                  f"{', '.join(shards[:4])}): ids must be unique in a store"))
    if len(repeated) > 20:
        report.problems.append(Problem("(samples)", f"{len(repeated)} sample ids are repeated in all"))


def check_lookalike_ids(store: Store, report: VerifyReport) -> None:
    """No two sample ids a person cannot tell apart (``terminal.visible_key``: the same once invisible characters
    are removed): a person reading ``info``, ``show`` or a refusal would take one for the other. Named with the
    shards that hold them."""
    ids = store.table.sample_id.tolist()
    keys = {visible_key(sid) for sid in ids if not sid.isprintable()}  # a lookalike pair has one such id at least
    if not keys:
        return
    groups: dict[str, dict[str, int]] = {}  # key -> {id: its row}
    for row, sid in enumerate(ids):
        key = visible_key(sid)
        if key in keys:
            groups.setdefault(key, {}).setdefault(sid, row)
    pairs = [g for g in groups.values() if len(g) > 1]
    first = store.table.first
    for group in pairs[:20]:
        plain, *others = sorted(group, key=len)
        shards = sorted({store.table.shard[int(np.searchsorted(first, r, side="right") - 1)] for r in group.values()})
        report.problems.append(Problem(shards[0], lookalike_refusal(others[0], plain, "held too") + " (shards "
                                       + ", ".join(shards[:4]) + ")", samples=[plain, *others]))
    if len(pairs) > 20:
        report.problems.append(Problem("(samples)", f"{len(pairs)} groups of sample ids differ only by invisible "
                                                    "characters in all"))


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
    check_record(store, rec, report)
    if not _check_names(store, rec, report):  # a name readers refuse is reported, never followed
        return
    try:  # a shard merged by reference: its files are checked where its record says they are
        store.shard_location(rec.shard)
    except Exception as e:
        report.problems.append(Problem(rec.shard, f"location {rec.location!r} cannot be opened: "
                                                  f"{type(e).__name__}: {e}"))
        return
    layout.get(store.manifest.layout).check_shard(store.source, rec, report, progress, tails)


def check_record(store: Store, rec: CommitRecord, report: VerifyReport) -> None:
    m = store.manifest
    if rec.shard in store.manifest_mismatch:
        report.problems.append(Problem(rec.shard, "written under another manifest: manifest.json was changed "
                                                  "after this shard was committed (layers, dtype, hashes, codec "
                                                  "or chunk grid)", "manifest.json"))
    if sorted(rec.layers, key=_feature_order) != [str(l) for l in m.all_features]:
        report.problems.append(Problem(rec.shard, f"commit record layers {sorted(rec.layers, key=_feature_order)} "
                                                  f"differ from the manifest's {m.all_features}"))
    if rec.chunk_tokens != m.chunk_tokens:
        report.problems.append(Problem(rec.shard, f"chunk_tokens {rec.chunk_tokens} differs from the manifest's "
                                                  f"{m.chunk_tokens}"))


def _feature_order(key: str) -> tuple:
    """Commit-record feature keys in manifest order: layer ids by value, then named features (``final_hidden``)."""
    return (0, int(key), "") if key.lstrip("-").isdigit() else (1, 0, key)
