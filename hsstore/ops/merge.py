"""``hsstore merge``: add the committed shards of compatible stores to one store, by copy or by reference.

Shards are immutable and self-describing, so a merge never re-encodes: **by copy** every file a commit
record lists is read, checked against the record's size and CRC32C, and written under the same key in
the destination; **by reference** only a commit record is written, whose ``location`` names the store
that holds the files (docs/FORMAT.md). Either way a shard becomes visible only when its record is
written, after its files, so an interrupted merge leaves nothing half-visible and a re-run finishes it
(shards already committed in the destination under the same name are skipped).

Everything that can be refused is refused before the first write: incompatible identities (target,
tokenizer, taps, dtype), different chunking or codec (shards are used as they are; ``hsstore subset``
re-encodes), and sample ids present in more than one place.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Sequence

from ..format import assets, commit, index, names
from ..layouts import base as layout
from ..io import destination, door, storage, transfer
from ..io.backends import backend_for
from ..errors import CorruptionError, ManifestError, StoreError
from ..format.manifest import check_compatible
from ..store.reader import Store
from ..redaction import recordable_url
from .subset import copy_assets_if_missing
from ..store.writer import ensure_manifest

log = logging.getLogger(__name__)
MODES = ("copy", "reference")
BATCH_BYTES = 256 << 20


@dataclass
class MergeResult:
    shards: int = 0
    samples: int = 0
    bytes_copied: int = 0
    already: int = 0


def _check_layout(a: Store, b: Store) -> None:
    """Shards are reused as they are: the chunk grid and codec must be the destination's."""
    for name in ("chunk_tokens", "codec", "layout", "encoding"):
        va, vb = getattr(a.manifest, name), getattr(b.manifest, name)
        if va != vb:
            raise ManifestError(f"store {b.url!r} has {name} {vb!r}, {a.url!r} has {va!r}: shards cannot be merged "
                                f"as they are (re-encode with `hsstore subset {b.url} DST`)")


def plan(dst: Store | None, srcs: Sequence[Store]) -> list[tuple[Store, commit.CommitRecord]]:
    """The (source, shard) pairs still to add, after every check; raises before anything is written."""
    first = dst or srcs[0]
    for s in srcs:
        if s is not first:
            what = f"destination {first.url!r}" if dst else f"store {first.url!r}"
            check_compatible(first.manifest, s.manifest, what, f"store {s.url!r}")
            _check_layout(first, s)
    present = {c.shard: c for c in dst.commits} if dst else {}
    owner: dict[str, str] = {sid: dst.url for c in dst.commits for sid in c.samples["sample_id"]} if dst else {}
    todo = []
    for s in srcs:
        for rec in s.commits:
            if rec.shard in present:  # a re-run: this shard was merged already
                if not commit.same_files(present[rec.shard], rec):  # (one may have been upgraded since)
                    raise StoreError(f"shard {rec.shard!r} of {s.url!r} differs from the destination's shard of the "
                                     "same name (refusing to overwrite)")
                continue
            for sid in rec.samples["sample_id"]:
                if sid in owner:
                    raise StoreError(f"sample id {sid!r} is in both {owner[sid]!r} and {s.url!r} (shard {rec.shard}): "
                                     "refusing a merge with duplicate ids (drop it from one side with "
                                     "`hsstore subset` first)")
                owner[sid] = s.url
            present[rec.shard] = rec
            todo.append((s, rec))
    return todo


def check_assets(fs, root: str, dst_url: str, srcs: Sequence[Store]) -> Store | None:
    """Refuse (one line naming the source and the asset) a merge whose stores' trainer assets differ: the embedding,
    lm_head or config of a source against the destination's, or against the first source's that has assets (a
    trainer of the merged store would take one of them, unsaid). Returns the source whose assets a destination
    without any receives (None: no source has any)."""
    ref = (dst_url, fs, root) if assets.has_assets(fs, root, dst_url) else None
    given = None
    for s in srcs:
        if not assets.has_assets(s.fs, s.root, s.url):
            continue
        given = given or s
        if ref is None:
            ref = (s.url, s.fs, s.root)
            continue
        name = assets.differing_asset(ref[1], ref[2], ref[0], s.fs, s.root, s.url)
        if name is not None:
            raise StoreError(f"store {s.url!r}: asset {name!r} differs from {ref[0]!r}'s: refusing to merge stores "
                             "whose assets differ (a trainer would take one of them; rebuild the odd store's assets "
                             "from its target)")
    return given


def copy_shard(src: Store, rec: commit.CommitRecord, fs, root: str,
               appender: index.SegmentAppender | None = None) -> int:
    """Copy one shard's files (each checked against its commit record), then publish its record (noted in
    ``appender``, the destination's index segment of this run). Returns bytes."""
    src_fs, src_root, _ = src.shard_location(rec.shard)
    where = f"store {src.url!r}, commit record of shard {rec.shard!r}"
    for key in rec.files:  # every key under the shard's own prefix, in both stores, before anything is written
        names.path(src_fs, src_root, names.file_key(rec.shard, key, where), "file key", where)
        names.path(fs, root, key, "file key", where)
    keys, size, copied = [], 0, 0
    items = list(rec.files.items())
    for n, (key, entry) in enumerate(items):
        keys.append(key)
        size += entry["size"]
        if size < BATCH_BYTES and n < len(items) - 1:
            continue
        # through the door at the sizes the record lists; objects cut or damaged in transit are fetched again
        # before they are called corrupt
        blobs = door.read_many(src_fs, src_root, keys, sizes={k: rec.files[k]["size"] for k in keys},
                               bound=lambda k: layout.get(src.manifest.layout).file_bound(src.manifest, rec, k),
                               ok=lambda k, b: commit.check_file(rec, k, b) is None, where=f"store {src.url!r}")
        out = {}
        for k in keys:
            data = blobs[k]
            where = f"store {src.url!r}, shard {rec.shard}, file {k}"
            if isinstance(data, Exception):
                raise CorruptionError(f"{where}: unreadable ({type(data).__name__}: {data})")
            wrong = commit.check_file(rec, k, data)
            if wrong:
                raise CorruptionError(f"{where}: does not match its commit record ({wrong}); run "
                                      f"`hsstore verify {src.url}`")
            out[storage.join(root, k)] = data
        transfer.put_many(fs, out, root)
        copied += sum(len(v) for v in out.values())
        keys, size = [], 0
    record = dataclasses.replace(rec, location=None)
    stamp = commit.publish(fs, root, record)
    if appender is not None:
        appender.add(record, stamp)
    return copied


def merge(dst_url: str, src_urls: Sequence[str], by: str = "copy", *, dst_options: dict[str, Any] | None = None,
          src_options: dict[str, Any] | None = None, progress: bool = True) -> MergeResult:
    """Add every committed shard of ``src_urls`` to ``dst_url`` (created from the first source's manifest
    when it does not exist). ``src_options`` apply to every source (default: ``dst_options``)."""
    if by not in MODES:
        raise ValueError(f"--by must be one of {MODES}, got {by!r}")
    if not src_urls:
        raise ValueError("merge needs at least one source store")
    dst_options = dst_options or {}
    src_options = dst_options if src_options is None else src_options
    fs, root = destination.open_destination(dst_url, dst_options, layout.own_objects())  # refusals before any request
    srcs = [Store(u, src_options) for u in src_urls]
    if by == "reference":
        far = [s.url for s in srcs if backend_for(s.fs).local_paths and not backend_for(fs).local_paths]
        if far:
            raise ValueError(f"{far[0]!r} is on local disk: a reference to it from {dst_url!r} would not resolve "
                             "for other readers (merge --by copy instead)")
    # one copying command at a time into a destination: two would each find no shard merged and add every one
    with destination.hold_lock(fs, root, dst_url, f"merge --by {by}"):
        return _merge(fs, root, dst_url, dst_options, srcs, by, progress)


def _merge(fs, root: str, dst_url: str, dst_options: dict[str, Any], srcs: list[Store], by: str,
           progress: bool) -> MergeResult:
    from ..progress import progress_bar

    dst = Store(dst_url, dst_options) if storage.store_exists(fs, root, dst_url) else None
    for store in ([dst] if dst else []) + srcs:  # the admission's store-wide rules, before anything is written
        store.admit()
    todo = plan(dst, srcs)
    for src, rec in todo:  # a shard refused anywhere (its rules, names, location): refused before the first write
        src.admit_shard(rec)
        src.shard_location(rec.shard)
        src.check_loss_tokens(rec.shard)  # its samples' loss tokens are what its mask holds (the mask read alone)
        if by == "copy":
            where = f"store {src.url!r}, commit record of shard {rec.shard!r}"
            for key in rec.files:
                names.file_key(rec.shard, key, where)
    given = check_assets(fs, root, dst_url, srcs)
    result = MergeResult(already=sum(len(s.commits) for s in srcs) - len(todo))
    if dst is None:  # the first source's manifest, as is: same identity, chunking and codec
        ensure_manifest(fs, root, dst_url, srcs[0].manifest)
    if given is not None:
        copy_assets_if_missing(given, fs, root)
    total = sum(f["size"] for _, rec in todo for f in rec.files.values()) if by == "copy" else len(todo)
    appender = index.SegmentAppender(fs, root, f"merge-{by}")  # the records written, as one index segment
    with progress_bar(total=total, unit="B" if by == "copy" else "shard", unit_scale=by == "copy", desc=f"merge ({by})",
                      disable=not progress) as bar:
        try:
            for src, rec in todo:
                if by == "copy":
                    n = copy_shard(src, rec, fs, root, appender)
                    result.bytes_copied += n
                    bar.update(n)
                else:
                    _, _, where = src.shard_location(rec.shard)
                    record = dataclasses.replace(rec, location=recordable_url(commit.relative_location(dst_url, where)))
                    appender.add(record, commit.publish(fs, root, record))
                    bar.update(1)
                result.shards += 1
                result.samples += rec.n_samples
                log.debug("merged shard %s of %s (%s)", rec.shard, src.url, by)
        finally:
            appender.flush()
    return result
