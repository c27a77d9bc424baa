"""A faster target forward for extraction: regional ``torch.compile`` of the decoder's dense parts.

Besides the GEMMs, the eager forward's time goes to unfused elementwise kernels (norms, gates, casts, RMSNorm's
``pow``) and copies (docs/PERFORMANCE.md, "The extraction forward by operator class"; ``tools/profile_extract.py``).
Compiling each decoder layer's norms, MLP and full-attention block, and with ``mixers`` each Gated DeltaNet mixer
around fla's kernels (which are called, not traced: tracing them makes compiling whole layers take many minutes),
fuses that elementwise work into the kernels around the GEMMs. The decoder layer's own control flow stays eager.

Modules of one class share their compiled code (dynamo inlines ``nn.Module``s and treats parameters as inputs),
so a 64-layer model compiles a handful of small graphs whatever its depth; a second batch shape marks the
dimensions dynamic, so varying token-budget batches do not compile again and again.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from hsstore.app.target import decoder_layers

log = logging.getLogger(__name__)

# class-name endings of the parts compiled: elementwise-heavy and free of custom kernels or cache bookkeeping
COMPILED_KINDS = ("RMSNorm", "RMSNormGated", "MLP", "Attention")
EAGER_KINDS = ("GatedDeltaNet", "LinearAttention", "Mamba")  # custom kernels inside: left as they are
# with ``mixers``: Gated DeltaNet mixers are compiled too, around their kernels. The functions of the mixer's module
# whose names hold one of these are wrapped in ``torch.compiler.disable`` first, so dynamo calls fla's Triton
# kernels as they are instead of tracing them (what made whole-layer compiles take many minutes)
MIXER_KINDS = ("GatedDeltaNet",)
OPAQUE_CALLS = ("gated_delta_rule",)


@dataclass
class CompileReport:
    modules: int = 0
    kinds: dict[str, int] = field(default_factory=dict)  # class name -> modules compiled

    def __str__(self) -> str:
        return f"{self.modules} modules ({', '.join(f'{k} x{n}' for k, n in sorted(self.kinds.items()))})"


def compiled_parts(model: nn.Module, mixers: bool = False) -> list[nn.Module]:
    """The submodules of every decoder layer that :func:`compile_forward` compiles, outermost first (a
    compiled attention block's own norms are traced with it, not compiled twice)."""
    kinds = COMPILED_KINDS + (MIXER_KINDS if mixers else ())
    parts: list[nn.Module] = []
    for layer in decoder_layers(model):
        taken: set[int] = set()
        for _, m in layer.named_modules():
            name = type(m).__name__
            mixer = mixers and name.endswith(MIXER_KINDS)
            if m is layer or id(m) in taken or (name.endswith(EAGER_KINDS) and not mixer) or not name.endswith(kinds):
                continue
            parts.append(m)
            taken.update(id(sub) for sub in m.modules())
    return parts


def prepare_mixer(mixer: nn.Module) -> list[str]:
    """Wrap the custom-kernel functions that ``mixer``'s forward calls (its module's globals named like
    ``OPAQUE_CALLS``) in ``torch.compiler.disable``, so dynamo calls fla's Triton kernels instead of tracing
    them; eager calls are unchanged. Returns the names wrapped.

    Tried and left out: computing transformers' reference causal convolution (PyTorch's generic depthwise kernel)
    as shifted multiply-adds inside the graph. It is faster end to end, but moves the features further from the
    eager forward than the eager forward's own shape-to-shape spread (docs/PERFORMANCE.md, "Design choices")."""
    scope = vars(sys.modules[type(mixer).__module__])
    wrapped = []
    for name, fn in list(scope.items()):
        if callable(fn) and any(k in name for k in OPAQUE_CALLS) and not getattr(fn, "_hsstore_opaque", False):
            opaque = torch.compiler.disable(fn)
            opaque._hsstore_opaque = True
            scope[name] = opaque
            wrapped.append(name)
    return wrapped


def compile_forward(model: nn.Module, mode: str | None = None, emulate_casts: bool = True,
                    mixers: bool = False) -> CompileReport:
    """Compile the dense parts of ``model``'s decoder layers in place (the first forward of each new shape
    pays the compile time).

    ``emulate_casts``: fused kernels round their intermediates to bf16 where eager kernels do (inductor's
    ``emulate_precision_casts``), so the features stay as close to the eager forward's as bf16 allows instead of
    being more precise in places, a difference a deep stack amplifies."""
    import torch._inductor.config as inductor_config

    inductor_config.emulate_precision_casts = emulate_casts
    report = CompileReport()
    parts = compiled_parts(model, mixers)
    if mixers:
        for m in {type(p): p for p in parts if type(p).__name__.endswith(MIXER_KINDS)}.values():
            log.info("%s: kernels left out of the compiled graph: %s", type(m).__name__, prepare_mixer(m) or "none")
    # one code object per module class, a few shapes each: well within a larger cache, never falling back to eager
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    for m in parts:
        m.compile(mode=mode)
        report.modules += 1
        report.kinds[type(m).__name__] = report.kinds.get(type(m).__name__, 0) + 1
    log.info("compiled %s", report)
    return report


# -- when compiling pays ------------------------------------------------------------------------------------
# The reference target's eager extraction rate, its decoder's parameters, what compiling gains and what
# compiling the first two batch shapes costs (docs/PERFORMANCE.md, "Extraction": 27B scale, one GPU). A tiny
# target is faster still per token, so its eager time is smaller than this estimate and compiling pays even less.
REFERENCE_EAGER_TOKENS_PER_S = 8419.0
REFERENCE_PARAMS = 26.9e9
SPEEDUP = 1.28
WARMUP_S = 40.0


@dataclass
class CompileChoice:
    compile: bool
    reason: str


def choose_compile(requested: bool | None, device: torch.device, decoder_params: int, tokens: int) -> CompileChoice:
    """Whether to compile the forward: as asked, else on CUDA only when the expected saving (the eager time
    estimated from the reference rate scaled by parameters, times 1 - 1/speedup) exceeds the warm-up."""
    if requested is not None:
        return CompileChoice(requested, "--compile" if requested else "--no-compile")
    if device.type != "cuda":
        return CompileChoice(False, "not on CUDA")
    eager_s = tokens / (REFERENCE_EAGER_TOKENS_PER_S * REFERENCE_PARAMS / max(decoder_params, 1))
    saving = eager_s * (1 - 1 / SPEEDUP)
    verdict = (f"{tokens:,} tokens x {decoder_params / 1e9:.3g}B decoder parameters: eager ~{eager_s:,.0f}s, "
               f"compiling would save ~{saving:,.0f}s for ~{WARMUP_S:.0f}s of warm-up")
    return CompileChoice(saving > WARMUP_S, verdict)


def inductor_cache_dir() -> Path:
    """Where torch.compile keeps the kernels it built, between processes (``TORCHINDUCTOR_CACHE_DIR``, else torch's
    default under the temp folder)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir())


def note_compile_cache(rank: int) -> bool:
    """Say, before a compiled forward's first batch, that its kernels are built now and once per machine when
    torch.compile's cache holds none yet (a fresh machine: the first batches run many times slower, with no other
    word); returns whether it said so."""
    cache = inductor_cache_dir()
    try:
        empty = not cache.is_dir() or next(cache.iterdir(), None) is None
    except OSError:
        empty = True
    if empty:
        log.warning("rank %d: compiling kernels, once per machine: torch.compile builds the forward's kernels during "
                    "its first batches (about %.0f s at 27B scale); later runs reuse %s", rank, WARMUP_S, cache)
    return empty


def compile_seconds() -> float:
    """Seconds this process has spent in torch.compile so far (dynamo's own timer; 0 where it has none)."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return 0.0
    return float(sum(compilation_time_metrics.get("_compile.compile_inner", ())))
