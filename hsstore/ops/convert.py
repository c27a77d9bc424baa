"""``hsstore convert``: copy a store's committed shards into a store of another layout, bit-exact.

Every source shard becomes one destination shard with the same name, samples, columns and stats, so
the sample order is unchanged and the destination's manifest differs from the source's only in
``layout`` (and ``codec``: wds members are plain ``.npy``). A re-run skips shards the destination has
already committed (resume). A shard is read whole and checked (CRC32C, tar member names) before any
of it is written, so a corrupt or unsafe source shard stops the run and leaves nothing of it behind;
shards converted before it stay committed.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from ..format import codec, commit, index, layout_spec
from ..layouts import base as layout
from ..io import destination
from ..errors import ManifestError, StoreError
from ..store.reader import Store
from .subset import copy_assets_if_missing
from ..store.writer import ensure_manifest

log = logging.getLogger(__name__)


@dataclass
class ConvertResult:
    shards: int = 0
    skipped: int = 0  # already committed in the destination
    samples: int = 0
    bytes_read: int = 0


def convert(src_url: str, dst_url: str, to_layout: str, src_options: dict[str, Any] | None = None,
            dst_options: dict[str, Any] | None = None, chunk_codec: str | None = None,
            progress: bool = False) -> ConvertResult:
    """Convert ``src_url`` into ``dst_url`` with layout ``to_layout`` (``chunk_codec``: the zarr codec of the
    destination, default the source's; wds takes none). ``progress``: a bar of feature bytes converted."""
    fs, root = destination.open_destination(dst_url, dst_options, layout.own_objects())  # refusals before any request
    src = Store(src_url, src_options)
    src.admit()  # the admission's store-wide rules, before the destination gets a byte
    if (type(fs), root) == (type(src.fs), src.root):
        raise StoreError(f"convert: source and destination are the same store {src_url!r}")
    with destination.hold_lock(fs, root, dst_url, "convert"):  # one copying command at a time into it
        return _convert(src, fs, root, dst_url, to_layout, chunk_codec, progress)


def _convert(src: Store, fs, root: str, dst_url: str, to_layout: str, chunk_codec: str | None,
             progress: bool) -> ConvertResult:
    from ..progress import progress_bar

    if chunk_codec is None:  # the source's, where the destination's layout stores it
        codecs = layout_spec.get(to_layout).codecs
        chunk_codec = src.manifest.codec if codecs is None or src.manifest.codec in codecs else codecs[0]
    codec.ChunkCodec(chunk_codec).zarr_compressors()  # an unknown codec fails here, before any write
    want = dataclasses.replace(src.manifest, layout=to_layout, codec=chunk_codec)
    dst_manifest = ensure_manifest(fs, root, dst_url, want)
    if dst_manifest.layout != to_layout or dst_manifest.codec != chunk_codec:
        raise ManifestError(f"convert: store {dst_url!r} exists with layout {dst_manifest.layout!r}, codec "
                            f"{dst_manifest.codec!r}; asked for {to_layout!r}, {chunk_codec!r}")
    if dst_manifest.chunk_tokens != src.manifest.chunk_tokens:
        raise ManifestError(f"convert: store {dst_url!r} has chunk_tokens {dst_manifest.chunk_tokens}, the source "
                            f"{src.manifest.chunk_tokens}")
    copy_assets_if_missing(src, fs, root)  # what train and show need instead of the target
    done = set(commit.list_committed(fs, root))
    result = ConvertResult()
    write_shard = layout.get(to_layout).write_shard
    appender = index.SegmentAppender(fs, root, "convert")  # the records written, as one index segment
    total = sum(v["raw_bytes"] for c in src.commits if c.shard not in done for v in c.layers.values())
    try:
        with progress_bar(total=total, unit="B", unit_scale=True, desc="convert", disable=not progress) as bar:
            for rec in src.commits:
                if rec.shard in done:
                    result.skipped += 1
                    continue
                every = src.manifest.all_features  # the layers, then named features (final_hidden)
                ids, mask, feats = src.read_range(rec.shard, 0, rec.n_tokens, every)  # every byte checked first
                features = {l: feats[j] for j, l in enumerate(every)}
                try:
                    new = write_shard(fs, root, rec.shard, rec.writer, dst_manifest, features, ids, mask, rec.samples,
                                      stats=rec.stats)
                    appender.add(new, commit.publish(fs, root, new))
                except Exception as e:
                    raise StoreError(f"convert: writing shard {rec.shard!r} into {dst_url!r} failed: "
                                     f"{type(e).__name__}: {e}") from e
                result.shards += 1
                result.samples += rec.n_samples
                result.bytes_read += int(feats.nbytes)
                bar.update(int(feats.nbytes))
                log.debug("converted shard %s (%d samples)", rec.shard, rec.n_samples)
    finally:
        appender.flush()
    return result
