"""``hsstore report PATH --out FILE.html``: a store or a training run as one self-contained HTML page.

People look at curves and histograms, not JSON: a store's loss-mask-sum histogram shows the stub signature
(one small value holding most samples) at a glance, a run's curves show whether the drafter is learning.
The page is inline SVG and CSS, with no external resource: it opens from disk with no server and no network.
A short inline script counts, after layout, how many marks of each chart have an area (``data-drawn`` on
the chart), so a headless browser's DOM dump tells whether every chart was drawn.

* a store (a URL with a manifest): loss-mask-sum and length histograms (log2 bins; the top loss-sum value
  marked, with the stub warning of ``hsstore info``), response vs prompt tokens, per-sample flags, stored
  bytes per layer; read from the commit records only (``info.summarize``), never the features;
* a run directory (``metrics.jsonl``): loss, teacher-forced tau and accuracy over steps (validation points
  against training), acceptance per draft position (last logged), tokens/s and learning rate.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any, Iterable, Sequence

W, H = 640, 260
M_LEFT, M_RIGHT, M_TOP, M_BOTTOM = 64, 16, 34, 44
COLORS = ("#3b6fd4", "#e0662b", "#2f9e58", "#9b59b6")
MARK = "#d62728"

_SCRIPT = """
document.querySelectorAll('svg.chart').forEach(function (svg) {
  var n = 0;
  svg.querySelectorAll('.mark').forEach(function (el) {
    var b = el.getBBox();
    if (el.tagName === 'path' ? (b.width > 0 || b.height > 0) : (b.width > 0 && b.height > 0)) n++;
  });
  svg.setAttribute('data-drawn', String(n));
});
"""

_CSS = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #222; max-width: 1400px; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin-top: 28px; }
.grid { display: flex; flex-wrap: wrap; gap: 16px; }
.card { border: 1px solid #ddd; border-radius: 6px; padding: 8px; background: #fff; }
.warn { background: #fde2e1; border: 1px solid #d62728; padding: 10px; border-radius: 6px; font-weight: 600; }
table { border-collapse: collapse; font-size: 13px; } td { padding: 2px 10px 2px 0; }
svg text { font-size: 11px; fill: #444; } svg .title { font-size: 13px; font-weight: 600; fill: #222; }
"""


def _esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e6 or a < 1e-3:
        return f"{v:.2e}"
    if a >= 100:
        return f"{v:,.0f}"
    return f"{v:.3g}"


def _frame(name: str, title: str, body: list[str], y_lo: float, y_hi: float, x_labels: list[str]) -> str:
    pw, ph = W - M_LEFT - M_RIGHT, H - M_TOP - M_BOTTOM
    out = [f'<svg class="chart" data-chart="{_esc(name)}" xmlns="http://www.w3.org/2000/svg" width="{W}" '
           f'height="{H}" viewBox="0 0 {W} {H}" role="img" aria-label="{_esc(title)}">',
           f'<text class="title" x="{M_LEFT}" y="18">{_esc(title)}</text>',
           f'<line x1="{M_LEFT}" y1="{M_TOP + ph}" x2="{M_LEFT + pw}" y2="{M_TOP + ph}" stroke="#999"/>',
           f'<line x1="{M_LEFT}" y1="{M_TOP}" x2="{M_LEFT}" y2="{M_TOP + ph}" stroke="#999"/>']
    for frac in (0.0, 0.5, 1.0):
        y = M_TOP + ph * (1 - frac)
        out.append(f'<text x="{M_LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{_fmt(y_lo + frac * (y_hi - y_lo))}'
                   "</text>")
        if frac:
            out.append(f'<line x1="{M_LEFT}" y1="{y:.1f}" x2="{M_LEFT + pw}" y2="{y:.1f}" stroke="#eee"/>')
    out += body
    for i, lab in enumerate(x_labels):
        if lab:
            x = M_LEFT + pw * (i / max(len(x_labels) - 1, 1))
            out.append(f'<text x="{x:.1f}" y="{M_TOP + ph + 16}" text-anchor="middle">{_esc(lab)}</text>')
    out.append("</svg>")
    return "\n".join(out)


def bar_chart(name: str, title: str, labels: list[str], values: list[float], mark: int | None = None,
              note: str = "", marks: Sequence[int] = ()) -> str:
    """Vertical bars; the bar at index ``mark`` (the stub signature's bin) and those at ``marks`` (outlier
    shards) in red."""
    pw, ph = W - M_LEFT - M_RIGHT, H - M_TOP - M_BOTTOM
    peak = max([v for v in values if v is not None and math.isfinite(v)] or [0]) or 1
    n = max(len(values), 1)
    pitch = pw / n
    body = []
    for i, (lab, v) in enumerate(zip(labels, values)):
        v = v if v is not None and math.isfinite(v) else 0
        h = ph * v / peak
        x = M_LEFT + i * pitch + pitch * 0.1
        color = MARK if mark == i or i in marks else COLORS[0]
        body.append(f'<rect class="mark bar" x="{x:.1f}" y="{M_TOP + ph - h:.1f}" width="{pitch * 0.8:.1f}" '
                    f'height="{max(h, 0.0):.1f}" fill="{color}"><title>{_esc(lab)}: {_esc(_fmt(v))}</title></rect>')
        if n <= 16 or i % math.ceil(n / 16) == 0:
            body.append(f'<text x="{x + pitch * 0.4:.1f}" y="{M_TOP + ph + 14}" text-anchor="middle">'
                        f'{_esc(lab)}</text>')
    if note:
        body.append(f'<text x="{W - M_RIGHT}" y="18" text-anchor="end" style="fill:{MARK}">{_esc(note)}</text>')
    return _frame(name, title, body, 0, peak, [])


def line_chart(name: str, title: str, series: list[tuple[str, list[tuple[float, float]]]],
               points_only: Iterable[str] = ()) -> str:
    """Lines over steps; the series named in ``points_only`` as dots (validation every N steps)."""
    pw, ph = W - M_LEFT - M_RIGHT, H - M_TOP - M_BOTTOM
    pts = [(x, y) for _, s in series for x, y in s if y is not None and math.isfinite(y)]
    if not pts:
        return _frame(name, title + " (no data)", [], 0, 1, [])
    x_lo, x_hi = min(p[0] for p in pts), max(p[0] for p in pts)
    y_lo, y_hi = min(p[1] for p in pts), max(p[1] for p in pts)
    if y_hi == y_lo:
        y_lo, y_hi = y_lo - 0.5, y_hi + 0.5
    x_hi = x_hi if x_hi > x_lo else x_lo + 1

    def xy(x, y):
        return M_LEFT + pw * (x - x_lo) / (x_hi - x_lo), M_TOP + ph * (1 - (y - y_lo) / (y_hi - y_lo))

    body, dots = [], set(points_only)
    for k, (label, s) in enumerate(series):
        color = COLORS[k % len(COLORS)]
        good = [xy(x, y) for x, y in s if y is not None and math.isfinite(y)]
        if not good:
            continue
        if label in dots or len(good) == 1:
            body += [f'<circle class="mark point" cx="{x:.1f}" cy="{y:.1f}" r="3.5" fill="{color}"/>' for x, y in good]
        else:
            d = " ".join(f"{'M' if i == 0 else 'L'}{x:.1f},{y:.1f}" for i, (x, y) in enumerate(good))
            body.append(f'<path class="mark series" d="{d}" fill="none" stroke="{color}" stroke-width="2"/>')
        body.append(f'<text x="{W - M_RIGHT - 110 * (len(series) - k) + 10}" y="18" style="fill:{color}">'
                    f'&#9632; {_esc(label)}</text>')
    return _frame(name, title, body, y_lo, y_hi, [_fmt(x_lo), "", f"step {_fmt(x_hi)}"])


def _hist_labels(hist: list[dict]) -> list[str]:
    return [str(h["lo"]) if h["lo"] == h["hi"] else f"{h['lo']}-{h['hi']}" for h in hist]


def _page(title: str, sections: list[str]) -> str:
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{_esc(title)}</title><style>{_CSS}</style></head><body>\n<h1>{_esc(title)}</h1>\n"
            + "\n".join(sections) + f"\n<script>{_SCRIPT}</script>\n</body></html>\n")


def _table(rows: list[tuple[str, Any]]) -> str:
    return "<table>" + "".join(f"<tr><td>{_esc(k)}</td><td><b>{_esc(v)}</b></td></tr>" for k, v in rows) + "</table>"


def store_html(store) -> str:
    """The page of an opened store (``hsstore.open``)."""
    import numpy as np

    from . import stats
    from .info import human_bytes, summarize

    s = summarize(store)
    sections = [_table([("store", s["url"]), ("target", s["target"]["name"]), ("taps", s["layers"]),
                        ("samples", f"{s['samples']:,} in {s['shards']} shard(s)"), ("tokens", f"{s['tokens']:,}"),
                        ("dtype / encoding", f"{s['dtype']} / {s['encoding']}"),
                        ("stored", human_bytes(s["stored_bytes"]))])]
    if not s["samples"]:
        return _page(f"hsstore store report: {s['url']}", sections + ["<p>(empty store: no committed shards)</p>"])
    top = s["top_loss_sum"]
    if s["stub_warning"]:
        sections.append(f'<p class="warn">{100 * top["share"]:.1f}% of samples have a loss-mask sum of exactly '
                        f'{top["value"]} tokens: stub answers? Read some with <code>hsstore show</code>.</p>')
    hist = s["loss_sum_histogram"]
    mark = next((i for i, h in enumerate(hist) if h["lo"] <= top["value"] <= h["hi"]), None)
    lengths = store.table.samples["length"].tolist()
    lhist = stats.log2_histogram(lengths)
    t = store.table
    codes = np.asarray(t.flags.codes)
    flags = {"(none)": int(sum(int((codes == c).sum()) for c, v in enumerate(t.flags.values) if not v))}
    flags.update({f: s["flags"].get(f, 0) for f in stats.SAMPLE_FLAGS})
    flags.update({k: v for k, v in s["flags"].items() if k not in flags})
    per_layer = s["bytes_per_layer"]
    charts = [
        bar_chart("loss_sum_histogram", "loss-mask sum per sample (samples per log2 bin)", _hist_labels(hist),
                  [h["count"] for h in hist], mark=mark,
                  note=f"top value {top['value']}: {100 * top['share']:.1f}% of samples"),
        bar_chart("length_histogram", "sample length in tokens (samples per log2 bin)", _hist_labels(lhist),
                  [h["count"] for h in lhist]),
        bar_chart("response_fraction", f"response tokens {100 * s['response_fraction']:.1f}% of all tokens",
                  ["response (loss) tokens", "prompt / other tokens"],
                  [s["loss_tokens"], s["tokens"] - s["loss_tokens"]]),
        bar_chart("flags", "samples per quality flag ((none): no flag)", list(flags), list(flags.values())),
        bar_chart("bytes_per_layer", "stored bytes per layer", [f"layer {k}" if k.isdigit() else k for k in per_layer],
                  [v["stored_bytes"] for v in per_layer.values()]),
    ]
    charts += feature_charts(store, s["feature_health"])
    sections.append('<div class="grid">' + "".join(f'<div class="card">{c}</div>' for c in charts) + "</div>")
    return _page(f"hsstore store report: {s['url']}", sections)


def feature_charts(store, h: dict[str, Any]) -> list[str]:
    """Per feature, its RMS in each shard (from the records' statistics); shards 10x from the median in red."""
    import numpy as np

    from ..format import health

    out = []
    for key in h["features"]:
        rms, far = health.shard_rms_of(store.table, key)
        n = int(far.sum())
        out.append(bar_chart(f"rms_{key}", f"{health.feature_name(key)}: RMS per shard", [str(i) for i in range(len(rms))],
                             rms.tolist(), marks=set(np.flatnonzero(far).tolist()),
                             note=f"{n} shard(s) {health.OUTLIER_FACTOR:g}x from the median" if n else ""))
    return out


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise ValueError(f"{path}: line {n} is not JSON") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), (int, float)):
            raise ValueError(f"{path}: line {n} has no step")
        rows.append(row)
    return rows


def run_html(run_dir: str | Path) -> str:
    """The page of a training run directory (its ``metrics.jsonl``)."""
    rows = read_metrics(run_dir)

    def series(key: str) -> list[tuple[float, float]]:
        return [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]

    last = rows[-1] if rows else {}
    val = [r for r in rows if "val_tau" in r]
    info = [("run", str(run_dir)), ("steps logged", f"{len(rows)} (last step {last.get('step', '-')})")]
    if val:
        best = max(val, key=lambda r: r["val_tau"] if r["val_tau"] is not None else -1)
        info.append(("best val tau", f"{best['val_tau']:.3f} at step {best['step']}"))
    charts = [
        line_chart("loss", "loss (weighted CE)", [("train", series("loss")), ("val", series("val_loss"))],
                   points_only=["val"]),
        line_chart("tau", "tau, teacher-forced (accepted prefix + 1)",
                   [("train", series("tau")), ("val", series("val_tau"))], points_only=["val"]),
        line_chart("acc", "draft token accuracy", [("train", series("acc")), ("val", series("val_acc"))],
                   points_only=["val"]),
    ]
    acc_k = last.get("acc_k") or []
    if acc_k:
        charts.append(bar_chart("acc_k", f"train accuracy per draft position (step {last['step']})",
                                [str(i) for i in range(1, len(acc_k) + 1)], acc_k))
    if val and val[-1].get("val_acceptance"):
        acc = val[-1]["val_acceptance"]
        charts.append(bar_chart("val_acceptance", f"val acceptance per draft position (step {val[-1]['step']})",
                                [str(i) for i in range(1, len(acc) + 1)], acc))
    charts += [line_chart("tokens_per_s", "tokens/s (all ranks)", [("tokens/s", series("tokens_per_s"))]),
               line_chart("lr", "learning rate", [("lr", series("lr"))])]
    sections = [_table(info),
                '<div class="grid">' + "".join(f'<div class="card">{c}</div>' for c in charts) + "</div>"]
    return _page(f"hsstore run report: {Path(run_dir).name}", sections)


def write_report(path: str, out: str | Path, storage_options: dict[str, Any] | None = None) -> str:
    """``hsstore report``: PATH a run directory (has metrics.jsonl) or a store URL; returns what it was."""
    local = Path(path)
    if local.is_dir() and (local / "metrics.jsonl").is_file():
        text, kind = run_html(local), "run"
    else:
        from ..store.reader import open_store

        text, kind = store_html(open_store(path, **(storage_options or {}))), "store"
    out = Path(out)
    tmp = out.with_name(f".tmp-{out.name}")
    tmp.write_text(text)
    tmp.replace(out)
    return kind
