"""``hsstore audit``: are a store's features what its target computes for the stored tokens?

Checksums prove the bytes are the bytes written, feature statistics that they are not zeros or NaN; neither says
they are the right layer of the right model for the right tokens. The field's silent failures are exactly that:
vLLM's capture returned zeros on hybrid targets, the peers count layer ids one apart, a batch padded on the wrong
side shifts or changes states, files from another checkpoint look like any others. ``audit`` re-runs the target's
reference forward on a few stored samples and compares every stored feature with the recomputed one.

The reference is the plain eager forward (never compiled; on CPU transformers' torch path, on GPU fla's
kernels), one sample at a time (batch 1, no padding), and it reads the layers independently of extraction's
capture hooks: HF ``hidden_states[l + 1]`` is layer ``l``'s output for every layer but the last, whose entry HF
replaces by the final norm's output (``final_hidden``); the last layer's own output is taken by a forward hook.

The samples are chosen from their content, so every copy of a store (converted, subset, imported, re-extracted)
audits the same ones: the ``N`` samples whose ``input_ids`` (little-endian int32 bytes) have the smallest
BLAKE2b-64 digests, ties in store order. Choosing them reads every sample's ``input_ids`` (4 bytes per token).

Each stored feature of each sample is held to the bound of the store's dtype and encoding at the feature's depth
(``compare.bound_of``: rounding grows with the layers a value went through), and must be closer to its own
recomputed layer than to the layers beside it (a neighbouring layer drifts least from it, and at depth the two can
approach); one that misses either is diagnosed: ``zeros``, ``non-finite values``, ``a different layer`` (another recomputed
feature holds the bound: which one), ``shifted tokens`` (stored position t matches the recomputed t-1 or t+1),
``different tokens`` (the store's tokenizer is not the model's), else ``a different target``.

Before any sample is read, the model's weights are held to what the manifest recorded of the extraction's:
``weights_fingerprint`` (every tensor, a few kB of each) and ``weights_hash`` (the embedding); when either differs
the audit fails at once, ``a different target``, without a forward. The bounds stay for what the hashes cannot see
(a store imported without them, a change between the values they sample).
"""

from __future__ import annotations

import hashlib
import heapq
import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from hsstore.app.devices import describe, resolve_device
from hsstore.format.health import feature_name
from hsstore.redaction import recordable_url
from hsstore.terminal import escape

from hsstore.app.target import base_model, decoder_layers, load_target
from .compare import Agreement, Bound, agreement, bound_of, bound_rule, depth_of
from .target import DTYPES, FINGERPRINT, identity_from_model_dir, weights_fingerprint, weights_hash

log = logging.getLogger(__name__)

DEFAULT_SAMPLES = 8


# -- which samples ---------------------------------------------------------------------------------------------
def ids_digest(ids: np.ndarray) -> bytes:
    """The key that orders samples for the audit: BLAKE2b-64 of the ids as little-endian int32 bytes."""
    return hashlib.blake2b(np.ascontiguousarray(ids, dtype="<i4").tobytes(), digest_size=8).digest()


def chosen_samples(store, n: int, progress: bool = False) -> list[int]:
    """Store indices of the ``n`` non-empty samples with the smallest ``ids_digest``, ties in store order (the
    rule the module docstring states); reads every shard's ``input_ids`` only."""
    from tqdm import tqdm

    t = store.table

    def keyed():
        for s in tqdm(range(len(t.shard)), desc="audit: choosing samples", unit="shard", disable=not progress):
            off = t.offsets(s)
            T = int(off[-1])
            ids, _, _ = store.read_range(t.shard[s], 0, T, layers=[], scales_out=store.new_scales(0, T))
            for k in range(len(off) - 1):
                if off[k + 1] > off[k]:
                    yield ids_digest(ids[off[k]:off[k + 1]]), int(t.first[s]) + k

    return [i for _, i in heapq.nsmallest(n, keyed())]


# -- the reference forward ---------------------------------------------------------------------------------------
@torch.inference_mode()
def reference_features(model, input_ids: torch.Tensor) -> torch.Tensor:
    """``[T, n_layers + 1, H]`` for one sample's ids ``[T]``: every decoder layer's output (tap id ``l`` at index
    ``l``), then the final norm's (``final_hidden``), from one eager forward at batch 1 without padding."""
    last: list[torch.Tensor] = []
    stack = decoder_layers(model)
    hook = stack[-1].register_forward_hook(
        lambda _m, _i, out: last.append(out[0] if isinstance(out, (tuple, list)) else out))
    try:
        device = next(model.parameters()).device
        out = base_model(model)(input_ids=input_ids.to(device)[None], output_hidden_states=True, use_cache=False)
    finally:
        hook.remove()
    hs = out.hidden_states  # [embeddings, layer 0, ..., layer n-2, final norm]: HF replaces the last layer's
    if len(hs) != len(stack) + 1 or not last:
        raise RuntimeError(f"the forward gave {len(hs)} hidden states for {len(stack)} decoder layers")
    return torch.stack([*hs[1:-1], last[0], hs[-1]], dim=2)[0]


def candidate_name(c: int, n_layers: int) -> str:
    """Recomputed feature ``c`` (index into ``reference_features``) as a person reads it."""
    return "final_hidden (the final norm's output)" if c == n_layers else f"layer {c}"


def candidate_of(feature: int | str, n_layers: int) -> int:
    return n_layers if feature == "final_hidden" else int(feature)


# -- one feature of one sample -------------------------------------------------------------------------------
@dataclass
class Finding:
    """One stored feature of one sample against its recomputation; ``diagnosis`` when it misses the bound."""

    index: int
    sample_id: str
    feature: int | str
    figures: Agreement
    ok: bool
    diagnosis: str | None = None
    detail: str = ""
    matches: int | None = None  # the recomputed feature it matches instead (a different layer)

    def as_dict(self, n_layers: int) -> dict[str, Any]:
        return {"index": self.index, "sample_id": self.sample_id, "feature": feature_name(self.feature),
                **self.figures.as_dict(), "ok": self.ok, "diagnosis": self.diagnosis, "detail": self.detail or None,
                "matches": None if self.matches is None else candidate_name(self.matches, n_layers)}


def convention(own: int, match: int, n_layers: int) -> str:
    """What a stored feature that holds another recomputed feature most likely is."""
    if own == n_layers - 1 and match == n_layers:
        return "the final norm's output (HF's last hidden_states entry), not the last layer's own output"
    if own == n_layers and match == n_layers - 1:
        return ("the last layer's output before the final norm (what vLLM id N and speculators' "
                "verifier_last_hidden_states hold), not the norm's output")
    if match == own + 1:
        return "the off-by-one tap convention between engines (vLLM/speculators count one higher)"
    if match == own - 1:
        return ("the off-by-one tap convention between engines the other way: vLLM/speculators ids (id i = output "
                "of layer i-1) taken as hsstore ids")
    return "taps recorded under the wrong ids"


def diagnose(stored: torch.Tensor, ref: torch.Tensor, own: int, bound_at: Callable[[int], Bound], tokens_differ: bool
             ) -> tuple[str, str, int | None]:
    """(diagnosis, detail, matched candidate) of stored ``[T, H]`` that misses its bound or is closer to another
    recomputed feature than to ``ref[:, own]`` (``ref``: ``[T, n_layers + 1, H]``; ``bound_at(c)``: the bound
    for candidate ``c``)."""
    n_layers = ref.shape[1] - 1
    name = feature_name(own) if own < n_layers else "final_hidden"
    if not bool(torch.isfinite(stored).all()):
        return "non-finite values", f"stored {name} holds NaN/Inf values", None
    if not bool(stored.any()):
        return "zeros", f"stored {name} is all zeros", None
    figures = [agreement(stored, ref[:, c]) for c in range(n_layers + 1)]
    held = [c for c in range(n_layers + 1) if c != own and bound_at(c).holds(figures[c])
            and figures[c].rel_err < figures[own].rel_err]
    if held:
        c = min(held, key=lambda k: figures[k].rel_err)
        return ("a different layer", f"stored {name} matches the target's {candidate_name(c, n_layers)} (cosine "
                f"{figures[c].cosine:.6f}; its own: {figures[own].cosine:.4f}): {convention(own, c, n_layers)}", c)
    own_bound = bound_at(own)
    if stored.shape[0] > 1:
        for lag, what in ((1, "t-1 (one token late)"), (-1, "t+1 (one token early)")):
            s, r = (stored[1:], ref[:-1, own]) if lag == 1 else (stored[:-1], ref[1:, own])
            shifted = agreement(s, r)
            if own_bound.holds(shifted):
                return ("shifted tokens", f"stored {name} at position t holds the target's position {what}, cosine "
                        f"{shifted.cosine:.6f}", None)
    if tokens_differ:
        return ("different tokens", "the store's tokenizer is not the model's: its input_ids are other tokens to "
                "this target", None)
    if own_bound.cosine <= figures[own].cosine and figures[own].rel_err > own_bound.rel_err:
        return ("scaled values", f"stored {name} points the way the target's does (cosine {figures[own].cosine:.6f}) "
                f"but its size is off: relative error {figures[own].rel_err:.4f}, norm "
                f"{float(stored.double().norm() / ref[:, own].double().norm().clamp_min(1e-30)):.3f}x the target's",
                None)
    c = max(range(n_layers + 1), key=lambda k: figures[k].cosine)
    return ("a different target", f"no feature of the target matches stored {name} (closest: the target's "
            f"{candidate_name(c, n_layers)}, cosine {figures[c].cosine:.4f}): another model or other weights made "
            "it", None)


def judge(stored: torch.Tensor, ref: torch.Tensor, own: int, bound_at: Callable[[int], Bound]) -> tuple[Agreement, bool]:
    """The figures of stored ``[T, H]`` against its own recomputed feature ``ref[:, own]``, and whether it is the
    target's own: within the bound at its depth and closer (relative error) than the recomputed features beside
    it (``own - 1``, ``own + 1``)."""
    figures = agreement(stored, ref[:, own])
    if not bound_at(own).holds(figures):
        return figures, False
    beside = [c for c in (own - 1, own + 1) if 0 <= c < ref.shape[1]]
    return figures, all(figures.rel_err < agreement(stored, ref[:, c]).rel_err for c in beside)


def stored_features(item: dict[str, Any], features: Sequence[int | str]) -> list[torch.Tensor]:
    """An item's features ``[T, H]`` each, in ``features``' (the manifest's) order."""
    hs = item["hidden_states"]
    return [item["final_hidden"] if f == "final_hidden" else hs[:, j] for j, f in enumerate(features)]


def json_safe(value: Any) -> Any:
    """``value`` with its non-finite floats as None (JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


# -- the report ------------------------------------------------------------------------------------------------
@dataclass
class AuditReport:
    url: str
    model: str
    encoding: str
    dtype: str
    n_layers: int
    store_samples: int
    features: list[int | str]
    samples: list[dict[str, Any]] = field(default_factory=list)  # index, sample_id, tokens of each audited one
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # identity mismatches, said before the figures
    other_weights: str | None = None  # the manifest's record of the weights against the model's, when they differ

    @property
    def ok(self) -> bool:
        return self.other_weights is None and all(f.ok for f in self.findings)

    def bound_at(self, candidate: int) -> Bound:
        """The bound for recomputed feature ``candidate`` (a layer, or ``n_layers``: the final norm's output)."""
        return bound_of(self.dtype, self.encoding, depth_of("final_hidden" if candidate == self.n_layers
                                                            else candidate, self.n_layers))

    def bound(self, feature: int | str) -> Bound:
        return self.bound_at(candidate_of(feature, self.n_layers))

    def by_feature(self) -> dict[int | str, list[Finding]]:
        out: dict[int | str, list[Finding]] = {f: [] for f in self.features}
        for f in self.findings:
            out[f.feature].append(f)
        return out

    def verdicts(self) -> dict[int | str, dict[str, Any]]:
        """Per feature: the worst figures, the samples within the bound and, when some are not, the diagnosis most
        of the failing samples share."""
        out = {}
        for feat, found in self.by_feature().items():
            failed = [f for f in found if not f.ok]
            common = Counter((f.diagnosis, f.matches) for f in failed).most_common(1)
            first = next((f for f in failed if (f.diagnosis, f.matches) == common[0][0]), None) if common else None
            bound = self.bound(feat)
            out[feat] = {"ok": not failed, "bound": {"cosine": bound.cosine, "rel_err": bound.rel_err},
                         "min_cosine": min((f.figures.cosine for f in found), default=float("nan")),
                         "max_rel_err": max((f.figures.rel_err for f in found), default=float("nan")),
                         "samples_ok": len(found) - len(failed), "samples": len(found),
                         "diagnosis": first.diagnosis if first else None, "detail": first.detail if first else None,
                         "diagnosed_samples": common[0][1] if common else 0,
                         "first_sample": first.sample_id if first else None}
        return out

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON values (a figure that could not be computed, NaN, as null)."""
        return json_safe({"url": recordable_url(self.url), "model": self.model, "ok": self.ok,
                "bound": {"rule": "1 - cosine <= floor + per_layer * depth (tap l: depth l + 1; final_hidden: "
                          "layers + 1); relative error <= rel_margin * sqrt(2 * (1 - cosine bound)); closer to its "
                          "own layer than to the layers beside it", **bound_rule(self.dtype, self.encoding)},
                "dtype": self.dtype, "encoding": self.encoding, "store_samples": self.store_samples,
                "notes": self.notes, "weights": {"ok": self.other_weights is None, "detail": self.other_weights},
                "samples": self.samples,
                "features": {feature_name(k): v for k, v in self.verdicts().items()},
                "results": [f.as_dict(self.n_layers) for f in self.findings]})

    def failures(self) -> list[str]:
        """One line per failing feature: its name, what it looks like, the figures; first the weights, when the
        manifest's record of them is not the model's."""
        lines = [f"weights: a different target: {self.other_weights}"] if self.other_weights else []
        for feat, v in self.verdicts().items():
            if not v["ok"]:
                lines.append(f"{feature_name(feat)}: {v['diagnosis']}: {v['detail']} ({v['diagnosed_samples']} of "
                             f"{v['samples']} samples, first {v['first_sample']!r}; worst cosine {v['min_cosine']:.4f}, relative error "
                             f"{v['max_rel_err']:.4f})")
        return lines

    def format_text(self) -> str:
        if self.other_weights:  # no feature compared: whatever their figures, they are another model's
            lines = [f"audit {recordable_url(self.url)} against {self.model}: the weights first (the manifest's "
                     "weights_hash and weights_fingerprint against the model's)", *(f"note: {n}" for n in self.notes),
                     *(f"FAIL {line}" for line in self.failures()),
                     "audit: FAILED, the model's weights are not those the store was extracted from"]
            return "\n".join(escape(line) for line in lines) + "\n"
        tokens = sum(s["tokens"] for s in self.samples)
        lines = [f"audit {recordable_url(self.url)} against {self.model}: {len(self.samples)} of "
                 f"{self.store_samples:,} samples ({tokens:,} tokens; the ones whose input_ids hash lowest), "
                 f"{self.dtype} {self.encoding}, held to {self.bound_at(0).why.rsplit(' after ', 1)[0]}, which grows "
                 "with depth, and to being closer to its own layer than to those beside it"]
        lines += [f"note: {n}" for n in self.notes]
        lines.append(f"{'feature':<14} {'min cosine':>12} {'(bound)':>10} {'max rel. error':>15} {'(bound)':>8}  "
                     "within the bound")
        for feat, v in self.verdicts().items():
            lines.append(f"{feature_name(feat):<14} {v['min_cosine']:>12.6f} {v['bound']['cosine']:>10.6f} "
                         f"{v['max_rel_err']:>15.6f} {v['bound']['rel_err']:>8.4f}  {v['samples_ok']}/{v['samples']}")
        lines += [f"FAIL {line}" for line in self.failures()]
        lines.append("audit: OK, every stored feature is the target's own" if self.ok else
                     f"audit: FAILED, {len(self.failures())} of {len(self.features)} features")
        return "\n".join(escape(line) for line in lines) + "\n"  # names, ids and URLs are the store's


# -- the audit ---------------------------------------------------------------------------------------------------
def identity_notes(manifest, model_dir: str) -> tuple[list[str], bool]:
    """What the store's manifest and the model folder disagree on, and whether the tokenizers differ; refuses a
    model of another depth or width (ValueError: its features could not be compared at all)."""
    target, tokenizer = identity_from_model_dir(model_dir)
    mt, mk = manifest.target, manifest.tokenizer
    if (mt.num_layers, mt.hidden_size) != (target.num_layers, target.hidden_size):
        raise ValueError(f"{model_dir} has {target.num_layers} layers of hidden size {target.hidden_size}; the store's "
                         f"target {mt.name!r} has {mt.num_layers} of {mt.hidden_size}: not the store's target")
    notes = []
    differ = mk.vocab_hash != tokenizer.vocab_hash
    if differ:
        notes.append(f"different tokens: the store's tokenizer ({mk.name!r}, vocab_hash {mk.vocab_hash[:12]}) is not "
                     f"{model_dir}'s (vocab_hash {tokenizer.vocab_hash[:12]}): its input_ids may be other tokens here")
    if mk.chat_template_hash != tokenizer.chat_template_hash:
        notes.append(f"the store was tokenized with another chat template than {model_dir}'s (chat_template_hash "
                     f"{str(mk.chat_template_hash)[:12]} vs {str(tokenizer.chat_template_hash)[:12]}): a drafter "
                     "trained on it sees other prompts than the served model")
    if mt.config_hash != target.config_hash:
        notes.append(f"the store names another model config than {model_dir}'s (config_hash {mt.config_hash[:12]} vs "
                     f"{target.config_hash[:12]})")
    return notes, differ


def audit(url: str, model_dir: str, samples: int = DEFAULT_SAMPLES, device: str | None = None,
          storage_options: dict[str, Any] | None = None, progress: bool = True) -> AuditReport:
    """Compare the features of ``samples`` stored samples with ``model_dir``'s reference forward (module
    docstring); raises ValueError for a model that is not the store's target's shape."""
    from hsstore.store import reader

    if samples < 1:
        raise ValueError(f"--samples must be at least 1, got {samples}")
    store = reader.open(url, **(storage_options or {}))
    m = store.manifest
    notes, tokens_differ = identity_notes(m, model_dir)
    dev = resolve_device(device)
    log.info("audit: loading %s on %s", model_dir, describe(dev))
    model = load_target(model_dir, DTYPES[m.dtype], dev, progress=progress)
    differs = other_weights(m, model, model_dir)
    if differs:  # the hash says it at once: no sample is read, no forward run
        return AuditReport(store.url, model_dir, m.encoding, m.dtype, m.target.num_layers, len(store),
                           list(m.all_features), notes=notes, other_weights=differs)
    chosen = chosen_samples(store, samples, progress)
    log.info("audit: %d samples chosen", len(chosen))
    return audit_model(store, model, model_dir, chosen, notes, tokens_differ, progress)


def other_weights(manifest, model, model_dir: str) -> str | None:
    """How the manifest's record of the target's weights differs from ``model``'s (None: it does not, or records
    none): ``weights_fingerprint`` (``extra``: every tensor sampled) and ``weights_hash`` (the embedding's first
    64 MiB), both as extraction computes them from the model it loaded, so a few kB per tensor and one pass over
    at most 64 MiB. What they cannot see (a change between the sampled values, a store imported without them) is
    left to the features' bounds."""
    recorded = manifest.extra.get(FINGERPRINT)
    if isinstance(recorded, str):
        mine = weights_fingerprint(model)
        if mine != recorded:
            return (f"{model_dir}'s weights are not those the store was extracted from (weights_fingerprint "
                    f"{recorded[:12]} in the manifest, {mine[:12]} of the model)")
    if manifest.target.weights_hash:
        mine = weights_hash(model)
        if mine != manifest.target.weights_hash:
            return (f"{model_dir}'s embedding is not the one the store was extracted with (weights_hash "
                    f"{manifest.target.weights_hash[:12]} in the manifest, {mine[:12]} of the model)")
    return None


def audit_model(store, model, model_name: str, chosen: Sequence[int], notes: list[str] | None = None,
                tokens_differ: bool = False, progress: bool = True) -> AuditReport:
    """The audit of ``store``'s samples ``chosen`` against ``model`` as loaded (eager: a compiled model is audited
    inside ``compile_check.eager_modules``); :func:`audit` opens both, a benchmark at the seeds' depth builds the
    model in process."""
    from tqdm import tqdm

    m = store.manifest
    features = list(m.all_features)
    report = AuditReport(store.url, model_name, m.encoding, m.dtype,
                         m.target.num_layers, len(store), features, notes=list(notes or []))
    vocab = model.get_input_embeddings().weight.shape[0]
    for i in tqdm(chosen, desc="audit: reference forwards", unit="sample", disable=not progress):
        item = store.read(i)
        ids = item["input_ids"]
        report.samples.append({"index": i, "sample_id": item["sample_id"], "tokens": int(ids.numel())})
        if int(ids.max()) >= vocab:
            for f in features:
                report.findings.append(Finding(i, item["sample_id"], f, Agreement(*[float("nan")] * 4), False,
                                               "different tokens", f"input_ids up to {int(ids.max())}, beyond the "
                                               f"target's vocabulary of {vocab}"))
            continue
        ref = reference_features(model, ids)
        for f, stored in zip(features, stored_features(item, features)):
            stored = stored.to(ref.device)
            own = candidate_of(f, m.target.num_layers)
            figures, ok = judge(stored, ref, own, report.bound_at)
            finding = Finding(i, item["sample_id"], f, figures, ok)
            if not ok:
                finding.diagnosis, finding.detail, finding.matches = diagnose(stored, ref, own, report.bound_at,
                                                                              tokens_differ)
            report.findings.append(finding)
        del ref
    return report
