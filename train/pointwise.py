"""The draft layer's pointwise math (RMSNorm, RoPE, SwiGLU), one function each, fused on the GPU.

Eager PyTorch runs each of these as several kernels over the block rows (RMSNorm alone: cast, square, mean,
rsqrt, two multiplies, cast; its backward as many again), each a full read and write of a [rows, hidden]
tensor: a large share of the published drafter's step (docs/PERFORMANCE.md, "The drafter step by operator
class"). Compiled
(``torch.compile`` with dynamic row counts: a new batch shape compiles nothing new), each function becomes one
kernel forward and one backward, the same math. The GEMMs and the attention stay eager: they are already one kernel.

Compiled only on CUDA tensors (``DEVICES``) and while ``FUSE`` holds (``tools.bench_attention --pointwise``
compares); elsewhere, and if compiling fails (logged once), the eager function runs.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

FUSE = True
DEVICES = ("cuda",)
BACKEND = "inductor"


_compiled: dict[str, object] = {}  # function name -> its compiled form, or None after compiling failed


def reset() -> None:
    """Forget every compiled form and failure (the next call compiles again under the current settings)."""
    _compiled.clear()


def fused(fn=None, *, without_grad: bool = False):
    """``fn(x, ...)`` compiled when ``x`` lives on one of ``DEVICES``, ``FUSE`` holds and gradients are on (training
    steps; evaluation and decoding run small blocks, where each shape would cost a graph and little time is won);
    eager otherwise, and inside a graph being compiled (which traces the eager body). ``.eager``: the plain one.
    ``without_grad``: compiled with gradients off too (math that a training step runs inside an autograd
    Function's forward, where they are always off)."""
    if fn is None:
        return functools.partial(fused, without_grad=without_grad)
    name = fn.__name__

    @functools.wraps(fn)
    def call(x, *args):
        if not FUSE or x.device.type not in DEVICES or not (without_grad or torch.is_grad_enabled()) \
                or torch.compiler.is_compiling():
            return fn(x, *args)
        if name not in _compiled:
            _compiled[name] = torch.compile(fn, dynamic=True, backend=BACKEND)
        compiled = _compiled[name]
        if compiled is None:
            return fn(x, *args)
        try:
            return compiled(x, *args)
        except Exception as e:  # noqa: BLE001 -- e.g. no compiler for the backend: the same math, eager
            _compiled[name] = None
            cause = e
            while (inner := getattr(cause, "inner_exception", None) or cause.__cause__) is not None:
                cause = inner  # dynamo wraps the backend's own error
            first = (str(cause).strip().splitlines() or [""])[0]
            log.warning("%s: compiling failed, running it eager from now on (%s: %s)", name, type(cause).__name__,
                        first)
            return fn(x, *args)

    call.eager = fn
    return call


# Each kernel sees its tensors flattened to the rows it runs over ([rows, width]): one graph per dtype serves every
# batch shape and every norm (the 5,120-wide layer norms and the 128-wide q/k norms alike), where the callers'
# ranks and a batch of one sequence (a size-1 dimension is specialised) would each need their own.


@fused
def _rms_norm(x, weight, eps: float):
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


@fused
def _rope(x, cos, sin):  # x [rows, heads, hd]; cos/sin [rows, 1, hd]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


@fused
def _swiglu(gate, up):
    return F.silu(gate) * up


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3's RMSNorm over the last dimension: normalised in fp32, cast back to ``x``'s dtype, then scaled (the
    result takes the wider of the two dtypes, as Hugging Face's does under autocast with fp32 weights)."""
    return _rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: x [B, N, heads, hd]; cos/sin [B, N, hd]."""
    B, N, h, d = x.shape
    return _rope(x.reshape(B * N, h, d), cos.reshape(B * N, 1, d), sin.reshape(B * N, 1, d)).view(B, N, h, d)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The MLP's gated activation: silu(gate) * up."""
    return _swiglu(gate.reshape(-1), up.reshape(-1)).view(gate.shape)
