"""Feature health: what the stored values look like, so a store that trains nothing is loud (docs/FORMAT.md,
"Feature statistics").

Checksums prove the bytes are the bytes written; they say nothing of the values. vLLM's extraction returned
all-zero hidden states on hybrid targets for months, speculators' older generator wrong ones at batch > 1, and
drafters trained on them "converged". So every commit record carries, per feature (a tapped layer or
``final_hidden``), the count, sum, sum of squares, max |x|, exact zeros and non-finite values of the shard, and
per sample the RMS, zeros and non-finite values: ``sample_stats`` computes them (on the GPU during extraction,
from the data on import, convert, subset and upgrade), ``shard_stats`` turns a shard's samples into the record's
``stats["features"]``. The rules read them back: ``record_problems`` (a non-finite value; a feature all zero for a
sample with loss tokens) for ``verify``, ``train`` and ``import``, ``outliers`` (a shard's RMS 10x from the
store's median, a zero-dominated feature) for ``info`` and ``report``. ``ValueTally`` counts zeros and non-finite
values from the bytes ``verify`` reads anyway, so a record's statistics are never taken on trust.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

SUMS = ("sum", "sumsq", "absmax", "zeros", "nonfinite")  # the per-sample columns of ``sample_stats``
OUTLIER_FACTOR = 10.0  # a shard's feature RMS this far from the store's median, either way, is named
ZERO_DOMINATED = 0.5  # a feature whose share of exact zeros in a shard exceeds this is named
# the bit patterns of an exact zero (sign aside) and of a non-finite value (exponent all ones), per storage dtype
_BITS = {"bfloat16": (np.uint16, 0x7FFF, 0x7F80), "float16": (np.uint16, 0x7FFF, 0x7C00),
         "float32": (np.uint32, 0x7FFFFFFF, 0x7F800000), "float8_e4m3fn": (np.uint8, 0x7F, 0x7F)}
# decoded values (float32) whose magnitude reaches these round to infinity in the store's dtype, which readers decode
# into: an encoded row can hold scales whose product is finite in float32 yet past bfloat16's largest value
FINITE_BELOW = {"bfloat16": float(np.array(0x7F7F8000, np.uint32).view(np.float32)), "float16": 65520.0,
                "float32": math.inf}


def feature_name(key: str) -> str:
    """How a feature is named to a person: ``layer 16``, ``final_hidden``."""
    return f"layer {key}" if str(key).lstrip("-").isdigit() else str(key)


def feature_key(feature: int | str) -> str:
    """A feature's key in a record's statistics: a layer id as text, a named feature as its name."""
    return str(feature)


def sample_stats(values) -> np.ndarray:
    """``[features, 5]`` float64 (``SUMS``) of one sample's features ``[T, features, H]`` (a torch tensor on any
    device, or a numpy array of float values): ``batch_stats`` of a batch of one, only the small result crossing
    to the host."""
    import torch

    x = torch.as_tensor(values)
    return batch_stats(x, [x.shape[0]])[0].double().cpu().numpy()


def batch_stats(packed, lengths: Sequence[int], scales=None):
    """``sample_stats`` of each sample of a packed batch ``[sum(lengths), features, H]``, on its device: a
    ``[samples, features, 5]`` float32 tensor, so a batch's statistics cross to the host in one small copy.
    With ``scales`` ``[sum(lengths), features]``, ``packed`` holds fp8 values and the statistics are those of
    ``values * scales``, what the store holds (values that round to zero in e4m3 are zeros there too), without
    making that product: each token's sums are scaled by its scale (sum), its square (sum of squares)."""
    import torch

    x = packed.to(torch.bfloat16) if scales is not None else packed  # e4m3 -> bf16 is exact
    finite = torch.isfinite(x)
    clean = torch.where(finite, x, torch.zeros((), dtype=x.dtype, device=x.device))
    per_token = torch.stack([clean.sum(dim=2, dtype=torch.float32),
                             torch.linalg.vector_norm(clean, dim=2, dtype=torch.float32) ** 2,
                             torch.linalg.vector_norm(clean, ord=math.inf, dim=2, dtype=torch.float32),
                             (x == 0).sum(dim=2).to(torch.float32),
                             (~finite).sum(dim=2).to(torch.float32)], dim=2)  # [tokens, features, 5]
    if scales is not None:
        s = scales.to(torch.float32)
        per_token[:, :, 0] *= s
        per_token[:, :, 1] *= s * s
        per_token[:, :, 2] *= s
    parts = torch.split(per_token, list(lengths), dim=0)
    return torch.stack([torch.cat([p[:, :, :2].sum(0), p[:, :, 2:3].amax(0), p[:, :, 3:].sum(0)], dim=1)
                        for p in parts])


def _float32_of_bits(bits: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values of stored bits of a float ``dtype`` (bf16 as the high half of a float32), numpy only."""
    if dtype == "bfloat16":
        return (bits.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if dtype == "float16":
        return bits.view(np.float16).astype(np.float32)
    if dtype == "float32":
        return bits.view(np.float32)
    raise ValueError(f"no statistics for stored dtype {dtype!r}")


def bits_stats(bits: np.ndarray, dtype: str, scales: np.ndarray | None = None, encoding: str = "raw",
               hidden: int | None = None) -> np.ndarray:
    """``sample_stats`` of one sample's stored bits ``[features, T, W]`` (the writer's buffer region) of manifest
    ``dtype`` and ``encoding``: raw bits are read as ``dtype``, the others decoded (fp8 with its per-row ``scales
    [features, T]``) into the ``hidden`` values each row holds. numpy only: copying commands (subset, upgrade,
    import of stored bits) never load torch."""
    from . import encodings

    enc = encodings.get(encoding)
    out = np.empty((bits.shape[0], len(SUMS)), dtype=np.float64)
    for j in range(bits.shape[0]):
        b = np.ascontiguousarray(bits[j])
        v = (enc.decode_numpy(b, None if scales is None else scales[j], hidden or b.shape[-1]) if enc.quantised
             else _float32_of_bits(b, dtype))
        # decoded rows: finite as readers decode them, into the store's dtype (``FINITE_BELOW``)
        finite = np.abs(v) < FINITE_BELOW.get(dtype, math.inf) if enc.quantised else np.isfinite(v)
        clean = np.where(finite, v, np.float32(0)).ravel()
        out[j] = (clean.sum(dtype=np.float64), float(np.dot(clean, clean)),
                  float(np.abs(clean).max(initial=0)), np.count_nonzero(v == 0), v.size - np.count_nonzero(finite))
    return out


def first_bad_row(bits: np.ndarray, dtype: str, encoding: str = "raw", scales: np.ndarray | None = None,
                  hidden: int | None = None, block: int = 1024) -> int | None:
    """The first row of one feature's stored bits ``[T, W]`` (manifest ``dtype`` and ``encoding``; fp8: its row
    ``scales [T]``) that readers decode to a NaN or an infinity in the store's dtype, or that no writer writes
    (``Encoding.bad_rows``); None when there is none: what ``verify`` counts, asked before a copy is written. Raw
    rows by bit tests; encoded ones decoded ``block`` rows at a time, so the check holds a block's floats, never a
    shard's."""
    from . import codec, encodings

    enc = encodings.get(encoding)
    if not enc.quantised:
        return codec.first_nonfinite_row(bits, dtype)
    below, hidden = FINITE_BELOW.get(dtype, math.inf), hidden or bits.shape[-1]
    for a in range(0, bits.shape[0], block):
        b = np.ascontiguousarray(bits[a:a + block])
        sc = None if scales is None else scales[a:a + block]
        with np.errstate(invalid="ignore", over="ignore"):  # a bad scale's NaN is what is looked for
            bad = enc.bad_rows(b, sc, hidden) | ~(np.abs(enc.decode_numpy(b, sc, hidden)) < below).all(axis=-1)
        hit = np.flatnonzero(bad)
        if hit.size:
            return a + int(hit[0])
    return None


def shard_stats(features: Sequence[int | str], lengths: Sequence[int], hidden: int,
                per_sample: Sequence[np.ndarray]) -> dict[str, dict[str, Any]]:
    """A record's ``stats["features"]``: per feature the shard's totals and each sample's RMS, zeros and
    non-finite count, from each sample's ``[features, 5]``."""
    s = np.asarray(per_sample, dtype=np.float64).reshape(len(lengths), len(features), len(SUMS))
    counts = np.asarray(lengths, dtype=np.float64) * hidden
    out = {}
    for j, f in enumerate(features):
        col = s[:, j]
        rms = np.sqrt(col[:, 1] / np.maximum(counts, 1))
        out[feature_key(f)] = {
            "count": int(counts.sum()), "sum": _num(col[:, 0].sum()), "sumsq": _num(col[:, 1].sum()),
            "absmax": _num(col[:, 2].max(initial=0.0)), "zeros": int(col[:, 3].sum()),
            "nonfinite": int(col[:, 4].sum()), "zero_samples": int((col[:, 3] >= counts).sum()),
            "nonfinite_samples": int((col[:, 4] > 0).sum()),
            "sample_rms": [_num(r) for r in rms], "sample_zeros": [int(z) for z in col[:, 3]],
            "sample_nonfinite": [int(n) for n in col[:, 4]]}
    return out


def _num(x: float) -> float:
    """A statistic as JSON keeps it: 7 significant digits (float32's), finite."""
    x = float(x)
    return float(f"{x:.7g}") if math.isfinite(x) else 0.0


def rms(entry: dict[str, Any]) -> float:
    """A shard's RMS of one feature, from its record entry."""
    return math.sqrt(entry["sumsq"] / entry["count"]) if entry.get("count") else 0.0


# -- the rules ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Unhealthy:
    """One sample's feature that trains nothing: ``why`` is ``nonfinite`` or ``zero``."""

    shard: str
    sample_id: str
    feature: str
    why: str
    count: int  # its non-finite values, or its zeros
    of: int  # the sample's values of this feature

    @property
    def what(self) -> str:
        return (f"non-finite values ({self.count:,} of {self.of:,})" if self.why == "nonfinite"
                else f"all zero ({self.of:,} values; the sample has loss tokens)")

    def __str__(self) -> str:
        return f"sample {self.sample_id!r}, {feature_name(self.feature)}: {self.what}"


def problems_of(shard: str, ids: Sequence[str], lengths: Sequence[int], loss: Sequence[int], hidden: int,
                feature: str, zeros: Sequence[int], nonfinite: Sequence[int]) -> list[Unhealthy]:
    """The unhealthy samples of one feature of one shard, from per-sample zero and non-finite counts."""
    out = []
    for i, sid in enumerate(ids):
        if nonfinite[i]:
            out.append(Unhealthy(shard, sid, feature, "nonfinite", int(nonfinite[i]), int(lengths[i]) * hidden))
        elif loss[i] and zeros[i] >= lengths[i] * hidden:
            out.append(Unhealthy(shard, sid, feature, "zero", int(zeros[i]), int(lengths[i]) * hidden))
    return out


def record_problems(rec, hidden: int) -> list[Unhealthy]:
    """What a commit record's statistics say is unhealthy (empty when it carries none: an older store)."""
    feats = (rec.stats or {}).get("features") if isinstance(rec.stats, dict) else None
    if not isinstance(feats, dict):
        return []
    cols = rec.samples
    out = []
    for f, e in feats.items():
        try:
            out += problems_of(rec.shard, cols["sample_id"], cols["length"], cols["loss_tokens"], hidden, f,
                               e["sample_zeros"], e["sample_nonfinite"])
        except (KeyError, TypeError, IndexError):
            continue  # malformed statistics: verify compares them with the data and names them
    return out


def unhealthy(store) -> list[Unhealthy]:
    """Every unhealthy sample's feature of an open store by its records' statistics (``train`` and ``import``
    refuse on them): the columns name the shards that may hold one (a non-finite value, or as many zeros as a
    sample's values), and only those records are parsed."""
    t, m = store.table, store.manifest
    if t.feature_stats is None or not len(t):
        return []
    from .records import FEATURE_STATS

    fs = np.nan_to_num(t.feature_stats, nan=0.0)
    maybe = (fs[:, :, FEATURE_STATS.index("nonfinite_samples")] > 0).any(axis=1) | (
        fs[:, :, FEATURE_STATS.index("zero_samples")] > 0).any(axis=1)
    out = []
    for i in np.flatnonzero(maybe).tolist():
        out += record_problems(store.commits[i], m.hidden_size)
    return out


def has_stats(rec) -> bool:
    return isinstance(rec.stats, dict) and isinstance(rec.stats.get("features"), dict)


def shard_rms_of(table, key: str) -> tuple[np.ndarray, np.ndarray]:
    """(RMS of feature ``key`` in each shard that has statistics, in table order; which of them lie
    ``OUTLIER_FACTOR`` or more from the median, either way): ``info``'s warning and ``report``'s red bars."""
    from .records import FEATURE_STATS

    col = table.feature_stats[:, table.slots.index(key)]
    have = ~np.isnan(col[:, 0]) & (col[:, 0] > 0)
    rms_ = np.sqrt(col[have, FEATURE_STATS.index("sumsq")] / col[have, 0])
    med = float(np.median(rms_)) if rms_.size else 0.0
    far = (rms_ > med * OUTLIER_FACTOR) | (rms_ < med / OUTLIER_FACTOR) if med > 0 else np.ones(rms_.size, bool)
    return rms_, far


def summary(table, features: Sequence[int | str]) -> dict[str, Any]:
    """``info``'s view of a store's feature statistics, from the records' columns alone (no record parsed): per
    feature the totals, mean and RMS, each shard's RMS (min / median / max), the shards whose RMS is
    ``OUTLIER_FACTOR`` from the median either way, and those dominated by zeros; ``shards_without`` counts the
    shards whose records carry none (stores written before them: ``hsstore upgrade`` adds them)."""
    from .records import FEATURE_STATS

    n = len(table)
    fs = table.feature_stats
    out: dict[str, Any] = {"features": {}, "shards_without": n, "warnings": []}
    if fs is None or not n:
        return out
    for f in features:
        key = feature_key(f)
        if key not in table.slots:
            continue
        col = fs[:, table.slots.index(key)]  # [shards, FEATURE_STATS]
        have = ~np.isnan(col[:, 0]) & (col[:, 0] > 0)
        if not have.any():
            continue
        c = {name: col[have, k] for k, name in enumerate(FEATURE_STATS)}
        count = float(c["count"].sum())
        shard_rms, off = shard_rms_of(table, key)
        med = float(np.median(shard_rms))
        far = [table.shard[i] for i in np.flatnonzero(have)[off]]
        zero_share = c["zeros"] / c["count"]
        zero_heavy = [table.shard[i] for i, z in zip(np.flatnonzero(have), zero_share) if z > ZERO_DOMINATED]
        out["features"][key] = {
            "count": int(count), "sum": float(c["sum"].sum()), "sumsq": float(c["sumsq"].sum()),
            "mean": float(c["sum"].sum() / count), "rms": float(np.sqrt(c["sumsq"].sum() / count)),
            "absmax": float(c["absmax"].max()), "zeros": int(c["zeros"].sum()), "nonfinite": int(c["nonfinite"].sum()),
            "zero_samples": int(c["zero_samples"].sum()), "nonfinite_samples": int(c["nonfinite_samples"].sum()),
            "zero_share": float(c["zeros"].sum() / count),
            "shard_rms": {"min": float(shard_rms.min()), "median": med, "max": float(shard_rms.max())},
            "outlier_shards": far, "zero_dominated_shards": zero_heavy}
        name = feature_name(key)
        if c["nonfinite"].sum():
            out["warnings"].append(f"{name}: {int(c['nonfinite'].sum()):,} non-finite values in "
                                   f"{int(c['nonfinite_samples'].sum()):,} sample(s) (hsstore verify names them; "
                                   "train refuses the store)")
        if c["zero_samples"].sum():
            out["warnings"].append(f"{name}: all zero in {int(c['zero_samples'].sum()):,} sample(s) (hsstore verify "
                                   "names those with loss tokens; train refuses the store)")
        if far:
            out["warnings"].append(f"{name}: RMS of {len(far)} shard(s) more than {OUTLIER_FACTOR:g}x from the "
                                   f"store's median {med:.4g} (first: {far[0]})")
        if zero_heavy:
            out["warnings"].append(f"{name}: {len(zero_heavy)} shard(s) more than {ZERO_DOMINATED:.0%} exact zeros "
                                   f"(first: {zero_heavy[0]}): a capture that returned zeros?")
        out["shards_without"] = min(out["shards_without"], int(n - have.sum()))
    return out


# -- what verify counts from the bytes it reads ------------------------------------------------------------
class ValueTally:
    """Per sample and feature, the exact zeros and non-finite values of a shard, counted from stored bits as
    ``verify`` reads them (``add``: the rows of one chunk or member), bit tests only (no float conversion); rows of
    a block encoding, whose zeros and NaNs depend on their scales, are decoded first (``decode``: rows -> float32
    values)."""

    def __init__(self, rec, features: Sequence[int | str], storage_dtype: str, decode=None) -> None:
        self.rec = rec
        self.keys = [feature_key(f) for f in features]
        self.offsets = np.asarray(rec.offsets, dtype=np.int64)
        self.zeros = np.zeros((rec.n_samples, len(self.keys)), np.int64)
        self.nonfinite = np.zeros_like(self.zeros)
        self.seen = np.zeros(len(self.keys), np.int64)  # tokens counted per feature
        self.decode = decode
        self.kind, self.magnitude, self.exponent = _BITS[storage_dtype]
        self.finite_below = FINITE_BELOW.get(storage_dtype, math.inf)  # a block encoding's: the store's dtype

    def add(self, feature: int | str, first_token: int, rows: np.ndarray) -> None:
        """Rows ``[n, H]`` of stored bits (any view of the storage dtype) starting at token ``first_token``."""
        j = self.keys.index(feature_key(feature))
        n = min(rows.shape[0], self.rec.n_tokens - first_token)
        if n <= 0:
            return
        if self.decode is not None:
            v = self.decode(np.ascontiguousarray(rows[:n]))
            zero_rows, bad_rows = (v == 0).sum(axis=1), (~(np.abs(v) < self.finite_below)).sum(axis=1)
        else:
            b = np.ascontiguousarray(rows[:n]).view(self.kind).reshape(n, -1)
            mag = b & self.kind(self.magnitude)
            zero_rows = (mag == 0).sum(axis=1)
            bad_rows = ((b & self.kind(self.exponent)) == self.kind(self.exponent)).sum(axis=1)
        sample = np.searchsorted(self.offsets, np.arange(first_token, first_token + n), side="right") - 1
        np.add.at(self.zeros[:, j], sample, zero_rows)
        np.add.at(self.nonfinite[:, j], sample, bad_rows)
        self.seen[j] += n

    def problems(self, hidden: int) -> list[Unhealthy]:
        cols = self.rec.samples
        out = []
        for j, f in enumerate(self.keys):
            if self.seen[j] < self.rec.n_tokens:  # not every token read (a chunk unreadable: reported already)
                continue
            out += problems_of(self.rec.shard, cols["sample_id"], cols["length"], cols["loss_tokens"], hidden, f,
                               self.zeros[:, j], self.nonfinite[:, j])
        return out

    def disagrees(self) -> list[str]:
        """Features whose record statistics (zeros, non-finite per sample) differ from the counted ones."""
        if not has_stats(self.rec):
            return []
        out = []
        for j, f in enumerate(self.keys):
            e = self.rec.stats["features"].get(f)
            if self.seen[j] < self.rec.n_tokens:
                continue
            try:
                same = (list(map(int, e["sample_zeros"])) == self.zeros[:, j].tolist()
                        and list(map(int, e["sample_nonfinite"])) == self.nonfinite[:, j].tolist())
            except (KeyError, TypeError, ValueError):
                same = False
            if not same:
                out.append(f)
        return out


def report_values(tally: ValueTally, hidden: int, report, file: str | None = None) -> None:
    """``verify``'s health rules on what it counted: each unhealthy sample's feature a FAIL naming it, and a record
    whose statistics say otherwise than the data a FAIL of its own (statistics are never taken on trust)."""
    from .report import Problem

    for u in tally.problems(hidden):
        report.problems.append(Problem(u.shard, f"{feature_name(u.feature)}: {u.what}", file, [u.sample_id]))
    wrong = tally.disagrees()
    if wrong:
        report.problems.append(Problem(tally.rec.shard, f"the commit record's feature statistics of {wrong} disagree "
                                                        "with the data (zeros or non-finite counts per sample)",
                                       file))
