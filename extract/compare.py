"""How close two computations of the same feature are, and how close they must be to count as the same.

``hsstore audit`` holds a store's features to these bounds against the target recomputed from the stored
``input_ids``, and extraction's compile check its compiled forward against the eager one, per token. A bound is
what rounding alone explains for the dtype and encoding the features went through after the layers they went
through (``Drift``); a wrong layer, shifted positions, another target or scaled values land outside it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hsstore.format import encodings


@dataclass(frozen=True)
class Agreement:
    """``values`` against ``ref`` (one feature, ``[..., H]``): cosine over all values, relative L2 error
    ``||values - ref|| / ||ref||``, the largest absolute difference and the lowest per-row (per-token) cosine."""

    cosine: float
    rel_err: float
    max_abs: float
    min_row_cosine: float

    def as_dict(self) -> dict[str, float]:
        return {"cosine": self.cosine, "rel_err": self.rel_err, "max_abs": self.max_abs,
                "min_token_cosine": self.min_row_cosine}


def agreement(values: torch.Tensor, ref: torch.Tensor) -> Agreement:
    """The figures of ``values`` against ``ref`` (same shape), computed in float64 on their device: a cosine of
    0.999999 needs more than float32's accumulation. Non-finite values give NaN figures, which no bound holds."""
    a, b = values.double().reshape(-1, values.shape[-1]), ref.double().reshape(-1, ref.shape[-1])
    na, nb, diff = a.norm(), b.norm(), (a - b)
    cos = float((a * b).sum() / (na * nb)) if na > 0 and nb > 0 else (1.0 if na == nb else 0.0)
    rel = float(diff.norm() / nb) if nb > 0 else (0.0 if na == 0 else float("inf"))
    rows = torch.nn.functional.cosine_similarity(a, b, dim=-1, eps=1e-30)
    return Agreement(cos, rel, float(diff.abs().max()) if diff.numel() else 0.0,
                     float(rows.min()) if rows.numel() else 1.0)


@dataclass(frozen=True)
class Bound:
    """What two computations of one feature may differ by: cosine at least ``cosine``, relative error at most
    ``rel_err``. ``why``: the rounding it allows for."""

    cosine: float
    rel_err: float
    why: str

    def holds(self, a: Agreement) -> bool:
        return a.cosine >= self.cosine and a.rel_err <= self.rel_err  # NaN holds neither

    def __str__(self) -> str:
        return f"cosine >= {self.cosine:.6g} and relative error <= {self.rel_err:.4g} ({self.why})"

    def as_dict(self) -> dict[str, float | str]:
        return {"cosine": self.cosine, "rel_err": self.rel_err, "why": self.why}


@dataclass(frozen=True)
class Drift:
    """How far two roundings of one feature drift apart: ``1 - cosine`` of ``floor`` (the encoding's own
    rounding, whatever the depth) plus ``per_layer`` for every decoder layer the value went through. Rounding
    differences (another batch shape, a fused kernel, another convolution kernel) enter at every layer and the
    residual stream carries them on, so ``1 - cosine`` grows about linearly with depth; a bound fixed at one
    depth is either loose for shallow taps or fails a correct deep one."""

    floor: float
    per_layer: float
    why: str

    def at(self, depth: int) -> Bound:
        """The bound after ``depth`` decoder layers (tap ``l``: ``l + 1``). The relative error allowed is what
        that cosine allows for two vectors of equal norm, ``sqrt(2 (1 - cosine))``, with ``REL_MARGIN`` for a
        norm that rounds too: a feature scaled by 2 keeps cosine 1 and only this catches it."""
        gap = self.floor + self.per_layer * max(0, int(depth))
        return Bound(1.0 - gap, REL_MARGIN * math.sqrt(2.0 * gap), f"{self.why} after {depth} layers")


REL_MARGIN = 1.25

# The bounds follow the rounding they exist to allow, per layer of depth, and sit below the closest wrong answer
# (a neighbouring layer) at every depth measured. Derivation and the figures: docs/ARCHITECTURE.md ("Bounds that
# follow the rounding") and docs/PERFORMANCE.md ("Bounds at the seeds' depth", `python -m tools.deep_bounds` on the
# GPU machine: 64 layers, hidden 5120, taps 1,16,31,46,61; `python -m tools.audit_bounds` for the tiny targets).
# ``per_layer`` is the worst measured drift per layer with a margin of MARGIN; ``floor`` the encoding's own
# (``Encoding.floor``, format/encodings.py: its own rounding, measured by tools/encoding_evidence.py).
MARGIN = 3.0
AUDIT_DRIFT = {
    # a stored feature (extracted in a batch, eager or compiled) against the audit's batch-1 eager recomputation,
    # over the whole feature of one sample
    "float32": Drift(1e-9, 1e-10, "float32 rounding"),
    "float16": Drift(1e-5, MARGIN * 4e-6, "float16 rounding"),
    "bfloat16": Drift(1e-4, MARGIN * 2.0e-5, "bfloat16 rounding"),
}
# extraction's compile check: the compiled forward's first batch against the eager forward, the worst token
COMPILE_DRIFT = Drift(1e-3, MARGIN * 1.7e-4, "bfloat16 rounding of fused kernels, worst token")


def depth_of(feature: int | str, n_layers: int) -> int:
    """Decoder layers a feature went through: tap ``l`` (the output of layer ``l``) ``l + 1``; ``final_hidden``
    all of them (the norm after them rounds once more, within the per-layer allowance)."""
    return n_layers + 1 if feature == "final_hidden" else int(feature) + 1


def audit_drift(dtype: str, encoding: str = "raw") -> Drift:
    """How far a stored feature computed in ``dtype`` and stored with ``encoding`` drifts from the recomputation: the
    dtype's drift per layer, from the encoding's own rounding (its ``floor``) on."""
    if dtype not in AUDIT_DRIFT:
        raise ValueError(f"no agreement bound for dtype {dtype!r}, encoding {encoding!r}")
    drift, enc = AUDIT_DRIFT[dtype], encodings.get(encoding)
    if not enc.quantised:
        return drift
    return Drift(enc.floor, drift.per_layer, f"{enc.rounding} on {drift.why}")


def bound_of(dtype: str, encoding: str = "raw", depth: int = 0) -> Bound:
    """The audit's bound for features computed in ``dtype``, stored with ``encoding``, after ``depth`` decoder
    layers (``depth_of``)."""
    return audit_drift(dtype, encoding).at(depth)


def bound_rule(dtype: str, encoding: str = "raw") -> dict[str, float | str]:
    """The audit's bound for ``dtype`` and ``encoding`` as a report records it: floor, per_layer, rel_margin, why."""
    drift = audit_drift(dtype, encoding)
    return {"floor": drift.floor, "per_layer": drift.per_layer, "rel_margin": REL_MARGIN, "why": drift.why}


def compile_bound(depth: int) -> Bound:
    """The compile check's per-token bound after ``depth`` decoder layers."""
    return COMPILE_DRIFT.at(depth)
