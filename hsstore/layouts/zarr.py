"""The zarr layout (the default): one shard is a Zarr v3 group of flat token-major arrays.

Layout under the store prefix (see docs/FORMAT.md)::

    shards/<name>/                 Zarr v3 group (attributes: shard name, per-sample columns)
        layer_<LLL>/               [tokens, hidden] features of tapped layer LLL, chunked along tokens
        input_ids/  loss_mask/     [tokens] int32 / uint8, same chunk grid as the layers
        offsets/                   [samples + 1] int64: sample i is tokens offsets[i]:offsets[i+1]
        scale_<LLL>/               (fp8 stores only) [tokens] float32 scales of layer LLL's rows
    (a block encoding's layer_<LLL> is [tokens, row bytes]: its scales live in each row)
    commits/<name>.json            the commit record (format/commit.py), written last

hsstore writes and reads the chunk objects itself (format/codec.py: one copy, checksums checked on the way);
zarr-python writes the metadata (so any Zarr v3 reader reads a shard) and makes what ``verify`` holds each
shard's metadata to; it never reads a store: a store's codecs are decoded only by hsstore's bounded decoder. Write, read and check live here; ``layout.get("zarr")`` is this module.
"""

from __future__ import annotations

import contextlib
import errno
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import zarr
from zarr.storage import MemoryStore

from ..format import admission, codec, encodings, fp8, health
from ..io import door, storage, transfer
from ..io.backends import backend_for
from ..format.commit import SHARDS_DIR, CommitRecord, check_file, is_chunk_key, layer_array, sample_offsets
from ..errors import CorruptionError, FetchError, StoreError
from ..format.manifest import Manifest, now_iso
from ..io.memory import pread_fold, pread_into, row_parts, scatter_rows, scratch
from ..format.report import Problem, VerifyReport
from ..terminal import escape, shown

if TYPE_CHECKING:
    from .source import ShardSource

BATCH_BYTES = 256 << 20  # verify reads a shard's files in batches of about this many bytes


def scale_array(layer: int | str) -> str:
    """The per-row scales of a layer (or feature) array of an encoding with a row scale (fp8)."""
    return f"scale_{layer}" if isinstance(layer, str) else f"scale_{layer:03d}"


def shard_path(name: str) -> str:
    return f"{SHARDS_DIR}/{name}"


def shard_of(entry: str) -> str | None:
    """The shard an entry of ``shards/`` belongs to (None: the ``shards/`` group's own metadata)."""
    return None if entry == "zarr.json" else entry


# -- writing -----------------------------------------------------------------------------------------

def zarr_metadata(build) -> dict[str, bytes]:
    """Zarr metadata objects made by ``build(memory_store)``, as ``{key: bytes}``: zarr-python writes the
    metadata (so it cannot drift from the spec) without any round trip to the real store."""
    objects: dict = {}  # MemoryStore's public store_dict: the objects land here
    build(MemoryStore(objects))
    return {k: v.to_bytes() for k, v in objects.items()}


def store_objects() -> dict[str, bytes]:
    """``zarr.json`` of the store root and of ``shards/``, so zarr-python can walk the hierarchy (written once,
    with the manifest, when a store is created)."""
    def build(mem):
        zarr.create_group(store=mem, path=SHARDS_DIR, zarr_format=3)
    return zarr_metadata(build)


def chunk_key(array_path: str, k: int, ndim: int) -> str:
    """Zarr v3 default chunk key of chunk ``k`` along tokens (other dimensions are one chunk)."""
    return f"{array_path}/c/{k}" + "/0" * (ndim - 1)


def encode_array(array_path: str, data: np.ndarray, chunk: int, chunk_codec: codec.ChunkCodec,
                 ) -> dict[str, codec.EncodedChunk]:
    """Chunk objects of a token-major array, keyed by store-relative path. Edge chunks are padded with
    the fill value to the full chunk shape, as Zarr v3 stores them."""
    out = {}
    n = data.shape[0]
    for k in range(-(-n // chunk)):
        part = data[k * chunk:(k + 1) * chunk]
        if part.shape[0] < chunk:
            padded = np.zeros((chunk,) + data.shape[1:], dtype=data.dtype)
            padded[: part.shape[0]] = part
            part = padded
        out[chunk_key(array_path, k, data.ndim)] = chunk_codec.encode(part)
    return out


def write_shard(
    fs,
    root: str,
    name: str,
    writer: str,
    manifest: Manifest,
    features: dict[int, np.ndarray],
    input_ids: np.ndarray,
    loss_mask: np.ndarray,
    samples: dict[str, list],
    stats: dict[str, Any] | None = None,
    scales: dict[int, np.ndarray] | None = None,
) -> CommitRecord:
    """Write one shard -- Zarr metadata and whole chunks, in one concurrent batch -- and return its commit
    record. The record is not yet published: see :func:`hsstore.format.commit.publish`. ``scales`` (fp8 stores): per layer,
    the float32 scale of every row of ``features`` (which then hold e4m3fn bits; a block encoding's rows hold their
    own scales)."""
    n_tokens = int(input_ids.shape[0])
    offsets = sample_offsets(name, samples, n_tokens)
    lengths = np.diff(offsets)
    base = shard_path(name)
    ct = manifest.chunk_tokens
    has_scales = encodings.get(manifest.encoding).row_scale
    if has_scales and scales is None:
        raise ValueError(f"shard {name}: an {manifest.encoding} store needs the scales of every layer")
    values = {**{layer_array(l): features[l] for l in manifest.all_features},
            **({scale_array(l): scales[l].astype(fp8.SCALE_DTYPE, copy=False) for l in manifest.all_features}
               if has_scales else {}),
            "input_ids": input_ids.astype("<i4", copy=False), "loss_mask": loss_mask.astype("|u1", copy=False),
            "offsets": offsets}
    specs = array_specs(manifest, n_tokens, len(lengths))
    arrays = [(arr_name, values[arr_name], chunk, chunk_codec, attrs) for arr_name, _, chunk, _, chunk_codec, attrs
              in specs]

    def build(mem):
        group = zarr.create_group(store=mem, path=base, zarr_format=3,
                                  attributes={"hsstore_shard": name, "writer": writer, "chunk_tokens": ct,
                                              "samples": samples})
        for arr_name, shape, chunk, dtype, chunk_codec, attrs in specs:
            group.create_array(arr_name, shape=shape, chunks=(chunk,) + shape[1:], dtype=dtype,
                               compressors=chunk_codec.zarr_compressors(), fill_value=0, attributes=attrs,
                               dimension_names=["token", "hidden"][: len(shape)])

    # only the shard's own metadata: parent groups are written once, when the store is created
    objects: dict[str, Any] = {k: v for k, v in zarr_metadata(build).items() if k.startswith(base + "/")}
    for arr_name, data, chunk, chunk_codec, _ in arrays:
        objects.update(encode_array(f"{base}/{arr_name}", data, chunk, chunk_codec))
    transfer.put_many(fs, {storage.join(root, k): v for k, v in objects.items()}, root)
    files = {k: {"size": len(v), "crc32c": v.crc32c if isinstance(v, codec.EncodedChunk) else codec.crc32c(v)}
             for k, v in sorted(objects.items())}
    layers = {}
    for l in manifest.all_features:  # a layer's bytes: its values, and its scales in an fp8 store
        prefixes = (f"{base}/{layer_array(l)}/", f"{base}/{scale_array(l)}/")
        raw = int(features[l].nbytes) + (int(scales[l].size) * fp8.SCALE_DTYPE.itemsize if has_scales else 0)
        layers[str(l)] = {"stored_bytes": sum(v["size"] for k, v in files.items() if k.startswith(prefixes)),
                          "raw_bytes": raw}
    return CommitRecord(
        shard=name, writer=writer, n_samples=len(lengths), n_tokens=n_tokens, samples=samples, layers=layers,
        files=files, chunk_tokens=ct, stats=stats or {}, created_at=now_iso(), manifest_key=manifest.shard_key())


def array_specs(manifest: Manifest, n_tokens: int, n_samples: int) -> list[tuple]:
    """(name, shape, chunk length, dtype, chunk codec, attributes) of every array of a shard of ``n_tokens``
    tokens and ``n_samples`` samples: what the writer writes, and what ``verify`` holds each ``zarr.json`` to."""
    ct, W = manifest.chunk_tokens, codec.row_width(manifest.hidden_size, manifest.encoding)
    feature_codec, plain = codec.ChunkCodec(manifest.codec), codec.ChunkCodec("none")
    values = codec.storage_dtype(manifest.dtype, manifest.encoding)
    out = [(layer_array(l), (n_tokens, W), ct, values, feature_codec, layer_attributes(manifest, l))
           for l in manifest.all_features]
    if encodings.get(manifest.encoding).row_scale:
        out += [(scale_array(l), (n_tokens,), ct, fp8.SCALE_DTYPE, plain,
                 {"layer": l, "hsstore_scales_of": layer_array(l)}) for l in manifest.all_features]
    out += [("input_ids", (n_tokens,), ct, np.dtype("<i4"), plain, {}),
            ("loss_mask", (n_tokens,), ct, np.dtype("|u1"), plain, {}),
            ("offsets", (n_samples + 1,), n_samples + 1, np.dtype("<i8"), plain, {})]
    return out


def layer_attributes(manifest: Manifest, layer: int) -> dict[str, Any]:
    """Zarr attributes of a layer array: ``hsstore_dtype`` names what the stored bits are (the manifest dtype,
    ``float8_e4m3fn`` in an fp8 store, whose ``hsstore_scales`` array holds the per-row scales, or ``uint8`` rows
    of a block encoding's bytes, ``hsstore_hidden`` values each: docs/FORMAT.md)."""
    if manifest.encoding == fp8.ENCODING:
        return {"hsstore_dtype": "float8_e4m3fn", "hsstore_encoding": fp8.ENCODING,
                "hsstore_scales": scale_array(layer), "layer": layer}
    if encodings.get(manifest.encoding).quantised:
        return {"hsstore_dtype": "uint8", "hsstore_encoding": manifest.encoding, "hsstore_hidden": manifest.hidden_size,
                "layer": layer}
    return {"hsstore_dtype": manifest.dtype, "layer": layer}


# -- reading -----------------------------------------------------------------------------------------

def check_extent(src: ShardSource, rec: CommitRecord) -> None:
    """Refuse (before any buffer is sized from it) a record whose token count its chunks cannot hold: it must
    list exactly ``ceil(n_tokens / chunk_tokens)`` chunks of ``input_ids``; and one whose sample lengths are not
    the boundaries its shard holds: the payload CRC32C it lists for its ``offsets`` chunk (format version 2 on)
    must be that of the offsets its lengths make, computed from the record alone (no read); a version-1 record,
    which lists no such checksum, is held to its ``offsets`` array, read. Checked once per record object."""
    if getattr(rec, "_extent_ok", False):
        return
    ct = src.manifest.chunk_tokens
    prefix = f"{shard_path(rec.shard)}/input_ids/c/"
    listed = sum(1 for k in rec.files if k.startswith(prefix))
    want = -(-rec.n_tokens // ct) if ct else 0
    if listed != want:
        raise CorruptionError(f"shard {rec.shard!r}: its commit record claims {rec.n_tokens:,} tokens, which need "
                              f"{want:,} chunks of input_ids, and lists {listed:,} (forged or damaged record; run "
                              "hsstore verify)")
    key = chunk_key(f"{shard_path(rec.shard)}/offsets", 0, 1)
    if rec.binds_chunks:
        same = key in rec.files and rec.files[key]["crc32c"] == codec.crc32c(rec.offsets.astype("<i8").tobytes())
    else:  # format version 1 lists no checksum that binds the lengths: its offsets array is read (one small object)
        same = key in rec.files and np.array_equal(_offsets_read(src, rec, key), rec.offsets)
    if not same:
        raise CorruptionError(f"shard {rec.shard!r}: field 'samples.length': the sample boundaries its lengths make "
                              f"are not those of its {key} (lengths shifted within the record; forged or damaged "
                              "record)")
    rec._extent_ok = True


def _offsets_read(src: ShardSource, rec: CommitRecord, key: str) -> np.ndarray:
    """``stored_offsets`` of a shard for the extent rule, a read that fails as the rule's ``CorruptionError``."""
    fs, root, _ = src.locate(rec.shard)
    try:
        return stored_offsets(fs, root, src.manifest, rec, key)
    except (OSError, StoreError) as e:
        raise CorruptionError(f"shard {rec.shard!r}: {key} unreadable ({type(e).__name__}: {e})") from None


def stored_offsets(fs, root: str, m: Manifest, rec: CommitRecord, key: str) -> np.ndarray:
    """A shard's ``offsets`` array as stored (``key``: its one chunk), read through the door at the size its record
    lists and decoded by hsstore's bounded codec: what the extent rule of a version-1 record and ``verify`` compare
    with the record's lengths."""
    blob = door.read(fs, root, key, bound=file_bound(m, rec, key), size=rec.files[key]["size"])
    return codec.ChunkCodec("none").decode(blob, np.dtype("<i8"), rec.n_samples + 1, where=key,
                                           expect=rec.chunk_checksum(key))


def read_into(src: ShardSource, rec: CommitRecord, start: int, stop: int, layers: Sequence[int], ids: np.ndarray,
              mask: np.ndarray, feats: np.ndarray, carry: dict | None = None, scales: np.ndarray | None = None,
              ) -> None:
    """Tokens ``start:stop`` of a shard into ``ids``, ``mask`` and layer-major ``feats`` (the layout's part of
    :meth:`hsstore.store.reader.Store.read_range`; a feature's destination, and a scale array's, may be
    ``memory.Rows`` pieces): the chunks of ``layers`` overlapping the range (and, fp8, of their scale arrays),
    every one checked against its CRC32C and the commit record. ``feats`` rows are the encoding's (its width)."""
    shard_name = rec.shard
    m = src.manifest
    ct, H = m.chunk_tokens, codec.row_width(m.hidden_size, m.encoding)
    feature_codec, plain = codec.ChunkCodec(m.codec), codec.ChunkCodec("none")
    base = shard_path(shard_name)
    k0, k1 = start // ct, (stop - 1) // ct
    targets = [(f"{base}/input_ids", ids, plain, 1), (f"{base}/loss_mask", mask, plain, 1)]
    targets += [(f"{base}/{layer_array(l)}", feats[j], feature_codec, H) for j, l in enumerate(layers)]
    if scales is not None:  # fp8: each layer's per-row scales
        targets += [(f"{base}/{scale_array(l)}", scales[j], plain, 1) for j, l in enumerate(layers)]
    fs, root, _ = src.locate(shard_name)
    direct = backend_for(fs).local_paths and feature_codec.spec == "none"
    # (key, destination rows in pieces, rows of the chunk to take, codec, width, read directly from a local file,
    # the destination's dtype)
    jobs = []
    for array_path, out, chunk_codec, width in targets:
        for k in range(k0, k1 + 1):
            lo, hi = max(start, k * ct), min(stop, (k + 1) * ct)
            key = chunk_key(array_path, k, 1 if width == 1 else 2)
            jobs.append((key, row_parts(out, lo - start, hi - start), slice(lo - k * ct, hi - k * ct), chunk_codec,
                         width, direct, out.dtype))
    if carry is None and not direct and feature_codec.spec == "none":
        return _stream_into(src, rec, fs, root, jobs, ct)
    carried = carry or {}
    fetch = [j[0] for j in jobs if not j[5] and j[0] not in carried]
    blobs: dict = dict(carried)
    if fetch:
        unlisted = [k for k in fetch if k not in rec.files]
        if unlisted:
            raise CorruptionError(f"shard {shard_name!r}, file {unlisted[0]}: not listed in the commit record")
        # the sizes the record lists, each within a chunk's bound: one ranged GET per chunk on object stores
        sizes = {k: rec.files[k]["size"] for k in fetch}
        bound = {j[0]: chunk_bound(ct * j[4] * j[6].itemsize) for j in jobs}
        try:
            if src.chunk_cache is not None and not backend_for(fs).local_paths:
                blobs.update(src.chunk_cache.cat(fs, root, fetch, namespace=src.cache_namespace(),
                                                 expect={k: rec.chunk_checksum(k) for k in fetch}, sizes=sizes,
                                                 bound=bound.__getitem__))
            else:
                blobs.update(door.read_many(fs, root, fetch, sizes=sizes, bound=bound.__getitem__,
                                            ok=lambda _k, b: codec.chunk_ok(b), where=f"shard {shard_name!r}"))
        except Exception as e:
            raise FetchError(f"shard {shard_name!r} of store {src.url!r}: read failed: "
                             f"{type(e).__name__}: {e}") from None
        for k in fetch:
            failure = transfer.fetch_failure(blobs.get(k))
            if failure and not isinstance(blobs.get(k), CorruptionError):
                # the path to the store failed (after retries), not the bytes: never "corrupt"
                raise FetchError(f"shard {shard_name!r} of store {src.url!r}, file {k}: read failed after "
                                 f"retries ({failure})")
    for key, dest, rows, chunk_codec, width, local, dtype in jobs:
        where = f"shard {shard_name!r}, file {key}"
        expect = rec.chunk_checksum(key)  # compared with the tail checked anyway: no extra pass
        if local:  # the rows wanted straight into the output; the rest of a partial chunk into scratch
            row_bytes = width * dtype.itemsize
            read_chunk_into(root, key, dest, where, expect, skip=(rows.start * row_bytes, (ct - rows.stop) * row_bytes))
            continue
        blob = blobs.get(key)
        if isinstance(blob, door.Refused):
            raise CorruptionError(f"{where}: refused ({blob.why})")
        if blob is None or isinstance(blob, Exception):
            detail = f"{type(blob).__name__}: {blob}" if blob is not None else "not returned"
            raise CorruptionError(f"{where}: chunk missing or unreadable ({detail})")
        vals = chunk_codec.decode(blob, dtype, ct * width, where=where, expect=expect)
        scatter_rows(dest, (vals.reshape(ct, width) if width > 1 else vals)[rows])
    if carry is not None:
        last = [chunk_key(t[0], k1, 1 if t[3] == 1 else 2) for t in targets]
        carry.clear()
        carry.update({k: blobs[k] for k in last if isinstance(blobs.get(k), (bytes, bytearray))})


def chunk_files(manifest: Manifest, rec: CommitRecord, spans: Sequence[tuple[int, int]], layers: Sequence[int]
                ) -> dict[str, int]:
    """The chunk objects (key -> the size the record lists) that reading the token ``spans`` of ``layers`` fetches,
    each once: what a chunk cache keeps of these reads (``read_into`` reads the same arrays)."""
    ct, base = manifest.chunk_tokens, shard_path(rec.shard)
    ks: set[int] = set()
    for a, b in spans:
        if b > a:
            ks.update(range(a // ct, (b - 1) // ct + 1))
    arrays = [("input_ids", 1), ("loss_mask", 1)] + [(layer_array(l), 2) for l in layers]
    if encodings.get(manifest.encoding).row_scale:
        arrays += [(scale_array(l), 1) for l in layers]
    keys = (chunk_key(f"{base}/{name}", k, ndim) for name, ndim in arrays for k in sorted(ks))
    return {k: int(rec.files[k]["size"]) for k in keys if k in rec.files}


def chunk_bound(nbytes: int) -> int:
    """The most bytes a chunk object of ``nbytes`` of values may hold: the payload, a compressor's worst-case
    growth on incompressible data (zstd and blosc add well under 1/16), its framing and the 4-byte CRC32C."""
    return nbytes + nbytes // 16 + 1024 + 4


def _stream_into(src: ShardSource, rec: CommitRecord, fs, root: str, jobs: list, ct: int) -> None:
    """``read_into``'s remote path for uncompressed chunks: each chunk's bytes go straight into the output (a
    whole chunk) or a reused scratch buffer (part of one), its 4-byte tail beside (``transfer.cat_into``, or the
    loader's chunk cache when attached), and are checked there: no bytes object per chunk, no fresh memory to
    fault in."""
    shard_name = rec.shard
    with contextlib.ExitStack() as stack:
        targets, crcs, parts = {}, {}, {}
        for key, dest, rows, _codec, width, _local, dtype in jobs:
            where = f"shard {shard_name!r}, file {key}"
            nbytes = ct * width * dtype.itemsize
            listed = rec.files.get(key, {}).get("size")
            if listed is not None and listed != nbytes + 4:
                raise CorruptionError(f"{where}: chunk holds {max(0, listed - 4)} bytes, expected {nbytes}")
            if rows.stop - rows.start == ct:  # the whole chunk: straight into its rows' places
                payload = [d.reshape(-1).view(np.uint8) for d in dest]
            else:
                payload = [stack.enter_context(scratch(nbytes))]
                parts[key] = (dest, rows, width, payload[0], dtype)
            tail = bytearray(4)
            targets[key] = [*payload, tail]
            crcs[key] = (payload, tail, rec.chunk_checksum(key), where)

        def check(key: str) -> str | None:
            payload, tail, expect, _ = crcs[key]
            crc = None
            for piece in payload:
                crc = codec.crc32c(piece, crc)
            return codec.checksum_problem(crc, int.from_bytes(tail, "little"), expect)

        try:
            if src.chunk_cache is not None:
                got = src.chunk_cache.cat_into(fs, root, targets, src.cache_namespace(), check)
            else:
                got = door.fill(fs, root, targets, check, where=f"shard {shard_name!r}")
        except Exception as e:
            raise FetchError(f"shard {shard_name!r} of store {src.url!r}: read failed: "
                             f"{type(e).__name__}: {e}") from None
        for key, result in got.items():
            where = crcs[key][3]
            if isinstance(result, FileNotFoundError):
                raise CorruptionError(f"{where}: chunk missing or unreadable ({type(result).__name__}: {result})")
            if isinstance(result, Exception):  # the path to the store failed (after retries), not the bytes
                if isinstance(result, CorruptionError):  # the door's refusal: a link, not a regular file
                    raise CorruptionError(f"{where}: {getattr(result, 'why', result)}")
                raise FetchError(f"shard {shard_name!r} of store {src.url!r}, file {key}: "
                                 f"read failed after retries ({type(result).__name__}: {result})")
            if result is not None:
                raise CorruptionError(f"{where}: {result}")
        for dest, rows, width, payload, dtype in parts.values():
            vals = payload.view(dtype)
            scatter_rows(dest, (vals.reshape(ct, width) if width > 1 else vals)[rows])


_NO_BYTES = np.empty(0, np.uint8)


def read_chunk_into(root: str, key: str, dest: np.ndarray | Sequence[np.ndarray], where: str,
                    expect: int | None = None, skip: tuple[int, int] = (0, 0)) -> None:
    """Read the uncompressed local chunk file ``key`` under ``root`` into ``dest`` (contiguous, or contiguous
    pieces filled in turn: ``memory.row_parts``) through the door (a regular file beneath the root, no link
    followed, exactly one chunk's size) and check its CRC32C, and that it is ``expect``, the payload CRC32C the
    commit record lists for the path (None: the record lists none). ``skip``: the payload bytes before and after
    ``dest``'s part of the chunk (rows of a partial chunk that are not wanted), read into a reused scratch buffer
    and checked with the rest.

    The payload is read with ``preadv`` straight into ``dest``, its CRC32C folded in block by block while each
    block is in cache (``memory.pread_fold``), and the 4-byte tail into a small buffer: no mapping to fault in,
    no second copy, no second pass over memory; the loader's reader threads read several chunks at once.
    Committed chunks are never rewritten, so the file cannot change under the read."""
    dests = [dest] if isinstance(dest, np.ndarray) else list(dest)
    if not all(d.flags.c_contiguous for d in dests):
        raise ValueError(f"{where}: the destination of a chunk read must be contiguous")
    head, tail_skip = skip
    with scratch(head + tail_skip) if head + tail_skip else contextlib.nullcontext(_NO_BYTES) as extra:
        middle = [d.reshape(-1).view(np.uint8) for d in dests]
        parts = [p for p in (extra[:head], *middle, extra[head:]) if p.nbytes]
        crc, tail = _read_parts(root, key, parts, where)
    problem = codec.checksum_problem(crc, int.from_bytes(tail, "little"), expect)
    if problem:
        raise CorruptionError(f"{where}: {problem}")


def _read_parts(root: str, key: str, parts: list[np.ndarray], where: str) -> tuple[int, bytes]:
    """(CRC32C of the payload, its 4-byte tail) of chunk file ``key``, whose payload is read into ``parts`` in
    turn (flat uint8 views; ``read_chunk_into``)."""
    n = sum(p.nbytes for p in parts)
    try:
        with door.opened(root, key) as (fd, size):
            if size != n + 4:
                raise CorruptionError(f"{where}: chunk is {size} bytes, expected {n + 4} (truncated?)")
            tail = bytearray(4)
            got, crc = pread_fold(fd, parts, 0, codec.crc32c)  # checked block by block as it is read
            if got != n or pread_into(fd, [tail], n) != 4:
                raise CorruptionError(f"{where}: chunk ended early (truncated while reading?)")
            return (codec.crc32c(b"") if crc is None else crc), bytes(tail)
    except FileNotFoundError:
        raise CorruptionError(f"{where}: chunk missing") from None
    except door.Refused as e:  # a link, a FIFO, not a regular file: never read
        raise CorruptionError(f"{where}: refused ({e.why})") from None


# -- checking (verify) --------------------------------------------------------------------------------

def samples_in_file(rec: CommitRecord, key: str) -> list[str]:
    """Sample ids whose tokens live in a file (a chunk of a token-major array; metadata: all samples)."""
    ids = rec.samples["sample_id"]
    parts = key.split("/")
    if is_chunk_key(key):  # shards/<name>/<array>/c/<k>[/0]
        if parts[2] == "offsets":
            return list(ids)
        chunk_tokens = rec.chunk_tokens
        k = int(parts[4])
        lo, hi = k * chunk_tokens, (k + 1) * chunk_tokens
        off = rec.offsets
        return [ids[i] for i in range(rec.n_samples) if off[i] < hi and off[i + 1] > lo]
    return list(ids)


def check_shard(src: ShardSource, rec: CommitRecord, report: VerifyReport, progress: Callable[[int], None] | None,
                tails: dict[str, int] | None = None) -> None:
    """``verify``'s checks of one committed shard whose files are in ``(fs, root)``: every listed file (size,
    CRC32C, chunk bound to its path), then the arrays' metadata and token arrays (shapes, dtypes, every chunk
    listed, offsets and loss-mask sums against the record; fp8: the scales). ``tails`` (``hsstore
    upgrade``): filled with the CRC32C each intact chunk ends with, read in the same pass."""
    fs, root, _ = src.locate(rec.shard)  # another store's, for a shard merged by reference
    _check_files(fs, root, rec, report, progress, tails, src.manifest)
    _check_arrays(src, rec, report)


def chunk_decoding(m: Manifest, rec: CommitRecord, key: str) -> tuple[codec.ChunkCodec, np.dtype, int] | None:
    """(codec, dtype, values) that readers decode chunk file ``key`` of a shard with (``read_into``, the
    token-array readers): a feature chunk with the manifest's codec into one chunk of rows, every other array
    uncompressed. None for a file that is not a chunk of an array readers read."""
    if not is_chunk_key(key):
        return None
    array, ct, W = key.split("/")[2], m.chunk_tokens, codec.row_width(m.hidden_size, m.encoding)
    plain = codec.ChunkCodec("none")
    if array in {layer_array(l) for l in m.all_features}:
        return codec.ChunkCodec(m.codec), codec.storage_dtype(m.dtype, m.encoding), ct * W
    if encodings.get(m.encoding).row_scale and array in {scale_array(l) for l in m.all_features}:
        return plain, fp8.SCALE_DTYPE, ct
    return {"input_ids": (plain, np.dtype("<i4"), ct), "loss_mask": (plain, np.dtype("|u1"), ct),
            "offsets": (plain, np.dtype("<i8"), rec.n_samples + 1)}.get(array)


def decoded(m: Manifest, rec: CommitRecord, key: str, blob) -> tuple[np.ndarray | None, str | None]:
    """(values, None) of a chunk whose object passed its checksums, decoded exactly as readers decode it; (None,
    why) when readers would refuse it (another size, a frame that declares another size or does not decode).
    ``verify`` calls a chunk OK only when this decodes it: what ``show`` and the loader refuse never passes."""
    how = chunk_decoding(m, rec, key)
    if how is None:
        return None, None
    chunk_codec, dtype, count = how
    try:
        return chunk_codec.decode(blob, dtype, count, where=key), None
    except CorruptionError as e:
        return None, str(e)[len(key) + 2:] if str(e).startswith(f"{key}: ") else str(e)


def file_bound(manifest: Manifest, rec: CommitRecord, key: str) -> int:
    """The most bytes file ``key`` of a shard may hold, from the manifest and the record alone: a chunk of a
    feature, its scales or the token arrays one chunk's values (``chunk_bound``), the offsets chunk its samples
    + 1 int64s, metadata ``door.JSON_CAP`` (the group's ``zarr.json``, which holds the sample columns, the
    record's size). ``verify`` refuses a larger one without reading it."""
    m = manifest
    parts = key.split("/")
    if not is_chunk_key(key):
        return max(door.JSON_CAP, len(rec.samples["sample_id"]) * 4096) if key.endswith("zarr.json") else 0
    array = parts[2]
    widths = {layer_array(l): codec.row_width(m.hidden_size, m.encoding) * codec.storage_dtype(m.dtype, m.encoding).itemsize
              for l in m.all_features}
    widths.update({scale_array(l): fp8.SCALE_DTYPE.itemsize for l in m.all_features},
                  input_ids=4, loss_mask=1)
    if array == "offsets":
        return chunk_bound((rec.n_samples + 1) * 8)
    return chunk_bound(m.chunk_tokens * widths[array]) if array in widths else 0


def _check_files(fs, root: str, rec: CommitRecord, report: VerifyReport, progress,
                 tails: dict[str, int] | None = None, manifest: Manifest | None = None) -> None:
    """Every file the record lists, read through the door in batches of ~``BATCH_BYTES``: a link, not a regular
    file, or larger than its bound (``file_bound``) is a problem named without reading it; then each one's
    size, CRC32C and (a chunk) payload bound to its path."""
    keys = list(rec.files)
    batch: list[str] = []
    size = 0
    tally = _value_tally(manifest, rec)
    for i, key in enumerate(keys):
        batch.append(key)
        size += rec.files[key]["size"]
        if size >= BATCH_BYTES or i == len(keys) - 1:
            sizes = {k: rec.files[k]["size"] for k in batch}
            bound = (lambda k: file_bound(manifest, rec, k)) if manifest is not None else door.SEGMENT_CAP
            try:
                blobs = door.read_many(fs, root, batch, sizes=sizes, bound=bound,
                                       ok=lambda k, b: check_file(rec, k, b) is None, where=f"shard {rec.shard!r}")
            except Exception as e:
                raise FetchError(f"shard {rec.shard}: cannot read files: {type(e).__name__}: {e}") from None
            for k in batch:
                data = blobs.get(k)
                if isinstance(data, door.Refused):  # not read: a link, not a file, too large, another size
                    why = data.why if isinstance(data, door.WrongSize) else f"refused ({data.why})"
                    report.problems.append(Problem(rec.shard, why, k, samples_in_file(rec, k)))
                    continue
                failure = transfer.fetch_failure(data)
                if failure:  # unreachable is not "missing": verify cannot tell, so it stops
                    raise FetchError(f"shard {rec.shard}, file {k}: read failed after retries ({failure})")
                if data is None or isinstance(data, Exception):
                    report.problems.append(Problem(rec.shard, "file missing" + (f" (referenced store {rec.location!r})"
                                                                                if rec.location else ""),
                                                   k, samples_in_file(rec, k)))
                    continue
                report.files += 1
                report.bytes += len(data)
                wrong = check_file(rec, k, data)
                vals = None
                if not wrong and manifest is not None:
                    vals, wrong = decoded(manifest, rec, k, data)
                if wrong:
                    report.problems.append(Problem(rec.shard, wrong, k, samples_in_file(rec, k)))
                else:
                    if tails is not None and is_chunk_key(k):
                        tails[k] = codec.chunk_tail(data)  # checked against its payload just now
                    if tally is not None and vals is not None:
                        _count_values(tally, manifest, k, vals, report)
                if progress:
                    progress(len(data))
            batch, size = [], 0
    if tally is not None:
        health.report_values(tally, manifest.hidden_size, report)


def _value_tally(manifest: Manifest | None, rec: CommitRecord) -> health.ValueTally | None:
    if manifest is None:
        return None
    enc, H = encodings.get(manifest.encoding), manifest.hidden_size
    if enc.quantised and not enc.row_scale:  # a block encoding: values depend on the scales in the row
        return health.ValueTally(rec, manifest.all_features, manifest.dtype,
                                 decode=lambda rows: enc.decode_numpy(rows, None, H))
    return health.ValueTally(rec, manifest.all_features,
                             "float8_e4m3fn" if manifest.encoding == fp8.ENCODING else manifest.dtype)


def _count_values(tally: health.ValueTally, m: Manifest, key: str, vals: np.ndarray, report: VerifyReport) -> None:
    """A checked feature chunk's decoded values (``decoded``) into ``tally``; a block encoding's rows that no writer
    writes (``Encoding.bad_rows``: a NaN or negative scale, an outlier index out of its row) named."""
    parts = key.split("/")
    feature = {layer_array(l): l for l in m.all_features}.get(parts[2])
    if feature is None:
        return
    ct, enc = m.chunk_tokens, encodings.get(m.encoding)
    first = int(parts[4]) * ct
    rows = vals.reshape(ct, codec.row_width(m.hidden_size, m.encoding))
    tally.add(feature, first, rows)
    if enc.quantised and not enc.row_scale:
        n = max(0, min(ct, tally.rec.n_tokens - first))
        bad = np.flatnonzero(enc.bad_rows(rows[:n], None, m.hidden_size))
        if bad.size:
            rec = tally.rec
            who = np.unique(np.searchsorted(rec.offsets, first + bad, side="right") - 1)
            report.problems.append(Problem(rec.shard, f"{health.feature_name(health.feature_key(feature))}: {bad.size} "
                                                      f"row(s) with a NaN or negative scale or an outlier index "
                                                      f"outside the row (first at token {first + int(bad[0])})", key,
                                           [rec.samples["sample_id"][i] for i in who]))


# the fields of an array's zarr.json that say how to read it: each must be what hsstore writes for that array
META_FIELDS = ("zarr_format", "node_type", "shape", "data_type", "chunk_grid", "chunk_key_encoding", "fill_value",
               "codecs")


def expected_metadata(m: Manifest, rec: CommitRecord) -> dict[str, dict]:
    """Array name -> the parsed ``zarr.json`` hsstore writes for a shard of ``rec``'s tokens and samples (made by
    zarr-python in memory, as the writer makes it)."""
    base = shard_path(rec.shard)
    specs = array_specs(m, rec.n_tokens, rec.n_samples)

    def build(mem):
        group = zarr.create_group(store=mem, path=base, zarr_format=3)
        for arr_name, shape, chunk, dtype, chunk_codec, attrs in specs:
            group.create_array(arr_name, shape=shape, chunks=(chunk,) + shape[1:], dtype=dtype,
                               compressors=chunk_codec.zarr_compressors(), fill_value=0, attributes=attrs,
                               dimension_names=["token", "hidden"][: len(shape)])
    objects = zarr_metadata(build)
    return {spec[0]: door.load_json(objects[f"{base}/{spec[0]}/zarr.json"], spec[0]) for spec in specs}


def _check_arrays(src: ShardSource, rec: CommitRecord, report: VerifyReport) -> None:
    """Each array's ``zarr.json`` (through the door, bounded) against what the manifest and record allow --
    shape, dtype, chunk grid, codecs -- before any of its data is looked at; then ``offsets``, ``input_ids``
    and ``loss_mask`` read with hsstore's own bounded reader (never a library's decoder on the store's codecs)
    and checked against the record's lengths and loss-mask sums."""
    m, name = src.manifest, rec.shard
    base = shard_path(name)
    fs, root, _ = src.locate(name)
    want = expected_metadata(m, rec)
    bad_meta = False
    for arr_name, expect in want.items():
        key = f"{base}/{arr_name}/zarr.json"
        what = arr_name if arr_name in ("input_ids", "loss_mask", "offsets") else (
            f"layer {arr_name[6:].lstrip('0') or 0}" if arr_name.startswith("layer_") else arr_name)
        try:
            meta = door.read_json(fs, root, key, where=f"shard {name!r}, file {key}",
                                  bound=file_bound(m, rec, key), size=rec.files.get(key, {}).get("size"))
        except FileNotFoundError:
            report.problems.append(Problem(name, f"array for {what} missing", key))
            bad_meta = True
            continue
        except StoreError as e:
            report.problems.append(Problem(name, f"array for {what} unreadable: {e}", key))
            bad_meta = True
            continue
        if not isinstance(meta, dict):
            report.problems.append(Problem(name, f"{what}: zarr.json is not an object", key))
            bad_meta = True
            continue
        diff = [f for f in META_FIELDS if meta.get(f) != expect.get(f) and f not in ("shape", "data_type")]
        if meta.get("storage_transformers") not in (None, []):
            diff.append("storage_transformers")
        attrs = meta.get("attributes") if isinstance(meta.get("attributes"), dict) else {}
        if meta.get("shape") != expect["shape"]:
            report.problems.append(Problem(name, f"{what} shape {escape(meta.get('shape'))} != {expect['shape']} "
                                                 f"(tokens {rec.n_tokens} implied by offsets, hidden "
                                                 f"{m.hidden_size})", key))
            bad_meta = True
        wanted = expect.get("attributes", {}).get("hsstore_dtype")
        if meta.get("data_type") != expect["data_type"] or attrs.get("hsstore_dtype") != wanted:
            report.problems.append(Problem(name, f"{what} dtype {escape(meta.get('data_type'))}/"
                                                 f"{escape(attrs.get('hsstore_dtype'))} != {wanted or expect['data_type']}"
                                                 f" (manifest dtype {m.dtype}, encoding {m.encoding})", key))
            bad_meta = True
        if diff:
            got = {f: meta.get(f) for f in diff}
            report.problems.append(Problem(name, f"{what}: zarr.json {', '.join(diff)} differ from what hsstore "
                                                 f"writes for it (got {shown(str(got)[:200])})", key))
            bad_meta = True
            continue
        listed = [k for k in range(-(-rec.n_tokens // m.chunk_tokens) if arr_name != "offsets" else 1)
                  if chunk_key(f"{base}/{arr_name}", k, len(expect["shape"])) not in rec.files]
        if listed:
            report.problems.append(Problem(name, f"chunks {listed[:5]} of {arr_name} not in the commit record",
                                           f"{base}/{arr_name}"))
            bad_meta = True
    if bad_meta:
        return
    _check_token_arrays(src, rec, report, fs, root)
    if encodings.get(m.encoding).row_scale:
        for l in m.all_features:
            _check_scales(src, rec, l, report)


def _check_token_arrays(src: ShardSource, rec: CommitRecord, report: VerifyReport, fs, root: str) -> None:
    name, base = rec.shard, shard_path(rec.shard)
    key = chunk_key(f"{base}/offsets", 0, 1)
    try:
        offsets = stored_offsets(fs, root, src.manifest, rec, key)
        mask = read_plain(fs, root, src.manifest, rec, "loss_mask", np.dtype("|u1"))
    except (OSError, StoreError) as e:
        report.problems.append(Problem(name, f"token arrays unreadable: {type(e).__name__}: {e}"))
        return
    if not np.array_equal(offsets, rec.offsets):
        report.problems.append(Problem(name, "offsets array disagrees with the commit record's lengths",
                                       f"{base}/offsets"))
        return
    bad = admission.loss_mask_problem(rec, mask, f"{base}/loss_mask")
    if bad:
        report.problems.append(bad)


def read_loss_mask(src: ShardSource, rec: CommitRecord) -> np.ndarray:
    """A shard's loss_mask whole, nothing else of it (``read_plain``: each chunk through the door at the size the
    record lists, checked against its CRC32C); a chunk missing, refused or damaged is the shard's corruption, a
    request that failed a ``FetchError``, each naming the shard and file."""
    fs, root, url = src.locate(rec.shard)
    try:
        return read_plain(fs, root, src.manifest, rec, "loss_mask", np.dtype("|u1"))
    except CorruptionError:
        raise
    except FileNotFoundError as e:
        raise CorruptionError(f"shard {rec.shard!r}, file {e.filename}: missing") from None
    except (OSError, StoreError) as e:
        raise FetchError(f"shard {rec.shard!r} of store {url!r}: loss_mask read failed: {type(e).__name__}: {e}"
                         ) from None


def read_plain(fs, root: str, m: Manifest, rec: CommitRecord, array: str, dtype: np.dtype) -> np.ndarray:
    """A whole uncompressed ``[tokens]`` array of a shard (``loss_mask``, an fp8 layer's scales), each chunk read
    through the door at the size the record lists and decoded by hsstore's bounded codec."""
    ct = m.chunk_tokens
    keys = [chunk_key(f"{shard_path(rec.shard)}/{array}", k, 1) for k in range(-(-rec.n_tokens // ct))]
    unlisted = [k for k in keys if k not in rec.files]
    if unlisted:
        raise CorruptionError(f"shard {rec.shard!r}, file {unlisted[0]}: not listed in the commit record")
    blobs = door.read_many(fs, root, keys, sizes={k: rec.files[k]["size"] for k in keys},
                           bound=chunk_bound(ct * dtype.itemsize), where=f"shard {rec.shard!r}")
    out = np.empty(len(keys) * ct, dtype)
    for j, k in enumerate(keys):
        if isinstance(blobs[k], FileNotFoundError):
            raise FileNotFoundError(errno.ENOENT, "missing", k)  # named by its key, not its last part
        if isinstance(blobs[k], Exception):
            raise blobs[k]
        out[j * ct:(j + 1) * ct] = codec.ChunkCodec("none").decode(blobs[k], dtype, ct, where=k,
                                                                  expect=rec.chunk_checksum(k))
    return out[:rec.n_tokens]


def _check_scales(src: ShardSource, rec: CommitRecord, layer: int, report: VerifyReport) -> None:
    """An fp8 layer's scales (their metadata checked already), read with hsstore's own reader: every one
    finite and positive (a bad scale silently scales a whole row)."""
    key = f"{shard_path(rec.shard)}/{scale_array(layer)}"
    m = src.manifest
    fs, root, _ = src.locate(rec.shard)
    try:
        scales = read_plain(fs, root, m, rec, scale_array(layer), fp8.SCALE_DTYPE)
    except (OSError, StoreError) as e:
        report.problems.append(Problem(rec.shard, f"layer {layer} scales unreadable: {type(e).__name__}: {e}", key))
        return
    good = np.isfinite(scales) & (scales > 0)
    with np.errstate(over="ignore"):  # e4m3's largest value times the scale, as readers decode it (float32)
        past = good & ~(np.float32(fp8.FP8_MAX) * scales < health.FINITE_BELOW.get(m.dtype, np.inf))
    for rows, what in ((np.flatnonzero(~good), "scales not finite and positive"),
                       (np.flatnonzero(past), f"scales so large that their rows decode past {m.dtype}'s largest value")):
        if rows.size:
            tokens = np.searchsorted(rec.offsets, rows, side="right") - 1
            who = [rec.samples["sample_id"][i] for i in np.unique(tokens)]
            report.problems.append(Problem(rec.shard, f"layer {layer}: {rows.size} {what}", key, who))
