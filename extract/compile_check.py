"""A compiled extraction checks itself: its first batch through the compiled forward against the eager one.

``torch.compile`` fuses kernels and may change how bf16 intermediates round; a miscompiled graph (a dropped op, a
wrong fusion, a precision bug) would give features that look like features and train nothing. So before anything is
written, :func:`check_first_batch` runs the first batch through extraction's own forward (``forward.packed_features``,
the capture hooks extraction uses) twice: as compiled, and with every compiled module called eagerly
(:func:`eager_modules`), and compares each tap per token. Beyond the bounds it raises :class:`CompileMismatch`
naming the tap, before the writer is opened: nothing is written, and what an earlier run committed stays, resumable.

The bounds (per token, per tap) grow with the tap's depth (``compare.compile_bound``): the compiled forward differs
from the eager one by bf16 rounding (a unit roundoff of 2^-8 per operation, fused kernels rounding in other places),
and the residual stream carries every layer's difference on, so ``1 - cosine`` grows about linearly with depth. The
per-layer allowance and its derivation from the forward measured at the seeds' depth (64 layers, hidden 5120) are in
``compare.py`` and docs/ARCHITECTURE.md; a real fault (a dropped op, a wrong fusion, another layer, zeros) lands far
outside them at every depth.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn

from hsstore.app.target import decoder_layers

from .compare import COMPILE_DRIFT, REL_MARGIN, compile_bound, depth_of
from .forward import packed_features

EXTRA_KEY = "compile_check"  # manifest extra: {writer tag: CompileCheck.record()} (docs/FORMAT.md)


class CompileMismatch(ValueError):
    """The compiled forward's first batch disagrees with the eager forward's beyond bf16 rounding."""


@contextlib.contextmanager
def eager_modules(model: nn.Module) -> Iterator[None]:
    """Within the block, every module that ``nn.Module.compile`` compiled (``extract/speed.py`` compiles
    submodules in place) runs its original, eager forward: their compiled call is set aside and put back after."""
    kept = [(m, m._compiled_call_impl) for m in model.modules() if getattr(m, "_compiled_call_impl", None)]
    try:
        for m, _ in kept:
            m._compiled_call_impl = None
        yield
    finally:
        for m, impl in kept:
            m._compiled_call_impl = impl


@dataclass
class CompileCheck:
    tokens: int
    per_tap: dict[str, dict[str, float]]  # tap ("1", ..., "final_hidden") -> {"min_cos", "max_rel", "bound_cos", "bound_rel"}
    seconds: float = 0.0

    @property
    def min_cos(self) -> float:
        return min(t["min_cos"] for t in self.per_tap.values())

    @property
    def max_rel(self) -> float:
        return max(t["max_rel"] for t in self.per_tap.values())

    def failed_taps(self) -> list[str]:
        return [k for k, t in self.per_tap.items() if not (t["min_cos"] >= t["bound_cos"] and t["max_rel"] <= t["bound_rel"])]

    @property
    def passed(self) -> bool:
        return not self.failed_taps()

    def record(self) -> dict:
        """What the manifest's extra holds for this rank (``compile_check``)."""
        return {"compiled": True, "passed": self.passed, "min_cos": self.min_cos, "max_rel": self.max_rel,
                "tokens": self.tokens, "bound": bound_rule(), "per_tap": self.per_tap, "seconds": round(self.seconds, 3)}

    def error(self) -> str:
        tap = self.failed_taps()[0]
        t = self.per_tap[tap]
        # how far past the bound, as a multiple of the rounding it allows (1 - cosine; relative error)
        over = max((1 - t["min_cos"]) / max(1 - t["bound_cos"], 1e-12), t["max_rel"] / max(t["bound_rel"], 1e-12))
        return (f"the compiled forward disagrees with the eager forward beyond bf16 rounding at tap {tap} on the "
                f"first batch ({self.tokens:,} tokens): min per-token cosine {t['min_cos']:.5f} (bound "
                f">= {t['bound_cos']:.5f} at this depth), max relative error {t['max_rel']:.4f} (bound <= "
                f"{t['bound_rel']:.4f}), {over:.1f}x what rounding allows; nothing was written (what earlier runs "
                "committed is kept): extract with --no-compile to use the eager forward (it resumes) and report the "
                "torch version")


def bound_rule() -> dict[str, float | str]:
    """The compile check's bound as recorded: ``1 - cosine <= floor + per_layer x depth`` per token (depth: tap + 1),
    relative error ``<= rel_margin x sqrt(2 (1 - cosine bound))``."""
    return {"rule": "1 - cos <= floor + per_layer * (tap + 1); rel <= rel_margin * sqrt(2 * (1 - cos bound))",
            "floor": COMPILE_DRIFT.floor, "per_layer": COMPILE_DRIFT.per_layer, "rel_margin": REL_MARGIN}


def compare_taps(eager: torch.Tensor, compiled: torch.Tensor, names: list[str], n_layers: int
                 ) -> dict[str, dict[str, float]]:
    """Per tap, the worst token and the bound at the tap's depth: ``{name: {"min_cos", "max_rel", "bound_cos",
    "bound_rel"}}`` of ``[tokens, taps, H]`` features (in fp32). A NaN (non-finite features) counts as the worst,
    never as a pass."""
    a, b = eager.float(), compiled.float()
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)  # [tokens, taps]
    rel = (a - b).norm(dim=-1) / a.norm(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)
    cos = torch.nan_to_num(cos, nan=-1.0)
    rel = torch.nan_to_num(rel, nan=float("inf"), posinf=float("inf"))
    out = {}
    for j, name in enumerate(names):
        bound = compile_bound(depth_of(name, n_layers))
        out[name] = {"min_cos": round(float(cos[:, j].min()), 7), "max_rel": round(float(rel[:, j].max()), 7),
                     "bound_cos": round(bound.cosine, 7), "bound_rel": round(bound.rel_err, 7)}
    return out


def check_first_batch(model: nn.Module, layers: list[int], batch, pad_id: int, device: torch.device,
                      final_hidden: bool = False) -> CompileCheck:
    """The first batch through the compiled and the eager forward, compared per tap (and ``final_hidden``);
    raises :class:`CompileMismatch` naming the first tap beyond the bounds."""
    t = time.perf_counter()
    compiled = packed_features(model, layers, batch, pad_id, device, final_hidden)
    with eager_modules(model):
        eager = packed_features(model, layers, batch, pad_id, device, final_hidden)
    names = [str(l) for l in layers] + (["final_hidden"] if final_hidden else [])
    n_layers = len(decoder_layers(model))
    check = CompileCheck(tokens=int(eager.shape[0]), per_tap=compare_taps(eager, compiled, names, n_layers))
    del compiled, eager
    check.seconds = time.perf_counter() - t
    if not check.passed:
        raise CompileMismatch(check.error())
    return check
