"""Per-sample distributions that make data problems loud.

Aggregates hide the failure this project exists for (87% of samples with a loss-mask sum of 6 still
gave a mean of 89.6); the most common exact value and its share do not. Used by ``hsstore info`` on
commit records and by the extraction quality gate on tokenized input.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable

import numpy as np

PERCENTILES = (0, 10, 50, 90, 99, 100)

#: Per-sample quality flags that extraction records (commit records' ``flags`` column), worst first:
#: ``stub_answer`` (final answer under the gate's stub limit), ``empty_thinking``, ``truncated`` (cut off:
#: no end of turn), ``over_length``, ``duplicate`` (the same tokens as an earlier sample), ``no_loss``;
#: ``feature_zero`` / ``feature_nonfinite``: a feature all zero / not finite, kept by ``import --keep-unhealthy``;
#: ``not_generated``: the loss covers an assistant turn marked ``"generated": false`` (``--learn-not-generated``).
SAMPLE_FLAGS = ("stub_answer", "empty_thinking", "truncated", "over_length", "duplicate", "no_loss", "feature_zero",
                "feature_nonfinite", "not_generated")


def percentiles(values: Iterable[int], qs: Iterable[int] = PERCENTILES) -> dict[str, int]:
    """``{"p90": v, ...}``: the one rule ``info`` and ``check`` both print. Each is a value some sample has
    (numpy's ``nearest``), never an interpolation between two, so a count stays a count."""
    v = np.asarray(list(values) if not isinstance(values, np.ndarray) else values, dtype=np.int64)
    if v.size == 0:
        return {}
    qs = tuple(qs)
    return {f"p{q}": int(x) for q, x in zip(qs, np.percentile(v, qs, method="nearest"), strict=True)}


def log2_histogram(values: Iterable[int]) -> list[dict]:
    """Counts and shares in bins 0, 1, 2-3, 4-7, ... up to the largest value (empty bins inside the range
    kept, so the shape of the distribution reads off directly)."""
    v = np.asarray(list(values) if not isinstance(values, np.ndarray) else values, dtype=np.int64)
    if v.size == 0:
        return []
    bins, lo = [(0, 0)], 1
    while lo <= int(v.max()):
        bins.append((lo, 2 * lo - 1))
        lo *= 2
    return [{"lo": a, "hi": b, "count": (c := int(((v >= a) & (v <= b)).sum())), "share": c / v.size}
            for a, b in bins]


def top_values(values: Iterable[int], k: int = 10) -> list[dict]:
    """The ``k`` most common exact values with count and share; ties go to the smaller value (a stub
    answer's sum wins a tie against a real one's, so the warning errs on the loud side)."""
    c = Counter(int(x) for x in values)
    n = sum(c.values())
    ranked = sorted(c.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
    return [{"value": v, "count": m, "share": m / n} for v, m in ranked]


def top_value(values: Iterable[int]) -> dict | None:
    """The most common exact value and its share of samples (``{"value", "count", "share"}``)."""
    top = top_values(values, 1)
    return top[0] if top else None


def loss_sum_summary(loss_sums: list[int], lengths: list[int]) -> dict:
    """The data-set view of loss-mask sums shared by ``info`` and the quality gate."""
    tokens = int(sum(lengths))
    loss = int(sum(loss_sums))
    return {
        "samples": len(loss_sums),
        "tokens": tokens,
        "loss_tokens": loss,
        "response_fraction": loss / tokens if tokens else 0.0,
        "loss_sum_mean": loss / len(loss_sums) if loss_sums else 0.0,
        "loss_sum_percentiles": percentiles(loss_sums),
        "loss_sum_histogram": log2_histogram(loss_sums),
        "top_loss_sum": top_value(loss_sums),
        "length_percentiles": percentiles(lengths),
    }


def dominated(top: dict | None, max_value: int, max_share: float) -> bool:
    """True when one small loss-sum value holds too large a share: the stub signature."""
    return bool(top) and top["value"] <= max_value and top["share"] >= max_share


def histogram_lines(hist: list[dict[str, int]], total: int, width: int = 40, mark: int | None = None) -> list[str]:
    """Text bars for a log2 histogram; the bucket holding ``mark`` is flagged."""
    lines = []
    peak = max((h["count"] for h in hist), default=1)
    for h in hist:
        label = f"{h['lo']}" if h["lo"] == h["hi"] else f"{h['lo']}-{h['hi']}"
        bar = "#" * round(width * h["count"] / peak) or ("#" if h["count"] else "")
        flag = "  <-- top value" if mark is not None and h["lo"] <= mark <= h["hi"] else ""
        lines.append(f"  {label:>13} | {bar:<{width}} {h['count']:>9} ({100 * h['count'] / max(total, 1):5.1f}%){flag}")
    return lines
