"""Every environment variable hsstore reads, in one table, and the one place its own (``HSSTORE_*``) are read.

Each switch has a type, a default, the people it is for (``USER``: someone running hsstore; ``TUNING``: a
deployment whose stores or network differ from the defaults' assumptions; ``BENCHMARK``: a paired measurement or
a diagnosis, not for production runs; ``TEST``: the test suite and fuzzers) and one line of meaning. Code reads a
switch through its entry (``env.MIN_RATE.get()``), never through ``os.environ``; docs/CLI.md's table is generated
from ``SWITCHES`` (``tools/cli_docs.py``), so the two cannot drift.

A value that does not parse is one ``SwitchError`` naming the variable and what it takes (the command line
prints it as one line, exit 2); an unset or empty variable is its default. ``check()`` validates every
``HSSTORE_*`` variable set (the command line calls it before a command runs) and warns, once per process, about
a name hsstore does not read: a misspelling, or a switch that has been removed (``REMOVED`` says why).

``OTHERS`` lists the variables of other programs that hsstore reads on purpose (torchrun's ranks, the AWS
endpoint, the trackers' settings, the secrets redacted from logs), where they are read, and why: the same table
in docs/CLI.md shows them beside the switches.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Callable

from .errors import StoreError

log = logging.getLogger(__name__)

PREFIX = "HSSTORE_"
USER, TUNING, BENCHMARK, TEST = "user", "tuning", "benchmark", "test"


class SwitchError(StoreError, ValueError):
    """An ``HSSTORE_*`` variable holds a value its switch does not take."""


def _prefixes(raw: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in raw.split(",") if p.strip())


def _count(raw: str) -> int:
    n = int(raw)
    if n < 1:
        raise ValueError
    return n


def _positive(raw: str) -> float:
    x = float(raw)
    if not (math.isfinite(x) and x > 0):
        raise ValueError
    return x


# kind -> (how the table names it, parser of a stripped, non-empty value)
KINDS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "prefixes": ("comma-separated URLs or paths", _prefixes),
    "count": ("positive integer", _count),
    "seconds": ("positive number (seconds)", _positive),
    "rate": ("positive number (bytes/s)", _positive),
    "choice": ("one of", str.lower),
    "path": ("path", str),
}


@dataclass(frozen=True)
class Switch:
    """One environment variable: ``kind`` (a key of ``KINDS``), ``default`` (what an unset or empty variable
    means; ``shown``: how the table writes it where the value alone does not say), ``audience`` and
    ``meaning`` (one line, for the table)."""

    name: str
    kind: str
    default: Any
    audience: str
    meaning: str
    choices: tuple[str, ...] = ()
    shown: str = ""

    def get(self) -> Any:
        """The variable's value as its type, else the default; ``SwitchError`` when it does not parse."""
        raw = os.environ.get(self.name, "").strip()
        if not raw:
            return self.default
        label, parse = KINDS[self.kind]
        try:
            value = parse(raw)
        except ValueError:
            value = None
        if value is None or (self.choices and value not in self.choices):
            takes = f"{label} {', '.join(self.choices)}" if self.choices else f"a {label}"
            raise SwitchError(f"{self.name}={raw!r}: expected {takes} (unset: {self.default_text()})")
        return value

    def type_text(self) -> str:
        label = KINDS[self.kind][0]
        return f"{label} {', '.join(self.choices)}" if self.choices else label

    def default_text(self) -> str:
        if self.shown:
            return self.shown
        if isinstance(self.default, bool):
            return str(int(self.default))
        if isinstance(self.default, float) and self.default.is_integer():
            return str(int(self.default))
        return str(self.default)


ALLOW_LOCATIONS = Switch(
    "HSSTORE_ALLOW_LOCATIONS", "prefixes", (), USER,
    "more prefixes a store merged by reference may read shards from, for every store opened (as --allow-location "
    "and hsstore.open(url, allow_locations=...) give them one command or store at a time)", shown="none")
CACHE_DIR = Switch(
    "HSSTORE_CACHE_DIR", "path", None, USER,
    "where hsstore demo and the tests keep the tiny targets they build, reused while their inputs are unchanged",
    shown="hsstore-cache in the temp dir")
# Small objects (commit records, index segments) are read many at once: latency, not bandwidth, is their cost.
# s3fs's connection pool is raised to match (botocore's default of 10 connections caps the requests in flight).
METADATA_CONCURRENCY = Switch(
    "HSSTORE_METADATA_CONCURRENCY", "count", 64, TUNING,
    "requests in flight for small-object reads and listings, and remote reads at once")
# A following reader's first pause after an arrival; the switch sets the longest (never below FOLLOW_POLL_MIN_S).
FOLLOW_POLL_FIRST_S, FOLLOW_POLL_MIN_S = 1.0, 0.01
# A deadline for every remote request (io/receive.py): a peer that trickles its bytes is cut off, never waited on.
REQUEST_S = Switch(
    "HSSTORE_REQUEST_S", "seconds", 10.0, TUNING,
    "the most seconds a remote request may wait for its answer's first byte (shorter: the fuzzers)")
MIN_RATE = Switch(
    "HSSTORE_MIN_RATE", "rate", float(256 << 10), TUNING,
    "the slowest average rate a remote answer's bytes may arrive at before it is cut off")
# An S3 request's status and headers include its wait for a pooled connection and the endpoint's queue, which
# under a burst of writes to a loaded endpoint exceeds REQUEST_S.
HEAD_S = Switch(
    "HSSTORE_HEAD_S", "seconds", 60.0, TUNING,
    "the most seconds an S3 request may wait for its status and headers (shorter: the fuzzers)")
WRITER_HEARTBEAT_S = Switch(
    "HSSTORE_WRITER_HEARTBEAT_S", "seconds", 30.0, TUNING,
    "seconds between a writer's heartbeats in writers/<key>.json (shorter: the follow tests)")
PROGRESS_S = Switch(
    "HSSTORE_PROGRESS_S", "seconds", 30.0, USER,
    "seconds between progress lines when stderr is not a terminal (a batch job's log; a terminal gets a bar)")
FOLLOW_POLL_S = Switch(
    "HSSTORE_FOLLOW_POLL_S", "seconds", 30.0, TUNING,
    "the longest pause of a following reader (train --follow) between two looks at its stores")
CONV = Switch(
    "HSSTORE_CONV", "choice", "fla", BENCHMARK,
    "torch: extraction keeps transformers' PyTorch Gated DeltaNet convolution on CUDA instead of fla's kernel "
    "(to compare, or to rule the kernel out)", choices=("fla", "torch"))
REPORT_SCREENSHOT = Switch(
    "HSSTORE_REPORT_SCREENSHOT", "path", None, TEST,
    "where tests/test_html_report.py keeps the browser's picture of a report, to look at", shown="none kept")

SWITCHES: dict[str, Switch] = {s.name: s for s in (
    ALLOW_LOCATIONS, CACHE_DIR, METADATA_CONCURRENCY, REQUEST_S, MIN_RATE, HEAD_S, WRITER_HEARTBEAT_S,
    PROGRESS_S, FOLLOW_POLL_S, CONV, REPORT_SCREENSHOT)}

# switches hsstore no longer reads, and why: a variable still set is warned about by name, never silently ignored
REMOVED: dict[str, str] = {
    PREFIX + "MAPPED_READS": "local chunks are always read with preadv into their destination",
    PREFIX + "READ_BLOCK": "reads are always checksummed block by block as they arrive",
    PREFIX + "STREAM_READS": "uncompressed S3 chunks are always streamed into their destination",
    PREFIX + "DIRECT_BATCHES": "TokenBatches always reads samples into their batch slots when the dataset can plan",
    PREFIX + "EVAL_THREADS": "eval takes --cpu-threads N, as every command that runs a model",
    PREFIX + "FEATURE_STATS": "writers always record feature statistics; StoreWriter(record_stats=False) leaves them out",
}


def get(name: str) -> Any:
    """The value of switch ``name`` (``HSSTORE_...``), as ``SWITCHES[name].get()``."""
    return SWITCHES[name].get()


@dataclass(frozen=True)
class Other:
    """A variable of another program that hsstore reads on purpose: ``where`` (the module) and ``meaning``."""

    name: str
    where: str
    meaning: str


OTHERS: tuple[Other, ...] = (
    Other("RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK", "hsstore/distributed.py, "
          "hsstore/app/devices.py, train/launch.py", "torchrun's ranks: each rank's share of the samples, its GPU "
          "and its CPU threads"),
    Other("AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL", "hsstore/io/storage.py",
          "an S3 endpoint set for botocore: named in messages, its credentials redacted"),
    Other("OMP_WAIT_POLICY", "hsstore/env.py (set, unless already set, before torch loads)",
          "PASSIVE: torch's idle OpenMP threads sleep between parallel regions instead of spinning on cores a "
          "neighbour holds"),
    Other("TRITON_CACHE_DIR", "hsstore/app/target.py", "where Triton keeps compiled kernels: an empty cache means "
          "fla's kernels compile on the first forward, which extraction says"),
    Other("WANDB_PROJECT, MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME", "train/tracking.py",
          "the trackers' own settings, for hsstore train --report-to"),
    Other("the variable --api-key-env names (default OPENAI_API_KEY)", "extract/settings.py",
          "the serving engine's API key, never written to a file or log"),
    Other("AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN and the other secrets redaction.SECRET_ENV lists",
          "hsstore/redaction.py", "their values are scrubbed from every message and log line"),
)


# OpenMP, torch's CPU thread pool, keeps its idle threads spinning for a while after each parallel region: beside a
# busy neighbour they spin on cores the neighbour holds, and every region waits for the slowest. PASSIVE makes them
# sleep at once. libgomp reads the variable once, when torch loads it.
OMP_WAIT = "OMP_WAIT_POLICY"


def passive_openmp() -> bool:
    """Ask for OpenMP's passive wait policy, unless the user chose one: before torch is imported (afterwards it is
    too late, and this returns False). Child processes (torchrun's ranks, DataLoader workers) inherit it."""
    import sys

    if "torch" in sys.modules:
        return os.environ.get(OMP_WAIT, "").upper() == "PASSIVE"
    os.environ.setdefault(OMP_WAIT, "PASSIVE")
    return True


_WARNED: set[str] = set()


def check() -> None:
    """Validate every ``HSSTORE_*`` variable set: ``SwitchError`` on the first that does not parse; a warning
    (once per name and process) for a name hsstore does not read."""
    for name in sorted(k for k in os.environ if k.startswith(PREFIX)):
        if name in SWITCHES:
            SWITCHES[name].get()
        elif name not in _WARNED:
            _WARNED.add(name)
            why = REMOVED.get(name)
            log.warning("%s is set, but hsstore does not read it (%s); unset it", name,
                        f"removed: {why}" if why else "no such switch; see docs/CLI.md, Environment variables")
