"""``hsstore info``: what a store holds, from commit records only (never feature data)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import numpy as np

from ..format import codec, health, serving
from . import stats
from ..store.reader import Store
from ..redaction import recordable_url
from ..terminal import escape

STUB_WARN_MAX_VALUE = 32
STUB_WARN_SHARE = 0.2


def summarize(store: Store) -> dict[str, Any]:
    """From the records' columns (``Store.table``): no record is parsed, however many shards."""
    m = store.manifest
    t = store.table
    loss_sums = t.samples["loss_tokens"].tolist()
    lengths = t.samples["length"].tolist()
    thinking = int(t.samples["thinking_tokens"].sum())
    flags: Counter[str] = Counter()
    for code, n in zip(*np.unique(t.flags.codes, return_counts=True)):
        for f in t.flags.values[code]:
            flags[f] += int(n)
    skipped_ids: dict[str, set[str]] = {}
    for row in sorted(t.skipped):  # ids, not counts: a resumed run notes the same skips again
        for reason, ids in t.skipped[row].items():
            skipped_ids.setdefault(reason, set()).update(ids)
    skipped = {reason: len(ids) for reason, ids in skipped_ids.items()}
    layers = {}
    for l in m.all_features:  # the layers, then named features (final_hidden)
        j = t.slots.index(str(l)) if str(l) in t.slots else None
        if not len(t):
            layers[str(l)] = {"stored_bytes": 0, "raw_bytes": 0, "ratio": None}
            continue
        # a shard that lists no such feature counts none (the admission's verdict names it)
        stored = int(np.maximum(t.layer_stored[:, j], 0).sum()) if j is not None else 0
        raw = int(np.maximum(t.layer_raw[:, j], 0).sum()) if j is not None else 0
        layers[str(l)] = {"stored_bytes": stored, "raw_bytes": raw, "ratio": raw / stored if stored else None}
    stored_total = int(t.ints["stored_bytes"].sum())
    raw_total = sum(v["raw_bytes"] for v in layers.values())
    n_tokens = int(t.n_tokens.sum())
    feature_stored = sum(v["stored_bytes"] for v in layers.values())
    out = {"admission": verdict(store)}  # first: what every reader will do with this store
    out.update(stats.loss_sum_summary(loss_sums, lengths))
    out.update({
        "url": recordable_url(store.url),
        "format_version": m.format_version,
        "shards": len(t),
        "writers": writer_sessions(t.shard.tolist()),
        "thinking_tokens": thinking,
        "flags": dict(flags),
        "skipped": dict(skipped),
        "layers": list(m.layers),
        "features": list(m.features),
        "tap_tensor": serving.TAP_TENSOR,
        "serving": serving.serving(m.layers, m.target.num_layers, m.features).summary(),
        "hidden_size": m.hidden_size,
        "dtype": m.dtype,
        "encoding": m.encoding,
        "codec": m.codec,
        "layout": m.layout,
        "bytes_per_layer": layers,
        "stored_bytes": stored_total,
        "raw_feature_bytes": raw_total,
        "feature_stored_bytes": feature_stored,  # of stored_bytes, the features' chunks (the rest: ids, masks, metadata)
        "compression_ratio": raw_total / feature_stored if raw_total else None,  # raw features / their stored bytes
        # stored feature bytes (all taps; fp8: values + scales) per token, and the same in the target's dtype
        "bytes_per_token": feature_stored / n_tokens if n_tokens else None,
        "dtype_bytes_per_token": codec.token_bytes(m.dtype, "raw", len(m.all_features), m.hidden_size),
        "target": dataclasses.asdict(m.target),
        "tokenizer": dataclasses.asdict(m.tokenizer),
        "created_by": m.created_by,
        # how this open used the index: records taken from it vs read one by one (`hsstore index` gathers them)
        "index": {"indexed": store.index_use.indexed, "fetched": store.index_use.fetched,
                  "segments": store.index_use.segments, "damaged": len(store.index_use.damaged)},
        "stub_warning": stats.dominated(out["top_loss_sum"], STUB_WARN_MAX_VALUE, STUB_WARN_SHARE),
        # what the stored values look like (docs/FORMAT.md, "Feature statistics"): a store of zeros trains nothing
        "feature_health": health.summary(t, m.all_features),
    })
    return out


def verdict(store: Store) -> dict[str, Any]:
    """The admission's store-wide verdict (``Store.breaches``): whether readers serve the store, and the breaches
    (each a line naming the shard and the rule)."""
    bad = store.breaches()
    return {"ok": not bad, "problems": [str(b.problem()) for b in bad]}


def writer_sessions(shards) -> int:
    """Writer sessions that made the shards: a shard is named ``<writer tag>-<session>-<sequence>`` (FORMAT.md), so
    two extractions (each rank tagged ``rank00000`` ...) merged into one store count as two, as does a resumed run."""
    return len({str(name).rsplit("-", 1)[0] for name in shards})


def feature_lines(h: dict[str, Any], shards: int) -> list[str]:
    """The feature statistics' lines: per feature mean, RMS (and its spread over shards), max |x|, zeros and
    non-finite values, then a warning line for each rule broken."""
    lines = []
    for key, f in h["features"].items():
        r = f["shard_rms"]
        lines.append(f"  {health.feature_name(key):>12}: rms {f['rms']:.4g} (shards {r['min']:.4g} / {r['median']:.4g} / "
                     f"{r['max']:.4g}), mean {f['mean']:.3g}, max |x| {f['absmax']:.4g}, zeros "
                     f"{100 * f['zero_share']:.2f}%, non-finite {f['nonfinite']:,}")
    if lines:
        lines.insert(0, "features   value statistics per feature (rms min / median / max over shards):")
    if h["shards_without"]:
        lines.append(f"features   {h['shards_without']} of {shards} shard(s) without value statistics (written "
                     "before them): `hsstore upgrade URL` adds them")
    lines += [f"!!! WARNING: {w}" for w in h["warnings"]]
    return lines


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n}"


def escaped(value: Any) -> Any:
    """``value`` with every string in it (keys too) escaped for a terminal (``terminal.escape``)."""
    if isinstance(value, str):
        return escape(value)
    if isinstance(value, dict):
        return {escaped(k): escaped(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [escaped(v) for v in value]
    return value


def format_text(s: dict[str, Any]) -> str:
    """``summarize``'s result as lines for a terminal: every store string escaped first."""
    ad = s["admission"]  # already escaped (``Problem``): first, before anything it describes
    lines = ["admission  OK: every reader serves this store" if ad["ok"] else
             f"admission  REFUSED: {len(ad['problems'])} problem(s); no reader serves this store (what follows "
             "describes it as its records say; `hsstore verify` checks every byte):"]
    lines += [f"  FAIL {p}" for p in ad["problems"]]
    s = escaped({k: v for k, v in s.items() if k != "admission"})
    lines.append(f"store      {s['url']}  (format v{s['format_version']}, {s['layout']}, {s['dtype']}, "
                 f"encoding {s['encoding']}, codec {s['codec']})")
    t, k = s["target"], s["tokenizer"]
    lines.append(f"target     {t['name']}  type={t['model_type']} layers={t['num_layers']} hidden={t['hidden_size']} "
                 f"revision={t['revision']} config={t['config_hash'][:12]}")
    lines.append(f"tokenizer  {k['name']}  vocab={k['vocab_hash'][:12]} template={(k['chat_template_hash'] or '-')[:12]}")
    lines.append(f"taps       layers {s['layers']} (layer l = {s['tap_tensor']}; for the last layer not HF's last "
                 "hidden_states entry, which is the norm's)"
                 + ("; + final_hidden (the final norm's output)" if s["features"] else ""))
    lines.append(f"serving    {s['serving']}")
    lines.append(f"samples    {s['samples']:,} in {s['shards']} shards from {s['writers']} writer session(s)")
    ix = s["index"]
    if ix["fetched"] and s["shards"] > 100:  # opening paid a request per record not indexed
        lines.append(f"index      {ix['indexed']:,} records indexed, {ix['fetched']:,} read one by one: "
                     f"`hsstore index {s['url']}` makes opening cheaper")
    if not s["samples"]:
        lines.append("           (empty store: no committed shards)")
        return "\n".join(lines)
    lines.append(f"tokens     {s['tokens']:,}; loss tokens {s['loss_tokens']:,} "
                 f"(response fraction {100 * s['response_fraction']:.1f}%); thinking tokens {s['thinking_tokens']:,}")
    lp = s["length_percentiles"]
    lines.append("length     " + "  ".join(f"{k}={v:,.0f}" for k, v in lp.items()))
    top = s["top_loss_sum"]
    lines.append(f"loss sum   mean {s['loss_sum_mean']:.1f}  " +
                 "  ".join(f"{k}={v:,.0f}" for k, v in s["loss_sum_percentiles"].items()))
    lines.append(f"           most common value {top['value']} held by {100 * top['share']:.1f}% of samples")
    if s["stub_warning"]:
        lines.append(f"!!! WARNING: {100 * top['share']:.1f}% of samples have a loss-mask sum of exactly {top['value']} "
                     "tokens: stub answers? Read some with `hsstore show`.")
    lines.append("loss-mask-sum histogram (samples):")
    lines += stats.histogram_lines(s["loss_sum_histogram"], s["samples"], mark=top["value"])
    if s["flags"]:
        lines.append("flags      " + ", ".join(f"{k}={v}" for k, v in sorted(s["flags"].items())))
    if s["skipped"]:
        lines.append("skipped    " + ", ".join(f"{k}={v}" for k, v in sorted(s["skipped"].items())))
    # every ratio is raw / stored, printed beside the two figures it divides: above 1x the codec saves space,
    # below 1x chunk padding and checksums cost more than it saves
    other = s["stored_bytes"] - s["feature_stored_bytes"]
    lines.append(f"bytes      {human_bytes(s['stored_bytes'])} stored in all: features {human_bytes(s['feature_stored_bytes'])}, "
                 f"token ids, masks and metadata {human_bytes(other)}")
    lines.append(f"features   {human_bytes(s['raw_feature_bytes'])} raw / {human_bytes(s['feature_stored_bytes'])} stored "
                 f"= {s['compression_ratio']:.2f}x (raw / stored: above 1x the codec saves space, below 1x chunk padding "
                 "and checksums cost more)")
    lines.append(f"per token  {s['dtype_bytes_per_token']:,} B as {s['dtype']} / {s['bytes_per_token']:,.1f} B stored "
                 f"({s['encoding']}) = {s['dtype_bytes_per_token'] / s['bytes_per_token']:.2f}x")
    for l, b in s["bytes_per_layer"].items():
        lines.append(f"  {'layer ' + format(int(l), '>3') if l.isdigit() else l}: {human_bytes(b['raw_bytes'])} raw / "
                     f"{human_bytes(b['stored_bytes'])} stored = {b['ratio']:.2f}x")
    lines += feature_lines(s["feature_health"], s["shards"])
    return "\n".join(lines)
