"""``hsstore convert``: copy a store's committed shards into a store of another layout, bit-exact, or of another
feature encoding.

Every source shard becomes one destination shard with the same name, samples, columns and stats, so
the sample order is unchanged and the destination's manifest differs from the source's only in
``layout`` (and ``codec``: wds members are plain ``.npy``) and ``encoding``. Another encoding decodes each feature
into the manifest dtype and encodes it again (``format/encodings.py``), so those values are not bit-exact and the
record's feature statistics are computed again from what the destination holds. A re-run skips shards the destination has
already committed (resume). A shard is read whole and checked (CRC32C, tar member names) before any
of it is written, so a corrupt or unsafe source shard stops the run and leaves nothing of it behind;
shards converted before it stay committed. So does a shard holding a sample whose features decode to a NaN or an
infinity (``refuse_nonfinite``): ``verify`` fails it, and the writer refuses such a sample.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..format import codec, commit, encodings, health, index, layout_spec
from ..layouts import base as layout
from ..io import destination
from ..errors import ManifestError, SampleError, StoreError
from ..format.manifest import Manifest
from ..redaction import recordable_url
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


def convert(src_url: str, dst_url: str, to_layout: str | None = None, src_options: dict[str, Any] | None = None,
            dst_options: dict[str, Any] | None = None, chunk_codec: str | None = None,
            progress: bool = False, encoding: str | None = None) -> ConvertResult:
    """Convert ``src_url`` into ``dst_url`` with layout ``to_layout`` and feature ``encoding`` (each default: the
    source's; ``chunk_codec``: the zarr codec of the destination, default the source's; wds takes none).
    ``progress``: a bar of feature bytes converted."""
    fs, root = destination.open_destination(dst_url, dst_options, layout.own_objects())  # refusals before any request
    src = Store(src_url, src_options)
    src.admit()  # the admission's store-wide rules, before the destination gets a byte
    if (type(fs), root) == (type(src.fs), src.root):
        raise StoreError(f"convert: source and destination are the same store {src_url!r}")
    with destination.hold_lock(fs, root, dst_url, "convert"):  # one copying command at a time into it
        return _convert(src, fs, root, dst_url, to_layout or src.manifest.layout, chunk_codec, progress,
                        encoding or src.manifest.encoding)


def _convert(src: Store, fs, root: str, dst_url: str, to_layout: str, chunk_codec: str | None,
             progress: bool, encoding: str) -> ConvertResult:
    from ..progress import progress_bar

    if chunk_codec is None:  # the source's, where the destination's layout stores it
        codecs = layout_spec.get(to_layout).codecs
        chunk_codec = src.manifest.codec if codecs is None or src.manifest.codec in codecs else codecs[0]
    codec.ChunkCodec(chunk_codec).zarr_compressors()  # an unknown codec fails here, before any write
    want = dataclasses.replace(src.manifest, layout=to_layout, codec=chunk_codec, encoding=encoding)
    dst_manifest = ensure_manifest(fs, root, dst_url, want)
    if dst_manifest.layout != to_layout or dst_manifest.codec != chunk_codec:
        raise ManifestError(f"convert: store {dst_url!r} exists with layout {dst_manifest.layout!r}, codec "
                            f"{dst_manifest.codec!r}; asked for {to_layout!r}, {chunk_codec!r}")
    recode = encoding != src.manifest.encoding
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
            for s, rec in enumerate(src.commits):
                if rec.shard in done:
                    result.skipped += 1
                    continue
                every = src.manifest.all_features  # the layers, then named features (final_hidden)
                scales = src.new_scales(len(every), rec.n_tokens)
                ids, mask, feats = src.read_range(rec.shard, 0, rec.n_tokens, every,  # every byte checked first
                                                  scales_out=scales)
                src.check_shard(s, mask)  # the record's samples are what its bytes hold, before any is written
                features = {l: feats[j] for j, l in enumerate(every)}
                stats = rec.stats
                new_scales = None if scales is None else {l: scales[j] for j, l in enumerate(every)}
                refuse_nonfinite(src.url, rec, src.manifest, features, new_scales)  # before any of the shard is written
                if recode:
                    features, new_scales, stats = recoded(src.manifest, dst_manifest, rec, feats, scales)
                try:
                    new = write_shard(fs, root, rec.shard, rec.writer, dst_manifest, features, ids, mask, rec.samples,
                                      stats=stats, scales=new_scales)
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


def refuse_nonfinite(src_url: str, rec, src: Manifest, features: dict, scales: dict | None) -> None:
    """Refuse (``SampleError``, one line naming the sample and its feature) a source shard whose features hold a
    value that readers decode to a NaN or an infinity, or a row no writer writes: ``verify`` fails such a sample,
    a record counting it is no reason to copy it, and an encoding of it is no cure (the writer refuses such a
    sample on ``add``). The source's stored rows are asked, not the copy's: raw ones by bit tests, so converting
    an extraction costs no decoding; the project's encoders make finite rows of finite values."""
    for l in src.all_features:
        row = health.first_bad_row(features[l], src.dtype, src.encoding, None if scales is None else scales[l],
                                   src.hidden_size)
        if row is None:
            continue
        i = int(np.searchsorted(rec.offsets, row, side="right")) - 1
        raise SampleError(f"convert: store {recordable_url(src_url)!r}, shard {rec.shard!r}, sample "
                          f"{rec.samples['sample_id'][i]!r}: {health.feature_name(health.feature_key(l))} has NaN/Inf "
                          f"features (first at token {row - int(rec.offsets[i])}) as readers decode them; nothing of "
                          f"the shard written (`hsstore verify` names every such sample)")


def recoded(src: Manifest, dst: Manifest, rec, feats: np.ndarray, scales: np.ndarray | None,
            ) -> tuple[dict, dict | None, dict]:
    """A shard's features ``[features, T, W]`` as ``dst``'s encoding holds them: each decoded into the manifest
    dtype, then encoded (raw: its bits); the per-feature scales (fp8), and the record's statistics with the feature
    statistics of the new values."""
    import torch

    src_enc, dst_enc = encodings.get(src.encoding), encodings.get(dst.encoding)
    H, dtype = src.hidden_size, codec.TORCH_DTYPE[src.dtype]
    features, new_scales = {}, {} if dst_enc.row_scale else None
    for j, l in enumerate(src.all_features):
        stored = torch.from_numpy(feats[j])
        if src_enc.row_scale:
            x = src_enc.decode(stored.view(torch.float8_e4m3fn), torch.from_numpy(scales[j]), H, dtype)
        else:
            x = src_enc.decode(stored, None, H, dtype) if src_enc.quantised else codec.from_storage(feats[j], src.dtype)
        if not dst_enc.quantised:
            features[l] = codec.bits_view(x).numpy().view(codec.storage_dtype(dst.dtype))
            continue
        values, sc = dst_enc.encode(x)
        features[l] = values.contiguous().view(torch.uint8).numpy()
        if new_scales is not None:
            new_scales[l] = sc.numpy()
    per_sample = []
    off = rec.offsets
    stacked = np.stack([features[l] for l in src.all_features])
    stacked_scales = np.stack([new_scales[l] for l in src.all_features]) if new_scales is not None else None
    for i in range(rec.n_samples):
        a, b = int(off[i]), int(off[i + 1])
        per_sample.append(health.bits_stats(stacked[:, a:b], dst.dtype,
                                            None if stacked_scales is None else stacked_scales[:, a:b],
                                            dst.encoding, H))
    stats = {k: v for k, v in (rec.stats or {}).items() if k != "features"}
    stats["features"] = health.shard_stats(src.all_features, rec.samples["length"], H, per_sample)
    return features, new_scales, stats
