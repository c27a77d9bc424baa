"""``hsstore subset``: copy the samples of a store that pass per-sample filters into another store.

SampleFilter uses only the commit records' per-sample columns (source, length, loss tokens, flags), so
choosing costs no feature reads; the chosen samples are then read in large windows and written
bit-exact through a :class:`StoreWriter` under the source's manifest identity. Re-running resumes:
ids already committed in the destination are skipped. Filters that keep no sample are refused, and nothing is
written: an empty store trains nothing, and every later command would have to say why.

Damage costs only what it touched: every chunk (or wds member) is checked against its commit record as it is
read, and with ``skip_corrupt`` a window that fails is read again sample by sample, so every sample whose bytes
verify is copied and those a damaged chunk or a missing file holds are left behind and named
(``SubsetResult.corrupt``): the salvage of a damaged store. ``skip_corrupt`` is the loader's name for the same
choice (``Reading.skip_corrupt``). A read that fails after the client's retries (``FetchError``) is never taken
for damage.

A :class:`Split` cuts the samples the filters keep in two (a validation store and the rest): a seeded
fraction of them or the ids of a list, or (``complement``) the others. It chooses conversations, not samples:
the samples of one multi-turn row (``{id}#t{k}``, docs/FORMAT.md) share their earlier turns, so they go to one
side together.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

from ..format import assets, codec, health
from ..layouts import base as layout
from ..io import destination, door, storage
from .stats import SAMPLE_FLAGS
from ..format.manifest import Manifest, check_compatible, read_manifest
from ..store.reader import Store, committed_ids
from ..redaction import recordable_url
from ..errors import CorruptionError, StoreError
from ..store.writer import DEFAULT_SHARD_BYTES, StoreWriter

log = logging.getLogger(__name__)
WINDOW_BYTES = 256 << 20


@dataclass(frozen=True)
class SampleFilter:
    """Per-sample filters; a sample is kept when it passes all of them (unset filters pass). ``min_length`` and
    ``max_length`` are tokens, as ``subset --min-length`` and the loader's ``Selection.min_length`` count them."""

    sources: tuple[str, ...] = ()
    min_length: int | None = None
    max_length: int | None = None
    min_loss_tokens: int | None = None
    exclude_flags: tuple[str, ...] = ()
    exclude_unhealthy: bool = False  # drop samples with a non-finite or all-zero feature (``health.unhealthy``)
    ids: frozenset[str] | None = None  # keep only these sample ids (a split's side, ``Split.side``)

    def describe(self) -> str:
        """The filters set, as the flags of ``hsstore subset`` that set them."""
        parts = [f"--source {x}" for x in self.sources] + [f"--exclude-flag {x}" for x in self.exclude_flags]
        parts += [f"--{name.replace('_', '-')} {value}" for name, value in (
            ("min_length", self.min_length), ("max_length", self.max_length),
            ("min_loss_tokens", self.min_loss_tokens)) if value is not None]
        parts += ["--exclude-unhealthy"] * self.exclude_unhealthy + ["a split's side"] * (self.ids is not None)
        return " ".join(parts) or "none"

    def keeps(self, cols: dict[str, list], i: int) -> bool:
        n, loss = cols["length"][i], cols["loss_tokens"][i]
        return ((self.ids is None or cols["sample_id"][i] in self.ids)
                and (not self.sources or cols["source"][i] in self.sources)
                and (self.min_length is None or n >= self.min_length)
                and (self.max_length is None or n <= self.max_length)
                and (self.min_loss_tokens is None or loss >= self.min_loss_tokens)
                and not (self.exclude_flags and set(cols["flags"][i]) & set(self.exclude_flags)))


def _selection(**kwargs: Any) -> SampleFilter:
    """``Selection(min_tokens=...)``, this module's old spelling of :class:`SampleFilter` (the loader's
    ``Selection`` is another thing): still made, with a DeprecationWarning."""
    old = {"min_tokens": "min_length", "max_tokens": "max_length"}
    warnings.warn("hsstore.ops.subset.Selection is now SampleFilter (min_tokens/max_tokens: min_length/max_length)",
                  DeprecationWarning, stacklevel=2)
    return SampleFilter(**{old.get(k, k): v for k, v in kwargs.items()})


def __getattr__(name: str) -> Any:
    if name == "Selection":
        return _selection
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def select(store: Store, sel: SampleFilter, skip_ids: set[str] = frozenset()) -> list[tuple[int, int, int]]:
    """Windows ``(shard_index, first, stop)`` of consecutive kept samples, each at most about
    ``WINDOW_BYTES`` of features (the unit :meth:`Store.iter_windows` reads in one go). A shard whose samples
    ``sel`` drops is admitted (``Store.admit_shard``: its columns are its record's) before they decide; a kept one
    is when it is read."""
    m = store.manifest
    token_bytes = codec.token_bytes(m.dtype, m.encoding, len(store.layers), m.hidden_size)
    out = []
    t = store.table
    for s in range(len(t)):  # the records' columns: no record is parsed
        cols, run, run_tokens, n, kept = t.sample_columns(s), None, 0, int(t.n_samples[s]), 0
        if n == 0:  # columns listing no sample decide too (none of its samples is copied): admitted first
            store.admit_shard(store.commits[s])
        for i in range(n + 1):
            keep = i < n and cols["sample_id"][i] not in skip_ids and sel.keeps(cols, i)
            kept += keep
            if run is not None and (not keep or run_tokens * token_bytes >= WINDOW_BYTES):
                out.append((s, run, i))
                run, run_tokens = None, 0
            if keep:
                run = i if run is None else run
                run_tokens += cols["length"][i]
        if kept < n:
            store.admit_shard(store.commits[s])
    return out


IDS_CAP = 256 << 20  # an --ids file: one sample id a line (a million ids of ~100 bytes is 100 MB)
_TURN = re.compile(r"#t[0-9]+$")  # a multi-turn row's sample: ``{id}#t{k}``


def conversation_of(sample_id: str) -> str:
    """The row a sample came from: ``conv#t2`` -> ``conv``; an id without a turn suffix is its own row."""
    return _TURN.sub("", sample_id)


def read_ids(path: str) -> frozenset[str]:
    """The sample (or conversation) ids of an --ids file: one a line, blank lines ignored."""
    data = door.read_file(path, bound=IDS_CAP, where="--ids")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"--ids {path}: not UTF-8 text (byte {e.start}): one sample id a line") from None
    ids = frozenset(line.strip() for line in text.splitlines() if line.strip())
    if not ids:
        raise ValueError(f"--ids {path}: no ids (one sample id a line)")
    return ids


def _digest(seed: int, conversation: str) -> bytes:
    return hashlib.blake2b(f"{seed}\0{conversation}".encode("utf-8", "surrogatepass"), digest_size=8).digest()


@dataclass(frozen=True)
class Split:
    """One side of a split of the samples the filters keep. ``fraction``: the ``round(fraction x n)`` of their n
    conversations whose BLAKE2b-64 digest of ``seed`` and conversation id is smallest (the same choice on every
    copy of a store, whatever its shards or order); ``ids``: the listed sample ids, a listed conversation id taking
    all its samples; ``complement``: the other samples. The two sides share nothing and hold every kept sample."""

    fraction: float | None = None
    seed: int = 0
    ids: frozenset[str] | None = None
    complement: bool = False

    def __post_init__(self) -> None:
        if (self.fraction is None) == (self.ids is None):
            raise ValueError("a split is --fraction F or --ids FILE (one of them)")
        if self.fraction is not None and not 0 < self.fraction < 1:
            raise ValueError(f"--fraction {self.fraction}: a share between 0 and 1 (e.g. 0.05)")

    def side(self, kept: list[str]) -> tuple[frozenset[str], int]:
        """(the sample ids of this side, of ``kept``; how many listed ids matched no kept sample)."""
        rows: dict[str, list[str]] = {}
        for sid in kept:
            rows.setdefault(conversation_of(sid), []).append(sid)
        unmatched = 0
        if self.ids is not None:
            chosen = {sid for sid in kept if sid in self.ids or conversation_of(sid) in self.ids}
            known = set(kept)
            unmatched = sum(1 for x in self.ids if x not in known and x not in rows)
            if not chosen:
                raise ValueError(f"none of the {len(self.ids)} ids of --ids is a sample (or conversation) id of the "
                                 f"{len(kept)} samples the filters keep")
        else:
            k = round(self.fraction * len(rows))
            if not 0 < k < len(rows):
                raise ValueError(f"--fraction {self.fraction} of the {len(rows)} conversation(s) the filters keep is "
                                 f"{k}: each side of the split needs at least one")
            picked = sorted(rows, key=lambda c: (_digest(self.seed, c), c))[:k]
            chosen = {sid for c in picked for sid in rows[c]}
        return frozenset(set(kept) - chosen if self.complement else chosen), unmatched

    def describe(self) -> dict[str, Any]:
        """The split as the destination's manifest records it (``extra.split``)."""
        how = {"fraction": self.fraction, "seed": self.seed} if self.ids is None else {"ids": len(self.ids)}
        return {**how, "complement": self.complement}


def destination_manifest(src: Manifest, fs, root: str, dst_url: str, note: dict) -> Manifest:
    """The source's manifest for a derived store (same identity, chunking and codec); an existing destination
    must be compatible."""
    out = dataclasses.replace(src, created_by="", created_at="", extra={**src.extra, **note})
    if storage.store_exists(fs, root, dst_url):  # an existing destination keeps its own layout and chunking
        have = read_manifest(fs, root, dst_url)
        check_compatible(have, src, f"destination {dst_url!r}", "the source")
        out = dataclasses.replace(out, layout=have.layout, codec=have.codec, chunk_tokens=have.chunk_tokens)
    return out


def copy_assets_if_missing(src: Store, dst_fs, dst_root: str) -> None:
    """Give the destination the source's trainer assets (embedding, lm_head, tokenizer) when it has none."""
    if assets.has_assets(src.fs, src.root) and not assets.has_assets(dst_fs, dst_root):
        assets.copy_assets(src.fs, src.root, dst_fs, dst_root, url=src.url)


def check_flags(store: Store, flags: tuple[str, ...]) -> None:
    """Refuse a flag name that no writer records and the store does not hold: a typo (``stub_answers``)
    would otherwise exclude nothing, silently."""
    fl = store.table.flags
    known = set(SAMPLE_FLAGS) | {f for c in set(fl.codes.tolist()) for f in fl.values[c]}
    unknown = [f for f in flags if f not in known]
    if unknown:
        raise ValueError(f"unknown flag(s) {', '.join(map(repr, unknown))}: flags are {', '.join(sorted(known))}")


@dataclass
class SubsetResult:
    selected: int = 0
    written: int = 0
    tokens: int = 0
    already: int = 0
    kept: int = 0  # samples the filters keep, before a split took its side
    unmatched_ids: int = 0  # --ids: listed ids that are no kept sample's (nor its conversation's)
    corrupt: list[str] = field(default_factory=list)  # skip_corrupt: the ids left behind, their bytes do not verify


class EmptyResult(StoreError, ValueError):
    """A subset that would hold no sample: refused, nothing written."""


def subset(src_url: str, dst_url: str, sel: SampleFilter, *, src_options: dict[str, Any] | None = None,
           dst_options: dict[str, Any] | None = None, shard_bytes: int = DEFAULT_SHARD_BYTES,
           progress: bool = True, split: Split | None = None, skip_corrupt: bool = False) -> SubsetResult:
    """Copy the samples of ``src_url`` that ``sel`` keeps (``split``: its side of them) into ``dst_url``
    (created, or resumed); ``skip_corrupt``: leave behind (and name) the samples whose bytes do not verify instead
    of stopping at the first."""
    dst_options = dst_options or {}
    # anon=true and a folder that is not a store refused before any request
    fs, root = destination.open_destination(dst_url, dst_options, layout.own_objects())
    src = Store(src_url, src_options)
    src.admit()  # the admission's store-wide rules, before the destination gets a byte
    check_flags(src, sel.exclude_flags)
    # one subset at a time into a destination: two would each find no sample committed and copy every one
    with destination.hold_lock(fs, root, dst_url, "subset"):
        try:
            return _subset(src, fs, root, dst_url, sel, dst_options, shard_bytes, progress, split, skip_corrupt)
        except CorruptionError as e:  # the one line that stops the copy says how to copy what is still good
            if skip_corrupt:
                raise
            raise CorruptionError(f"{e}; run it again with --skip-corrupt to copy every sample whose bytes verify "
                                  f"(`hsstore verify {recordable_url(src_url)}` names the damaged ones)") from None


def kept_ids(store: Store, sel: SampleFilter, skip_ids: set[str]) -> list[str]:
    """The sample ids ``sel`` keeps, in store order."""
    t = store.table
    return [sid for s, i, j in select(store, sel, skip_ids)
            for sid in t.sample_id.slice(int(t.first[s]) + i, int(t.first[s]) + j)]


def _subset(src: Store, fs, root: str, dst_url: str, sel: SampleFilter, dst_options: dict[str, Any], shard_bytes: int,
            progress: bool, split: Split | None = None, skip_corrupt: bool = False) -> SubsetResult:
    from ..progress import progress_bar

    src_url = src.url
    note: dict[str, Any] = {"subset_of": recordable_url(src_url)}
    done = committed_ids(dst_url, dst_options)
    sick = {u.sample_id for u in health.unhealthy(src)} if sel.exclude_unhealthy else set()
    kept, unmatched = None, 0
    if split is not None:  # chosen among every kept sample, whatever this destination holds already
        kept = kept_ids(src, sel, sick)
        side, unmatched = split.side(kept)
        sel = dataclasses.replace(sel, ids=side)
        note["split"] = split.describe()
    manifest = destination_manifest(src.manifest, fs, root, dst_url, note)
    all_kept = select(src, sel, skip_ids=sick)
    windows = select(src, sel, skip_ids=done | sick)
    result = SubsetResult(selected=sum(j - i for _, i, j in all_kept), unmatched_ids=unmatched)
    result.kept = result.selected if kept is None else len(kept)
    result.already = result.selected - sum(j - i for _, i, j in windows)
    if not result.selected:
        raise EmptyResult(f"the filters ({sel.describe()}) keep none of the {len(src)} samples of "
                          f"{recordable_url(src.url)}: nothing written")
    if not windows:
        log.info("subset: nothing to copy (%d selected, all already in %s)", result.selected, recordable_url(dst_url))
        return result
    total = sum(int(src.commits[s].offsets[j] - src.commits[s].offsets[i]) for s, i, j in windows)
    writer: StoreWriter | None = None  # made at the first sample that verifies: a salvage of nothing writes nothing
    with progress_bar(total=total, unit="tok", unit_scale=True, desc="subset", disable=not progress) as bar:
        try:
            for (sample_id, ids, mask, feats, scales), cols, k in verified(src, windows, skip_corrupt, result.corrupt):
                if writer is None:
                    writer = StoreWriter(dst_url, manifest, writer_tag="subset", storage_options=dst_options,
                                         shard_bytes=shard_bytes)
                    copy_assets_if_missing(src, writer.fs, writer.root)
                T = int(ids.shape[0])
                writer.add_stored(sample_id, ids, mask, feats, scales, source=cols["source"][k],
                                  thinking_tokens=cols["thinking_tokens"][k], flags=cols["flags"][k])
                result.written += 1
                result.tokens += T
                bar.update(T)
            if writer is not None:
                writer.close()
        except BaseException:
            if writer is not None:
                writer.close(commit=False)
            raise
    if not result.written and not result.already:
        raise EmptyResult(f"none of the {result.selected} samples selected from {recordable_url(src.url)} "
                          "has bytes that verify (`hsstore verify` names the damage): nothing written")
    return result


def verified(src: Store, windows: list[tuple[int, int, int]], skip_corrupt: bool, lost: list[str]):
    """``((sample_id, ids, mask, features, scales), the record's columns, the sample's index in them)`` of every
    sample of ``windows`` in order, as the store holds it (each chunk checked against its record as it is read).
    ``skip_corrupt``: a window whose read fails is read again sample by sample; the samples whose bytes do not
    verify are left out and their ids appended to ``lost``. Otherwise the first failure is raised."""
    features = src.manifest.all_features
    rest = list(windows)
    while rest:
        done = 0  # samples of ``rest`` handed out
        try:
            for stored, (cols, k) in zip(src.iter_stored(rest, features), _columns(src, rest)):
                yield stored, cols, k
                done += 1
            return
        except CorruptionError:
            if not skip_corrupt:
                raise
        w = 0
        while done >= rest[w][2] - rest[w][1]:  # the window that failed: the first not handed out whole
            done -= rest[w][2] - rest[w][1]
            w += 1
        s, i, j = rest[w]
        cols = src.commits[s].samples
        for k in range(i + done, j):
            try:
                (stored,) = src.iter_stored([(s, k, k + 1)], features)
            except CorruptionError as e:
                log.info("subset: left behind, its bytes do not verify: %s", e)
                lost.append(cols["sample_id"][k])
                continue
            yield stored, cols, k
        rest = rest[w + 1:]


def _columns(store: Store, windows):
    """(commit-record columns, local index) of every sample of ``windows``, in order."""
    for s, i, j in windows:
        for k in range(i, j):
            yield store.commits[s].samples, k
