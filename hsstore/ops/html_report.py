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
import math
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

from ..io import door, sinks

W, H = 640, 260
M_LEFT, M_RIGHT, M_TOP, M_BOTTOM = 64, 16, 46, 44  # the top holds the title and a legend row
COLORS = ("#3b6fd4", "#e0662b", "#2f9e58", "#9b59b6")
MARK = "#d62728"
# in the head of every page: what tells a page this command may replace from a file of the user's
GENERATOR = '<meta name="generator" content="hsstore report">'

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
    if a < 1e-3:
        return f"{v:.1e}"
    if a >= 100:
        return f"{v:,.0f}"
    return f"{v:.3g}"


def count_fmt(v: float) -> str:
    """Counts (samples, tokens) on an axis: whole numbers with thousands separators."""
    return f"{v:,.0f}"


def nice_ticks(lo: float, hi: float, *, from_zero: bool = False) -> tuple[list[float], float, float]:
    """(ticks, axis low, axis high): round values (steps of 1, 2, 2.5 or 5 x 10^k), as near 5-6 of them as such
    steps allow (4-7), so an axis reads at a glance. ``from_zero`` (bars): the axis runs from 0 to the tick at
    or above ``hi``; else it is the data's range with the ticks inside it."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        lo = lo if math.isfinite(lo) else 0.0
        hi = lo + 1
    mag = 10.0 ** math.floor(math.log10((hi - lo) / 6))
    best = None
    for step in (m * mag * 10 ** k for k in range(3) for m in (1, 2, 2.5, 5)):
        first = math.ceil(lo / step - 1e-9) * step
        top = math.ceil(hi / step - 1e-9) * step if from_zero else hi
        n = int(math.floor((top - first) / step + 1e-9)) + 1
        if n > 7:
            continue
        miss = max(5 - n, n - 6, 0)
        if best is None or miss < best[0]:
            best = (miss, [round(first + i * step, 12) for i in range(n)], top)
        if n < 5:
            break
    ticks, top = best[1], best[2]
    return ticks, (0.0 if from_zero else lo), (top if from_zero else hi)


def step_fmt(ticks: list[float]):
    """Plain numbers for the ticks of one axis, all with the decimals their step needs (0.0005, 0.0010, ...),
    never exponents (a reader compares ticks by their digits)."""
    step = min((b - a for a, b in zip(ticks, ticks[1:])), default=1.0) or 1.0
    exp = math.floor(math.log10(step) + 1e-9)
    decimals = max(0, -exp + (1 if round(step / 10 ** exp, 6) == 2.5 else 0))  # 2.5 x 10^k needs one more
    return lambda v: f"{v:,.{decimals}f}"


def _frame(name: str, title: str, body: list[str], y_lo: float, y_hi: float, y_ticks: list[float],
           y_fmt=_fmt, x_ticks: list[tuple[float, str]] = (), x_title: str = "",
           legend: list[tuple[str, str, bool]] = ()) -> str:
    """The chart around ``body``: title, axes, y ticks (values in the units ``y_fmt`` writes), x ticks
    ((x in pixels, label)), an x-axis title, and a legend ((label, color, dots)) under the title."""
    pw, ph = W - M_LEFT - M_RIGHT, H - M_TOP - M_BOTTOM
    out = [f'<svg class="chart" data-chart="{_esc(name)}" xmlns="http://www.w3.org/2000/svg" width="{W}" '
           f'height="{H}" viewBox="0 0 {W} {H}" role="img" aria-label="{_esc(title)}">',
           f'<text class="title" x="{M_LEFT}" y="18">{_esc(title)}</text>',
           f'<line x1="{M_LEFT}" y1="{M_TOP + ph}" x2="{M_LEFT + pw}" y2="{M_TOP + ph}" stroke="#999"/>',
           f'<line x1="{M_LEFT}" y1="{M_TOP}" x2="{M_LEFT}" y2="{M_TOP + ph}" stroke="#999"/>']
    span = (y_hi - y_lo) or 1.0
    y_fmt = step_fmt(y_ticks) if y_fmt is _fmt else y_fmt
    for v in y_ticks:
        y = M_TOP + ph * (1 - (v - y_lo) / span)
        out.append(f'<text class="ytick" x="{M_LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{_esc(y_fmt(v))}</text>')
        if v != y_lo:
            out.append(f'<line x1="{M_LEFT}" y1="{y:.1f}" x2="{M_LEFT + pw}" y2="{y:.1f}" stroke="#eee"/>')
    out += body
    for x, lab in x_ticks:
        out.append(f'<line x1="{x:.1f}" y1="{M_TOP + ph}" x2="{x:.1f}" y2="{M_TOP + ph + 4}" stroke="#999"/>')
        out.append(f'<text class="xtick" x="{x:.1f}" y="{M_TOP + ph + 16}" text-anchor="middle">{_esc(lab)}</text>')
    if x_title:
        out.append(f'<text class="xtitle" x="{M_LEFT + pw / 2:.1f}" y="{H - 6}" text-anchor="middle">'
                   f'{_esc(x_title)}</text>')
    x = M_LEFT
    for label, color, dots in legend:
        mark = (f'<circle cx="{x + 8}" cy="32" r="3.5" fill="{color}"/>' if dots else
                f'<line x1="{x}" y1="32" x2="{x + 16}" y2="32" stroke="{color}" stroke-width="2"/>')
        out.append(f'<g class="legend">{mark}<text x="{x + 22}" y="36">{_esc(label)}</text></g>')
        x += 30 + 7 * len(label)
    out.append("</svg>")
    return "\n".join(out)


def bar_chart(name: str, title: str, labels: list[str], values: list[float], mark: int | None = None,
              note: str = "", warn: bool = False, y_fmt=_fmt, marks: Sequence[int] = ()) -> str:
    """Vertical bars; the bar at index ``mark`` outlined, and in red with its ``note`` only when ``warn`` (the
    stub signature: one small value dominates); those at ``marks`` (outlier shards) in red. ``y_fmt``: the axis's
    units (``human_bytes``, counts)."""
    pw, ph = W - M_LEFT - M_RIGHT, H - M_TOP - M_BOTTOM
    peak = max([v for v in values if v is not None and math.isfinite(v)] or [0]) or 1
    ticks, _, top = nice_ticks(0, peak, from_zero=True)
    n = max(len(values), 1)
    pitch = pw / n
    body, x_ticks = [], []
    for i, (lab, v) in enumerate(zip(labels, values)):
        v = v if v is not None and math.isfinite(v) else 0
        h = ph * v / top
        x = M_LEFT + i * pitch + pitch * 0.1
        color = MARK if (warn and mark == i) or i in marks else COLORS[0]
        outline = ' stroke="#222" stroke-width="1.5"' if mark == i else ""
        body.append(f'<rect class="mark bar" x="{x:.1f}" y="{M_TOP + ph - h:.1f}" width="{pitch * 0.8:.1f}" '
                    f'height="{max(h, 0.0):.1f}" fill="{color}"{outline}><title>{_esc(lab)}: {_esc(y_fmt(v))}'
                    '</title></rect>')
        if n <= 16 or i % math.ceil(n / 16) == 0:
            x_ticks.append((x + pitch * 0.4, lab))
    if note:
        style = f' style="fill:{MARK}"' if warn else ""
        body.append(f'<text class="note" x="{W - M_RIGHT}" y="18" text-anchor="end"{style}>{_esc(note)}</text>')
    return _frame(name, title, body, 0, top, ticks, y_fmt, x_ticks)


def line_chart(name: str, title: str, series: list[tuple[str, list[tuple[float, float]]]],
               points_only: Iterable[str] = (), y_fmt=_fmt) -> str:
    """Lines over steps; the series named in ``points_only`` as dots (validation every N steps). Step numbers
    on the x axis; a legend once two series have data."""
    pw, ph = W - M_LEFT - M_RIGHT, H - M_TOP - M_BOTTOM
    pts = [(x, y) for _, s in series for x, y in s if y is not None and math.isfinite(y)]
    if not pts:
        return _frame(name, title + " (no data)", [], 0, 1, [])
    x_lo, x_hi = min(p[0] for p in pts), max(p[0] for p in pts)
    y_lo, y_hi = min(p[1] for p in pts), max(p[1] for p in pts)
    if y_hi == y_lo:
        y_lo, y_hi = y_lo - 0.5, y_hi + 0.5
    x_hi = x_hi if x_hi > x_lo else x_lo + 1
    pad = 0.05 * (y_hi - y_lo)  # lines clear of the axes
    y_ticks, y_lo, y_hi = nice_ticks(y_lo - pad, y_hi + pad)
    steps, _, _ = nice_ticks(x_lo, x_hi)

    def xy(x, y):
        return M_LEFT + pw * (x - x_lo) / (x_hi - x_lo), M_TOP + ph * (1 - (y - y_lo) / (y_hi - y_lo))

    body, dots, legend = [], set(points_only), []
    for k, (label, s) in enumerate(series):
        color = COLORS[k % len(COLORS)]
        good = [xy(x, y) for x, y in s if y is not None and math.isfinite(y)]
        if not good:
            continue
        as_dots = label in dots or len(good) == 1
        if as_dots:
            body += [f'<circle class="mark point" cx="{x:.1f}" cy="{y:.1f}" r="3.5" fill="{color}"/>' for x, y in good]
        else:
            d = " ".join(f"{'M' if i == 0 else 'L'}{x:.1f},{y:.1f}" for i, (x, y) in enumerate(good))
            body.append(f'<path class="mark series" d="{d}" fill="none" stroke="{color}" stroke-width="2"/>')
        legend.append((label, color, as_dots))
    x_ticks = [(xy(t, y_lo)[0], f"{t:,.0f}") for t in steps if t == int(t)]
    return _frame(name, title, body, y_lo, y_hi, y_ticks, y_fmt, x_ticks, "step",
                  legend if len(legend) > 1 else [])


def _hist_labels(hist: list[dict]) -> list[str]:
    return [str(h["lo"]) if h["lo"] == h["hi"] else f"{h['lo']}-{h['hi']}" for h in hist]


def _page(title: str, sections: list[str]) -> str:
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">" + GENERATOR
            + f"<title>{_esc(title)}</title><style>{_CSS}</style></head><body>\n<h1>{_esc(title)}</h1>\n"
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
                  [h["count"] for h in hist], mark=mark, warn=s["stub_warning"], y_fmt=count_fmt,
                  note=f"top value {top['value']}: {100 * top['share']:.1f}% of samples"),
        bar_chart("length_histogram", "sample length in tokens (samples per log2 bin)", _hist_labels(lhist),
                  [h["count"] for h in lhist], y_fmt=count_fmt),
        bar_chart("response_fraction", f"response tokens {100 * s['response_fraction']:.1f}% of all tokens",
                  ["response (loss) tokens", "prompt / other tokens"],
                  [s["loss_tokens"], s["tokens"] - s["loss_tokens"]], y_fmt=count_fmt),
        bar_chart("flags", "samples per quality flag ((none): no flag)", list(flags), list(flags.values()),
                  y_fmt=count_fmt),
        bar_chart("bytes_per_layer", "stored bytes per layer", [f"layer {k}" if k.isdigit() else k for k in per_layer],
                  [v["stored_bytes"] for v in per_layer.values()], y_fmt=human_bytes),
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


# the fields of a metrics.jsonl row (``train/metrics.py`` writes them) by kind: a run from elsewhere holds whatever
# its sender wrote, so every row is typed field by field before any field is used
COUNT, NUMBER, NUMBERS, FLAG = "a count", "a number or null", "a list of numbers", "true or false"
ROW_FIELDS = {**dict.fromkeys(("step", "epoch", "tokens", "samples", "interval_steps", "val_anchors", "arrived_samples",
                               "arrived_tokens"), COUNT),
              **dict.fromkeys(("loss", "acc", "tau", "lr", "grad_norm", "tokens_per_s", "wait_frac", "interval_seconds",
                               "gpu_mem_gib", "val_loss", "val_acc", "val_tau", "val_seconds"), NUMBER),
              "acc_k": NUMBERS, "val_acceptance": NUMBERS, "arrival_done": FLAG}
MAX_POSITIONS = 1 << 12  # entries of a per-draft-position list (a block has a few dozen)


def _typed(value: Any, kind: str) -> tuple[bool, Any]:
    """(whether ``value`` is of ``kind``, the value to use: a non-finite number as null, as the trainer writes it)."""
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == COUNT:
        return is_number and isinstance(value, int) and 0 <= value < 1 << 53, value
    if kind == NUMBER:
        return value is None or is_number, value if is_number and math.isfinite(value) else None
    if kind == FLAG:
        return isinstance(value, bool), value
    if not isinstance(value, list) or len(value) > MAX_POSITIONS:
        return False, value
    items = [_typed(v, NUMBER) for v in value]
    return all(ok for ok, _ in items), [v for _, v in items]


def metrics_row(obj: Any, where: str, *, needs_step: bool = True) -> dict[str, Any]:
    """A metrics.jsonl row (or the metrics a best-checkpoint pointer copies from one, which may have no step) with
    every field of ``ROW_FIELDS`` checked against its kind, and nothing else; ValueError naming ``where`` and the
    field."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: not a metrics row (a JSON {type(obj).__name__}, not an object)")
    out = {}
    for key, kind in ROW_FIELDS.items():
        if key in obj:
            ok, out[key] = _typed(obj[key], kind)
            if not ok:
                raise ValueError(f"{where}: {key} {obj[key]!r:.60} is not {kind}")
    if needs_step and "step" not in out:
        raise ValueError(f"{where}: has no step")
    return out


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The typed rows of a run's metrics.jsonl (``metrics_row``), read through the door."""
    path = Path(run_dir) / "metrics.jsonl"
    text = door.read_beneath(run_dir, path.name, bound=door.RUN_LOG_CAP, where=str(run_dir)).decode("utf-8", "replace")
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}: line {n}"
        rows.append(metrics_row(door.load_json(line, where, error=ValueError), where))
    return rows


def run_html(run_dir: str | Path) -> str:
    """The page of a training run directory (its ``metrics.jsonl``)."""
    rows = read_metrics(run_dir)

    def series(key: str) -> list[tuple[float, float]]:
        return [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]

    last = rows[-1] if rows else {}
    val = [r for r in rows if r.get("val_tau") is not None]
    info = [("run", str(run_dir)), ("steps logged", f"{len(rows)} (last step {last.get('step', '-')})")]
    if val:
        best = max(val, key=lambda r: r["val_tau"])
        info.append(("best val tau", f"{best['val_tau']:.3f} at step {best['step']} (teacher-forced, the mean over "
                                     "every anchor of the validation stores)"))
    charts = [
        line_chart("loss", "loss (weighted CE)", [("train", series("loss")), ("val", series("val_loss"))],
                   points_only=["val"]),
        line_chart("tau", "tau, teacher-forced (accepted prefix + 1, the mean over each point's anchors)",
                   [("train", series("tau")), ("val", series("val_tau"))], points_only=["val"]),
        line_chart("acc", "draft token accuracy", [("train", series("acc")), ("val", series("val_acc"))],
                   points_only=["val"]),
    ]
    epoch0 = [r for r in rows if isinstance(r.get("arrived_samples"), int) and r.get("epoch") == 0]
    if epoch0:  # train --follow: the data's arrival beside what was trained, over the steps of epoch 0
        trained, total = [], 0
        for r in epoch0:
            total += r.get("samples") or 0
            trained.append((r["step"], total))
        charts.insert(1, line_chart("arrivals", "epoch 0: samples arrived and trained (--follow)",
                                    [("arrived", [(r["step"], r["arrived_samples"]) for r in epoch0]),
                                     ("trained", trained)], y_fmt=count_fmt))
    acc_k = last.get("acc_k") or []
    if acc_k:
        charts.append(bar_chart("acc_k", f"train accuracy per draft position (step {last['step']})",
                                [str(i) for i in range(1, len(acc_k) + 1)], acc_k))
    if val and val[-1].get("val_acceptance"):
        acc = val[-1]["val_acceptance"]
        charts.append(bar_chart("val_acceptance", f"val acceptance per draft position (step {val[-1]['step']})",
                                [str(i) for i in range(1, len(acc) + 1)], acc))
    charts += [line_chart("tokens_per_s", "tokens/s (all ranks)", [("tokens/s", series("tokens_per_s"))],
                          y_fmt=count_fmt),
               line_chart("lr", "learning rate", [("lr", series("lr"))])]
    sections = [_table(info),
                '<div class="grid">' + "".join(f'<div class="card">{c}</div>' for c in charts) + "</div>"]
    return _page(f"hsstore run report: {Path(run_dir).name}", sections)


def check_report_destination(out: Path) -> None:
    """The destination rule of every writing command, for one file: a new path, or a page this command wrote
    before (its generator tag in the first bytes) is replaced; anything else is the user's and is refused,
    before the store or run is read."""
    from ..io.destination import DestinationError

    if not out.exists() and not out.is_symlink():
        return
    if out.is_dir():
        raise DestinationError(f"report --out {out}: is a folder; give a file name such as {out / 'report.html'} "
                               "(nothing was written)")
    try:  # through the door: a FIFO there is refused, not waited on; a link is not followed
        with door.opened(str(out.parent), out.name, where="report --out") as (fd, _):
            head = os.pread(fd, 512, 0)
    except door.Refused as e:
        raise DestinationError(f"report --out {out}: {e.why}; give a new file name (nothing was written)") from None
    except OSError as e:
        raise DestinationError(f"report --out {out}: exists and cannot be read ({e}); nothing was written") from None
    if GENERATOR.encode() not in head:
        raise DestinationError(f"report --out {out}: exists and is not a report hsstore wrote; give a new file "
                               "name, or move it away (nothing was written)")


def write_report(path: str, out: str | Path, storage_options: dict[str, Any] | None = None) -> str:
    """``hsstore report``: PATH a run directory (has metrics.jsonl) or a store URL; returns what it was."""
    out = Path(out)
    check_report_destination(out)
    local = Path(path)
    if local.is_dir() and (local / "metrics.jsonl").is_file():
        text, kind = run_html(local), "run"
    else:
        from ..store import reader

        text, kind = store_html(reader.open(path, **(storage_options or {}))), "store"
    # a fresh temporary name renamed over OUT: a link planted at a fixed temporary name is never written through
    sinks.write_atomic(out.parent, out.name, text.encode("utf-8"), what=f"report --out {out}")
    return kind
