"""The ``hsstore`` command line.

Store commands (info, verify, index, upgrade, convert, bench, subset, copy, merge, report) live here; the extraction
commands (check, show, extract, import, export, regenerate, demo) and the training commands (train, eval,
export-drafter) are registered by ``hsstore.extract.cli`` and ``hsstore.train.cli`` through the ``hsstore.commands``
entry-point group (so another installed package can add commands the same way); they import transformers only
when their command runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from importlib.metadata import entry_points

from . import config
from .. import env
from ..io import storage
from ..format import layout_spec
from ..format.names import allow_for_command
from ..errors import StoreError
from ..redaction import RedactingFilter, recordable_url, scrub
from ..terminal import EscapingFilter, escape
from .schema import Deprecated
from ..version import __version__

log = logging.getLogger("hsstore")
COMMANDS_GROUP = "hsstore.commands"  # entry points: a callable that adds sub-parsers


def add_storage_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--storage-option", "-S", action="append", default=[], metavar="KEY=VALUE",
                   help="fsspec/s3fs option, repeatable (e.g. anon=true, endpoint_url=http://..., "
                        "client_kwargs.region_name=us-east-1); AWS env vars and profiles apply as usual")
    p.add_argument("--allow-location", action="append", default=[], metavar="PREFIX",
                   help="read shards merged by reference from stores under PREFIX (a URL or local path; "
                        "repeatable; for every store this command opens). Without it a "
                        "commit record's location outside the store is refused; local system paths always are")


def add_quiet_option(p: argparse.ArgumentParser) -> None:
    """``-q/--quiet`` on every command that shows progress (``--no-progress``, its old spelling, still works)."""
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bars")
    p.add_argument("--no-progress", dest="quiet", nargs=0, action=Deprecated, new="--quiet")


def add_json_option(p: argparse.ArgumentParser, what: str = "the summary") -> None:
    p.add_argument("--json", action="store_true", help=f"print {what} as JSON on stdout")


def interactive_options(url: str, args) -> dict:
    """The storage options of a command a person waits for (``storage.interactive_options``)."""
    return storage.interactive_options(url, storage.parse_storage_options(args.storage_option))


def cmd_info(args) -> int:
    from ..ops.info import format_text, summarize
    from ..store import reader

    store = reader.open(args.url, **interactive_options(args.url, args))
    s = summarize(store)
    print(json.dumps(s, indent=2) if args.json else format_text(s))
    return 0


def cmd_verify(args) -> int:
    from tqdm import tqdm

    from ..store import reader
    from ..ops.verify import verify

    store = reader.open(args.url, **storage.parse_storage_options(args.storage_option))
    total = int(store.table.ints["stored_bytes"].sum())  # every record's file sizes, from the columns
    with tqdm(total=total, unit="B", unit_scale=True, desc="verify", disable=args.quiet) as bar:
        report = verify(store, progress=bar.update)
    if args.json:
        print(json.dumps({"url": recordable_url(args.url), "ok": report.ok, "shards": report.shards, "files": report.files,
                          "bytes": report.bytes, "problems": [str(p) for p in report.problems],
                          "uncommitted": list(report.uncommitted), "weak_records": list(report.weak_records),
                          "assets": report.assets, "index": report.index}, indent=2))
        return 0 if report.ok else 1
    for p in report.problems:
        print(f"FAIL {p}")
    if report.uncommitted:
        print(f"note: {len(report.uncommitted)} uncommitted shard(s) present (ignored by readers): "
              + ", ".join(report.uncommitted[:5]))
    if report.weak_records:
        print(f"warning: {len(report.weak_records)} shard(s) have commit records of format version 1, whose chunk "
              "checksums cannot tell one valid chunk from another (a chunk swapped between shards or copied from "
              f"another store passes); `hsstore upgrade {recordable_url(args.url)}` re-derives them (safe to interrupt and re-run)")
    if report.index.get("unindexed_shards"):
        print(f"note: {report.index['unindexed_shards']} shard(s) not in the index (readers read their records one "
              f"by one); `hsstore index {recordable_url(args.url)}` adds them")
    if not report.assets:
        print("warning: the store has no assets (the target's embedding, lm_head, config and tokenizer): "
              "`hsstore train` and `hsstore show` need them; `hsstore extract` writes them, and merge, subset and "
              "convert copy them from a source that has them")
    status = "OK" if report.ok else f"FAILED ({len(report.problems)} problem(s))"
    print(f"verify {recordable_url(args.url)}: {status}; {report.shards} shards, {report.files} files, {report.bytes:,} bytes checked")
    return 0 if report.ok else 1


def cmd_index(args) -> int:
    from ..format.index import compact
    from ..format.manifest import read_manifest

    fs, root = storage.resolve(args.url, interactive_options(args.url, args))
    read_manifest(fs, root, args.url)  # an hsstore store, or a clear error before anything is written
    r = compact(fs, root, grace_s=args.grace)
    if args.json:
        print(json.dumps({"url": recordable_url(args.url), **dataclasses.asdict(r)}, indent=2))
        return 0
    print(f"index {recordable_url(args.url)}: {r.shards} commit record(s) in index/{r.segment} ({r.fetched} read from commits/); "
          f"{r.superseded} older segment(s) superseded, {len(r.removed)} removed"
          + (f"; {len(r.damaged)} damaged segment(s) superseded" if r.damaged else ""))
    return 0


def cmd_upgrade(args) -> int:
    from tqdm import tqdm

    from ..store import reader
    from ..ops.upgrade import upgrade

    store = reader.open(args.url, **storage.parse_storage_options(args.storage_option))
    total = sum(f["size"] for c in store.commits if not c.binds_chunks for f in c.files.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc="upgrade", disable=args.quiet) as bar:
        r = upgrade(store, progress=bar.update)
    for p in r.refused:
        print(f"FAIL {p}")
    left = len({p.shard for p in r.refused})
    print(f"upgrade {recordable_url(args.url)}: {r.rewritten} commit record(s) rewritten, {r.current} already current"
          + (f"; {left} shard(s) left as they were (problems above)" if left else "")
          + ("; manifest now at format version 2" if r.manifest_upgraded else ""))
    return 1 if left else 0


def cmd_convert(args) -> int:
    from ..ops.convert import convert

    src_options = storage.parse_storage_options(args.storage_option)
    dst_options = storage.parse_storage_options(args.dst_storage_option) if args.dst_storage_option else src_options
    r = convert(args.src, args.dst, args.layout, src_options, dst_options, chunk_codec=args.codec,
                progress=not args.quiet)
    print(f"convert {recordable_url(args.src)} -> {recordable_url(args.dst)} ({args.layout}): {r.shards} shards, {r.samples} samples written; "
          f"{r.skipped} shards already there")
    return 0


def cmd_bench(args) -> int:
    from ..loader.options import Reading
    from ..ops.bench import LoaderBench, format_source, run_loader_bench, run_source_bench, run_store_bench

    options = storage.parse_storage_options(args.storage_option)
    if args.what == "source":
        reading = {k: v for k, v in (("cache_dir", args.cache_dir), ("cache_bytes", args.cache_bytes),
                                     ("prefetch", args.prefetch)) if v is not None}
        result = run_source_bench(args.url, options, size_mb=args.size_mb, hidden=args.hidden, layers=args.num_taps,
                                  procs=args.procs, epochs=args.epochs, cold=args.cold, partition=args.partition,
                                  reading=Reading(pin_memory=args.pin_memory, **reading), progress=not args.quiet,
                                  batch_tokens=args.batch_tokens)
        print(json.dumps(result, indent=2) if args.json else format_source(result["source"]))
        return 0
    layouts = args.layout.split(",")
    result: dict = {}
    for lay in layouts:  # several layouts: one after the other in this run, each against its own raw baseline
        part: dict = {}
        if args.what in ("store", "all"):
            part.update(run_store_bench(args.url, options, size_mb=args.size_mb, hidden=args.hidden,
                                        layers=args.num_taps, codec=args.codec, rounds=args.rounds, what=args.what,
                                        layout=lay, progress=not args.quiet))
        if args.what in ("loader", "all"):
            read_layers = tuple(int(x) for x in args.read_layers.split(",")) if args.read_layers else None
            part.update(run_loader_bench(args.url, options, LoaderBench(
                size_mb=args.size_mb, hidden=args.hidden, layers=args.num_taps, codec=args.codec, rounds=args.rounds,
                read_layers=read_layers, workers=args.workers, cold=args.cold, peers=not args.no_peers,
                pin=args.pin_memory, layout=lay, progress=not args.quiet, procs=args.procs,
                batch_tokens=args.batch_tokens)))
        result.update(part if len(layouts) == 1 else {f"{k}[{lay}]": v for k, v in part.items()})
    if len(layouts) > 1:
        base, other = layouts[0], layouts[1:]
        for name in [k[:-len(f"[{base}]")] for k in result if k.endswith(f"[{base}]")]:
            for lay in other:
                a, b = result[f"{name}[{base}]"], result[f"{name}[{lay}]"]
                a.setdefault("vs_layout", {})[lay] = b["gbps"] / a["gbps"]
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for name, r in result.items():
            print(f"{name:>20}: {r['gbps']:.3f} GB/s vs raw {r['raw_gbps']:.3f} GB/s -> ratio {r['ratio']:.2f} "
                  f"({r['bytes'] / 1e9:.2f} GB)")
            if "raw_durable_gbps" in r:
                print(f"{'':>20}  vs raw write + fsync {r['raw_durable_gbps']:.3f} GB/s -> ratio "
                      f"{r['ratio_durable']:.2f}")
            if "raw_direct_gbps" in r:
                print(f"{'':>20}  vs unbuffered readinto {r['raw_direct_gbps']:.3f} GB/s -> ratio "
                      f"{r['ratio_direct']:.2f}")
            if "peer_gbps" in r:
                print(f"{'peer layout':>20}: {r['peer_gbps']:.3f} GB/s (torch.save per sample) -> ratio "
                      f"{r['peer_ratio']:.2f}; loader is {r['vs_peer']:.2f}x the peers' layout")
            if "workers_gbps" in r:
                print(f"{'':>20}  {r['workers']} DataLoader workers: {r['workers_gbps']:.3f} GB/s -> "
                      f"{r['workers_vs_inprocess']:.2f}x in-process")
            if "procs" in r:
                m = r["procs"]
                print(f"{'':>20}  {m['procs']} loaders at once: {m['total_gbps']:.3f} GB/s in all, "
                      f"{m['min_process_gbps']:.3f} GB/s for the slowest")
            for lay, x in r.get("vs_layout", {}).items():
                print(f"{'':>20}  {lay} layout: {x:.2f}x this throughput")
    return 0


def subset_split(args):
    """The split that ``--fraction``/``--ids`` (and ``--complement``, ``--seed``) ask for, else None."""
    from ..ops.subset import Split, read_ids

    if args.fraction is None and args.ids is None:
        if args.complement:
            raise ValueError("--complement goes with --fraction F or --ids FILE: the split it is the other side of")
        if args.seed is not None:
            raise ValueError("--seed goes with --fraction F: the share it chooses")
        return None
    if args.fraction is not None and args.ids is not None:
        raise ValueError("--fraction or --ids, not both: a split is chosen one way")
    if args.ids is not None and args.seed is not None:
        raise ValueError("--seed goes with --fraction: an --ids list chooses by itself")
    return Split(fraction=args.fraction, seed=args.seed or 0,
                 ids=None if args.ids is None else read_ids(args.ids), complement=args.complement)


def cmd_subset(args) -> int:
    from ..ops.subset import Selection, subset

    options = storage.parse_storage_options(args.storage_option)
    sel = Selection(sources=tuple(args.source), min_tokens=args.min_length, max_tokens=args.max_length,
                    min_loss_tokens=args.min_loss_tokens, exclude_flags=tuple(args.exclude_flag),
                    exclude_unhealthy=args.exclude_unhealthy)
    split = subset_split(args)
    r = subset(args.src, args.dst, sel, src_options=options, dst_options=options, progress=not args.quiet,
               split=split)
    if r.unmatched_ids:
        print(f"hsstore subset: warning: {r.unmatched_ids} of the {len(split.ids)} ids of --ids {args.ids} are no "
              "sample (or conversation) id among the samples the filters keep", file=sys.stderr)
    if args.json:
        print(json.dumps({"src": recordable_url(args.src), "dst": recordable_url(args.dst), **dataclasses.asdict(r)}, indent=2))
        return 0
    side = "" if split is None else (
        f" ({'the complement of ' if split.complement else ''}"
        + (f"--fraction {split.fraction} seed {split.seed}" if split.ids is None else f"--ids {args.ids}")
        + f", of the {r.kept} samples the filters keep)")
    print(f"subset {recordable_url(args.src)} -> {recordable_url(args.dst)}: {r.selected} samples selected{side}, "
          f"{r.written} written ({r.tokens:,} tokens), {r.already} already there")
    return 0


def cmd_copy(args) -> int:
    from ..ops.copy import copy

    src_options = storage.parse_storage_options(args.storage_option)
    dst_options = storage.parse_storage_options(args.dst_storage_option) if args.dst_storage_option else src_options
    r = copy(args.src, args.dst, src_options=src_options, dst_options=dst_options, progress=not args.quiet)
    if args.json:
        print(json.dumps({"src": recordable_url(args.src), "dst": recordable_url(args.dst), "ok": r.ok,
                          **dataclasses.asdict(r)}, indent=2))
        return 0 if r.ok else 1
    for p in r.problems:
        print(f"FAIL {p}")
    status = "OK" if r.ok else f"FAILED ({len(r.problems)} problem(s) above)"
    print(f"copy {recordable_url(args.src)} -> {recordable_url(args.dst)}: {r.shards} shards, {r.samples} samples, "
          f"{r.bytes_copied:,} bytes copied ({r.already} shards already there); verify of the copy: {status}, "
          f"{r.verified_shards} shards, {r.verified_bytes:,} bytes re-read against the source's commit records")
    return 0 if r.ok else 1


def cmd_merge(args) -> int:
    from ..ops.merge import merge

    options = storage.parse_storage_options(args.storage_option)
    r = merge(args.dst, args.src, by=args.by, dst_options=options, progress=not args.quiet)
    if args.json:
        print(json.dumps({"dst": recordable_url(args.dst), "src": recordable_url(args.src), "by": args.by, **dataclasses.asdict(r)}, indent=2))
        return 0
    print(f"merge into {recordable_url(args.dst)} (by {args.by}): {r.shards} shards, {r.samples} samples added"
          + (f", {r.bytes_copied:,} bytes copied" if args.by == "copy" else "") + f"; {r.already} already there")
    return 0


def cmd_report(args) -> int:
    from ..ops.html_report import write_report

    kind = write_report(args.path, args.out, interactive_options(args.path, args))
    print(f"report of {kind} {recordable_url(args.path)}: {args.out}")
    return 0


STORE_URL_HELP = "store URL: a local path or s3://bucket/prefix (any fsspec URL)"


def add_info(sub) -> None:
    q = sub.add_parser("info", help="what a store holds (from commit records; fast)")
    q.add_argument("url", help=STORE_URL_HELP)
    add_json_option(q, "the summary")
    add_storage_option(q)
    q.set_defaults(func=cmd_info)


def add_verify(sub) -> None:
    q = sub.add_parser("verify", help="re-read every byte, check checksums, shapes and offsets")
    q.add_argument("url", help=STORE_URL_HELP)
    add_quiet_option(q)
    add_json_option(q, "the report (exit status as without it: 1 when a problem was found)")
    add_storage_option(q)
    q.set_defaults(func=cmd_verify)


def add_index(sub) -> None:
    q = sub.add_parser("index", help="gather the commit records into one index segment (opening then reads a "
                                     "handful of objects, not one per shard); safe while writers add shards")
    q.add_argument("url", help=STORE_URL_HELP)
    q.add_argument("--grace", type=float, default=3600.0, metavar="SECONDS",
                   help="remove index segments superseded by a segment at least this old (readers that listed "
                        "them before may still be reading them); 0: also those this run supersedes")
    add_json_option(q)
    add_storage_option(q)
    q.set_defaults(func=cmd_index)


def add_upgrade(sub) -> None:
    q = sub.add_parser("upgrade", help="rewrite commit records of format version 1 with checksums that tell "
                                       "chunks apart (each shard verified first; safe to interrupt and re-run)")
    q.add_argument("url", help=STORE_URL_HELP)
    add_quiet_option(q)
    add_storage_option(q)
    q.set_defaults(func=cmd_upgrade)


def add_convert(sub) -> None:
    q = sub.add_parser("convert", help="copy a store into a new store of another layout ("
                                       + " <-> ".join(layout_spec.names()) + "), bit-exact")
    q.add_argument("src", help="the store to copy (" + STORE_URL_HELP + ")")
    q.add_argument("dst", help="destination store (created, or resumed when it already holds some shards)")
    q.add_argument("--layout", required=True, choices=layout_spec.names(), help="the destination's shard layout")
    q.add_argument("--codec", default=None, help="zarr destination: chunk codec (default: the source's)")
    q.add_argument("--dst-storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="storage options of the destination only (default: those of -S)")
    add_quiet_option(q)
    add_storage_option(q)
    q.set_defaults(func=cmd_convert)


def add_bench(sub) -> None:
    q = sub.add_parser("bench", help="store write/read and loader throughput against raw reads/writes of the "
                                     "same bytes")
    q.add_argument("url", help="scratch location (a store is written under URL/bench-<random>, then removed)")
    q.add_argument("--size-mb", type=int, default=512, help="feature megabytes of the synthetic store")
    q.add_argument("--hidden", type=int, default=5120, help="hidden size of the synthetic features")
    q.add_argument("--num-taps", type=int, default=5, metavar="N", help="tapped layers of the synthetic store")
    q.add_argument("--layers", dest="num_taps", type=int, action=Deprecated, new="--num-taps")
    q.add_argument("--codec", default="none", help="chunk codec of the synthetic store (none, zstd[:level], "
                   "blosc-zstd[:level], lz4)")
    names = layout_spec.names()
    q.add_argument("--layout", default=layout_spec.DEFAULT,
                   help=f"{', '.join(names)}, or {'both' if len(names) == 2 else 'several'} ({','.join(names)}: one "
                        "after the other, compared)")
    q.add_argument("--what", choices=["store", "loader", "all", "source"], default="store",
                   help="store: write/read; loader: HiddenStateDataset vs raw reads and the peers' layout; source: "
                        "--procs ranks read one epoch after another at once (--cold: page cache dropped before "
                        "each), GB/s per rank and CPU-seconds per GB, beside N plain readers of the same files "
                        "(loader/raw; local stores) (tools/bench_source.py: the same from S3 "
                        "behind a proxy with latency and a bandwidth cap)")
    q.add_argument("--rounds", type=int, default=3, help="rounds (alternating raw and store; best of each)")
    q.add_argument("--read-layers", default=None, metavar="L,L",
                   help="loader: layer ids to read (default all; the bench store has layers 0..LAYERS-1)")
    q.add_argument("--workers", type=int, default=0,
                   help="loader: also time N persistent DataLoader workers beside the in-process loader")
    q.add_argument("--batch-tokens", type=int, default=0, metavar="N",
                   help="loader: time packed TokenBatches of N tokens instead of single samples; source: each rank "
                        "reads padded TokenBatches of N tokens, the trainer's (features of real tokens counted)")
    q.add_argument("--procs", type=int, default=1, metavar="N",
                   help="loader: also run N in-process loaders at once, each a rank of N on its share of the "
                        "cores (one node's GPUs): per-process and total GB/s")
    q.add_argument("--cold", action="store_true", help="loader, source: drop local files from the page cache each "
                                                       "round / epoch")
    q.add_argument("--epochs", type=int, default=2, help="source: epochs each rank reads")
    q.add_argument("--partition", choices=["global", "node"], default="global",
                   help="source: the ranks' plan (node: each rank as its own node, keeping one share every epoch)")
    q.add_argument("--cache-dir", default=None, help="source: local chunk cache for remote stores (one per rank)")
    q.add_argument("--cache-bytes", type=int, default=None, help="source: cap of each rank's cache")
    q.add_argument("--prefetch", type=int, default=None, metavar="N",
                   help="source: units each rank reads ahead at once (the loader's prefetch: on local disk, its "
                        "read threads; default the loader's)")
    q.add_argument("--no-peers", action="store_true", help="loader: skip the one-file-per-sample comparison")
    q.add_argument("--pin-memory", action="store_true", help="loader, source: deliver items (source with "
                                                                "--batch-tokens: batches) in pinned memory (needs a GPU)")
    add_quiet_option(q)
    add_json_option(q, "the results")
    add_storage_option(q)
    q.set_defaults(func=cmd_bench)


def add_subset(sub) -> None:
    q = sub.add_parser("subset", help="copy the samples that pass per-sample filters (or one side of a split) into "
                                      "another store")
    q.add_argument("src", help="the store to select from (" + STORE_URL_HELP + ")")
    q.add_argument("dst", help="created with the source's manifest, or an existing compatible store (resumed)")
    q.add_argument("--source", action="append", default=[], metavar="S", help="keep this source (repeatable)")
    q.add_argument("--min-length", type=int, default=None, metavar="N", help="drop samples shorter than N tokens")
    q.add_argument("--max-length", type=int, default=None, metavar="N", help="drop samples longer than N tokens")
    q.add_argument("--min-tokens", dest="min_length", type=int, action=Deprecated, new="--min-length")
    q.add_argument("--max-tokens", dest="max_length", type=int, action=Deprecated, new="--max-length")
    q.add_argument("--min-loss-tokens", type=int, default=None, metavar="N", help="drop samples whose loss-mask "
                   "sum is below N (stub answers)")
    q.add_argument("--exclude-flag", action="append", default=[], metavar="F",
                   help="drop samples with this quality flag (stub_answer, empty_thinking, truncated, feature_zero, ...)")
    q.add_argument("--exclude-unhealthy", action="store_true",
                   help="drop samples whose records' statistics show a non-finite or all-zero feature")
    q.add_argument("--fraction", type=float, default=None, metavar="F",
                   help="a split (a validation store): of the conversations the other filters keep, the share F "
                        "chosen by --seed (by sample id: the same on every copy of the store; a multi-turn row's "
                        "id#tN samples stay together)")
    q.add_argument("--seed", type=int, default=None, metavar="N", help="--fraction's choice (default 0)")
    q.add_argument("--ids", default=None, metavar="FILE",
                   help="a split by list: the samples whose ids FILE lists, one a line (a conversation's id takes "
                        "all its id#tN samples)")
    q.add_argument("--complement", action="store_true",
                   help="the other side of the --fraction or --ids split: the kept samples it leaves out (the two "
                        "sides share none and together hold all)")
    add_quiet_option(q)
    add_storage_option(q)
    add_json_option(q)
    q.set_defaults(func=cmd_subset)


def add_copy(sub) -> None:
    q = sub.add_parser("copy", help="copy a store to another place (local disk <-> S3, bucket to bucket), verified "
                                    "at the end",
                       description="Every file of every committed shard read, checked against its commit record and "
                       "written under the same key (as merge --by copy), the assets with them; then every byte of "
                       "the destination re-read (as verify) and its shards compared with the source's. Exit 1 when "
                       "that verification fails. Re-running resumes.")
    q.add_argument("src", help="the store to copy (" + STORE_URL_HELP + ")")
    q.add_argument("dst", help="the copy: a new or empty place, or an earlier copy of SRC (resumed)")
    q.add_argument("--dst-storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="storage options of the destination only (default: those of -S)")
    add_quiet_option(q)
    add_storage_option(q)
    add_json_option(q, "the summary (exit status as without it)")
    q.set_defaults(func=cmd_copy)


def add_merge(sub) -> None:
    q = sub.add_parser("merge", help="add the committed shards of compatible stores to DST, by copy or by reference")
    q.add_argument("dst", help="created from the first source's manifest when it does not exist")
    q.add_argument("src", nargs="+", help="the stores whose committed shards are added (same target, tokenizer, "
                   "taps, dtype, encoding, layout, chunking)")
    q.add_argument("--by", choices=["copy", "reference"], default="copy",
                   help="copy: shard files are copied (CRC-checked); reference: DST's commit records point at "
                        "the source stores, nothing else is copied")
    add_quiet_option(q)
    add_storage_option(q)
    add_json_option(q)
    q.set_defaults(func=cmd_merge)


def add_report(sub) -> None:
    q = sub.add_parser("report", help="a store or a training run as one self-contained HTML page of charts",
                       description="PATH a store (loss-mask-sum and length histograms with the stub signature "
                       "marked, response fraction, flags, bytes per layer; from the commit records) or a run "
                       "directory of `hsstore train` (loss, tau, accuracy and acceptance curves, val against "
                       "train, tokens/s, lr). Inline SVG: opens from disk, no server, no network.")
    q.add_argument("path", metavar="PATH", help="store URL or run directory (OUT of hsstore train)")
    q.add_argument("--out", required=True, metavar="FILE.html",
                   help="the page to write: a new file, or a page `hsstore report` wrote before (replaced)")
    add_storage_option(q)
    q.set_defaults(func=cmd_report)


STORE_COMMANDS = (add_info, add_verify, add_index, add_upgrade, add_convert, add_bench, add_subset, add_copy, add_merge,
                  add_report)  # extract's and train's come through entry points; --help lists all in WORKFLOW_ORDER


class Parser(argparse.ArgumentParser):
    """A parser that takes no abbreviated flags (argparse's default would read ``--step`` as ``--steps``); the
    sub-commands' parsers are of this class too (``add_subparsers`` makes its own kind)."""

    def __init__(self, *args, allow_abbrev: bool = False, **kwargs):
        super().__init__(*args, allow_abbrev=allow_abbrev, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="hsstore", description="Hidden-state store for speculative-decoding drafters")
    p.add_argument("--version", action="version", version=f"hsstore {__version__}")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND",
                           help="one of these, in the order of the work (`hsstore COMMAND --help` for its flags)")

    for add in STORE_COMMANDS:
        add(sub)
    for ep in sorted(entry_points(group=COMMANDS_GROUP), key=lambda e: e.name):
        ep.load()(sub)
    in_workflow_order(sub)
    return p


# --help lists the commands as the work runs: try it, make the data, check it, extract, look at (and audit) the store, train,
# evaluate, then what shares and maintains stores; commands of other packages come after these
WORKFLOW_ORDER = ("demo", "regenerate", "check", "show", "extract", "info", "verify", "audit", "report", "train", "eval",
                  "export-drafter", "subset", "copy", "merge", "export", "import", "convert", "index", "upgrade", "bench")


def in_workflow_order(sub: argparse._SubParsersAction) -> None:
    rank = {name: i for i, name in enumerate(WORKFLOW_ORDER)}
    sub._choices_actions.sort(key=lambda a: rank.get(a.dest, len(rank)))  # what --help lists, in this order


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """``--help`` shows each option's default (where it has one worth showing)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if ("%(default)" in text or action.default in (None, False, [], argparse.SUPPRESS)
                or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)".lstrip()


def unknown_word(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """One line for a mistyped command or flag, naming the nearest real one (argparse's own message for an
    unknown flag comes after the top-level usage and suggests nothing); None when every word is known."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    words = [w for w in argv if not w.startswith("-")]
    if not words:
        return None
    if words[0] not in sub.choices:
        guess = config.near(words[0], list(sub.choices))
        return (f"hsstore: error: unknown command {words[0]!r}" + (f" (did you mean {guess}?)" if guess else "")
                + "; `hsstore --help` lists the commands")
    cmd = sub.choices[words[0]]
    flags = [o for a in cmd._actions for o in a.option_strings]
    for word in argv[argv.index(words[0]) + 1:]:
        if word == "--":
            break
        name = word.split("=", 1)[0]
        if not name.startswith("--") or name in flags:
            continue  # a value or a flag
        # flags are never abbreviated (``--step 300`` is not ``--steps``): a prefix is refused naming the flag
        longer = [f for f in flags if f.startswith(name)]
        guess = (longer[0] if len(longer) == 1 else config.near(name, longer)
                 or config.near(name, [f for f in flags if f.startswith("--")]))
        return (f"{cmd.prog}: error: unknown flag {name}" + (f" (did you mean {guess}?)" if guess else "")
                + f"; `{cmd.prog} --help` lists the flags")
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    problem = unknown_word(parser, list(sys.argv[1:] if argv is None else argv))
    if problem:
        print(problem, file=sys.stderr)
        return 2
    config.apply(parser, argv)  # a sub-command's --config FILE: its values become that parser's defaults
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:  # third-party debug logs quote endpoints and signed headers
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
            handler.addFilter(EscapingFilter())  # store strings in log lines never drive the terminal
    try:
        env.check()  # every HSSTORE_* variable set: one line for a bad value, a warning for an unknown name
        allow_for_command(getattr(args, "allow_location", None) or ())  # every store this command opens
        config.check_applied(args)
        if getattr(args, "preflight", None) is not None:  # refusals that need nothing loaded, before its first line
            args.preflight(args)
        if getattr(args, "announce", None) is not None:  # a command's first line, before any heavy import
            args.announce(args)
        if getattr(args, "device", None) is not None:  # every command with --device: refused before any work
            from .devices import resolve_device

            resolve_device(args.device)
        rc = int(args.func(args) or 0)
        sys.stdout.flush()  # inside the try: a reader that went away (`info | head`) is not an error
        return rc
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to write, no noise at exit
        return 141  # 128 + SIGPIPE, as a shell reports a tool killed by it
    except (StoreError, ValueError, OSError) as e:  # bad input: one line, exit 2 (-vv shows the traceback)
        log.debug("error", exc_info=True)
        msg = escape(scrub((str(e).strip().splitlines() or [type(e).__name__])[0]))
        print(f"hsstore {args.command}: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # what was kept and how to go on is logged by the command itself
        print(f"hsstore {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
