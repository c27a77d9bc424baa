"""How close two computations of the same feature are, and how close they must be to count as the same.

``hsstore audit`` holds a store's features to these bounds against the target recomputed from the stored
``input_ids`` (extraction's compile check has per-token bounds of its own, ``compile_check.py``). A bound is what rounding alone explains for the dtype and encoding the features went through;
a wrong layer, shifted positions or another target land far outside it (figures in ``BOUNDS``'s comment).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
        return f"cosine >= {self.cosine:g} and relative error <= {self.rel_err:g} ({self.why})"


# Measured on the tiny targets (trained and random, 8 layers, hidden 64; `python -m tools.audit_bounds`), each
# store extracted in token-budget batches (right padding) and its features compared per sample with a batch-1
# eager forward in the store's dtype (worst of 8 samples x taps 1-5; docs/PERFORMANCE.md "Audit"):
#   float32   true layer: 1 - cosine 3e-14, rel. error 2.4e-7
#   float16   true layer: 1 - cosine 1e-8,  rel. error 1.5e-4
#   bfloat16  true layer: 1 - cosine 4e-7,  rel. error 8.8e-4
#   fp8       true layer: 1 - cosine 3e-4,  rel. error 0.026 (e4m3 rounding, at most 2^-4 per value, on top of bf16)
#   any dtype: neighbour layer (l-1, l+1) cosine 0.77-0.991, rel. error >= 0.135; another target's cosine < 0.04
# They sit above the closest wrong answer (a neighbour layer) on both figures. A deep target amplifies rounding,
# and how much is not measured for audit: at 27B scale (random weights, H200, tools/bench_extract) the compiled vs
# eager per-token cosine at tap 61 averages 0.9989 (worst token 0.9957), below the bf16 bound's 0.999.
BOUNDS = {
    "float32": Bound(0.99999, 1e-3, "float32 rounding"),
    "float16": Bound(0.9995, 0.03, "float16 rounding"),
    "bfloat16": Bound(0.999, 0.05, "bfloat16 rounding"),
    "fp8": Bound(0.995, 0.1, "fp8 e4m3 with a per-token scale: at most 2^-4 per value, on top of the dtype's rounding"),
}


def bound_of(dtype: str, encoding: str = "raw") -> Bound:
    """The bound for features computed in ``dtype`` and stored with ``encoding`` (``raw`` or ``fp8``)."""
    key = "fp8" if encoding == "fp8" else dtype
    if key not in BOUNDS:
        raise ValueError(f"no agreement bound for dtype {dtype!r}, encoding {encoding!r}")
    return BOUNDS[key]
