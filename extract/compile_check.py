"""A compiled extraction checks itself: its first batch through the compiled forward against the eager one.

``torch.compile`` fuses kernels and may change how bf16 intermediates round; a miscompiled graph (a dropped op, a
wrong fusion, a precision bug) would give features that look like features and train nothing. So before anything is
written, :func:`check_first_batch` runs the first batch through extraction's own forward (``forward.packed_features``,
the capture hooks extraction uses) twice: as compiled, and with every compiled module called eagerly
(:func:`eager_modules`), and compares each tap per token. Beyond the bounds it raises :class:`CompileMismatch`
naming the tap, before the writer is opened: nothing is written, and what an earlier run committed stays, resumable.

The bounds (per token, at every tap): cosine >= ``MIN_COS`` = 0.99 and relative error ``|c - e| / |e|`` <=
``MAX_REL`` = 0.15. Why: the compiled forward differs from the eager one by bf16 rounding (a unit roundoff of
2^-8 per operation), amplified with depth, and the eager forward differs from itself by as much when only the batch
shape changes. Measured, as the worst token of a batch (1 - cosine; relative error):
- tiny random Qwen3.5 (8 layers, hidden 64, bf16, CPU), 3 batches of the demo conversations: eager alone vs in its
  batch down to cosine 0.999982 (rel 0.0064), compiled vs eager 0.999957 (rel 0.0093), both at the last layer;
- random-weight Qwen3.5 at 27B scale (64 layers, H200, fla; the #18 note, ``tools/bench_extract --compile``): taps
  1/16/31/46/61, compiled vs eager 0.99991 / 0.99917 / 0.99821 / 0.99698 / 0.99570, eager alone vs in batch 0.99993
  / 0.99936 / 0.99867 / 0.99788 / 0.99709: a chaotic random 64-layer stack, the worst case known.
0.99 leaves 2.3x that worst 1 - cosine (3.4x the eager forward's own spread), and 0.15 the relative error that
cosine allows (sqrt(2 x 0.0043) = 0.093, 1.6x); a real fault is far outside both: another layer's output agrees at
cosine 0.91-0.93 on the tiny target, zeros at 0, another target at ~0.01.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn

from .forward import packed_features

MIN_COS = 0.99
MAX_REL = 0.15
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
    per_tap: dict[str, dict[str, float]]  # tap ("1", ..., "final_hidden") -> {"min_cos", "max_rel"}
    seconds: float = 0.0
    bound: dict[str, float] = field(default_factory=lambda: {"min_cos": MIN_COS, "max_rel": MAX_REL})

    @property
    def min_cos(self) -> float:
        return min(t["min_cos"] for t in self.per_tap.values())

    @property
    def max_rel(self) -> float:
        return max(t["max_rel"] for t in self.per_tap.values())

    def failed_taps(self) -> list[str]:
        return [k for k, t in self.per_tap.items()
                if not (t["min_cos"] >= self.bound["min_cos"] and t["max_rel"] <= self.bound["max_rel"])]

    @property
    def passed(self) -> bool:
        return not self.failed_taps()

    def record(self) -> dict:
        """What the manifest's extra holds for this rank (``compile_check``)."""
        return {"compiled": True, "passed": self.passed, "min_cos": self.min_cos, "max_rel": self.max_rel,
                "tokens": self.tokens, "bound": dict(self.bound), "per_tap": self.per_tap,
                "seconds": round(self.seconds, 3)}

    def error(self) -> str:
        tap = self.failed_taps()[0]
        t = self.per_tap[tap]
        return (f"the compiled forward disagrees with the eager forward beyond bf16 rounding at tap {tap} on the "
                f"first batch ({self.tokens:,} tokens): min per-token cosine {t['min_cos']:.5f} (bound "
                f">= {self.bound['min_cos']}), max relative error {t['max_rel']:.4f} (bound <= "
                f"{self.bound['max_rel']}); nothing was written (what earlier runs committed is kept): extract with "
                "--no-compile (it resumes) and report the torch version")


def compare_taps(eager: torch.Tensor, compiled: torch.Tensor, names: list[str]) -> dict[str, dict[str, float]]:
    """Per tap, the worst token: ``{name: {"min_cos", "max_rel"}}`` of ``[tokens, taps, H]`` features (in fp32).
    A NaN (non-finite features) counts as the worst, never as a pass."""
    a, b = eager.float(), compiled.float()
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)  # [tokens, taps]
    rel = (a - b).norm(dim=-1) / a.norm(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)
    cos = torch.nan_to_num(cos, nan=-1.0)
    rel = torch.nan_to_num(rel, nan=float("inf"), posinf=float("inf"))
    return {name: {"min_cos": round(float(cos[:, j].min()), 7), "max_rel": round(float(rel[:, j].max()), 7)}
            for j, name in enumerate(names)}


def check_first_batch(model: nn.Module, layers: list[int], batch, pad_id: int, device: torch.device,
                      final_hidden: bool = False) -> CompileCheck:
    """The first batch through the compiled and the eager forward, compared per tap (and ``final_hidden``);
    raises :class:`CompileMismatch` naming the first tap beyond the bounds."""
    t = time.perf_counter()
    compiled = packed_features(model, layers, batch, pad_id, device, final_hidden)
    with eager_modules(model):
        eager = packed_features(model, layers, batch, pad_id, device, final_hidden)
    names = [str(l) for l in layers] + (["final_hidden"] if final_hidden else [])
    check = CompileCheck(tokens=int(eager.shape[0]), per_tap=compare_taps(eager, compiled, names))
    del compiled, eager
    check.seconds = time.perf_counter() - t
    if not check.passed:
        raise CompileMismatch(check.error())
    return check
