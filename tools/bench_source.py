"""Feeding N ranks at once from the source (issue #28): local files cold, and S3 emulated by moto behind the
fault proxy with a per-request latency and a bandwidth cap per connection, side by side in one run.

Rows (``hsstore.ops.bench.run_source_bench``, one per epoch): GB/s in all and per rank, CPU-seconds per GB of the
rank processes, bytes fetched remotely per epoch and the most requests in flight (counted by the proxy).
The proxy answers repeated reads from memory (``replay``; the store is read through it once before), so moto's
CPU stays out of the timed epochs; the proxy's own threads share the machine with the ranks, so compare rows of
one run (latency 0 vs ``--latency``: the read-ahead should give the same rate once the pipeline is full).

    python -m tools.bench_source --procs 4 --size-mb 2048 --latency 0.03 --bandwidth-mb 100
    python -m tools.bench_source --procs 2 --size-mb 64 --hidden 512 --latency 0.03   # CPU smoke size

The s3 section's rows also get a raw baseline (``raw_s3_pass``, ``--no-raw`` skips it): the same objects read by as many
processes with plain concurrent ranged GETs through s3fs at the same latency and cap, as loader/raw.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import tempfile
import uuid

from hsstore.io import storage, transfer
from hsstore.loader.options import Reading
from hsstore.ops.bench import _per_rank_row, _split_by_size, format_source, run_source_bench
from tools.measure import free_port


def use_test_credentials() -> None:
    """moto's test credentials for this process's S3 clients, unless some are set."""
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        os.environ.setdefault(k, v)


@contextlib.contextmanager
def emulated_s3(latency: float = 0.0, bandwidth: float | None = None):
    """(endpoint moto serves on, proxy in front of it): a fresh bucket name comes with it. The proxy replays
    repeated reads from memory; ``proxy.latency`` / ``proxy.bandwidth`` give it an object store's shape, and
    its answers to ranged GETs carry no object checksum, as AWS S3's do not."""
    from hsstore.testing.faultproxy import FaultProxy
    from moto.server import ThreadedMotoServer
    import s3fs

    use_test_credentials()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server logs every request otherwise
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    try:
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        s3fs.S3FileSystem(endpoint_url=endpoint).mkdir(bucket)
        # answers to ranged GETs without the object's checksum, as AWS S3 gives them (moto adds it when the range
        # covers the whole object, and botocore would then check a CRC32 of every chunk: 0.3-0.5 CPU-s/GB here)
        with FaultProxy(endpoint, faults=[], limit=0, replay=True, range_checksums=False) as proxy:
            proxy.bucket = bucket
            yield endpoint, proxy
    finally:
        server.stop()


def warm_through(proxy, prefix: str, latency: float, bandwidth: float | None) -> None:
    """Every object under ``prefix`` once through the proxy (into its memory), asked for as the readers ask (one
    ranged GET of its listed size: the proxy replays by path and Range), then the latency and cap."""
    fs, root = storage.resolve(prefix, {"endpoint_url": proxy.url})
    sizes = {p: int(i["size"]) for p, i in fs.find(root, detail=True).items() if "/shards/" in p}
    transfer.cat_many(fs, list(sizes), list(sizes.values()))
    proxy.latency, proxy.bandwidth = latency, bandwidth
    proxy.reset_counts()


def shard_counts(proxy) -> dict:
    """What the readers fetched of the store's shards through ``proxy`` since its last reset, and how many
    requests it held at once."""
    return {"remote_bytes": sum(n for p, n in proxy.sent.items() if "/shards/" in p),
            "max_in_flight": proxy.max_in_flight}


class EmulatedS3Process:
    """``emulated_s3`` in a process of its own, for a reader that shares its process with a GPU step (the
    trainer): moto's and the proxy's Python threads would otherwise take the trainer's GIL, a cost no remote
    object store puts on its clients. ``endpoint`` (moto, for writing), ``url`` (the proxy, for reading) and
    ``bucket`` as ``emulated_s3`` gives them; ``warm`` and ``counts`` run in the server's process."""

    def __init__(self):
        import multiprocessing as mp

        use_test_credentials()  # the readers' (and writer's) clients live in this process
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve_emulation, args=(child,), daemon=True)
        self._proc.start()
        child.close()  # so that a server that dies is an EOFError here, not a wait
        self.endpoint, self.url, self.bucket = self._ask("where")

    def _ask(self, *cmd):
        self._conn.send(cmd)
        ok, value = self._conn.recv()
        if not ok:
            raise RuntimeError(f"S3 emulation: {value}")
        return value

    def warm(self, prefix: str, latency: float, bandwidth: float | None) -> None:
        self._ask("warm", prefix, latency, bandwidth)

    def counts(self) -> dict:
        return self._ask("counts")

    def __enter__(self) -> "EmulatedS3Process":
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._conn.send(("stop",))
        finally:
            self._proc.join(timeout=30)
            if self._proc.is_alive():
                self._proc.kill()


def _serve_emulation(conn) -> None:
    """The server side of ``EmulatedS3Process``: answers its commands until told to stop."""
    with emulated_s3() as (endpoint, proxy):
        while True:
            cmd, *a = conn.recv()
            try:
                if cmd == "stop":
                    return
                value = {"where": lambda: (endpoint, proxy.url, proxy.bucket),
                         "warm": lambda: warm_through(proxy, *a),
                         "counts": lambda: {**shard_counts(proxy), "server_pid": os.getpid()}}[cmd]()
                conn.send((True, value))
            except Exception as e:  # told to the caller, which raises it
                conn.send((False, f"{cmd}: {type(e).__name__}: {e}"))


def _raw_s3_reader(endpoint: str, objects: list[tuple[str, int]], rank: int, start, results) -> None:
    """One process of the raw S3 baseline: its objects with plain concurrent ranged GETs through s3fs, each body
    streamed into a buffer reused batch after batch (``transfer.cat_into``, one GET per object with its listed
    size, as the loader asks for a chunk), timed from a
    barrier shared with the others; CPU-seconds of the process."""
    import resource
    import time

    import numpy as np

    fs, _ = storage.resolve("s3://x", {"endpoint_url": endpoint})
    batch = storage.metadata_concurrency()
    bufs = [np.empty(max((n for _, n in objects), default=0), np.uint8) for _ in range(min(batch, len(objects)))]
    for b in bufs:
        b.fill(0)  # faulted in before the clock starts, as the loader's recycled buffers are after epoch 0
    if objects:  # the client made (botocore's models loaded) before the clock starts, as the loader's is
        transfer.cat_into(fs, {objects[0][0]: [bufs[0][:1]]})
    start.wait()
    ru, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    bad, nbytes = [], 0
    for i in range(0, len(objects), batch):
        part = objects[i:i + batch]
        got = transfer.cat_into(fs, {p: [bufs[j][:n]] for j, (p, n) in enumerate(part)})
        bad += [f"{p}: {r}" for p, r in got.items() if r is not None]
        nbytes += sum(n for p, n in part if got[p] is None)
    secs, ru2 = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF)
    results.put((rank, nbytes, secs, (ru2.ru_utime - ru.ru_utime) + (ru2.ru_stime - ru.ru_stime), bad[:3]))


def raw_s3_pass(proxy, prefix: str, procs: int) -> dict:
    """The store's shard objects read by ``procs`` processes at once (split by size) with plain concurrent
    ranged GETs through the proxy, at its latency and cap: what the emulated S3 gives N readers without the
    loader, beside the loader's rows (loader/raw). Its requests are not counted in the loader's epochs."""
    import multiprocessing as mp

    fs, root = storage.resolve(prefix, {"endpoint_url": proxy.url})
    sizes = {p: int(info["size"]) for p, info in fs.find(root, detail=True).items() if "/shards/" in p}
    groups = [[(p, sizes[p]) for p in g] for g in _split_by_size(list(sizes), procs, sizes.__getitem__)]
    ctx = mp.get_context("spawn")
    start, results = ctx.Barrier(procs), ctx.Queue()
    ps = [ctx.Process(target=_raw_s3_reader, args=(proxy.url, g, i, start, results)) for i, g in enumerate(groups)]
    for p in ps:
        p.start()
    got = sorted(results.get(timeout=3600) for _ in ps)
    for p in ps:
        p.join()
    bad = [b for *_, b in got if b]
    if bad:
        raise RuntimeError(f"raw S3 baseline: reads failed, e.g. {bad[0]}")
    proxy.reset_counts()
    return {"mode": "s3 ranged GET", **_per_rank_row([g[:4] for g in got])}


def s3_rows(args, latency: float, partition: str, cache_dir: str | None, cache_bytes: int | None,
            raw_baseline: bool = False) -> dict:
    bw = args.bandwidth_mb * 1e6 if args.bandwidth_mb else None
    with emulated_s3() as (endpoint, proxy):
        def counters():
            return shard_counts(proxy)

        url = f"s3://{proxy.bucket}"
        raw: dict = {}

        def before_ranks():
            warm_through(proxy, url, latency, bw)
            if raw_baseline and args.raw:
                raw.update(raw_s3_pass(proxy, url, args.procs))

        cache_cap = {} if cache_bytes is None else {"cache_bytes": cache_bytes}
        out = run_source_bench(url, {"endpoint_url": endpoint}, size_mb=args.size_mb, hidden=args.hidden,
                               layers=args.num_taps, procs=args.procs, epochs=args.epochs, cold=False,
                               partition=partition, reading=Reading(cache_dir=cache_dir, **cache_cap),
                               read_options={"endpoint_url": proxy.url}, counters=counters,
                               before_ranks=before_ranks)["source"]
        if raw:  # once per store, shown beside every epoch as the local rows are
            for e in out["epochs"]:
                e["raw"] = {"s3": raw}
                e["vs_raw"] = {"s3": {"total": e["total_gbps"] / raw["total_gbps"],
                                      "min_rank": e["min_rank_gbps"] / raw["min_rank_gbps"]}}
        return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--procs", type=int, default=4, help="ranks at once")
    ap.add_argument("--size-mb", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--num-taps", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--latency", type=float, default=0.03, help="seconds added to every S3 request")
    ap.add_argument("--bandwidth-mb", type=float, default=100.0, help="MB/s per connection (0: no cap)")
    ap.add_argument("--scratch", default=None, help="local directory for the cold rows (default: a temp dir)")
    ap.add_argument("--sections", default="local,s3,node", help="local (cold files), s3 (0 and --latency), "
                    "node (S3 + --partition node with a per-rank cache: remote bytes per epoch)")
    ap.add_argument("--cache-mb", type=float, default=None, help="node section: each rank's cache cap (default 1.5x "
                    "a rank's share of the store; a rank that needs more says how much in one log line)")
    ap.add_argument("--no-raw", dest="raw", action="store_false", help="S3 rows: skip the raw baseline (the "
                    "same objects by as many processes with plain concurrent ranged GETs, same latency and cap)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    sections = a.sections.split(",")
    out = {}
    with tempfile.TemporaryDirectory(dir=a.scratch) as tmp:
        if "local" in sections:
            out["local cold"] = run_source_bench(tmp, {}, size_mb=a.size_mb, hidden=a.hidden, layers=a.num_taps,
                                                 procs=a.procs, epochs=a.epochs, cold=True)["source"]
        if "s3" in sections:
            out["s3 latency 0"] = s3_rows(a, 0.0, "global", None, None, raw_baseline=True)
            out[f"s3 latency {a.latency:g}"] = s3_rows(a, a.latency, "global", None, None, raw_baseline=True)
        if "node" in sections:
            share = int(a.size_mb * 1.5 * (1 << 20) / a.procs)  # 1.5x a rank's share: less than the store
            if a.cache_mb is not None:
                share = int(a.cache_mb * (1 << 20))
            for part in ("global", "node"):
                out[f"s3 {part} + cache"] = s3_rows(a, a.latency, part, os.path.join(tmp, f"cache-{part}"), share)
    if a.json:
        print(json.dumps(out, indent=2))
    else:
        for name, r in out.items():
            print(f"== {name}")
            print(format_source(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
