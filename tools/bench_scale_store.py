"""Store metadata at scale (issue #17): requests, time and peak memory of ``open``, ``info --json``, ``verify``'s
metadata part and the loader's first item, on metadata-only stores of many shards, with and without the index.

Stores are built by writing commit records directly (one real tiny shard is written with ``StoreWriter`` and
its record cloned under new shard names; only the first 16 shards have files, all that the loader's first item and
its read-ahead touch with ``shuffle=False``). Each measurement runs in a fresh child process (peak RSS is its own; the
figure after imports is reported as ``base``). On ``s3`` the store lives on moto's S3 server behind the fault
proxy (``hsstore.testing.faultproxy``), which delays every request by ``--latency`` seconds and counts requests.

    python -m tools.bench_scale_store --shards 1000,10000 --where s3 --latency 0.03,0.1
    python -m tools.bench_scale_store --shards 100000 --where s3 --latency 0.05 --index yes --s3-like-listing --replay
    python -m tools.bench_scale_store --shards 100000 --where local
    python -m tools.bench_scale_store --plan-samples 1000000 --plan-shards 100000   # the loader plan alone

``verify`` here is its metadata part only: every record against the manifest plus ``check_index`` (the index
against the records, which reads every record); the shard files are not read.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid

from tools.measure import peak_rss_mb

OPS = ("open", "info", "verify", "first_item")
SAMPLES_PER_SHARD = 10
WITH_FILES = 16  # shards that get files (the rest are commit records only)


# -- child: one measurement ---------------------------------------------------------------------------------
def child(op: str, url: str, endpoint: str | None, use_index: bool) -> dict:
    import hsstore
    from hsstore.store.reader import Store

    opts = {"endpoint_url": endpoint} if endpoint else {}
    base = peak_rss_mb()
    t0, c0 = time.perf_counter(), time.process_time()
    out: dict = {}
    if op == "first_item":
        store = Store(url, opts, use_index=use_index)
        t1 = time.perf_counter()
        ds = hsstore.HiddenStateDataset(store, planning=hsstore.Planning(shuffle=False))
        t2 = time.perf_counter()
        item = next(iter(ds))
        assert item["input_ids"].numel() > 0
        out.update(open_s=t1 - t0, catalog_s=t2 - t1, plan_and_read_s=time.perf_counter() - t2)
    else:
        store = Store(url, opts, use_index=use_index)
        if op == "info":
            from hsstore.ops.info import summarize

            json.dumps(summarize(store))
        elif op == "verify":
            from hsstore.format.report import VerifyReport
            from hsstore.ops.verify import check_index

            report = VerifyReport(shards=len(store.commits))
            report.problems += [b.problem() for b in store.breaches()]
            for rec in store.commits:
                report.problems += [b.problem() for b in store.shard_breaches(rec)]
            check_index(store, report)
            assert report.ok, report.problems[:3]
        out["index_use"] = {k: v for k, v in dataclasses.asdict(store.index_use).items() if isinstance(v, int)}
    out.update(seconds=time.perf_counter() - t0, cpu_s=time.process_time() - c0,  # this process's, all threads
               peak_rss_mb=peak_rss_mb(), base_rss_mb=base, shards=len(store.commits))
    return out


def plan_child(samples: int, shards: int, world: int, workers: int) -> dict:
    """The loader plan alone, from synthetic records: catalog, then every slot's plan of one epoch."""
    import numpy as np

    from hsstore.format import records
    from hsstore.format.commit import CommitRecord
    from hsstore.distributed import World
    from hsstore.loader.plan import Filters, Planner, build_catalog

    per = samples // shards
    rng = np.random.default_rng(0)

    class FakeStore:  # what build_catalog reads: the records' columns
        table = None

    items = []
    for i in range(shards):
        lengths = rng.integers(200, 4000, per).tolist()
        cols = {"sample_id": [f"{i}-{j}" for j in range(per)], "source": ["a"] * per, "length": lengths,
                "loss_tokens": [x // 2 for x in lengths], "thinking_tokens": [0] * per, "flags": [[]] * per}
        rec = CommitRecord(f"s{i:06d}", "w", per, sum(lengths), cols, {}, {}, 64)
        items.append((rec, rec.to_json(), None, 0))
    FakeStore.table = records.from_records(items)
    del items
    base = peak_rss_mb()
    t0 = time.perf_counter()
    cat = build_catalog([FakeStore], Filters(), unit_tokens=4096)
    t1 = time.perf_counter()
    planner = Planner(cat, [1.0], seed=0, shuffle=True, even=None, unit_tokens=4096, token_bytes=51200,
                      shuffle_bytes=1 << 30)
    n = sum(len(planner.slot_plan(0, None, 0, World.of_slot(s, world, workers))) for s in range(world * workers))
    t2 = time.perf_counter()
    assert n == samples
    return {"samples": samples, "shards": shards, "world": world, "workers": workers, "catalog_s": t1 - t0,
            "plan_all_slots_s": t2 - t1, "catalog_mb": sum(getattr(cat, f).nbytes for f in
                                                          ("store", "shard", "local", "start", "stop", "unit")) / 2**20,
            "peak_rss_mb": peak_rss_mb(), "rss_before_mb": base}


# -- parent: build stores, run children ---------------------------------------------------------------------
def build_store(fs, root: str, shards: int, scratch: str) -> None:
    """A store of ``shards`` shards: one real tiny shard's record cloned; the first ``WITH_FILES`` have files."""
    import torch

    from hsstore.io import storage, transfer
    from hsstore import StoreWriter
    from hsstore.format.commit import commit_path
    from hsstore.format.manifest import Manifest, TargetIdentity, TokenizerIdentity

    local = os.path.join(scratch, f"template-{uuid.uuid4().hex[:6]}")
    manifest = Manifest(TargetIdentity("bench", 8, 16, "cfg"), TokenizerIdentity("tok", "vocab", "tmpl"),
                        layers=(1, 3, 5), chunk_tokens=64)
    g = torch.Generator().manual_seed(0)
    with StoreWriter(local, manifest, shard_bytes=1 << 30, index_every=10**9) as w:
        for j in range(SAMPLES_PER_SHARD):
            T = 12
            w.add(f"x{j}", torch.randint(0, 100, (T,), generator=g), torch.ones(T, dtype=torch.bool),
                  torch.randn(T, 3, 16, generator=g).to(torch.bfloat16))
    (rec,) = w.committed
    objects = {}
    for dirpath, _, files in os.walk(local):
        for f in files:
            key = os.path.relpath(os.path.join(dirpath, f), local)
            if key.startswith(("commits", "index")):
                continue
            objects[key] = open(os.path.join(dirpath, f), "rb").read()
    # files for the first shards only: what the first item and the loader's read-ahead touch
    batch = {storage.join(root, k.replace(rec.shard, f"{rec.writer}-bench-{i:06d}")): v for k, v in objects.items()
             for i in range(min(shards, WITH_FILES)) if rec.shard in k or i == 0}
    for i in range(shards):
        name = f"{rec.writer}-bench-{i:06d}"  # a writer's name (<writer>-<session>-<sequence>), as the admission asks
        files = {k.replace(rec.shard, name): v for k, v in rec.files.items()}
        samples = {**rec.samples, "sample_id": [f"{name}-{j}" for j in range(rec.n_samples)]}
        batch[storage.join(root, commit_path(name))] = dataclasses.replace(rec, shard=name, files=files,
                                                                         samples=samples).to_json()
        if len(batch) >= 2000 or i == shards - 1:
            transfer.put_many(fs, batch)
            batch = {}
    shutil.rmtree(local)


def s3_like_listing() -> None:
    """Make moto answer a LIST page in time independent of the bucket's size, as S3 does.

    moto builds, sorts and scans every key of the bucket on every ListObjectsV2 page (``S3Backend.
    list_objects_v2``): measured here ~0.6 s of server CPU a page at 1e4 keys, so at 1e5 keys a listing (100
    pages, serial or in ranges) costs minutes of moto time that S3 does not charge. This answers the same
    pages (keys after ``StartAfter``/the continuation token, up to ``MaxKeys``, same tokens) by bisecting the
    sorted names under the prefix; anything but a ``/``-delimited listing of a folder without sub-folders goes
    to moto's own code. Only the benchmark's in-process server is patched (``--s3-like-listing``)."""
    import bisect

    from moto.s3.models import S3Backend
    from moto.utilities.utils import md5_hash

    original = S3Backend.list_objects_v2

    def listing(self, bucket, prefix, delimiter, continuation_token, start_after, max_keys):
        if delimiter != "/" or not prefix or not prefix.endswith("/") or not max_keys:
            return original(self, bucket, prefix, delimiter, continuation_token, start_after, max_keys)
        names = sorted(k for k in list(bucket.keys.keys()) if k.startswith(prefix))
        after = self._pagination_tokens.get(continuation_token) if continuation_token else start_after
        i = bisect.bisect_right(names, after) if after else 0
        page = names[i:i + max_keys]
        if any("/" in n[len(prefix):] for n in page):
            return original(self, bucket, prefix, delimiter, continuation_token, start_after, max_keys)
        keys = [bucket.keys[n] for n in page]
        if i + max_keys < len(names):
            token = md5_hash(page[-1].encode("utf-8")).hexdigest()
            self._pagination_tokens[token] = page[-1]
            return keys, True, token
        return keys, False, None

    S3Backend.list_objects_v2 = listing


def run_child(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-m", "tools.bench_scale_store", "--child", *args], capture_output=True,
                         text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"child {args} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--shards", default="1000,10000", help="comma-separated shard counts")
    p.add_argument("--where", default="local,s3", help="local, s3 (moto behind the delaying proxy), or both")
    p.add_argument("--latency", default="0.03,0.1", help="s3: seconds added to every request (comma-separated)")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--index", default="no,yes", help="without the index (every record read), with it, or both")
    p.add_argument("--plan-samples", type=int, default=0, help="measure the loader plan alone for N samples")
    p.add_argument("--plan-shards", type=int, default=100000)
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--s3-like-listing", action="store_true",
                   help="s3: moto answers a LIST page in constant time like S3 (see s3_like_listing)")
    p.add_argument("--replay", action="store_true",
                   help="s3: run each op twice through one proxy that keeps every GET/LIST answer, and measure the "
                        "second run, served from memory: requests and latency as before, but no moto CPU on this "
                        "machine (S3's own servers do not share the client's cores)")
    p.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        kind = args.child[0]
        if kind == "plan":
            print(json.dumps(plan_child(*map(int, args.child[1:]))))
        else:
            op, url, endpoint, use_index = args.child
            print(json.dumps(child(op, url, endpoint if endpoint != "-" else None, use_index == "1")))
        return 0
    results = []
    if args.plan_samples:
        r = run_child(["plan", str(args.plan_samples), str(args.plan_shards), "8", "2"])
        print(json.dumps(r))
        results.append({"what": "plan", **r})
    ops = [o for o in args.ops.split(",") if o]
    shard_counts = [int(x) for x in args.shards.split(",") if x] if ops else []
    scratch = tempfile.mkdtemp(prefix="bench-scale-")
    server = None
    try:
        for where in [w for w in args.where.split(",") if w]:
            if where == "s3":
                from moto.server import ThreadedMotoServer

                from hsstore.testing.ports import free_port

                for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret",
                             "AWS_DEFAULT_REGION": "us-east-1"}.items():
                    os.environ[k] = v
                os.environ.pop("AWS_PROFILE", None)
                if args.s3_like_listing:
                    s3_like_listing()
                port = free_port()
                server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
                server.start()
                endpoint = f"http://127.0.0.1:{port}"
                latencies = [float(x) for x in args.latency.split(",")]
            else:
                endpoint, latencies = None, [0.0]
            for n in shard_counts:
                results += bench_one(where, n, endpoint, latencies, ops, scratch,
                                     [m == "yes" for m in args.index.split(",") if m], replay=args.replay)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def bench_one(where: str, n: int, endpoint: str | None, latencies: list[float], ops: list[str], scratch: str,
              modes: tuple[bool, ...] = (False, True), replay: bool = False):
    from hsstore.io import storage
    from hsstore.format.index import compact

    if where == "s3":
        import s3fs

        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        s3fs.S3FileSystem(endpoint_url=endpoint).mkdir(bucket)
        url = f"s3://{bucket}/store"
    else:
        url = os.path.join(scratch, f"store-{n}")
    fs, root = storage.resolve(url, {"endpoint_url": endpoint} if endpoint else {})
    t = time.perf_counter()
    build_store(fs, root, n, scratch)
    print(f"# built {where} store of {n} shards in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    out = []
    for indexed in modes:
        if indexed:
            compact(fs, root, grace_s=0)
        for lat in latencies:
            for op in ops:
                if where == "s3":
                    from hsstore.testing.faultproxy import FaultProxy

                    with FaultProxy(endpoint, faults=["latency"], persistent=True, delay=lat, replay=replay) as proxy:
                        if replay:  # the same reads once, to fill the proxy's answers
                            run_child([op, url, proxy.url, "1" if indexed else "0"])
                            proxy.reset_counts()
                            proxy.replayed = 0
                        c0 = time.process_time()
                        r = run_child([op, url, proxy.url, "1" if indexed else "0"])
                    # moto and the proxy run in this process: their CPU is what S3 would spend, not the client
                    r.update(requests=proxy.requests, max_in_flight=proxy.max_in_flight,
                             server_cpu_s=time.process_time() - c0)
                    if replay:
                        r["replayed"] = proxy.replayed
                else:
                    r = run_child([op, url, "-", "1" if indexed else "0"])
                row = {"where": where, "shards": n, "latency_s": lat, "index": indexed, "op": op, **r}
                out.append(row)
                print(json.dumps(row))
                sys.stdout.flush()
    return out


if __name__ == "__main__":
    sys.exit(main())
