"""The admission: the structural rules of a store's metadata, in one place, for ``verify`` and every reader.

What ``verify`` refuses no reader may serve, so the rules a store's metadata must keep are defined once, here, and
applied by both: ``verify`` collects every breach (``Breach``) into its report; a reader (``Store.admit``,
``Store.admit_shard``: ``show``, the loader, ``train``, ``eval``, ``subset``, ``copy``, ``merge``, ``convert``,
``export``) refuses at the first one, in one line naming the shard and the rule (``AdmissionRefused``); ``info``
describes the store with the verdict first.

The rules cost no request of their own. The store's are checked on the columns an open store already holds
(``records.RecordTable``: the index's copies or the records read), vectorised, so ``info``'s path stays O(1) in
requests and about linear in samples at numpy speed:

- ``record``: every commit record listed parses, each field of its type (a damaged one is named with its field);
- ``counts``: each shard's sample lengths add up to its token count;
- ``non-empty``: every sample has at least one token;
- ``bounds``: a sample's loss and thinking tokens lie within its length;
- ``grid``: each shard was cut on the manifest's chunk grid and holds exactly the manifest's features;
- ``manifest``: each shard was written under this manifest (its ``manifest_key``);
- ``session``: each shard's name is its writer's (``<writer>-<session>-<sequence>``);
- ``unique-ids``: every sample id once in the store;
- ``lookalike-ids``: no two ids a person cannot tell apart (the same once invisible characters are removed).

A shard's own rules run on its commit record when a reader first touches the shard (it parses the record then
anyway): ``index``, the record's index entry says what the record says (``records.Records``: a forged column never
decides what is read); ``names``, every name it holds is one readers follow (``names.record_problems``); and
``extent``, the layout's check that the record's tokens and sample boundaries are what its files hold
(``Layout.check_extent``: a zarr record's lengths against the payload checksum it lists for its ``offsets`` chunk,
or, where a record lists no such checksum (format version 1), against its ``offsets`` array read then (one small
object); a wds record's against the members it lists), so boundaries shifted inside a record are refused before
a feature byte is read. The loss_mask a reader reads anyway is held to the record's ``loss_tokens`` per sample
served as well (``served_problem``), so a record's loss tokens that its mask does not hold are refused; the rule is
one function, ``loss_disagreements`` (vectorised over a shard's samples), which ``verify`` applies too
(``loss_mask_problem``, both layouts). What copies a shard whole (``convert``) holds every sample of it so before
writing any (``Store.check_shard``), what hands a shard's files on as they are (``merge``, ``copy``) reads its
loss_mask alone first (``Store.check_loss_tokens``: ``Layout.read_loss_mask``), and a scan's window is held so
before any of it is handed on. Also ``verify``'s alone: bytes readers never read (a
file's checksum over its whole object, a tar's bytes outside its listed members).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from . import names
from .commit import COMMITS_DIR, CommitRecord
from .manifest import Manifest
from .records import RecordTable, Strings
from .report import Problem
from ..errors import CorruptionError
from ..terminal import lookalike_refusal, visible_key

RULES = {
    "record": "every commit record listed parses, each field of its type",
    "counts": "a shard's sample lengths add up to its token count",
    "non-empty": "every sample has at least one token",
    "bounds": "a sample's loss and thinking tokens lie within its length",
    "grid": "a shard is cut on the manifest's chunk grid and holds exactly the manifest's features",
    "manifest": "a shard was written under the store's manifest",
    "session": "a shard's name is its writer's",
    "unique-ids": "every sample id once in the store",
    "lookalike-ids": "no two sample ids differ only by invisible characters",
    "index": "an index entry says what its commit record says",
    "names": "every name a record holds is one readers follow",
    "extent": "a record's tokens and sample boundaries are what its files hold",
    "served": "a served sample's loss_mask adds up to its record's loss tokens",
}
SHOWN = 20  # breaches of one rule named one by one; the rest counted


@dataclass(frozen=True)
class Breach:
    """One rule a store's metadata breaks: the shard (or ``(samples)`` for ids across shards), the rule (a key of
    ``RULES``), what breaks it, and the file (and field) at fault where there is one."""

    shard: str
    rule: str
    detail: str
    file: str = ""

    def problem(self) -> Problem:
        """The breach as ``verify`` and ``info`` report it, the rule named."""
        return Problem(self.shard, f"{self.detail} (rule {self.rule!r})", self.file or None)


class AdmissionRefused(CorruptionError):
    """A reader's refusal: the store or shard breaks a rule of the admission (``verify`` names every breach)."""


def refusal(url: str, b: Breach) -> AdmissionRefused:
    """The one line a reader stops with."""
    where = f", {b.file}" if b.file else ""
    return AdmissionRefused(f"store {url!r}, shard {b.shard!r}{where}: refused by rule {b.rule!r} ({b.detail}); "
                   "`hsstore verify` names every problem")


def damaged_record(shard: str, why: str) -> Breach:
    """A commit record that does not parse (``why`` names the field)."""
    return Breach(shard, "record", why, f"{COMMITS_DIR}/{shard}.json")


# -- the store's rules, on its columns --------------------------------------------------------------------------
def table_breaches(t: RecordTable, m: Manifest, damaged: dict[str, str] | None = None) -> Iterator[Breach]:
    """Every breach of the store-wide rules in the columns of ``t`` (``damaged``: shard -> why, its record does not
    parse), rule by rule, at most ``SHOWN`` of a rule named one by one."""
    for shard, why in sorted((damaged or {}).items()):
        yield damaged_record(shard, why)
    if not len(t):
        return
    n_samples = np.diff(t.first)
    length = t.samples["length"]
    row = np.repeat(np.arange(len(t)), n_samples)  # each sample's shard row
    sums = np.bincount(row, weights=length, minlength=len(t)) if len(length) else np.zeros(len(t))
    yield from _rows(t, np.flatnonzero((sums != t.n_tokens) | (n_samples != t.n_samples)), "counts",
                     lambda i: f"sample lengths add up to {int(sums[i]):,} tokens, n_tokens says {int(t.n_tokens[i]):,}")
    yield from _samples(t, row, np.flatnonzero(length < 1), "non-empty",
                        lambda k: f"sample {t.sample_id[k]!r} has {int(length[k])} tokens")
    over = (t.samples["loss_tokens"] > length) | (t.samples["thinking_tokens"] > length)
    yield from _samples(t, row, np.flatnonzero(over), "bounds",
                        lambda k: f"sample {t.sample_id[k]!r}: {int(t.samples['loss_tokens'][k])} loss and "
                                  f"{int(t.samples['thinking_tokens'][k])} thinking tokens in {int(length[k])}")
    yield from _rows(t, np.flatnonzero(t.ints["chunk_tokens"] != m.chunk_tokens), "grid",
                     lambda i: f"chunk_tokens {int(t.ints['chunk_tokens'][i])}, the manifest's {m.chunk_tokens}")
    feats = [str(f) for f in m.all_features]
    want = np.array([s in feats for s in t.slots], bool)
    held = t.layer_stored >= 0
    short = ~held[:, want].all(axis=1) if want.sum() == len(feats) else np.ones(len(t), bool)
    yield from _rows(t, np.flatnonzero(short | held[:, ~want].any(axis=1)), "grid",
                     lambda i: f"features {[s for j, s in enumerate(t.slots) if held[i, j]]}, the manifest's {feats}")
    key = m.shard_key()
    odd = np.array([bool(v) and v != key for v in t.manifest_key.values] or [False])
    yield from _rows(t, np.flatnonzero(odd[t.manifest_key.codes]), "manifest",
                     lambda i: "written under another manifest: manifest.json was changed after this shard was "
                               "committed (layers, dtype, hashes, codec or chunk grid)")
    yield from _rows(t, np.flatnonzero(~_named_by_writer(t)), "session",
                     lambda i: f"the name is not of its writer {t.writer[i]!r} (<writer>-<session>-<sequence>)")
    yield from _repeated(t, row)
    yield from _lookalikes(t, row)


def _rows(t: RecordTable, bad: np.ndarray, rule: str, detail: Callable[[int], str]) -> Iterator[Breach]:
    for i in bad[:SHOWN].tolist():
        yield Breach(t.shard[i], rule, detail(i), f"{COMMITS_DIR}/{t.shard[i]}.json")
    if len(bad) > SHOWN:
        yield Breach("(shards)", rule, f"{len(bad):,} shards break it in all")


def _samples(t: RecordTable, row: np.ndarray, bad: np.ndarray, rule: str, detail: Callable[[int], str]
             ) -> Iterator[Breach]:
    for k in bad[:SHOWN].tolist():
        yield Breach(t.shard[int(row[k])], rule, detail(k), f"{COMMITS_DIR}/{t.shard[int(row[k])]}.json")
    if len(bad) > SHOWN:
        yield Breach("(samples)", rule, f"{len(bad):,} samples break it in all")


def _named_by_writer(t: RecordTable) -> np.ndarray:
    """Per shard row: whether its name starts with ``<its writer>-`` (bytes compared in place, one writer at a
    time: a store has few)."""
    ok = np.zeros(len(t), bool)
    start, size = t.shard.off[:-1], np.diff(t.shard.off)
    for code, writer in enumerate(t.writer.values):
        rows = np.flatnonzero(t.writer.codes == code)
        prefix = np.frombuffer((str(writer) + "-").encode(), np.uint8)
        fits = rows[size[rows] > len(prefix)]
        same = np.ones(len(fits), bool)
        for j, byte in enumerate(prefix.tolist()):
            same &= t.shard.blob[start[fits] + j] == byte
        ok[fits[same]] = True
    return ok


_MIX = np.uint64(0x9E3779B97F4A7C15)


def id_hashes(ids: Strings) -> np.ndarray:
    """A 64-bit hash of each string of ``ids`` from its length and up to eight 8-byte words spread over it (as many
    as the longest id needs to cover every byte, up to 64 bytes), all rows at once: equal ids hash equal; unequal
    ones almost never do, and ``_repeated`` compares the strings of equal hashes."""
    off = ids.off
    lens = np.diff(off)
    buf = np.zeros(len(ids.blob) + 8, np.uint8)
    buf[:len(ids.blob)] = ids.blob
    words = np.ndarray((len(buf) - 7,), "<u8", buf, 0, (1,))  # the 8 bytes at every offset
    start, span = off[:-1], np.maximum(lens - 8, 0)
    short = np.minimum(lens, 8).astype(np.uint64) * np.uint64(8)
    keep = np.where(short >= 64, ~np.uint64(0), (np.uint64(1) << (short % np.uint64(64))) - np.uint64(1))
    h = lens.astype(np.uint64) * _MIX
    n_words = int(min(8, max(2, -(-int(lens.max(initial=0)) // 8))))
    for k in range(n_words):
        w = words[start + span * k // (n_words - 1)]
        h = (h ^ (w & keep)) * _MIX  # an id shorter than a word: its own bytes only
        h ^= h >> np.uint64(29)
    return h


def _repeated(t: RecordTable, row: np.ndarray) -> Iterator[Breach]:
    """``unique-ids``: ids held more than once, each named with the shards that hold it."""
    n = len(t.sample_id)
    if n < 2:
        return
    h = id_hashes(t.sample_id)
    hs = np.sort(h)
    twice = hs[1:][hs[1:] == hs[:-1]]
    if not len(twice):
        return
    where: dict[str, list[int]] = {}
    for k in np.flatnonzero(np.isin(h, twice)).tolist():  # rows of a repeated hash: their strings compared
        where.setdefault(t.sample_id[k], []).append(k)
    repeated = {sid: ks for sid, ks in where.items() if len(ks) > 1}
    for sid, ks in list(repeated.items())[:SHOWN]:
        shards = sorted({t.shard[int(row[k])] for k in ks})
        yield Breach(shards[0], "unique-ids", f"sample id {sid!r} is held {len(ks)} times (shards "
                                              f"{', '.join(shards[:4])}): ids must be unique in a store")
    if len(repeated) > SHOWN:
        yield Breach("(samples)", "unique-ids", f"{len(repeated):,} sample ids are repeated in all")


def _lookalikes(t: RecordTable, row: np.ndarray) -> Iterator[Breach]:
    """``lookalike-ids``: groups of distinct ids with one ``visible_key``, each named with the shards that hold it.
    Only an id holding a byte outside printable ASCII can have an invisible character, so a store of plain ids costs
    one vectorised pass over the id bytes; the keys of the others are hashed together with every id (one column,
    so one hash) to find their plain partners."""
    ids = t.sample_id
    odd = np.flatnonzero((ids.blob >= 0x7F) | (ids.blob < 0x20))
    if not len(odd):
        return
    keyed: dict[str, list[int]] = {}
    for k in np.unique(np.searchsorted(ids.off, odd, side="right") - 1).tolist():
        sid = ids[k]
        key = visible_key(sid)
        if key != sid:
            keyed.setdefault(key, []).append(k)
    if not keyed:
        return
    keys = Strings.of(list(keyed))
    both = Strings(np.concatenate([ids.blob, keys.blob]), np.concatenate([ids.off, keys.off[1:] + ids.off[-1]]))
    h = id_hashes(both)
    for k in np.flatnonzero(np.isin(h[:len(ids)], h[len(ids):])).tolist():
        sid = ids[k]
        if sid in keyed:
            keyed[sid].append(k)
    groups = [ks for ks in keyed.values() if len({ids[k] for k in ks}) > 1]
    for ks in groups[:SHOWN]:
        plain, *others = sorted({ids[k] for k in ks}, key=len)
        shards = sorted({t.shard[int(row[k])] for k in ks})
        yield Breach(shards[0], "lookalike-ids", lookalike_refusal(others[0], plain, "held too") + " (shards "
                     + ", ".join(shards[:4]) + ")")
    if len(groups) > SHOWN:
        yield Breach("(samples)", "lookalike-ids", f"{len(groups):,} groups of sample ids differ only by invisible "
                                                   "characters in all")


# -- a shard's rules, on its record ------------------------------------------------------------------------------
def shard_breaches(rec: CommitRecord, extent: Callable[[CommitRecord], None]) -> Iterator[Breach]:
    """The breaches of a shard's own rules in its parsed record (the ``index`` rule is the parse's:
    ``records.Records``): its names, then the layout's ``extent`` (a ``Layout.check_extent`` bound to the store's
    shard source; it raises ``CorruptionError``), which runs only on a record whose names are safe."""
    bad = names.record_problems(rec)
    for key, why in bad:
        yield Breach(rec.shard, "names", f"unsafe name, not followed: {why}", key)
    if bad:
        return
    try:
        extent(rec)
    except CorruptionError as e:
        yield Breach(rec.shard, "extent", str(e), f"{COMMITS_DIR}/{rec.shard}.json")


# -- a sample's loss tokens, held to its loss_mask -----------------------------------------------------------------
LOSS_DISAGREEMENT = "loss_mask sums disagree with the commit record"


def loss_tokens_held(mask: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Each sample's loss tokens as its loss_mask holds them: sample ``k``'s tokens are
    ``mask[offsets[k]:offsets[k + 1]]`` and its loss tokens those not 0 (readers serve the mask as bool). One
    prefix count for every sample at once; a span past the mask counts what the mask holds of it."""
    held = np.concatenate(([0], np.cumsum(np.asarray(mask) != 0, dtype=np.int64)))
    ends = np.clip(np.asarray(offsets, np.int64), 0, len(held) - 1)
    return held[ends[1:]] - held[ends[:-1]]


def loss_disagreements(loss_tokens: Sequence[int] | np.ndarray, mask: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """The samples (indices) whose loss_mask does not hold the ``loss_tokens`` their record says (their boundaries
    are not where the record puts them), or holds a value other than 0 and 1 (which no writer writes: a reader serves
    it as 1, a peer that reads the bytes as weights would not). The one rule behind ``verify`` (both layouts: ``loss_mask_problem``), a
    sample read for serving (``served_problem``) and a shard handed on whole (``Store.check_shard``)."""
    counts = loss_tokens_held(mask, offsets) != np.asarray(loss_tokens, np.int64)
    over = np.asarray(mask) > 1
    if over.any():  # (a second prefix count only where such a byte is: the served path asks this of every sample)
        counts |= loss_tokens_held(over, offsets) > 0
    return np.flatnonzero(counts)


def loss_mask_problem(rec: CommitRecord, mask: np.ndarray, key: str, samples: range | None = None) -> Problem | None:
    """``verify``'s problem, naming the samples, when samples ``samples`` of ``rec`` (default: all) break the rule of
    ``loss_disagreements``; ``mask`` holds their tokens, from the first one's on (``key``: the file it came from)."""
    k = range(rec.n_samples) if samples is None else samples
    off = np.concatenate(([0], np.cumsum(np.asarray(rec.samples["length"][k.start:k.stop], np.int64))))
    bad = loss_disagreements(rec.samples["loss_tokens"][k.start:k.stop], mask, off)
    if not len(bad):
        return None
    return Problem(rec.shard, LOSS_DISAGREEMENT, key, [rec.samples["sample_id"][k.start + int(j)] for j in bad])


def served_problem(loss_tokens: int, mask: np.ndarray) -> str | None:
    """Why a sample read for serving is not the record's (None: it is): its loss_mask, read anyway, must hold the
    record's ``loss_tokens`` for it (``loss_disagreements``), else its boundaries are not where the record puts
    them."""
    whole = np.array([0, len(mask)])
    if not len(loss_disagreements([loss_tokens], mask, whole)):
        return None
    got = int(loss_tokens_held(mask, whole)[0])
    if got == loss_tokens:
        return f"its loss_mask holds a value other than 0 and 1 ({int(np.max(mask))})"
    return (f"its loss_mask holds {got} loss tokens, its commit record says {loss_tokens} (sample boundaries not "
            "where the record puts them)")
