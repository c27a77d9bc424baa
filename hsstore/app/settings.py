"""The store commands' settings (info, verify, index, upgrade, convert, bench, subset, copy, merge, report): one
schema per command, in the same system as extract's and train's (``schema.py``), so a setting has one name from
its flag to its field to the code it is passed to (``subset --min-length`` is ``SampleFilter(min_length=)``).

The flags every command shares (``--storage-option``, ``--allow-location``, ``--quiet``, ``--json``) are placed
by ``cli.py``'s ``STORE_COMMANDS`` (``commands.py``) and read from the parsed flags as they are; the settings the
families share (``--token-budget``, ``--cache-dir``, ``--seed``, ...) are declared in ``sections.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..format import encodings, layout_spec
from . import sections
from .schema import option, section

STORE_URL_HELP = "store URL: a local path or s3://bucket/prefix (any fsspec URL)"


def _dst_storage_option():
    return option(default_factory=list, metavar="KEY=VALUE",
                  help="storage options of the destination only (default: those of -S)")


@dataclass
class StoreAt:
    url: str = option(positional=True, help=STORE_URL_HELP)


@dataclass
class InfoSettings:
    store: StoreAt = section(StoreAt, "store")


@dataclass
class VerifySettings:
    store: StoreAt = section(StoreAt, "store")


@dataclass
class IndexGrace:
    grace: float = option(3600.0, metavar="SECONDS",
                          help="remove index segments superseded by a segment at least this old (readers that listed "
                               "them before may still be reading them); 0: also those this run supersedes")


@dataclass
class IndexSettings:
    store: StoreAt = section(StoreAt, "store")
    index: IndexGrace = section(IndexGrace, "index")


@dataclass
class UpgradeSettings:
    store: StoreAt = section(StoreAt, "store")


@dataclass
class ConvertStores:
    src: str = option(positional=True, help="the store to copy (" + STORE_URL_HELP + ")")
    dst: str = option(positional=True, help="destination store (created, or resumed when it already holds some "
                                            "shards)")
    layout: str | None = option(None, choices=layout_spec.names(), help="the destination's shard layout (default: "
                                                                        "the source's)")
    codec: str | None = option(None, help="zarr destination: chunk codec (default: the source's)")
    encoding: str | None = option(None, choices=list(encodings.NAMES),
                                  help="the destination's feature encoding (default: the source's): each feature "
                                       "decoded into the manifest dtype and encoded again, so not bit-exact")
    dst_storage_option: list[str] = _dst_storage_option()


@dataclass
class ConvertSettings:
    convert: ConvertStores = section(ConvertStores, "convert")


_LAYOUTS = layout_spec.names()


@dataclass
class BenchStore:
    """The synthetic store the bench writes and reads."""

    url: str = option(positional=True, help="scratch location (a store is written under URL/bench-<random>, then "
                                            "removed)")
    size_mb: int = option(512, help="feature megabytes of the synthetic store")
    hidden: int = option(5120, help="hidden size of the synthetic features")
    num_taps: int = option(5, metavar="N", old="--layers", help="tapped layers of the synthetic store")
    codec: str = option("none", help="chunk codec of the synthetic store (none, zstd[:level], blosc-zstd[:level], "
                                     "lz4)")
    encoding: str = option("raw", choices=list(encodings.NAMES),
                           help="feature encoding of the synthetic store (store, source; zarr): the same bf16 samples "
                                "(--size-mb: their bf16 megabytes) encoded on the GPU when there is one, else on the "
                                "host; source reports tokens/s and CPU-seconds per million tokens to compare "
                                "encodings")
    layout: str = option(layout_spec.DEFAULT,
                         help=f"{', '.join(_LAYOUTS)}, or {'both' if len(_LAYOUTS) == 2 else 'several'} "
                              f"({','.join(_LAYOUTS)}: one after the other, compared)")


@dataclass
class BenchRun:
    what: str = option("store", choices=("store", "loader", "all", "source"),
                       help="store: write/read; loader: HiddenStateDataset vs raw reads and the peers' layout; source: "
                            "--procs ranks read one epoch after another at once (--cold: page cache dropped before "
                            "each), GB/s per rank and CPU-seconds per GB, beside N plain readers of the same files "
                            "(loader/raw; local stores) (tools/bench_source.py: the same from S3 "
                            "behind a proxy with latency and a bandwidth cap)")
    rounds: int = option(3, help="rounds (alternating raw and store; best of each)")


@dataclass
class BenchLoader:
    read_layers: str | None = option(None, metavar="L,L", help="loader: layer ids to read (default all; the bench "
                                                               "store has layers 0..NUM_TAPS-1)")
    workers: int = option(0, help="loader: also time N persistent DataLoader workers beside the in-process loader")
    token_budget: int = sections.token_budget(
        0, old="--batch-tokens", help="loader: time packed TokenBatches of N tokens instead of single samples; source: "
                                      "each rank reads padded TokenBatches of N tokens, the trainer's (features of "
                                      "real tokens counted)")
    procs: int = option(1, metavar="N", help="loader: also run N in-process loaders at once, each a rank of N on its "
                                             "share of the cores (one node's GPUs): per-process and total GB/s")
    cold: bool = option(False, help="loader, source: drop local files from the page cache each round / epoch")
    peers: bool = option(True, help="loader: also time the one-file-per-sample comparison (--no-peers: skip it)")
    pin_memory: bool = option(False, help="loader, source: deliver items (source with --token-budget: batches) in "
                                          "pinned memory (needs a GPU)")


@dataclass
class BenchSource:
    epochs: int = option(2, help="source: epochs each rank reads")
    partition: str = option("global", choices=("global", "node"),
                            help="source: the ranks' plan (node: each rank as its own node, keeping one share every "
                                 "epoch)")
    cache_dir: str | None = sections.cache_dir("source: local chunk cache for remote stores (one per rank)")
    cache_bytes: int | None = sections.cache_bytes("source: cap of each rank's cache")
    prefetch: int | None = option(None, metavar="N", help="source: units each rank reads ahead at once (the loader's "
                                                         "prefetch: on local disk, its read threads; default the "
                                                         "loader's)")


@dataclass
class BenchSettings:
    store: BenchStore = section(BenchStore, "bench store")
    run: BenchRun = section(BenchRun, "bench")
    loader: BenchLoader = section(BenchLoader, "loader")
    source: BenchSource = section(BenchSource, "source")


@dataclass
class SubsetStores:
    src: str = option(positional=True, help="the store to select from (" + STORE_URL_HELP + ")")
    dst: str = option(positional=True, help="created with the source's manifest, or an existing compatible store "
                                            "(resumed)")


@dataclass
class SubsetFilters:
    """Per-sample filters (``ops.subset.SampleFilter``)."""

    source: list[str] = option(default_factory=list, metavar="S", help="keep this source (repeatable)")
    min_length: int | None = option(None, metavar="N", old="--min-tokens", help="drop samples shorter than N tokens")
    max_length: int | None = option(None, metavar="N", old="--max-tokens", help="drop samples longer than N tokens")
    min_loss_tokens: int | None = option(None, metavar="N", help="drop samples whose loss-mask sum is below N (stub "
                                                                "answers)")
    exclude_flag: list[str] = option(default_factory=list, metavar="F",
                                     help="drop samples with this quality flag (stub_answer, empty_thinking, "
                                          "truncated, feature_zero, ...)")
    exclude_unhealthy: bool = option(False, help="drop samples whose records' statistics show a non-finite or "
                                                 "all-zero feature")
    skip_corrupt: bool = option(False, help="the salvage of a damaged store: copy every sample whose bytes verify "
                                            "and leave behind, named with their count, those a damaged chunk or a "
                                            "missing file holds (without it the first damaged read stops the copy)")


@dataclass
class SubsetSplit:
    """One side of a split (``ops.subset.Split``)."""

    fraction: float | None = option(None, metavar="F",
                                    help="a split (a validation store): of the conversations the other filters keep, "
                                         "the share F chosen by --seed (by sample id: the same on every copy of the "
                                         "store; a multi-turn row's id#tN samples stay together)")
    seed: int | None = sections.seed(None, "--fraction's choice (default 0)", metavar="N")
    ids: str | None = option(None, metavar="FILE",
                             help="a split by list: the samples whose ids FILE lists, one a line (a conversation's id "
                                  "takes all its id#tN samples)")
    complement: bool = option(False, help="the other side of the --fraction or --ids split: the kept samples it "
                                          "leaves out (the two sides share none and together hold all)")


@dataclass
class SubsetSettings:
    stores: SubsetStores = section(SubsetStores, "stores")
    filters: SubsetFilters = section(SubsetFilters, "filters")
    split: SubsetSplit = section(SubsetSplit, "split")


@dataclass
class CopyStores:
    src: str = option(positional=True, help="the store to copy (" + STORE_URL_HELP + ")")
    dst: str = option(positional=True, help="the copy: a new or empty place, or an earlier copy of SRC (resumed)")
    dst_storage_option: list[str] = _dst_storage_option()


@dataclass
class CopySettings:
    copy: CopyStores = section(CopyStores, "copy")


@dataclass
class MergeStores:
    dst: str = option(positional=True, help="created from the first source's manifest when it does not exist")
    src: list[str] = option(positional=True, nargs="+",
                            help="the stores whose committed shards are added (same target, tokenizer, taps, dtype, "
                                 "encoding, layout, chunking)")
    by: str = option("copy", choices=("copy", "reference"),
                     help="copy: shard files are copied (CRC-checked); reference: DST's commit records point at the "
                          "source stores, nothing else is copied")


@dataclass
class MergeSettings:
    merge: MergeStores = section(MergeStores, "merge")


@dataclass
class ReportPage:
    path: str = option(positional=True, metavar="PATH", help="store URL or run directory (OUT of hsstore train)")
    out: str = option(required=True, metavar="FILE.html",
                      help="the page to write: a new file, or a page `hsstore report` wrote before (replaced)")


@dataclass
class ReportSettings:
    report: ReportPage = section(ReportPage, "report")
