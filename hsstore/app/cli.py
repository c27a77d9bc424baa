"""The ``hsstore`` command line.

Store commands (info, verify, index, upgrade, convert, bench, subset, copy, merge, report) live here; the extraction
commands (check, show, extract, import, export, regenerate, demo) and the training commands (train, eval,
export-drafter) are registered by ``hsstore.extract.cli`` and ``hsstore.train.cli`` through the ``hsstore.commands``
entry-point group (so another installed package can add commands the same way); they import transformers only
when their command runs. Every family lists its commands as ``commands.Command`` values, registered by
``commands.add_commands``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import sys
from importlib.metadata import entry_points

from . import config
from .. import env
from ..io import storage
from ..format import encodings, layout_spec
from ..format.manifest import DamagedManifest
from ..format.names import allow_for_command
from ..errors import StoreError
from ..redaction import RedactingFilter, recordable_url, scrub
from ..terminal import EscapingFilter, escape, shown
from . import commands
from .commands import Command, add_commands, json_flag, quiet, storage_flags
from .schema import from_args, moved_names
from .settings import (STORE_URL_HELP, BenchSettings, ConvertSettings, CopySettings, IndexSettings, InfoSettings,
                             MergeSettings, ReportSettings, SubsetSettings, SubsetSplit, UpgradeSettings,
                             VerifySettings)
from ..version import __version__

log = logging.getLogger("hsstore")
COMMANDS_GROUP = "hsstore.commands"  # entry points: a callable that adds sub-parsers
# the commands' shared flags and help formatter, now in commands.py: still read from here, with a DeprecationWarning
__getattr__ = moved_names(__name__, commands, ("DefaultsHelpFormatter", "add_storage_option", "add_quiet_option",
                                               "add_json_option"))


def interactive_options(url: str, args) -> dict:
    """The storage options of a command a person waits for (``storage.interactive_options``)."""
    return storage.interactive_options(url, storage.parse_storage_options(args.storage_option))


def cmd_info(args) -> int:
    from ..ops.info import format_text, summarize
    from ..store import reader

    url = from_args(InfoSettings, args).store.url
    store = reader.open(url, **interactive_options(url, args))
    s = summarize(store)
    print(json.dumps(s, indent=2) if args.json else format_text(s))
    return 0 if s["admission"]["ok"] else 1  # described, and refused by every reader


def cmd_verify(args) -> int:
    from ..progress import progress_bar

    from ..store import reader
    from ..ops.verify import verify

    url = from_args(VerifySettings, args).store.url
    try:
        store = reader.open(url, **storage.parse_storage_options(args.storage_option))
    except DamagedManifest as e:  # a finding of verify's, not a refusal to run
        problem = escape(scrub(str(e).splitlines()[0]))
        if args.json:
            print(json.dumps({"url": recordable_url(url), "ok": False, "problems": [problem]}, indent=2))
        else:
            print(f"FAIL {problem}\nverify {recordable_url(url)}: FAILED (1 problem(s)); the manifest is damaged, "
                  "no shard was read")
        return 1
    total = int(store.table.ints["stored_bytes"].sum())  # every record's file sizes, from the columns
    with progress_bar(total=total, unit="B", unit_scale=True, desc="verify", disable=args.quiet) as bar:
        report = verify(store, progress=bar.update)
    if args.json:
        print(json.dumps({"url": recordable_url(url), "ok": report.ok, "shards": report.shards, "files": report.files,
                          "bytes": report.bytes, "problems": [str(p) for p in report.problems],
                          "uncommitted": list(report.uncommitted), "weak_records": list(report.weak_records),
                          "assets": report.assets, "index": report.index}, indent=2))
        return 0 if report.ok else 1
    for p in report.problems:
        print(f"FAIL {p}")
    if report.uncommitted:
        print(f"note: {len(report.uncommitted)} uncommitted shard(s) present (ignored by readers): "
              + ", ".join(map(escape, report.uncommitted[:5])))
    if report.weak_records:
        print(f"warning: {len(report.weak_records)} shard(s) have commit records of format version 1, whose chunk "
              "checksums cannot tell one valid chunk from another (a chunk swapped between shards or copied from "
              f"another store passes); `hsstore upgrade {recordable_url(url)}` re-derives them (safe to interrupt and re-run)")
    if report.index.get("unindexed_shards"):
        print(f"note: {report.index['unindexed_shards']} shard(s) not in the index (readers read their records one "
              f"by one); `hsstore index {recordable_url(url)}` adds them")
    if not report.assets:
        print("warning: the store has no assets (the target's embedding, lm_head, config and tokenizer): "
              "`hsstore train` and `hsstore show` need them; `hsstore extract` writes them, and merge, subset and "
              "convert copy them from a source that has them")
    status = "OK" if report.ok else f"FAILED ({len(report.problems)} problem(s))"
    print(f"verify {recordable_url(url)}: {status}; {report.shards} shards, {report.files} files, {report.bytes:,} bytes checked")
    return 0 if report.ok else 1


def cmd_index(args) -> int:
    from ..format.index import compact
    from ..format.manifest import read_manifest

    settings = from_args(IndexSettings, args)
    url = settings.store.url
    fs, root = storage.resolve(url, interactive_options(url, args))
    read_manifest(fs, root, url)  # an hsstore store, or a clear error before anything is written
    r = compact(fs, root, grace_s=settings.index.grace)
    if args.json:
        print(json.dumps({"url": recordable_url(url), **dataclasses.asdict(r)}, indent=2))
        return 0
    print(f"index {recordable_url(url)}: {r.shards} commit record(s) in index/{r.segment} ({r.fetched} read from commits/); "
          f"{r.superseded} older segment(s) superseded, {len(r.removed)} removed"
          + (f"; {len(r.damaged)} damaged segment(s) superseded" if r.damaged else ""))
    return 0


def cmd_upgrade(args) -> int:
    from ..progress import progress_bar

    from ..store import reader
    from ..ops.upgrade import upgrade

    url = from_args(UpgradeSettings, args).store.url
    store = reader.open(url, **storage.parse_storage_options(args.storage_option))
    total = sum(f["size"] for c in store.commits if not c.binds_chunks for f in c.files.values())
    with progress_bar(total=total, unit="B", unit_scale=True, desc="upgrade", disable=args.quiet) as bar:
        r = upgrade(store, progress=bar.update)
    for p in r.refused:
        print(f"FAIL {p}")
    left = len({p.shard for p in r.refused})
    print(f"upgrade {recordable_url(url)}: {r.rewritten} commit record(s) rewritten, {r.current} already current"
          + (f"; {left} shard(s) left as they were (problems above)" if left else "")
          + ("; manifest now at format version 2" if r.manifest_upgraded else ""))
    return 1 if left else 0


def src_dst_options(args, dst_storage_option: list[str]) -> tuple[dict, dict]:
    """(source's, destination's) storage options: ``--dst-storage-option`` where given, else ``-S``'s for both."""
    src = storage.parse_storage_options(args.storage_option)
    return src, storage.parse_storage_options(dst_storage_option) if dst_storage_option else src


def cmd_convert(args) -> int:
    from ..ops.convert import convert

    c = from_args(ConvertSettings, args).convert
    src_options, dst_options = src_dst_options(args, c.dst_storage_option)
    r = convert(c.src, c.dst, c.layout, src_options, dst_options, chunk_codec=c.codec, progress=not args.quiet,
                encoding=c.encoding)
    what = ", ".join(x for x in (c.layout, c.encoding and f"encoding {c.encoding}") if x) or "a copy"
    print(f"convert {recordable_url(c.src)} -> {recordable_url(c.dst)} ({what}): {r.shards} shards, {r.samples} samples written; "
          f"{r.skipped} shards already there")
    return 0


def cmd_bench(args) -> int:
    from ..loader.options import Reading
    from ..ops.bench import LoaderBench, format_source, run_loader_bench, run_source_bench, run_store_bench

    settings = from_args(BenchSettings, args)
    st, run, ld, src = settings.store, settings.run, settings.loader, settings.source
    options = storage.parse_storage_options(args.storage_option)
    if st.encoding != "raw" and run.what in ("loader", "all"):
        raise ValueError(f"--encoding {st.encoding}: the loader bench counts bf16 bytes and compares them with the "
                         "peers' bf16 files; encodings are benched with --what store or --what source")
    if run.what == "source":
        reading = {k: v for k, v in (("cache_dir", src.cache_dir), ("cache_bytes", src.cache_bytes),
                                     ("prefetch", src.prefetch)) if v is not None}
        result = run_source_bench(st.url, options, size_mb=st.size_mb, hidden=st.hidden, layers=st.num_taps,
                                  procs=ld.procs, epochs=src.epochs, cold=ld.cold, partition=src.partition,
                                  reading=Reading(pin_memory=ld.pin_memory, **reading), progress=not args.quiet,
                                  token_budget=ld.token_budget, encoding=st.encoding)
        print(json.dumps(result, indent=2) if args.json else format_source(result["source"]))
        return 0
    layouts = st.layout.split(",")
    result: dict = {}
    for lay in layouts:  # several layouts: one after the other in this run, each against its own raw baseline
        part: dict = {}
        if run.what in ("store", "all"):
            part.update(run_store_bench(st.url, options, size_mb=st.size_mb, hidden=st.hidden,
                                        layers=st.num_taps, codec=st.codec, rounds=run.rounds, what=run.what,
                                        layout=lay, progress=not args.quiet, encoding=st.encoding))
        if run.what in ("loader", "all"):
            read_layers = tuple(int(x) for x in ld.read_layers.split(",")) if ld.read_layers else None
            part.update(run_loader_bench(st.url, options, LoaderBench(
                size_mb=st.size_mb, hidden=st.hidden, layers=st.num_taps, codec=st.codec, rounds=run.rounds,
                read_layers=read_layers, workers=ld.workers, cold=ld.cold, peers=ld.peers,
                pin=ld.pin_memory, layout=lay, progress=not args.quiet, procs=ld.procs,
                token_budget=ld.token_budget)))
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


def subset_split(split: SubsetSplit):
    """The split that ``--fraction``/``--ids`` (and ``--complement``, ``--seed``) ask for, else None."""
    from ..ops.subset import Split, read_ids

    if split.fraction is None and split.ids is None:
        if split.complement:
            raise ValueError("--complement goes with --fraction F or --ids FILE: the split it is the other side of")
        if split.seed is not None:
            raise ValueError("--seed goes with --fraction F: the share it chooses")
        return None
    if split.fraction is not None and split.ids is not None:
        raise ValueError("--fraction or --ids, not both: a split is chosen one way")
    if split.ids is not None and split.seed is not None:
        raise ValueError("--seed goes with --fraction: an --ids list chooses by itself")
    return Split(fraction=split.fraction, seed=split.seed or 0,
                 ids=None if split.ids is None else read_ids(split.ids), complement=split.complement)


def cmd_subset(args) -> int:
    from ..ops.subset import SampleFilter, subset

    settings = from_args(SubsetSettings, args)
    src, dst, f = settings.stores.src, settings.stores.dst, settings.filters
    options = storage.parse_storage_options(args.storage_option)
    sel = SampleFilter(sources=tuple(f.source), min_length=f.min_length, max_length=f.max_length,
                       min_loss_tokens=f.min_loss_tokens, exclude_flags=tuple(f.exclude_flag),
                       exclude_unhealthy=f.exclude_unhealthy)
    split = subset_split(settings.split)
    r = subset(src, dst, sel, src_options=options, dst_options=options, progress=not args.quiet, split=split,
               skip_corrupt=f.skip_corrupt)
    ids = settings.split.ids
    if r.unmatched_ids:
        print(f"hsstore subset: warning: {r.unmatched_ids} of the {len(split.ids)} ids of --ids {ids} are no "
              "sample (or conversation) id among the samples the filters keep", file=sys.stderr)
    if args.json:
        print(json.dumps({"src": recordable_url(src), "dst": recordable_url(dst), **dataclasses.asdict(r)}, indent=2))
        return 0
    side = "" if split is None else (
        f" ({'the complement of ' if split.complement else ''}"
        + (f"--fraction {split.fraction} seed {split.seed}" if split.ids is None else f"--ids {ids}")
        + f", of the {r.kept} samples the filters keep)")
    print(f"subset {recordable_url(src)} -> {recordable_url(dst)}: {r.selected} samples selected{side}, "
          f"{r.written} written ({r.tokens:,} tokens), {r.already} already there" + (
              f"; {len(r.corrupt)} left behind whose bytes do not verify: {', '.join(map(shown, r.corrupt[:10]))}"
              + (f", ... ({len(r.corrupt)} in all; --json lists them)" if len(r.corrupt) > 10 else "")
              if r.corrupt else ""))
    return 0


def cmd_copy(args) -> int:
    from ..ops.copy import copy

    c = from_args(CopySettings, args).copy
    src_options, dst_options = src_dst_options(args, c.dst_storage_option)
    r = copy(c.src, c.dst, src_options=src_options, dst_options=dst_options, progress=not args.quiet)
    if args.json:
        print(json.dumps({"src": recordable_url(c.src), "dst": recordable_url(c.dst), "ok": r.ok,
                          **dataclasses.asdict(r)}, indent=2))
        return 0 if r.ok else 1
    for p in r.problems:
        print(f"FAIL {p}")
    status = "OK" if r.ok else f"FAILED ({len(r.problems)} problem(s) above)"
    print(f"copy {recordable_url(c.src)} -> {recordable_url(c.dst)}: {r.shards} shards, {r.samples} samples, "
          f"{r.bytes_copied:,} bytes copied ({r.already} shards already there); verify of the copy: {status}, "
          f"{r.verified_shards} shards, {r.verified_bytes:,} bytes re-read against the source's commit records")
    return 0 if r.ok else 1


def cmd_merge(args) -> int:
    from ..ops.merge import merge

    m = from_args(MergeSettings, args).merge
    options = storage.parse_storage_options(args.storage_option)
    r = merge(m.dst, m.src, by=m.by, dst_options=options, progress=not args.quiet)
    if args.json:
        print(json.dumps({"dst": recordable_url(m.dst), "src": recordable_url(m.src), "by": m.by, **dataclasses.asdict(r)}, indent=2))
        return 0
    print(f"merge into {recordable_url(m.dst)} (by {m.by}): {r.shards} shards, {r.samples} samples added"
          + (f", {r.bytes_copied:,} bytes copied" if m.by == "copy" else "") + f"; {r.already} already there")
    return 0


def cmd_report(args) -> int:
    from ..ops.html_report import write_report

    page = from_args(ReportSettings, args).report
    kind = write_report(page.path, page.out, interactive_options(page.path, args))
    print(f"report of {kind} {recordable_url(page.path)}: {page.out}")
    return 0


STORE_COMMANDS = (
    Command("info", InfoSettings, cmd_info, help="what a store holds (from commit records; fast)",
            shared=(quiet("store"), json_flag("store", "the summary"), storage_flags("store"))),
    Command("verify", VerifySettings, cmd_verify, help="re-read every byte, check checksums, shapes and offsets",
            shared=(quiet("store"),
                    json_flag("store", "the report (exit status as without it: 1 when a problem was found)"),
                    storage_flags("store"))),
    Command("index", IndexSettings, cmd_index,
            help="gather the commit records into one index segment (opening then reads a handful of objects, not "
                 "one per shard); safe while writers add shards",
            shared=(quiet("index"), json_flag("index"), storage_flags("store"))),
    Command("upgrade", UpgradeSettings, cmd_upgrade,
            help="rewrite commit records of format version 1 with checksums that tell chunks apart (each shard "
                 "verified first; safe to interrupt and re-run)",
            shared=(quiet("store"), storage_flags("store"))),
    Command("convert", ConvertSettings, cmd_convert,
            help="copy a store into a new store of another layout (" + " <-> ".join(layout_spec.names()) + "), "
                 "bit-exact, or another feature encoding (" + ", ".join(encodings.NAMES) + ")",
            shared=(quiet("convert"), storage_flags("convert"))),
    Command("bench", BenchSettings, cmd_bench,
            help="store write/read and loader throughput against raw reads/writes of the same bytes",
            shared=(quiet("run"), json_flag("run", "the results"), storage_flags("store"))),
    Command("subset", SubsetSettings, cmd_subset,
            help="copy the samples that pass per-sample filters (or one side of a split) into another store",
            shared=(quiet("stores"), storage_flags("stores"), json_flag("stores"))),
    Command("copy", CopySettings, cmd_copy,
            help="copy a store to another place (local disk <-> S3, bucket to bucket), verified at the end",
            description="Every file of every committed shard read, checked against its commit record and written "
            "under the same key (as merge --by copy), the assets with them; then every byte of the destination "
            "re-read (as verify) and its shards compared with the source's. Exit 1 when that verification fails. "
            "Re-running resumes.",
            shared=(quiet("copy"), storage_flags("copy"),
                    json_flag("copy", "the summary (exit status as without it)"))),
    Command("merge", MergeSettings, cmd_merge,
            help="add the committed shards of compatible stores to DST, by copy or by reference",
            shared=(quiet("merge"), storage_flags("merge"), json_flag("merge"))),
    Command("report", ReportSettings, cmd_report,
            help="a store or a training run as one self-contained HTML page of charts",
            description="PATH a store (loss-mask-sum and length histograms with the stub signature marked, response "
            "fraction, flags, bytes per layer; from the commit records) or a run directory of `hsstore train` (loss, "
            "tau, accuracy and acceptance curves, val against train, tokens/s, lr). Inline SVG: opens from disk, no "
            "server, no network.",
            shared=(quiet("report"), storage_flags("report"))),
)  # extract's and train's come through entry points; --help lists all in WORKFLOW_ORDER


class Parser(argparse.ArgumentParser):
    """A parser that takes no abbreviated flags (argparse's default would read ``--step`` as ``--steps``); the
    sub-commands' parsers are of this class too (``add_subparsers`` makes its own kind)."""

    def __init__(self, *args, allow_abbrev: bool = False, **kwargs):
        super().__init__(*args, allow_abbrev=allow_abbrev, **kwargs)

    def error(self, message: str):
        """One line with the command's short usage, not argparse's full usage block (a page for ``train``)."""
        if self.prog == "hsstore":
            self.exit(2, f"hsstore: error: {message}; `hsstore --help` lists the commands\n")
        self.exit(2, word_error(self, message) + "\n")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="hsstore", description="Hidden-state store for speculative-decoding drafters")
    p.add_argument("--version", action="version", version=f"hsstore {__version__}")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND",
                           help="one of these, in the order of the work (`hsstore COMMAND --help` for its flags)")

    add_commands(sub, STORE_COMMANDS)
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


def short_usage(cmd: argparse.ArgumentParser) -> str:
    """A command's usage in a few words: its required flags and positional arguments (``--help`` has the rest)."""
    words = [cmd.prog]
    for a in cmd._actions:
        if a.option_strings and a.required:
            flag = next((o for o in a.option_strings if o.startswith("--")), a.option_strings[0])
            words.append(f"{flag} {a.metavar or a.dest.upper()}")
    words.append("[options]")
    for a in cmd._actions:
        if not a.option_strings and not isinstance(a, argparse._SubParsersAction):
            name = a.metavar or a.dest.upper()
            words.append({"+": f"{name} [{name} ...]", "*": f"[{name} ...]", "?": f"[{name}]"}.get(a.nargs, name))
    return " ".join(words)


def word_error(cmd: argparse.ArgumentParser, what: str, guess: str | None = None) -> str:
    """One line for a word ``cmd`` does not take: what it is, the near flag, the command's usage."""
    return (f"{cmd.prog}: error: {what}" + (f" (did you mean {guess}?)" if guess else "")
            + f"; usage: {short_usage(cmd)}; `{cmd.prog} --help` lists the flags")


def _near_flag(name: str, flags: list[str]) -> str | None:
    """The flag ``name`` most likely meant: the one it is a prefix of (flags are never abbreviated: ``--step``
    is refused naming ``--steps``), else the closest spelling."""
    longer = [f for f in flags if f.startswith(name) and name.startswith("--")]
    if len(longer) == 1:
        return longer[0]
    return (config.near(name, longer) or config.near(name, [f for f in flags if f.startswith("--")])
            or config.near("-" + name.lstrip("-"), [f for f in flags if not f.startswith("--")]))


_NUMBER = re.compile(r"^-\.?\d")  # a negative number is a value (``--gamma -1``), never a flag


def unknown_word(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """One line for a mistyped command or flag, naming the nearest real one and the command's usage (argparse's
    own message for an unknown flag comes after the top-level usage and suggests nothing); None when every word
    is known."""
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
        if not word.startswith("-") or word == "-" or _NUMBER.match(word):
            continue  # a value, a positional argument or a number
        # a long flag with its value after "=", or a short flag with its value attached (``-Sanon=true``)
        name = word.split("=", 1)[0] if word.startswith("--") else word[:2]
        if name in flags:
            continue
        return word_error(cmd, f"unknown flag {name}", _near_flag(name, flags))
    return None


def unexpected_words(parser: argparse.ArgumentParser, args: argparse.Namespace, extras: list[str]) -> str:
    """One line for what a command parsed but does not take (a positional argument too many), with its usage."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    cmd = sub.choices[args.command]
    shown = " ".join(repr(w) for w in extras[:3]) + (" ..." if len(extras) > 3 else "")
    return word_error(cmd, f"unexpected argument{'s' if len(extras) > 1 else ''} {shown}")


def main(argv: list[str] | None = None) -> int:
    env.passive_openmp()  # before any command loads torch: idle CPU threads sleep, not spin
    parser = build_parser()
    problem = unknown_word(parser, list(sys.argv[1:] if argv is None else argv))
    if problem:
        print(problem, file=sys.stderr)
        return 2
    config.apply(parser, argv)  # a sub-command's --config FILE: its values become that parser's defaults
    args, extras = parser.parse_known_args(argv)
    if extras:  # (argparse would print the top-level usage and no suggestion)
        print(unexpected_words(parser, args, extras), file=sys.stderr)
        return 2
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
