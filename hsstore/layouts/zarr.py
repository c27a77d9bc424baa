"""The zarr layout (the default): one shard is a Zarr v3 group of flat token-major arrays.

Layout under the store prefix (see docs/FORMAT.md)::

    shards/<name>/                 Zarr v3 group (attributes: shard name, per-sample columns)
        layer_<LLL>/               [tokens, hidden] features of tapped layer LLL, chunked along tokens
        input_ids/  loss_mask/     [tokens] int32 / uint8, same chunk grid as the layers
        offsets/                   [samples + 1] int64: sample i is tokens offsets[i]:offsets[i+1]
        scale_<LLL>/               (fp8 stores only) [tokens] float32 scales of layer LLL's rows
    commits/<name>.json            the commit record (format/commit.py), written last

hsstore writes and reads the chunk objects itself (format/codec.py: one copy, checksums checked on the way);
zarr-python writes the metadata and opens the group for ``verify``'s checks, so any Zarr v3 reader reads
a shard. Write, read and check live here; ``layout.get("zarr")`` is this module.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import zarr
from zarr.abc.store import Store as ZarrStore
from zarr.storage import FsspecStore, LocalStore, MemoryStore

from ..format import codec, fp8
from .. import storage
from ..format.commit import SHARDS_DIR, CommitRecord, check_file, is_chunk_key, layer_array, sample_offsets
from ..errors import CorruptionError, FetchError
from ..format.manifest import Manifest, now_iso
from ..memory import copy_bytes, mapped_reads, pread_into, torch_threads
from ..format.report import Problem, VerifyReport

if TYPE_CHECKING:
    from .source import ShardSource

BATCH_BYTES = 256 << 20  # verify reads a shard's files in batches of about this many bytes


def scale_array(layer: int | str) -> str:
    """The per-row scales of an fp8-encoded layer (or feature) array."""
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


def zarr_store(fs, root: str, url: str, storage_options: dict | None, read_only: bool) -> ZarrStore:
    """The Zarr store object for a store prefix (LocalStore on disk, FsspecStore elsewhere)."""
    if storage.is_local(fs):
        return LocalStore(root, read_only=read_only)
    return FsspecStore.from_url(url, storage_options=storage_options, read_only=read_only)


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
    the float32 scale of every row of ``features`` (which then hold e4m3fn bits)."""
    n_tokens = int(input_ids.shape[0])
    offsets = sample_offsets(name, samples, n_tokens)
    lengths = np.diff(offsets)
    base = shard_path(name)
    ct = manifest.chunk_tokens
    feature_codec, plain = codec.ChunkCodec(manifest.codec), codec.ChunkCodec("none")
    is_fp8 = manifest.encoding == fp8.ENCODING
    if is_fp8 and scales is None:
        raise ValueError(f"shard {name}: an fp8 store needs the scales of every layer")
    arrays: list[tuple[str, np.ndarray, int, codec.ChunkCodec, dict]] = [
        (layer_array(l), features[l], ct, feature_codec, layer_attributes(manifest, l)) for l in manifest.all_features]
    if is_fp8:
        arrays += [(scale_array(l), scales[l].astype(fp8.SCALE_DTYPE, copy=False), ct, plain,
                    {"layer": l, "hsstore_scales_of": layer_array(l)}) for l in manifest.all_features]
    arrays += [("input_ids", input_ids.astype("<i4", copy=False), ct, plain, {}),
               ("loss_mask", loss_mask.astype("|u1", copy=False), ct, plain, {}),
               ("offsets", offsets, max(1, offsets.shape[0]), plain, {})]

    def build(mem):
        group = zarr.create_group(store=mem, path=base, zarr_format=3,
                                  attributes={"hsstore_shard": name, "writer": writer, "chunk_tokens": ct,
                                              "samples": samples})
        for arr_name, data, chunk, chunk_codec, attrs in arrays:
            group.create_array(arr_name, shape=data.shape, chunks=(chunk,) + data.shape[1:], dtype=data.dtype,
                               compressors=chunk_codec.zarr_compressors(), fill_value=0, attributes=attrs,
                               dimension_names=["token", "hidden"][: data.ndim])

    # only the shard's own metadata: parent groups are written once, when the store is created
    objects: dict[str, Any] = {k: v for k, v in zarr_metadata(build).items() if k.startswith(base + "/")}
    for arr_name, data, chunk, chunk_codec, _ in arrays:
        objects.update(encode_array(f"{base}/{arr_name}", data, chunk, chunk_codec))
    storage.put_many(fs, {storage.join(root, k): v for k, v in objects.items()})
    files = {k: {"size": len(v), "crc32c": v.crc32c if isinstance(v, codec.EncodedChunk) else codec.crc32c(v)}
             for k, v in sorted(objects.items())}
    layers = {}
    for l in manifest.all_features:  # a layer's bytes: its values, and its scales in an fp8 store
        prefixes = (f"{base}/{layer_array(l)}/", f"{base}/{scale_array(l)}/")
        raw = int(features[l].nbytes) + (int(scales[l].size) * fp8.SCALE_DTYPE.itemsize if is_fp8 else 0)
        layers[str(l)] = {"stored_bytes": sum(v["size"] for k, v in files.items() if k.startswith(prefixes)),
                          "raw_bytes": raw}
    return CommitRecord(
        shard=name, writer=writer, n_samples=len(lengths), n_tokens=n_tokens, samples=samples, layers=layers,
        files=files, chunk_tokens=ct, stats=stats or {}, created_at=now_iso(), manifest_key=manifest.shard_key())


def layer_attributes(manifest: Manifest, layer: int) -> dict[str, Any]:
    """Zarr attributes of a layer array: ``hsstore_dtype`` names what the stored bits are (the manifest dtype,
    or ``float8_e4m3fn`` in an fp8 store, whose ``hsstore_scales`` array holds the per-row scales)."""
    if manifest.encoding == fp8.ENCODING:
        return {"hsstore_dtype": "float8_e4m3fn", "hsstore_encoding": fp8.ENCODING,
                "hsstore_scales": scale_array(layer), "layer": layer}
    return {"hsstore_dtype": manifest.dtype, "layer": layer}


# -- reading -----------------------------------------------------------------------------------------

def check_extent(src: ShardSource, rec: CommitRecord) -> None:
    """Refuse (before any buffer is sized from it) a record whose token count its chunks cannot hold: it must
    list exactly ``ceil(n_tokens / chunk_tokens)`` chunks of ``input_ids``. Checked once per record object."""
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
    rec._extent_ok = True


def read_into(src: ShardSource, rec: CommitRecord, start: int, stop: int, layers: Sequence[int], ids: np.ndarray,
              mask: np.ndarray, feats: np.ndarray, carry: dict | None = None, scales: np.ndarray | None = None,
              ) -> None:
    """Tokens ``start:stop`` of a shard into ``ids``, ``mask`` and layer-major ``feats`` (the layout's part of
    :meth:`hsstore.store.reader.Store.read_range`): the chunks of ``layers`` overlapping the range (and, fp8, of
    their scale arrays), every one checked against its CRC32C and the commit record."""
    shard_name = rec.shard
    m = src.manifest
    ct, H = m.chunk_tokens, m.hidden_size
    feature_codec, plain = codec.ChunkCodec(m.codec), codec.ChunkCodec("none")
    base = shard_path(shard_name)
    k0, k1 = start // ct, (stop - 1) // ct
    targets = [(f"{base}/input_ids", ids, plain, 1), (f"{base}/loss_mask", mask, plain, 1)]
    targets += [(f"{base}/{layer_array(l)}", feats[j], feature_codec, H) for j, l in enumerate(layers)]
    if scales is not None:  # fp8: each layer's per-row scales
        targets += [(f"{base}/{scale_array(l)}", scales[j], plain, 1) for j, l in enumerate(layers)]
    fs, root, _ = src.locate(shard_name)
    direct = storage.is_local(fs) and feature_codec.spec == "none"
    # (key, destination rows, rows of the chunk to take, codec, width, read directly from a local file)
    jobs = []
    for array_path, out, chunk_codec, width in targets:
        for k in range(k0, k1 + 1):
            lo, hi = max(start, k * ct), min(stop, (k + 1) * ct)
            key = chunk_key(array_path, k, 1 if width == 1 else 2)
            jobs.append((key, out[lo - start:hi - start], slice(lo - k * ct, hi - k * ct), chunk_codec, width,
                         direct))
    if carry is None and not direct and feature_codec.spec == "none" and storage.stream_reads():
        return _stream_into(src, rec, fs, root, jobs, ct)
    carried = carry or {}
    fetch = [p for p in (storage.join(root, j[0]) for j in jobs if not j[5]) if p not in carried]
    blobs: dict = dict(carried)
    if fetch:
        cached = src.chunk_cache is not None and not storage.is_local(fs)
        listed = {storage.join(root, j[0]): rec.chunk_checksum(j[0]) for j in jobs} if cached else None
        # the sizes the record lists: one ranged GET per chunk on object stores, not a HEAD and a GET
        sizes = {storage.join(root, j[0]): rec.files[j[0]]["size"] for j in jobs if j[0] in rec.files}
        try:
            if cached:
                blobs.update(src.chunk_cache.cat(fs, fetch, namespace=src.cache_namespace(), expect=listed,
                                                   sizes=sizes))
            else:
                blobs.update(storage.cat_verified(fs, fetch, lambda _p, b: codec.chunk_ok(b), sizes=sizes))
        except Exception as e:
            raise FetchError(f"shard {shard_name!r} of store {src.url!r}: read failed: "
                             f"{type(e).__name__}: {e}") from None
        for p in fetch:
            failure = storage.fetch_failure(blobs.get(p))
            if failure:  # the path to the store failed (after retries), not the bytes: never "corrupt"
                raise FetchError(f"shard {shard_name!r} of store {src.url!r}, file "
                                 f"{p[len(root) + 1:]}: read failed after retries ({failure})")
    for key, dest, rows, chunk_codec, width, local in jobs:
        where = f"shard {shard_name!r}, file {key}"
        path = storage.join(root, key)
        expect = rec.chunk_checksum(key)  # compared with the tail checked anyway: no extra pass
        if local and rows.stop - rows.start == ct:  # the whole chunk: read straight into the output
            read_chunk_into(path, dest, where, expect)
            continue
        if local:  # part of a chunk: whole chunk into a reused per-thread buffer (checked), copy the rows
            with _scratch(ct * width * dest.itemsize) as buf:
                vals = buf.view(dest.dtype)
                read_chunk_into(path, vals, where, expect)
                dest[:] = (vals.reshape(ct, width) if width > 1 else vals)[rows]
            continue
        blob = blobs.get(path)
        if blob is None or isinstance(blob, Exception):
            detail = f"{type(blob).__name__}: {blob}" if blob is not None else "not returned"
            raise CorruptionError(f"{where}: chunk missing or unreadable ({detail})")
        vals = chunk_codec.decode(blob, dest.dtype, ct * width, where=where, expect=expect)
        dest[:] = (vals.reshape(ct, width) if width > 1 else vals)[rows]
    if carry is not None:
        last = [storage.join(root, chunk_key(t[0], k1, 1 if t[3] == 1 else 2)) for t in targets]
        carry.clear()
        carry.update({p: blobs[p] for p in last if isinstance(blobs.get(p), (bytes, bytearray))})


def _stream_into(src: ShardSource, rec: CommitRecord, fs, root: str, jobs: list, ct: int) -> None:
    """``read_into``'s remote path for uncompressed chunks: each chunk's bytes go straight into the output (a
    whole chunk) or a reused scratch buffer (part of one), its 4-byte tail beside (``storage.cat_into``, or the
    loader's chunk cache when attached), and are checked there: no bytes object per chunk, no fresh memory to
    fault in."""
    shard_name = rec.shard
    with contextlib.ExitStack() as stack:
        targets, crcs, parts = {}, {}, {}
        for key, dest, rows, _codec, width, _local in jobs:
            where = f"shard {shard_name!r}, file {key}"
            nbytes = ct * width * dest.itemsize
            listed = rec.files.get(key, {}).get("size")
            if listed is not None and listed != nbytes + 4:
                raise CorruptionError(f"{where}: chunk holds {max(0, listed - 4)} bytes, expected {nbytes}")
            path = storage.join(root, key)
            if rows.stop - rows.start == ct and dest.flags.c_contiguous:
                payload = dest.reshape(-1).view(np.uint8)
            else:
                payload = stack.enter_context(_scratch(nbytes))
                parts[path] = (dest, rows, width, payload)
            tail = bytearray(4)
            targets[path] = [payload, tail]
            crcs[path] = (payload, tail, rec.chunk_checksum(key), where)

        def check(path: str) -> str | None:
            payload, tail, expect, _ = crcs[path]
            return codec.payload_problem(payload, int.from_bytes(tail, "little"), expect)

        try:
            if src.chunk_cache is not None:
                got = src.chunk_cache.cat_into(fs, targets, src.cache_namespace(), check)
            else:
                got = storage.cat_into(fs, targets, check)
        except Exception as e:
            raise FetchError(f"shard {shard_name!r} of store {src.url!r}: read failed: "
                             f"{type(e).__name__}: {e}") from None
        for path, result in got.items():
            where = crcs[path][3]
            if isinstance(result, FileNotFoundError):
                raise CorruptionError(f"{where}: chunk missing or unreadable ({type(result).__name__}: {result})")
            if isinstance(result, Exception):  # the path to the store failed (after retries), not the bytes
                raise FetchError(f"shard {shard_name!r} of store {src.url!r}, file {path[len(root) + 1:]}: "
                                 f"read failed after retries ({type(result).__name__}: {result})")
            if result is not None:
                raise CorruptionError(f"{where}: {result}")
        for dest, rows, width, payload in parts.values():
            vals = payload.view(dest.dtype)
            dest[:] = (vals.reshape(ct, width) if width > 1 else vals)[rows]


_SCRATCH: list[np.ndarray] = []  # free partial-chunk buffers, shared by all threads of this process
_SCRATCH_LOCK = threading.Lock()


@contextlib.contextmanager
def _scratch(nbytes: int):
    """A byte buffer for one partial chunk, reused across threads and the loader's per-epoch thread pools:
    fresh memory costs more to fault in than the read (1-3 CPU-s per GB in a VM), so none is dropped."""
    with _SCRATCH_LOCK:
        fits = [i for i, b in enumerate(_SCRATCH) if b.nbytes >= nbytes]
        buf = _SCRATCH.pop(min(fits, key=lambda i: _SCRATCH[i].nbytes)) if fits else None
    if buf is None:
        buf = np.empty(nbytes, np.uint8)
    try:
        yield buf[:nbytes]
    finally:
        with _SCRATCH_LOCK:
            _SCRATCH.append(buf)


def read_chunk_into(path: str, dest: np.ndarray, where: str, expect: int | None = None) -> None:
    """Read an uncompressed local chunk file into ``dest`` (contiguous) and check its CRC32C, and that it is
    ``expect``, the payload CRC32C the commit record lists for the path (None: the record lists none).

    The payload is read with ``preadv`` straight into ``dest`` and the 4-byte tail into a small buffer: no
    mapping to fault in and no second copy; the loader's reader threads read several chunks at once
    (``memory.mapped_reads``: the former mapped path, for comparison). Committed chunks are never
    rewritten, so the file cannot change under the read."""
    flat = dest.reshape(-1).view(np.uint8)
    n = flat.nbytes
    try:
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            if size != n + 4:
                raise CorruptionError(f"{where}: chunk is {size} bytes, expected {n + 4} (truncated?)")
            if not mapped_reads() or torch_threads() == 1:
                tail = bytearray(4)
                if pread_into(f.fileno(), [flat, tail], 0) != n + 4:
                    raise CorruptionError(f"{where}: chunk ended early (truncated while reading?)")
            else:
                with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:  # private: torch may wrap it
                    src = np.frombuffer(m, np.uint8, count=n)
                    copy_bytes(flat, src)
                    tail = m[n:n + 4]
                    del src  # release the buffer before the mapping closes
    except FileNotFoundError:
        raise CorruptionError(f"{where}: chunk missing") from None
    problem = codec.payload_problem(dest, int.from_bytes(tail, "little"), expect)
    if problem:
        raise CorruptionError(f"{where}: {problem}")


def open_group(src: ShardSource, name: str) -> zarr.Group:
    """Shard ``name`` of a store as a Zarr group, through zarr-python (the metadata checks; data reads
    do not need it)."""
    fs, root, url = src.locate(name)
    zstore = zarr_store(fs, root, url, dict(src.storage_options), read_only=True)
    return zarr.open_group(zstore, path=shard_path(name), mode="r")


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
    CRC32C, chunk bound to its path), then the arrays through zarr-python (shapes, dtypes, every chunk
    listed, offsets and loss-mask sums against the record; fp8: the scales). ``tails`` (``hsstore
    upgrade``): filled with the CRC32C each intact chunk ends with, read in the same pass."""
    fs, root, _ = src.locate(rec.shard)  # another store's, for a shard merged by reference
    _check_files(fs, root, rec, report, progress, tails, src.manifest)
    _check_arrays(src, rec, report)


def decoded_size_problem(m: Manifest, key: str, blob) -> str | None:
    """Why a layer chunk's payload would not decode to one chunk of the manifest's shape (None: it would): an
    uncompressed payload must be that size, a compressed one must declare it (``codec.decode_bounded``), so
    ``verify`` refuses what readers would refuse, without decoding."""
    if not is_chunk_key(key) or key.split("/")[2] not in {layer_array(l) for l in m.all_features}:  # others: plain
        return None
    nbytes = m.chunk_tokens * m.hidden_size * codec.storage_dtype(m.dtype, m.encoding).itemsize
    c = codec.ChunkCodec(m.codec)._numcodec()
    payload = memoryview(blob)[:-4]
    if c is None:
        got = len(payload)
    else:
        blosc = m.codec.split(":")[0] in ("lz4", "blosc-zstd")
        got = codec.blosc_content_size(payload) if blosc else codec.zstd_content_size(payload)
    if got != nbytes:
        return f"chunk decodes to {'an undeclared size' if got is None else f'{got:,} bytes'}, one chunk is {nbytes:,}"
    return None


def _check_files(fs, root: str, rec: CommitRecord, report: VerifyReport, progress,
                 tails: dict[str, int] | None = None, manifest: Manifest | None = None) -> None:
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
                blobs = storage.cat_verified(fs, paths, lambda p, b: check_file(rec, key_of[p], b) is None)
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
                wrong = check_file(rec, k, data) or (manifest and decoded_size_problem(manifest, k, data))
                if wrong:
                    report.problems.append(Problem(rec.shard, wrong, k, samples_in_file(rec, k)))
                elif tails is not None and is_chunk_key(k):
                    tails[k] = codec.chunk_tail(data)  # checked against its payload just now
                if progress:
                    progress(len(data))
            batch, size = [], 0


def _check_arrays(src: ShardSource, rec: CommitRecord, report: VerifyReport) -> None:
    m, name = src.manifest, rec.shard
    base = shard_path(name)
    try:
        g = open_group(src, name)
    except Exception as e:
        report.problems.append(Problem(name, f"shard group cannot be opened: {e}", f"{base}/zarr.json"))
        return
    for l in m.all_features:
        key = f"{base}/{layer_array(l)}"
        try:
            a = g[layer_array(l)]
        except Exception:
            report.problems.append(Problem(name, f"array for layer {l} missing", key))
            continue
        if a.shape != (rec.n_tokens, m.hidden_size):
            report.problems.append(Problem(name, f"layer {l} shape {a.shape} != (tokens {rec.n_tokens}, hidden "
                                                 f"{m.hidden_size}) implied by offsets", key))
        want = layer_attributes(m, l)["hsstore_dtype"]
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


def _check_scales(g: zarr.Group, rec: CommitRecord, layer: int, report: VerifyReport) -> None:
    """An fp8 layer's scale array: present, ``[tokens]`` float32, every chunk committed, every scale finite
    and positive (a bad scale silently scales a whole row)."""
    name = scale_array(layer)
    key = f"{shard_path(rec.shard)}/{name}"
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


def _check_chunks_listed(rec: CommitRecord, key: str, a: zarr.Array, report: VerifyReport) -> None:
    n_chunks = -(-a.shape[0] // a.chunks[0]) if a.shape[0] else 0
    missing = [k for k in range(n_chunks) if chunk_key(key, k, a.ndim) not in rec.files]
    if missing:
        report.problems.append(Problem(rec.shard, f"chunks {missing[:5]} of {n_chunks} not in the commit record", key))
