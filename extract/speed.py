"""A faster target forward for extraction: regional ``torch.compile`` of the decoder's dense parts.

Where the eager forward's time goes (one H200, random-weight Qwen3.5 at 27B scale, a 16K-token batch, in the
brief): GEMMs 53%, unfused elementwise kernels (norms, gates, casts, RMSNorm's ``pow``) 30%, SDPA 7%, the
causal-conv fallback 5%, fla's Gated DeltaNet kernels 4%. Compiling each decoder layer's norms, MLP and
full-attention block fuses that elementwise work into the kernels around the GEMMs. The Gated DeltaNet mixer
(fla's Triton kernels, the layer's cache logic) and the decoder layer's own control flow stay eager: tracing them
is what made compiling whole layers take many minutes.

Modules of one class share their compiled code (dynamo inlines ``nn.Module``s and treats parameters as inputs),
so a 64-layer model compiles a handful of small graphs whatever its depth; a second batch shape marks the
dimensions dynamic, so varying token-budget batches do not compile again and again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from .capture import decoder_layers

log = logging.getLogger(__name__)

# class-name endings of the parts compiled: elementwise-heavy and free of custom kernels or cache bookkeeping
COMPILED_KINDS = ("RMSNorm", "RMSNormGated", "MLP", "Attention")
EAGER_KINDS = ("GatedDeltaNet", "LinearAttention", "Mamba")  # custom kernels inside: left as they are


@dataclass
class CompileReport:
    modules: int = 0
    kinds: dict[str, int] = field(default_factory=dict)  # class name -> modules compiled

    def __str__(self) -> str:
        return f"{self.modules} modules ({', '.join(f'{k} x{n}' for k, n in sorted(self.kinds.items()))})"


def compiled_parts(model: nn.Module) -> list[nn.Module]:
    """The submodules of every decoder layer that :func:`compile_forward` compiles, outermost first (a
    compiled attention block's own norms are traced with it, not compiled twice)."""
    parts: list[nn.Module] = []
    for layer in decoder_layers(model):
        taken: set[int] = set()
        for _, m in layer.named_modules():
            name = type(m).__name__
            if m is layer or id(m) in taken or name.endswith(EAGER_KINDS) or not name.endswith(COMPILED_KINDS):
                continue
            parts.append(m)
            taken.update(id(sub) for sub in m.modules())
    return parts


def compile_forward(model: nn.Module, mode: str | None = None, emulate_casts: bool = True) -> CompileReport:
    """Compile the dense parts of ``model``'s decoder layers in place (the first forward of each new shape
    pays the compile time).

    ``emulate_casts``: fused kernels round their intermediates to bf16 where eager kernels do (inductor's
    ``emulate_precision_casts``), so the features stay as close to the eager forward's as bf16 allows instead of
    being more precise in places, a difference a deep stack amplifies."""
    import torch._inductor.config as inductor_config

    inductor_config.emulate_precision_casts = emulate_casts
    report = CompileReport()
    parts = compiled_parts(model)
    # one code object per module class, a few shapes each: well within a larger cache, never falling back to eager
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    for m in parts:
        m.compile(mode=mode)
        report.modules += 1
        report.kinds[type(m).__name__] = report.kinds.get(type(m).__name__, 0) + 1
    log.info("compiled %s", report)
    return report
