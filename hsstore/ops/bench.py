"""Store and loader throughput against raw reads/writes of the same bytes on the same filesystem.

Machines here are noisy, so speed is reported as a ratio measured in one run: store write vs
``fs.pipe`` of byte-identical objects, store read (decoded, all layers, as tensors) vs ``fs.cat_ranges`` of
the store's own files. Rounds alternate (raw, store, raw, store) and the best of each is kept.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..io import storage, transfer
from ..io.backends import backend_for
from ..layouts import wds
from ..format import encodings, names
from ..format.codec import token_bytes
from ..format.commit import layer_array
from ..format.manifest import Manifest, TargetIdentity, TokenizerIdentity
from ..loader.options import Reading
from ..store.reader import Store
from ..store.writer import StoreWriter, default_chunk_tokens

log = logging.getLogger(__name__)


def synthetic_samples(total_bytes: int, layers: int, hidden: int, seed: int = 0, mean_len: int = 2048):
    """Finite random bf16 features (random bits with the exponent's top bit clear), ~total_bytes in all."""
    g = torch.Generator().manual_seed(seed)
    per_token = layers * hidden * 2
    out, size, i = [], 0, 0
    while size < total_bytes:
        T = int(torch.randint(mean_len // 2, mean_len * 3 // 2, (1,), generator=g))
        bits = torch.randint(0, 1 << 15, (T, layers, hidden), dtype=torch.int32, generator=g) & 0x3FFF
        bits |= torch.randint(0, 2, (T, layers, hidden), dtype=torch.int32, generator=g) << 15
        hs = bits.to(torch.int16).view(torch.bfloat16)
        ids = torch.randint(0, 32000, (T,), generator=g)
        mask = torch.rand(T, generator=g) > 0.3
        out.append((f"bench-{i}", ids, mask, hs))
        size += T * per_token
        i += 1
    return out


def bench_manifest(layers: int, hidden: int, codec: str, layout: str = "zarr", encoding: str = "raw") -> Manifest:
    """The synthetic store's manifest: bf16 features in ``encoding``, chunked as an extraction in that encoding
    chunks them (about 16 MiB per layer chunk of stored rows)."""
    enc = encodings.get(encoding)
    return Manifest(
        target=TargetIdentity(name="bench", num_layers=max(64, layers), hidden_size=hidden, config_hash="bench"),
        tokenizer=TokenizerIdentity(name="bench", vocab_hash="bench"),
        layers=tuple(range(layers)), codec=codec, layout=layout, encoding=encoding,
        chunk_tokens=default_chunk_tokens(enc.width(hidden), enc.storage_dtype("bfloat16").itemsize))


def write_bench_store(store_url: str, manifest: Manifest, storage_options: dict[str, Any], samples) -> None:
    """``samples`` (``synthetic_samples``) into a new store of ``manifest``. An encoded store's features are
    encoded on the GPU when there is one, as extraction encodes them (the host's encoder would take longer than
    the reads a bench times), else by the writer on the host."""
    enc = encodings.get(manifest.encoding)
    on_gpu = enc.quantised and torch.cuda.is_available()
    with StoreWriter(store_url, manifest, storage_options=storage_options, shard_bytes=256 << 20) as w:
        for sid, ids, mask, hs in samples:
            if on_gpu:
                hs = enc.encode(hs.cuda()).cpu()
            w.add(sid, ids, mask, hs)


def timed(fn, sync=None) -> float:
    """Seconds ``fn()`` took; ``sync`` (e.g. ``torch.cuda.synchronize``) runs before and after, so queued device
    work is neither counted against ``fn`` nor left out of it."""
    if sync is not None:
        sync()
    t = time.perf_counter()
    fn()
    if sync is not None:
        sync()
    return time.perf_counter() - t


def _loader_process(store_url: str, storage_options: dict[str, Any], layers: list[int], rank: int, world: int,
                    workers: int, seed: int, start, results, allow: list[str]) -> None:
    """One of several concurrent loaders (a spawned process): open, read one epoch to warm up, wait for the
    others, then time the next epoch. ``allow``: the parent's allowed locations (``names.allowed()``).
    Its intra-op threads are its share of the cores, as torchrun's ranks (``OMP_NUM_THREADS``) would have them."""
    from torch.utils.data import DataLoader

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    names.allow_for_command(allow)
    from ..distributed import World
    from ..loader.dataset import HiddenStateDataset
    from ..loader.options import Planning

    ds = HiddenStateDataset(store_url, layers=layers, planning=Planning(seed=seed), world=World(rank, world),
                            storage_options=storage_options)
    it = ds if workers == 0 else DataLoader(ds, batch_size=None, num_workers=workers, persistent_workers=True)
    for epoch in range(2):  # epoch 0 warms up (first-touch memory, as a training run's first steps), 1 is timed
        ds.set_epoch(epoch)
        if epoch:
            start.wait()
        t = time.perf_counter()
        got = sum(item["hidden_states"].numel() * item["hidden_states"].element_size() for item in it)
    results.put((rank, got, time.perf_counter() - t))


def _concurrent_loaders(store_url: str, storage_options: dict[str, Any], layers: list[int], procs: int,
                        workers: int, rounds: int, progress: bool) -> dict[str, Any]:
    """``procs`` loader processes at once, each rank r of world ``procs``: the best round's per-process GB/s
    (its bytes / its time) and total GB/s (all bytes / the slowest process's time)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # fresh interpreters, as torchrun starts its ranks
    best: dict[str, Any] | None = None
    bar = _bar(rounds, f"bench {procs} loaders at once", progress)
    for r in range(rounds):
        start, results = ctx.Barrier(procs), ctx.Queue()
        ps = [ctx.Process(target=_loader_process, args=(store_url, storage_options, layers, i, procs, workers, r,
                                                         start, results, names.allowed()))
              for i in range(procs)]
        for p in ps:
            p.start()
        got = sorted(results.get(timeout=3600) for _ in ps)
        for p in ps:
            p.join()
        per = [b / s / 1e9 for _, b, s in got]
        total = sum(b for _, b, _ in got) / max(s for _, _, s in got) / 1e9
        if best is None or total > best["total_gbps"]:
            best = {"procs": procs, "workers_each": workers, "total_gbps": total, "per_process_gbps": per,
                    "min_process_gbps": min(per)}
        bar.update(1)
    bar.close()
    assert best is not None
    return best


def _bar(total: int, desc: str, progress: bool, unit: str = "round"):
    """Benchmarks run for minutes: a bar that says which round and which pass is running."""
    from ..progress import progress_bar

    return progress_bar(total=total, desc=desc, unit=unit, disable=not progress)


def run_store_bench(url: str, storage_options: dict[str, Any], size_mb: int = 512, hidden: int = 5120,
                    layers: int = 5, codec: str = "none", rounds: int = 2, what: str = "store", layout: str = "zarr",
                    progress: bool = False, encoding: str = "raw") -> dict[str, dict]:
    """Store write (an encoded store's encoding included, as ``write_bench_store`` does it) and read (decoded into
    bf16) of the same bf16 samples, GB/s of those bf16 bytes, against plain writes and reads of the store's own
    files."""
    fs, root = storage.resolve(url, storage_options)
    samples = synthetic_samples(size_mb << 20, layers, hidden)
    nbytes = sum(s[3].numel() * 2 for s in samples)
    run = f"bench-{uuid.uuid4().hex[:8]}"
    manifest = bench_manifest(layers, hidden, codec, layout, encoding)
    stored = 0
    best = {"write": np.inf, "raw_write": np.inf, "raw_durable": np.inf, "read": np.inf, "raw_read": np.inf}
    local = backend_for(fs).local_paths
    bar = _bar(rounds, f"bench store ({layout})", progress)
    try:
        for r in range(rounds):
            bar.set_postfix_str(f"round {r + 1}/{rounds}: write")
            store_url = f"{url.rstrip('/')}/{run}/store{r}"
            raw_root = storage.join(root, run, f"raw{r}")

            best["write"] = min(best["write"], timed(lambda: write_bench_store(store_url, manifest, storage_options,
                                                                              samples)))
            store = Store(store_url, storage_options)
            files = [storage.join(store.root, k) for c in store.commits for k in c.files]
            sizes = [int(f["size"]) for c in store.commits for f in c.files.values()]
            stored = sum(sizes)
            blobs = transfer.cat_many(fs, files, sizes)  # byte-identical payloads for the raw write
            raw_objects = {storage.join(raw_root, f"{i:06d}"): blobs[p] for i, p in enumerate(files)}
            del blobs
            fs.makedirs(raw_root, exist_ok=True)
            best["raw_write"] = min(best["raw_write"], timed(lambda: fs.pipe(raw_objects)))
            if local:  # the store fsyncs every chunk before its commit record; so does this baseline
                best["raw_durable"] = min(best["raw_durable"], timed(lambda: pipe_fsync(raw_objects)))
            raw_objects = None  # free the copies before the read rounds
            best["raw_read"] = min(best["raw_read"], timed(lambda: transfer.cat_many(fs, files, sizes)))

            def read_store():  # sequential decode of every sample, all layers, as tensors
                for _ in store:
                    pass

            bar.set_postfix_str(f"round {r + 1}/{rounds}: read")
            best["read"] = min(best["read"], timed(read_store))
            bar.update(1)
            fs.rm(storage.join(root, run, f"raw{r}"), recursive=True)
            fs.rm(storage.join(root, run, f"store{r}"), recursive=True)
    finally:
        bar.close()
        _remove(fs, storage.join(root, run))
    gb = nbytes / 1e9
    result = {
        "store_write": {"gbps": gb / best["write"], "raw_gbps": gb / best["raw_write"], "bytes": nbytes},
        "store_read": {"gbps": gb / best["read"], "raw_gbps": gb / best["raw_read"], "bytes": nbytes},
    }
    if local:
        w = result["store_write"]
        w["raw_durable_gbps"] = gb / best["raw_durable"]
        w["ratio_durable"] = w["gbps"] / w["raw_durable_gbps"]
    for r in result.values():
        r["ratio"] = r["gbps"] / r["raw_gbps"]
        r.update({"codec": codec, "hidden": hidden, "layers": layers, "url": url, "layout": layout,
                  "encoding": encoding, "stored_bytes": stored})
    return result


def _raw_pieces(store: Store, layers: list[int]) -> list[tuple[str, int, int]]:
    """``(path, start, end)`` of the objects (zarr: chunk files; wds: tar members) that hold the ids, masks
    and ``layers``' features of a store: what a plain reader of those bytes would fetch."""
    wanted = [f"/{layer_array(l)}/c/" for l in layers] + ["/input_ids/c/", "/loss_mask/c/"]
    member_parts = [f".{wds.layer_part(l)}" for l in layers] + [".input_ids.npy", ".loss_mask.npy"]
    out = []
    for c in store.commits:
        if c.members is not None:
            path = storage.join(store.root, wds.tar_path(c.shard))
            out += [(path, o, o + n) for k, (o, n, _) in c.members.items() if any(k.endswith(x) for x in member_parts)]
        else:
            out += [(storage.join(store.root, k), 0, v["size"]) for k, v in c.files.items()
                    if any(x in k for x in wanted)]
    return out


def _remove(fs, path: str) -> None:
    """Delete a bench's scratch folder, whatever of it exists."""
    try:
        fs.rm(path, recursive=True)
    except FileNotFoundError:
        pass
    except Exception as e:  # cleanup after a failure must not replace that failure's error
        log.warning("bench: could not remove scratch %s (%s: %s)", path, type(e).__name__, e)


def pipe_fsync(objects: dict[str, bytes]) -> None:
    """Raw local writes made durable (write + fsync per file, sequentially, as ``fs.pipe`` writes)."""
    for path, data in objects.items():
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())


def drop_page_cache(paths: list[str]) -> None:
    """Ask the kernel to forget cached pages of local files (no root needed), for cold-read rounds."""
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _write_peer_layout(fs, peer_root: str, samples) -> list[str]:
    """The peers' layout: one ``torch.save`` file per sample (SpecForge / ModelOpt style)."""
    local = backend_for(fs).local_paths
    paths = []
    if local:
        os.makedirs(peer_root, exist_ok=True)
    for i, (sid, ids, mask, hs) in enumerate(samples):
        path = storage.join(peer_root, f"{i:06d}.pt")
        d = {"input_ids": ids, "loss_mask": mask, "hidden_states": hs}
        if local:
            torch.save(d, path)
        else:
            buf = io.BytesIO()
            torch.save(d, buf)
            fs.pipe_file(path, buf.getvalue())
        paths.append(path)
    return paths


@dataclass(frozen=True)
class LoaderBench:
    """What ``run_loader_bench`` measures (the flags of ``hsstore bench --what loader``).

    A synthetic store of ``size_mb`` (``layers`` taps of ``hidden``, chunk ``codec``, ``layout``) read back
    ``rounds`` times, best round of each path kept; ``read_layers`` (default all) are the layers read.
    ``workers`` > 0 also times that many persistent DataLoader workers; ``token_budget`` > 0 times packed
    ``TokenBatches`` of that many tokens instead of single samples; ``procs`` > 1 also runs that many loaders at
    once; ``cold`` drops local files from the page cache before every pass; ``peers`` times the peers'
    one-file-per-sample layout; ``pin`` delivers items in pinned memory."""

    size_mb: int = 512
    hidden: int = 5120
    layers: int = 5
    codec: str = "none"
    rounds: int = 3
    read_layers: tuple[int, ...] | None = None
    workers: int = 0
    cold: bool = False
    peers: bool = True
    pin: bool = False
    layout: str = "zarr"
    progress: bool = False
    procs: int = 1
    token_budget: int = 0


def _write_loader_store(fs, root: str, url: str, storage_options: dict[str, Any], run: str, s: LoaderBench,
                        ) -> tuple[Store, list[str]]:
    """The bench's store (and, with ``s.peers``, the same samples in the peers' layout): (store, peer files)."""
    store_url = f"{url.rstrip('/')}/{run}/store"
    samples = synthetic_samples(s.size_mb << 20, s.layers, s.hidden)
    write_bench_store(store_url, bench_manifest(s.layers, s.hidden, s.codec, s.layout), storage_options, samples)
    peer_paths = _write_peer_layout(fs, storage.join(root, run, "peer"), samples) if s.peers else []
    return Store(store_url, storage_options), peer_paths


class _LoaderPasses:
    """One pass of each path the loader bench times, over the same bytes: ``raw`` (``fs.cat_ranges`` of the
    objects holding them), ``raw_direct`` (local: unbuffered ``readinto`` into fresh memory, a ceiling),
    ``loader`` / ``workers`` (``HiddenStateDataset`` in-process / through DataLoader workers, one dataset across
    rounds as a training run keeps it) and ``peer`` (``torch.load`` of one file per sample)."""

    def __init__(self, fs, store: Store, sel: list[int], peer_paths: list[str], s: LoaderBench) -> None:
        self.fs, self.store, self.sel, self.peer_paths, self.s = fs, store, sel, peer_paths, s
        self.local = backend_for(fs).local_paths
        self.pieces = _raw_pieces(store, sel)
        self.files = sorted({p for p, _, _ in self.pieces})
        self.nbytes = store.num_tokens * len(sel) * s.hidden * 2
        self.sel_idx = [store.manifest.layers.index(l) for l in sel]
        self.in_process = self._loader(0)
        self.in_workers = self._loader(s.workers) if s.workers else None

    def raw(self, r: int) -> None:
        batch, size = [], 0
        for piece in self.pieces + [None]:
            if piece is not None:
                batch.append(piece)
                size += piece[2] - piece[1]
            if batch and (piece is None or size >= 512 << 20):
                self.fs.cat_ranges(*map(list, zip(*batch)))
                batch, size = [], 0

    def raw_direct(self, r: int) -> None:
        held, size = [], 0
        for f, start, end in self.pieces:
            buf = np.empty(end - start, np.uint8)
            with open(f, "rb", buffering=0) as fh:
                fh.seek(start)
                fh.readinto(memoryview(buf))
            held.append(buf)
            size += end - start
            if size >= 512 << 20:
                held, size = [], 0

    def _loader(self, n_workers: int):
        from torch.utils.data import DataLoader

        from ..loader.batching import TokenBatches
        from ..loader.dataset import HiddenStateDataset
        from ..loader.options import Reading

        s = self.s
        ds = HiddenStateDataset(self.store, layers=self.sel, reading=Reading(pin_memory=s.pin))
        src = TokenBatches(ds, token_budget=s.token_budget, mode="pack", pin_memory=s.pin) if s.token_budget else ds
        it = src if n_workers == 0 else DataLoader(src, batch_size=None, num_workers=n_workers, pin_memory=s.pin,
                                                   persistent_workers=True)

        def one_epoch(r: int) -> None:
            ds.set_epoch(r)
            got = sum(item["hidden_states"].numel() * 2 for item in it)
            assert got == self.nbytes, (got, self.nbytes)
        return one_epoch

    def loader(self, r: int) -> None:
        self.in_process(r)

    def workers(self, r: int) -> None:
        self.in_workers(r)

    def peer(self, r: int) -> None:
        order = np.random.default_rng(r).permutation(len(self.peer_paths))
        for i in order:
            p = self.peer_paths[i]
            if self.local:
                d = torch.load(p, mmap=True, weights_only=True)
            else:
                d = torch.load(io.BytesIO(self.fs.cat_file(p)), weights_only=True)
            hs = d["hidden_states"]
            hs = hs[:, self.sel_idx] if len(self.sel_idx) < hs.shape[1] else hs.clone()  # bytes into memory
            d["input_ids"].clone(), d["loss_mask"].clone()

    def wanted(self, name: str) -> bool:
        return not ((name == "peer" and not self.s.peers) or (name == "raw_direct" and not self.local)
                    or (name == "workers" and not self.s.workers))


LOADER_PASSES = ("raw", "raw_direct", "loader", "workers", "peer")


def _best_of_rounds(passes: _LoaderPasses, s: LoaderBench) -> dict[str, float]:
    """Seconds of the best round of each pass, alternating them round after round (cold: each after a drop)."""
    best = dict.fromkeys(LOADER_PASSES, np.inf)
    bar = _bar(s.rounds * len(LOADER_PASSES), f"bench loader ({s.layout})", s.progress, unit="pass")
    for r in range(s.rounds):
        for name in LOADER_PASSES:
            bar.update(1)
            if not passes.wanted(name):
                continue
            bar.set_postfix_str(f"round {r + 1}/{s.rounds}: {name}")
            if s.cold and passes.local:
                drop_page_cache(passes.files + passes.peer_paths)
            best[name] = min(best[name], timed(lambda: getattr(passes, name)(r)))
            log.info("loader bench round %d: %s %.3f GB/s", r, name, passes.nbytes / 1e9 / best[name])
    bar.close()
    return best


def _loader_result(url: str, best: dict[str, float], passes: _LoaderPasses, s: LoaderBench,
                   multi: dict[str, Any] | None) -> dict[str, Any]:
    gb = passes.nbytes / 1e9
    out = {"gbps": gb / best["loader"], "raw_gbps": gb / best["raw"], "bytes": passes.nbytes, "workers": s.workers,
           "token_budget": s.token_budget, "pin_memory": s.pin, "layout": s.layout, "layers": s.layers,
           "read_layers": passes.sel, "hidden": s.hidden, "codec": s.codec, "cold": s.cold, "url": url}
    out["ratio"] = out["gbps"] / out["raw_gbps"]
    if s.workers:
        out["workers_gbps"] = gb / best["workers"]
        out["workers_vs_inprocess"] = out["workers_gbps"] / out["gbps"]
    if passes.local:  # fs.cat's buffered reads into fresh bytes are not the fastest raw read: report the best too
        out["raw_direct_gbps"] = gb / best["raw_direct"]
        out["ratio_direct"] = out["gbps"] / out["raw_direct_gbps"]
    if multi is not None:
        out["procs"] = multi
    if s.peers:
        out["peer_gbps"] = gb / best["peer"]
        out["peer_ratio"] = out["peer_gbps"] / out["raw_gbps"]
        out["vs_peer"] = out["gbps"] / out["peer_gbps"]
        if s.workers:
            out["workers_vs_peer"] = out["workers_gbps"] / out["peer_gbps"]
    return out


def run_loader_bench(url: str, storage_options: dict[str, Any], settings: LoaderBench = LoaderBench(),
                     ) -> dict[str, dict]:
    """Loader throughput: decoded hidden-state bytes into memory through ``HiddenStateDataset`` (shuffled,
    optionally through DataLoader workers) against ``fs.cat_ranges`` of the chunk files holding those bytes, and
    the peers' one-``torch.save``-file-per-sample layout read with ``torch.load(mmap=True)`` (remote:
    ``fs.cat`` + ``torch.load``), all in one run with alternating rounds, best of each (``_LoaderPasses``).

    ``raw_gbps`` is ``fs.cat_ranges`` of whole objects (as the store bench); locally ``raw_direct_gbps`` is also
    reported: unbuffered ``readinto`` of each file into fresh memory, the fastest plain read here. Locally the
    files are in the page cache unless ``settings.cold``, so this measures the CPU cost of each path on this
    machine. With ``workers``, ``workers_gbps`` and ``workers_vs_inprocess``; round 0 warms up recycled memory.
    ``procs`` > 1 also runs that many in-process loaders at once, each a rank of that world reading its share on
    its share of the cores (the loaders of one training node's GPUs, sharing its CPUs and disk), each timing its
    second epoch: per-process and total GB/s."""
    s = settings
    fs, root = storage.resolve(url, storage_options)
    run = f"bench-{uuid.uuid4().hex[:8]}"
    try:
        store, peer_paths = _write_loader_store(fs, root, url, storage_options, run, s)
        sel = list(s.read_layers) if s.read_layers else list(store.manifest.layers)
        multi = (_concurrent_loaders(store.url, storage_options, sel, s.procs, 0, s.rounds, s.progress)
                 if s.procs > 1 else None)
        passes = _LoaderPasses(fs, store, sel, peer_paths, s)
        best = _best_of_rounds(passes, s)
    finally:
        _remove(fs, storage.join(root, run))
    return {"loader": _loader_result(url, best, passes, s, multi)}


def feature_bytes(x: dict[str, Any]) -> int:
    """Bytes of the samples' features in an item or a batch (a padded batch's real tokens, not its padding): for an
    encoded store as stored, fp8's row scales (``hidden_scales``) included, which is what crosses to the device."""
    total = 0
    for key in ("hidden_states", "hidden_scales"):
        h = x.get(key)
        if h is None:
            continue
        if "lengths" in x:  # padded [B, T, L, ...]
            total += int(x["lengths"].sum()) * h[0, 0].numel() * h.element_size()
        else:
            total += h.numel() * h.element_size()
    return total


def sample_tokens(x: dict[str, Any]) -> int:
    """Tokens of the samples in an item or a padded batch (its real tokens, not its padding)."""
    return int(x["lengths"].sum()) if "lengths" in x else int(x["input_ids"].shape[0])


def handed_bytes_per_token(manifest: Manifest, reading: Reading) -> int:
    """Feature bytes per token a reader of every tap hands over: the encoding's stored row bytes (scales included)
    per tap, or, when the host decodes (``reading.dequantise``), the manifest dtype's."""
    encoding = "raw" if reading.dequantise else manifest.encoding
    return token_bytes(manifest.dtype, encoding, len(manifest.layers), manifest.hidden_size)


def _source_rank(store_url: str, storage_options: dict[str, Any], rank: int, world: int, epochs: int,
                 partition: str, reading: Reading, token_budget: int, start, done, results, allow: list[str]) -> None:
    """One rank of ``run_source_bench`` (a spawned process, on its share of the cores): every epoch waits for
    the parent (which drops the page cache and reads the proxy's counters in between), then reads its share: items,
    or with ``token_budget`` the trainer's padded ``TokenBatches`` (pinned with ``reading.pin_memory``); ``allow``:
    the parent's allowed locations (``names.allowed()``)."""
    import resource

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    names.allow_for_command(allow)
    from ..distributed import World
    from ..loader.batching import TokenBatches
    from ..loader.dataset import HiddenStateDataset
    from ..loader.options import Planning

    if reading.cache_dir:  # one cache per rank
        reading = dataclasses.replace(reading, cache_dir=os.path.join(reading.cache_dir, f"node{rank}"))
    ds = HiddenStateDataset(store_url, planning=Planning(partition=partition), reading=reading,
                            world=World(rank, world, *((rank, world) if partition == "node" else (0, 1))),
                            storage_options=storage_options)
    src = TokenBatches(ds, token_budget, pin_memory=reading.pin_memory) if token_budget else ds
    for epoch in range(epochs):
        ds.set_epoch(epoch)
        start.wait()
        ru, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        got = tokens = 0
        for x in src:
            got, tokens = got + feature_bytes(x), tokens + sample_tokens(x)
        secs, ru2 = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF)
        cpu = (ru2.ru_utime - ru.ru_utime) + (ru2.ru_stime - ru.ru_stime)
        results.put((epoch, rank, got, secs, cpu, tokens))
        done.wait()


RAW_BLOCK = 8 << 20  # bytes per plain read of the raw baseline
RAW_KEPT_BYTES = 256 << 20  # a kept reader's destination: past a last-level cache, as the loader's recycled buffers
RAW_MODES = ("read", "mmap", "kept", "checked")


def _read_kept(fd: int, size: int, dest: np.ndarray, pos: int, check: bool) -> int:
    """One file read with ``preadv`` into ``dest`` from ``pos`` on (wrapping to 0 when it does not fit), each
    block folded into a CRC32C as it lands when ``check`` (the loader's ``pread_fold``); the next position."""
    from ..format import codec
    from ..io.memory import pread_fold, pread_into

    done = 0
    while done < size:
        n = min(size - done, dest.nbytes)
        if pos + n > dest.nbytes:
            pos = 0
        view = dest[pos:pos + n]
        if check:
            pread_fold(fd, view, done, codec.crc32c)
        else:
            pread_into(fd, [view], done)
        pos, done = pos + n, done + n
    return pos


def _raw_reader(paths: list[str], mode: str, rank: int, start, results) -> None:
    """One reader of the source bench's raw baseline (a thread: every read below releases the GIL): its files
    read start to end, timed from a barrier shared with the others. ``read``: unbuffered ``readinto`` of
    ``RAW_BLOCK`` bytes at a time into one reused buffer (what the disk gives a plain sequential reader: the
    buffer stays in cache); ``mmap``: each file mapped and copied out block by block, the way the loader reads a
    chunk when it has several intra-op threads (page faults read the file). ``kept``: ``preadv`` of each file
    into the next bytes of a ``RAW_KEPT_BYTES`` destination, written before the barrier (a loader keeps what it
    reads until the trainer takes it: its writes go to memory, not to cache); ``checked``: ``kept`` with each
    block's CRC32C folded in as it lands (the loader's read primitive alone). plain -> kept -> checked -> loader
    splits the loader's cost per GB into the destination's memory traffic, the check and the rest."""
    import mmap
    import resource

    kept = mode in ("kept", "checked")
    mine = max(1, sum(os.path.getsize(p) for p in paths))  # a small store needs no more
    buf = np.ones(min(RAW_KEPT_BYTES, mine) if kept else RAW_BLOCK, np.uint8)  # faulted in before the clock
    view, pos = memoryview(buf), 0
    start.wait()
    ru, t = resource.getrusage(resource.RUSAGE_THREAD), time.perf_counter()
    got = 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            got += size
            if kept:
                pos = _read_kept(f.fileno(), size, buf, pos, mode == "checked")
            elif mode == "read":
                while f.readinto(view):
                    pass
            elif size:
                with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as m:
                    for off in range(0, size, RAW_BLOCK):
                        n = min(RAW_BLOCK, size - off)
                        src = np.frombuffer(m, np.uint8, count=n, offset=off)
                        buf[:n] = src
                        del src  # the mapping cannot close while a view of it exists
    secs, ru2 = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_THREAD)
    results.put((rank, got, secs, (ru2.ru_utime - ru.ru_utime) + (ru2.ru_stime - ru.ru_stime)))


def _split_by_size(paths: list[str], parts: int, size=os.path.getsize) -> list[list[str]]:
    """``paths`` in ``parts`` groups of about equal bytes (largest first, each to the lightest group);
    ``size``: a path's bytes (default: the local file's)."""
    groups: list[list[str]] = [[] for _ in range(parts)]
    load = [0] * parts
    for p in sorted(paths, key=lambda p: -size(p)):
        i = load.index(min(load))
        groups[i].append(p)
        load[i] += size(p)
    return groups


def _per_rank_row(got: list[tuple]) -> dict[str, Any]:
    """GB/s per rank (its bytes / its time), in all (all bytes / the slowest rank's time) and CPU-s per GB, from
    ``(rank, bytes, seconds, cpu seconds)`` per rank."""
    per = [b / s / 1e9 for _, b, s, _ in got]
    total = sum(b for _, b, _, _ in got)
    return {"per_rank_gbps": per, "min_rank_gbps": min(per),
            "total_gbps": total / max(s for _, _, s, _ in got) / 1e9,
            "cpu_s_per_gb": sum(c for *_, c in got) / (total / 1e9), "bytes": total}


def _token_row(got: list[tuple]) -> dict[str, Any]:
    """Tokens/s per rank, in all (all tokens / the slowest rank's time) and CPU-s per million tokens, from
    ``(rank, tokens, seconds, cpu seconds)`` per rank: what compares two encodings of the same samples, whose
    bytes differ."""
    per = [n / s for _, n, s, _ in got]
    total = sum(n for _, n, _, _ in got)
    return {"tokens": total, "per_rank_tokens_per_s": per, "min_rank_tokens_per_s": min(per),
            "tokens_per_s": total / max(s for _, _, s, _ in got),
            "cpu_s_per_mtok": sum(c for *_, c in got) / (total / 1e6)}


def raw_source_pass(files: list[str], procs: int, mode: str, cold: bool) -> dict[str, Any]:
    """``procs`` readers at once read ``files`` (split by size) with plain sequential reads (``_raw_reader``),
    after the same page-cache drop as the loader's epochs when ``cold``: the disk's limit, beside the loader's.
    Threads of this process, not processes: the reads run without the GIL, and a spawned interpreter per reader
    and pass would cost more than a small store's reads."""
    import queue
    import threading

    if cold:
        drop_page_cache(files)
    start, results = threading.Barrier(procs), queue.Queue()
    ts = [threading.Thread(target=_raw_reader, args=(group, mode, i, start, results), name=f"hsstore-raw-{i}")
          for i, group in enumerate(_split_by_size(files, procs))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return {"mode": mode, **_per_rank_row(sorted(results.get() for _ in ts))}


def _source_epoch_row(epoch: int, got: list[tuple], files: list[str] | None, cold: bool) -> dict[str, Any]:
    """One epoch's row from its ranks' ``(epoch, rank, bytes, seconds, cpu seconds, tokens)``; with the local
    ``files`` (None: a remote store), the raw baseline of as many readers beside it (the ranks wait at the next
    epoch's barrier meanwhile)."""
    row = {"epoch": epoch, **_per_rank_row([(r, b, s, c) for _, r, b, s, c, _ in got]),
           **_token_row([(r, n, s, c) for _, r, _, s, c, n in got])}
    if files is not None:
        row["raw"] = {m: raw_source_pass(files, len(got), m, cold) for m in RAW_MODES}
        row["vs_raw"] = {m: {"total": row["total_gbps"] / r["total_gbps"],
                             "min_rank": row["min_rank_gbps"] / r["min_rank_gbps"]}
                         for m, r in row["raw"].items()}
    return row


def run_source_bench(url: str, storage_options: dict[str, Any], size_mb: int = 512, hidden: int = 5120,
                     layers: int = 5, procs: int = 4, epochs: int = 2, cold: bool = True, partition: str = "global",
                     reading: Reading = Reading(), progress: bool = False,
                     read_options: dict[str, Any] | None = None, counters=None, before_ranks=None,
                     token_budget: int = 0, encoding: str = "raw") -> dict[str, Any]:
    """``procs`` ranks read the store at once, one epoch after another, as one node's trainers would: items, or
    with ``token_budget`` the padded ``TokenBatches`` of that many tokens a trainer takes (``reading.pin_memory``:
    pinned, as the trainer's on a GPU; the bytes counted are the samples' features, not the padding).

    Per epoch: GB/s of every rank (its bytes / its time), the total (all bytes / the slowest rank's time), and
    CPU-seconds per GB (user + system time of the rank processes over their bytes). Local stores are dropped from
    the page cache before every epoch when ``cold`` (``posix_fadvise(DONTNEED)`` per file: read-once NVMe).
    ``reading``: how each rank reads (the loader's ``Reading``; a ``cache_dir`` gets one subfolder per rank).
    ``read_options``: how the ranks reach the store (default ``storage_options``, which wrote it), e.g. through
    a proxy with latency and a bandwidth cap; ``counters()``, called between epochs, returns cumulative
    ``{"remote_bytes": ..., "max_in_flight": ...}`` of that proxy (``tools/bench_source.py``): bytes fetched
    remotely per epoch and the most requests in flight. ``before_ranks()`` runs once the store is written.

    ``encoding``: the store's, of the same bf16 samples (``size_mb``: their megabytes); the ranks hand over its
    stored bytes (codes and scales: what crosses to the device), so every epoch also reports tokens/s and
    CPU-seconds per million tokens, which compare encodings, and the result the bytes per token.

    Local stores also get a raw baseline after every epoch (``raw_source_pass``, per mode of ``RAW_MODES``): the
    store's files read by as many readers with plain sequential reads after the same page-cache drop, and
    ``vs_raw`` = the loader's GB/s / the raw GB/s (in all and for the slowest rank), so a low figure tells the
    disk's limit from the loader's."""
    import multiprocessing as mp

    fs, root = storage.resolve(url, storage_options)
    run = f"bench-{uuid.uuid4().hex[:8]}"
    store_url = f"{url.rstrip('/')}/{run}/store"
    manifest = bench_manifest(layers, hidden, "none", encoding=encoding)
    try:
        write_bench_store(store_url, manifest, storage_options, synthetic_samples(size_mb << 20, layers, hidden))
        store = Store(store_url, storage_options)
        files = [storage.join(store.root, k) for c in store.commits for k in c.files]
        per_token = handed_bytes_per_token(manifest, reading)
        nbytes = store.num_tokens * per_token
        # every object the records list: what an epoch without a cache fetches at least
        stored = sum(int(f["size"]) for c in store.commits for f in c.files.values())
        if before_ranks is not None:
            before_ranks()
        ctx = mp.get_context("spawn")
        start, done, results = ctx.Barrier(procs + 1), ctx.Barrier(procs + 1), ctx.Queue()
        opts = storage_options if read_options is None else read_options
        ps = [ctx.Process(target=_source_rank, args=(store_url, opts, r, procs, epochs, partition, reading,
                                                    token_budget, start, done, results, names.allowed()))
              for r in range(procs)]
        for p in ps:
            p.start()
        rows = []
        bar = _bar(epochs, f"bench source, {procs} ranks", progress, unit="epoch")
        before = counters() if counters else {}
        for e in range(epochs):
            if cold and backend_for(fs).local_paths:
                drop_page_cache(files)
            start.wait(timeout=3600)
            got = sorted(results.get(timeout=3600) for _ in ps)
            done.wait(timeout=3600)
            after = counters() if counters else {}
            row = _source_epoch_row(e, got, files if backend_for(fs).local_paths else None, cold)
            if counters:
                row["remote_bytes"] = after.get("remote_bytes", 0) - before.get("remote_bytes", 0)
                row["max_in_flight"] = after.get("max_in_flight")
            before = after
            rows.append(row)
            bar.update(1)
        bar.close()
        for p in ps:
            p.join()
        tokens = store.num_tokens
        assert all(r["bytes"] == nbytes and r["tokens"] == tokens for r in rows), (
            [(r["bytes"], r["tokens"]) for r in rows], nbytes, tokens)
    finally:
        _remove(fs, storage.join(root, run))
    return {"source": {"url": url, "procs": procs, "prefetch": reading.prefetch, "cold": cold,
                       "partition": partition, "bytes": nbytes, "stored_bytes": stored, "hidden": hidden,
                       "layers": layers, "cache_dir": reading.cache_dir, "token_budget": token_budget,
                       "pin_memory": reading.pin_memory, "epochs": rows, "encoding": encoding, "tokens": tokens,
                       "feature_bytes_per_token": per_token, "stored_bytes_per_token": stored / tokens}}


def format_source(r: dict[str, Any]) -> str:
    """The source bench as a compact table, one row per epoch."""
    stored = f" ({r['stored_bytes'] / 1e9:.2f} GB stored)" if "stored_bytes" in r else ""
    ahead = f", prefetch {r['prefetch']}" if r.get("prefetch") else ""
    what = (f", padded batches of {r['token_budget']} tokens{' (pinned)' if r.get('pin_memory') else ''}"
            if r.get("token_budget") else ", items")
    enc = (f", encoding {r['encoding']} ({r['feature_bytes_per_token']:,} feature bytes/token), "
           f"{r['tokens'] / 1e6:.2f} M tokens" if "encoding" in r else "")
    lines = [f"{r['procs']} ranks at once{ahead}{what}, {r['bytes'] / 1e9:.2f} GB{stored}{enc}, "
             f"{'cold' if r['cold'] else 'warm'}, partition {r['partition']}, {r['url']}",
             f"{'epoch':>5} {'GB/s total':>10} {'GB/s/rank min':>13} {'mean':>6} {'CPU-s/GB':>8} {'remote GB':>9} "
             f"{'in flight':>9} {'Mtok/s':>7} {'min rank':>8} {'CPU-s/Mtok':>10}"]
    for e in r["epochs"]:
        remote = f"{e['remote_bytes'] / 1e9:.3f}" if "remote_bytes" in e else "-"
        tok = (f" {e['tokens_per_s'] / 1e6:>7.3f} {e['min_rank_tokens_per_s'] / 1e6:>8.3f} {e['cpu_s_per_mtok']:>10.2f}"
               if "tokens_per_s" in e else "")
        lines.append(f"{e['epoch']:>5} {e['total_gbps']:>10.3f} {e['min_rank_gbps']:>13.3f} "
                     f"{sum(e['per_rank_gbps']) / len(e['per_rank_gbps']):>6.3f} {e['cpu_s_per_gb']:>8.2f} "
                     f"{remote:>9} {str(e.get('max_in_flight', '-')):>9}{tok}")
        for mode, raw in e.get("raw", {}).items():  # the disk's limit beside the loader's
            v = e["vs_raw"][mode]
            lines.append(f"{'  raw':<5} {raw['total_gbps']:>10.3f} {raw['min_rank_gbps']:>13.3f} "
                         f"{sum(raw['per_rank_gbps']) / len(raw['per_rank_gbps']):>6.3f} {raw['cpu_s_per_gb']:>8.2f} "
                         f"  plain {mode}: loader/raw {v['total']:.2f} in all, {v['min_rank']:.2f} slowest rank")
    return "\n".join(lines)
