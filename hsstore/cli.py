"""The ``hsstore`` command line.

Store commands (info, verify, bench) live here; extraction commands (check, show, extract, demo) and
training commands (train, eval) are registered by ``extract.cli`` and ``train.cli``, which import
transformers only when their command runs.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys

from . import storage
from .errors import StoreError
from .redaction import RedactingFilter, scrub
from .version import __version__

log = logging.getLogger("hsstore")
PLUGINS = ("extract.cli", "train.cli")


def add_storage_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--storage-option", "-S", action="append", default=[], metavar="KEY=VALUE",
                   help="fsspec/s3fs option, repeatable (e.g. anon=true, endpoint_url=http://..., "
                        "client_kwargs.region_name=us-east-1); AWS env vars and profiles apply as usual")


def cmd_info(args) -> int:
    from .info import format_text, summarize
    from .reader import open_store

    store = open_store(args.url, **storage.parse_storage_options(args.storage_option))
    s = summarize(store)
    print(json.dumps(s, indent=2) if args.json else format_text(s))
    return 0


def cmd_verify(args) -> int:
    from tqdm import tqdm

    from .reader import open_store
    from .verify import verify

    store = open_store(args.url, **storage.parse_storage_options(args.storage_option))
    total = sum(f["size"] for c in store.commits for f in c.files.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc="verify", disable=args.quiet) as bar:
        report = verify(store, progress=bar.update)
    for p in report.problems:
        print(f"FAIL {p}")
    if report.uncommitted:
        print(f"note: {len(report.uncommitted)} uncommitted shard(s) present (ignored by readers): "
              + ", ".join(report.uncommitted[:5]))
    status = "OK" if report.ok else f"FAILED ({len(report.problems)} problem(s))"
    print(f"verify {args.url}: {status}; {report.shards} shards, {report.files} files, {report.bytes:,} bytes checked")
    return 0 if report.ok else 1


def cmd_bench(args) -> int:
    from .bench import run_loader_bench, run_store_bench

    options = storage.parse_storage_options(args.storage_option)
    result: dict = {}
    if args.what in ("store", "all"):
        result.update(run_store_bench(args.url, options, size_mb=args.size_mb, hidden=args.hidden,
                                      layers=args.layers, codec=args.codec, rounds=args.rounds, what=args.what))
    if args.what in ("loader", "all"):
        read_layers = [int(x) for x in args.read_layers.split(",")] if args.read_layers else None
        result.update(run_loader_bench(args.url, options, size_mb=args.size_mb, hidden=args.hidden,
                                       layers=args.layers, codec=args.codec, rounds=args.rounds,
                                       read_layers=read_layers, workers=args.workers, cold=args.cold,
                                       peers=not args.no_peers, pin=args.pin_memory))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for name, r in result.items():
            print(f"{name:>14}: {r['gbps']:.3f} GB/s vs raw {r['raw_gbps']:.3f} GB/s -> ratio {r['ratio']:.2f} "
                  f"({r['bytes'] / 1e9:.2f} GB)")
            if "raw_durable_gbps" in r:
                print(f"{'':>14}  vs raw write + fsync {r['raw_durable_gbps']:.3f} GB/s -> ratio {r['ratio_durable']:.2f}")
            if "raw_direct_gbps" in r:
                print(f"{'':>14}  vs unbuffered readinto {r['raw_direct_gbps']:.3f} GB/s -> ratio {r['ratio_direct']:.2f}")
            if "peer_gbps" in r:
                print(f"{'peer layout':>14}: {r['peer_gbps']:.3f} GB/s (torch.save per sample) -> ratio "
                      f"{r['peer_ratio']:.2f}; loader is {r['vs_peer']:.2f}x the peers' layout")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hsstore", description="Hidden-state store for speculative-decoding drafters")
    p.add_argument("--version", action="version", version=f"hsstore {__version__}")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    q = sub.add_parser("info", help="what a store holds (from commit records; fast)")
    q.add_argument("url")
    q.add_argument("--json", action="store_true")
    add_storage_option(q)
    q.set_defaults(func=cmd_info)

    q = sub.add_parser("verify", help="re-read every byte, check checksums, shapes and offsets")
    q.add_argument("url")
    q.add_argument("--quiet", "-q", action="store_true")
    add_storage_option(q)
    q.set_defaults(func=cmd_verify)

    q = sub.add_parser("bench", help="store write/read and loader throughput against raw reads/writes of the "
                                     "same bytes")
    q.add_argument("url", help="scratch location (a store is written under URL/bench-<random>, then removed)")
    q.add_argument("--size-mb", type=int, default=512)
    q.add_argument("--hidden", type=int, default=5120)
    q.add_argument("--layers", type=int, default=5)
    q.add_argument("--codec", default="none")
    q.add_argument("--what", choices=["store", "loader", "all"], default="store",
                   help="store: write/read; loader: HiddenStateDataset vs raw reads and the peers' layout")
    q.add_argument("--rounds", type=int, default=3, help="rounds (alternating raw and store; best of each)")
    q.add_argument("--read-layers", default=None, metavar="L,L",
                   help="loader: layer ids to read (default all; the bench store has layers 0..LAYERS-1)")
    q.add_argument("--workers", type=int, default=0, help="loader: DataLoader worker processes (0: in-process)")
    q.add_argument("--cold", action="store_true", help="loader: drop local files from the page cache each round")
    q.add_argument("--no-peers", action="store_true", help="loader: skip the one-file-per-sample comparison")
    q.add_argument("--pin-memory", action="store_true", help="loader: deliver items in pinned memory (needs a GPU)")
    q.add_argument("--json", action="store_true")
    add_storage_option(q)
    q.set_defaults(func=cmd_bench)

    for mod in PLUGINS:
        try:
            plugin = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name not in (mod, mod.split(".")[0]):
                raise
            continue
        plugin.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:  # third-party debug logs quote endpoints and signed headers
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
    try:
        return int(args.func(args) or 0)
    except (StoreError, ValueError, OSError) as e:  # bad input: one line, exit 2 (-vv shows the traceback)
        log.debug("error", exc_info=True)
        msg = scrub((str(e).strip().splitlines() or [type(e).__name__])[0])
        print(f"hsstore {args.command}: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
