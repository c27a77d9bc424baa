"""Quality gate: look at per-sample loss-mask distributions before any GPU time is spent.

The failure this exists for: 87% of a data set's samples had a loss-mask sum of exactly 6
(``<think>\\n\\n</think>\\n\\nOK.<|im_end|>``) while the aggregate counts looked fine. Means hide it; the
most common per-sample value and its share do not. The gate refuses such a set and shows decoded
examples so a person sees what the drafter would learn.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields

import numpy as np

from .show import format_sample
from hsstore.app.schema import option
from hsstore.ops.stats import SAMPLE_FLAGS, log2_histogram, percentiles, top_values
from hsstore.terminal import escape, shown, visible_key
from .sample import TokenizedSample
from .tokenize import TokenizeStats

PERCENTILES = (0, 1, 5, 10, 25, 50, 75, 90, 95, 99, 100)
FLAG_ORDER = SAMPLE_FLAGS


def _limit(default: int | float, help: str):
    """A threshold: its flag says its default (``N`` for counts, ``X`` for shares)."""
    return option(default, metavar="N" if isinstance(default, int) else "X", help=f"{help} (default {default})")


@dataclass
class GateThresholds:
    """Limits of the gate; each field is also a flag of ``hsstore check`` and ``extract`` (``--small-loss-sum``
    ...), in their ``gate thresholds`` group."""

    small_loss_sum: int = _limit(32, "a most-common loss-mask sum at or below this many tokens is suspicious")
    max_top_share: float = _limit(0.20, "fail when such a small value holds at least this share of samples")
    stub_answer_tokens: int = _limit(4, "a final answer with fewer tokens than this is a stub")
    max_stub_share: float = _limit(0.20, "fail when stub answers exceed this share")
    max_empty_thinking_share: float = _limit(0.50, "fail when empty thinking blocks exceed this share")
    max_truncated_share: float = _limit(0.10, "fail when responses cut off (no end of turn) exceed this share")
    max_over_length_share: float = _limit(0.10, "fail when samples over --max-length exceed this share")
    max_duplicate_share: float = _limit(0.10, "fail when repeated token sequences exceed this share")
    min_response_fraction: float = _limit(0.0, "fail when loss tokens / all tokens is below this")
    max_skipped_share: float = _limit(0.02, "fail when input rows that cannot be tokenized faithfully (skipped) "
                                            "exceed this share of the rows")


@dataclass(slots=True)
class SampleStats:
    """What the gate records for one sample."""

    sample_id: str
    source: str
    tokens: int
    loss_tokens: int
    thinking_tokens: int
    answer_tokens: int | None
    flags: tuple[str, ...]


@dataclass
class GateReport:
    """Result of :func:`check`: data-set distributions, per-sample records, verdict and reasons."""

    thresholds: GateThresholds
    samples: list[SampleStats]
    total_tokens: int = 0
    loss_tokens: int = 0
    response_fraction: float = 0.0
    loss_sum_mean: float = 0.0
    loss_sum_percentiles: dict[str, int] = field(default_factory=dict)
    loss_sum_histogram: list[dict] = field(default_factory=list)  # power-of-two bins {lo, hi, count, share}
    top_values: list[dict] = field(default_factory=list)  # most common exact sums {value, count, share}
    top_loss_sum: dict = field(default_factory=dict)  # {value, count, share}
    flag_counts: dict[str, int] = field(default_factory=dict)
    sources: dict[str, int] = field(default_factory=dict)
    input_stats: dict | None = None
    failures: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    dominant: bool = False
    #: sample ids met more than once (each once, in input order): resume matches samples by id
    repeated_ids: list[str] = field(default_factory=list)
    _examples: dict[str, list] = field(default_factory=dict, repr=False)

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def n_samples(self) -> int:
        return len(self.samples)

    def share(self, flag: str) -> float:
        return self.flag_counts.get(flag, 0) / self.n_samples if self.samples else 0.0

    @property
    def stub_share(self) -> float:
        return self.share("stub_answer")

    def to_dict(self, per_sample: bool = False, max_listed: int = 20) -> dict:
        """JSON-ready summary. Flagged sample ids are listed (first ``max_listed`` per flag)."""
        listed: dict[str, list[str]] = {}
        for s in self.samples:
            for f in s.flags:
                ids = listed.setdefault(f, [])
                if len(ids) < max_listed:
                    ids.append(s.sample_id)
        out = {
            "ok": self.ok,
            "failures": self.failures,
            "warnings": self.warnings,
            "samples": self.n_samples,
            "total_tokens": self.total_tokens,
            "loss_tokens": self.loss_tokens,
            "response_fraction": self.response_fraction,
            "loss_sum": {
                "mean": self.loss_sum_mean,
                "percentiles": self.loss_sum_percentiles,
                "histogram": self.loss_sum_histogram,
                "top_values": self.top_values,
            },
            "top_loss_sum": self.top_loss_sum,
            "stub_share": self.stub_share,
            "shares": {f: self.share(f) for f in FLAG_ORDER},
            "flag_counts": self.flag_counts,
            "flagged_ids": listed,
            "sources": self.sources,
            "input": self.input_stats,
            "skipped": (self.input_stats or {}).get("skipped", {}),
            "repeated_ids": {"count": len(self.repeated_ids), "ids": self.repeated_ids[:max_listed]},
            "thresholds": asdict(self.thresholds),
        }
        if per_sample:
            out["per_sample"] = [
                {f.name: (list(v) if isinstance(v := getattr(s, f.name), tuple) else v) for f in fields(s)}
                for s in self.samples
            ]
        return out

    def to_json(self, per_sample: bool = False, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(per_sample=per_sample), indent=indent, ensure_ascii=False)

    def format_text(self, tokenizer=None, n_examples: int = 3, color: bool = False, max_chars: int = 1500) -> str:
        """Readable report; a dominating small loss-sum value is announced first. Decodes ``n_examples``
        flagged samples (needs ``tokenizer``) with the loss mask marked."""
        return _format_report(self, tokenizer, n_examples, color, max_chars)


def _sample_hash(ids: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(ids, dtype="<i4").tobytes(), digest_size=16).digest()


def is_stub(s: TokenizedSample, t: GateThresholds) -> bool:
    """A final answer shorter than ``stub_answer_tokens`` (the gate's ``stub_answer`` flag)."""
    return s.answer_tokens is not None and s.loss_tokens > 0 and s.answer_tokens < t.stub_answer_tokens


def check(
    samples: Iterable[TokenizedSample],
    thresholds: GateThresholds | None = None,
    *,
    stats: TokenizeStats | None = None,
    keep_examples: int = 5,
) -> GateReport:
    """Run the gate over ``samples`` (streamed once). Adds ``stub_answer`` and ``duplicate`` flags to the
    per-sample records (samples themselves are not modified); a sample id met twice (or one that differs from an
    earlier id only by invisible characters: ``terminal.visible_key``) fails the gate."""
    t = thresholds or GateThresholds()
    records: list[SampleStats] = []
    seen: set[bytes] = set()
    ids: set[str] = set()  # visible keys: two ids a person cannot tell apart are one
    repeated: dict[str, None] = {}
    examples: dict[str, list] = {}
    for s in samples:
        key = visible_key(s.sample_id)
        if key in ids:
            repeated[s.sample_id] = None
        ids.add(key)
        flags = list(s.flags)
        if is_stub(s, t):
            flags.append("stub_answer")
        digest = _sample_hash(s.input_ids)
        if digest in seen:
            flags.append("duplicate")
        seen.add(digest)
        rec = SampleStats(
            s.sample_id, s.source, s.num_tokens, s.loss_tokens, s.thinking_tokens, s.answer_tokens, tuple(flags)
        )
        records.append(rec)
        keys = list(flags)
        if rec.loss_tokens <= t.small_loss_sum:
            keys.append(f"loss_sum={rec.loss_tokens}")
        for key in keys:
            bucket = examples.setdefault(key, [])
            if len(bucket) < keep_examples:
                bucket.append((rec, np.asarray(s.input_ids), np.asarray(s.loss_mask)))

    report = GateReport(thresholds=t, samples=records, repeated_ids=list(repeated), _examples=examples)
    if stats is not None:
        report.input_stats = stats.to_dict()
    n = len(records)
    if n == 0:
        _skipped_verdict(report)
        report.failures.append("no samples to check")
        return report

    sums = np.fromiter((r.loss_tokens for r in records), dtype=np.int64, count=n)
    report.total_tokens = int(sum(r.tokens for r in records))
    report.loss_tokens = int(sums.sum())
    report.response_fraction = report.loss_tokens / report.total_tokens if report.total_tokens else 0.0
    report.loss_sum_mean = float(sums.mean())
    report.loss_sum_percentiles = percentiles(sums, PERCENTILES)
    report.loss_sum_histogram = log2_histogram(sums)
    report.top_values = top_values(sums, 10)
    report.top_loss_sum = dict(report.top_values[0])
    report.flag_counts = {f: c for f, c in Counter(f for r in records for f in r.flags).items()}
    report.sources = dict(Counter(r.source for r in records).most_common())
    _verdict(report)
    return report


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _skipped_verdict(report: GateReport) -> None:
    """Rows that could not be tokenized faithfully: a failure past the threshold, else a warning."""
    inp = report.input_stats or {}
    count, rows = inp.get("skipped_rows", 0), inp.get("rows", 0)
    if not count:
        return
    share = count / rows if rows else 1.0
    reasons = ", ".join(f"{r} {v['count']:,}" for r, v in inp["skipped"].items())
    limit = report.thresholds.max_skipped_share
    what = f"rows that cannot be tokenized faithfully, skipped ({reasons}): {count:,} of {rows:,} ({_pct(share)})"
    if share > limit:
        first = next(iter(inp["skipped"].values())).get("first", "")
        report.failures.append(f"{what}, limit {_pct(limit)}" + (f"; first: {first[:240]}" if first else ""))
    else:
        report.warnings.append(f"{what}, under the limit {_pct(limit)}")


def _verdict(report: GateReport) -> None:
    t = report.thresholds
    _skipped_verdict(report)
    if report.repeated_ids:
        first = report.repeated_ids[0]
        report.failures.append(
            f"{len(report.repeated_ids):,} sample id(s) occur more than once, e.g. {shown(first)} (ids that differ "
            "only by invisible characters count as one): ids must be unique (extract resumes by id)")
    top = report.top_loss_sum
    if top["value"] <= t.small_loss_sum and top["share"] >= t.max_top_share:
        report.dominant = True
        report.failures.append(
            f"{_pct(top['share'])} of samples have a loss-mask sum of exactly {top['value']} tokens "
            f"(a value <= {t.small_loss_sum} holding >= {_pct(t.max_top_share)}): "
            "the set is dominated by stub responses"
        )
    limits = [
        ("stub_answer", t.max_stub_share, f"stub answers (final answer < {t.stub_answer_tokens} tokens)"),
        ("empty_thinking", t.max_empty_thinking_share, "empty thinking blocks"),
        ("truncated", t.max_truncated_share, "truncated responses (no end of turn)"),
        ("over_length", t.max_over_length_share, "samples over the maximum length"),
        ("duplicate", t.max_duplicate_share, "duplicate token sequences"),
    ]
    for flag, limit, what in limits:
        share = report.share(flag)
        count = report.flag_counts.get(flag, 0)
        if share > limit:
            report.failures.append(f"{what}: {count} samples ({_pct(share)}), limit {_pct(limit)}")
        elif count:
            report.warnings.append(f"{what}: {count} samples ({_pct(share)}), under the limit {_pct(limit)}")
    trusted = (report.input_stats or {}).get("engine_prompt_mismatch_trusted", 0)
    if trusted:
        report.warnings.append(f"{trusted} turns' recorded prompt ids differ from this tokenizer's render of the "
                               "template; kept as the engine computed them (--trust-engine-ids)")
    if report.flag_counts.get("not_generated"):
        report.warnings.append(f"{report.flag_counts['not_generated']} samples learn assistant turns the target did not "
                               "generate (marked generated: false; --learn-not-generated)")
    if report.flag_counts.get("no_loss"):
        report.warnings.append(f"{report.flag_counts['no_loss']} samples have an empty loss mask (nothing to learn)")
    if report.response_fraction < t.min_response_fraction:
        report.failures.append(
            f"response fraction {_pct(report.response_fraction)} is below {_pct(t.min_response_fraction)}"
        )


def _format_report(report: GateReport, tokenizer, n_examples: int, color: bool, max_chars: int) -> str:
    n = report.n_samples
    verdict = "PASS" if report.ok else "FAIL"
    lines = [f"hsstore quality gate: {verdict}"]
    if n == 0:
        lines += [f"  FAIL  {f}" for f in report.failures]
        lines += _skipped_lines(report)
        return "\n".join(lines) + "\n"
    top = report.top_loss_sum
    if report.dominant:
        banner = f"!! {_pct(top['share'])} OF SAMPLES HAVE A LOSS-MASK SUM OF EXACTLY {top['value']} TOKENS !!"
        lines += ["", "!" * len(banner), banner, "!" * len(banner)]
    p = report.loss_sum_percentiles
    inp = report.input_stats or {}
    rows = f" (from {inp['rows']:,} rows, {inp['expanded']:,} added by multi-turn expansion)" if inp else ""
    lines += [
        "",
        f"  samples          {n:,}{rows}",
        "  sources          "
        + ", ".join(f"{escape(k)} {v:,}" for k, v in list(report.sources.items())[:6])
        + (" ..." if len(report.sources) > 6 else ""),
        f"  tokens           {report.total_tokens:,} total, {report.loss_tokens:,} in loss masks "
        f"(response fraction {_pct(report.response_fraction)})",
        f"  loss-mask sum    mean {report.loss_sum_mean:.1f}   "
        + "  ".join(f"{k} {p[k]:,}" for k in ("p0", "p10", "p50", "p90", "p100")),
        f"  most common sum  {top['value']:,} tokens in {top['count']:,} samples ({_pct(top['share'])})"
        + ("   <== DOMINATES" if report.dominant else ""),
        "",
        "  loss-mask sum per sample (histogram)",
    ]
    width = 40
    peak = max(b["count"] for b in report.loss_sum_histogram) or 1
    for b in report.loss_sum_histogram:
        label = f"{b['lo']}" if b["lo"] == b["hi"] else f"{b['lo']}-{b['hi']}"
        bar = "#" * round(width * b["count"] / peak)
        mark = ""
        if report.dominant and b["lo"] <= top["value"] <= b["hi"]:
            mark = f"   <== {top['value']} tokens: {_pct(top['share'])}"
        lines.append(f"    {label:>13} | {bar:<{width}} {b['count']:>9,} {_pct(b['share']):>6}{mark}")
    lines += ["", "  flags"]
    for flag in FLAG_ORDER:
        c = report.flag_counts.get(flag, 0)
        lines.append(f"    {flag:<16} {c:>9,}  {_pct(c / n):>6}")
    lines += _engine_lines(report)
    lines += _skipped_lines(report)
    lines += ["", "  verdict"]
    lines += [f"    FAIL  {f}" for f in report.failures]
    lines += [f"    warn  {w}" for w in report.warnings]
    if report.ok and not report.warnings:
        lines.append("    ok    no problems found")
    if tokenizer is not None and n_examples > 0:
        picked = _pick_examples(report, n_examples)
        if picked:
            marking = "bold green" if color else f"inside {'⟦ ⟧'}"
            lines += ["", f"  examples (loss-masked tokens {marking})"]
            for rec, ids, mask in picked:
                flags = ", ".join(rec.flags) or "-"
                lines.append(
                    f"--- {escape(rec.sample_id)} [{escape(rec.source)}] {rec.tokens} tokens, loss {rec.loss_tokens}, "
                    f"thinking {rec.thinking_tokens}, answer {rec.answer_tokens}, flags: {escape(flags)}"
                )
                lines.append(format_sample(tokenizer, ids, mask, color=color, max_chars=max_chars))
    return "\n".join(lines) + "\n"


def _engine_lines(report: GateReport) -> list[str]:
    """How many turns came from the serving engine's own ids, and how many of those re-tokenizing would change."""
    inp = report.input_stats or {}
    turns = inp.get("engine_turns", 0)
    if not turns:
        return []
    nc, trusted = inp.get("non_canonical", 0), inp.get("engine_prompt_mismatch_trusted", 0)
    lines = ["", "  engine ids (prompt_token_ids + token_ids recorded by the serving engine)",
             f"    turns            {turns:>9,}  taken as the engine computed them",
             f"    non_canonical    {nc:>9,}  {_pct(nc / turns):>6}  differ from re-tokenizing their text"]
    if trusted:
        lines.append(f"    prompt mismatch  {trusted:>9,}  {_pct(trusted / turns):>6}  kept (--trust-engine-ids)")
    return lines


def _skipped_lines(report: GateReport, shown: int = 3) -> list[str]:
    """Skipped rows by reason, with the first ids (the log has each row's message)."""
    skipped = (report.input_stats or {}).get("skipped") or {}
    if not skipped:
        return []
    lines = ["", "  skipped rows (not tokenized faithfully; nothing of them is used)"]
    for reason, v in skipped.items():
        ids = ", ".join(v["ids"][:shown]) + (" ..." if v["count"] > shown else "")
        lines.append(f"    {reason:<16} {v['count']:>9,}  {ids}")
    return lines


def _pick_examples(report: GateReport, n: int) -> list:
    """Samples with the dominating value first, then flagged ones by severity; each sample once."""
    keys = [f"loss_sum={report.top_loss_sum['value']}"] if report.dominant else []
    keys += list(FLAG_ORDER)
    picked, seen = [], set()
    for key in keys:
        for item in report._examples.get(key, []):
            if item[0].sample_id not in seen and len(picked) < n:
                picked.append(item)
                seen.add(item[0].sample_id)
    return picked
