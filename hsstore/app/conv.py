"""The Gated DeltaNet short convolution on fla's Triton kernel instead of transformers' PyTorch fallback.

transformers looks for the ``causal-conv1d`` package for the 48 Gated DeltaNet layers' short convolution of a
Qwen3.5/3.6 target; without it every layer runs a generic depthwise ``F.conv1d`` plus a separate SiLU (and logs
"``causal_conv1d_fn`` is falling back to its reference PyTorch implementation"). flash-linear-attention, which
extraction needs anyway for the gated delta rule, ships a Triton causal convolution with the activation fused.
:func:`use_fla_conv` puts it behind the modeling module's ``causal_conv1d_fn``, looked up at call time: by the
mixer's forward in transformers 5.17 and 5.24; in 5.25 by the module's ``causal_conv1d_forward`` (which the mixer
calls, and which also reads the conv state from the cache; the global there is a ``kernels`` layer, called like the
function). For CUDA tensors only: CPU tensors, a ``seq_idx`` and ``HSSTORE_CONV=torch`` keep whatever was there
(transformers' torch path, or the CPU router's).

Layouts: transformers calls ``fn(x [batch, dim, time], weight [dim, width], bias, activation=..., **kwargs)``;
fla's ``causal_conv1d(x [batch, time, dim], weight [dim, width], bias, activation=...)`` returns
``(y [batch, time, dim], final_state)``. The mixer's ``x`` is the transpose of a contiguous ``[batch, time, dim]``
projection, so transposing it back is free, and so is transposing fla's output for the mixer (which transposes
it again). Under ``torch.compile`` the kernel call is left out of the graph (``torch.compiler.disable``): one
graph break per mixer, as for the gated delta rule.
"""

from __future__ import annotations

import logging
import sys
from typing import Callable

import torch

from .. import env

log = logging.getLogger(__name__)

HOOKED = "causal_conv1d_fn"  # the modeling module's global the mixer calls (5.25: through causal_conv1d_forward)
MIXER = "GatedDeltaNet"  # class-name ending of the mixers whose module is hooked


def fla_causal_conv1d() -> Callable | None:
    """fla's causal convolution (``[batch, time, dim]`` in, ``(y, final_state)`` out), or None without fla."""
    try:
        from fla.modules.causal_conv1d import causal_conv1d
    except Exception:  # not installed, or its Triton import fails on this machine
        return None
    return causal_conv1d


def conv_adapter(previous: Callable, kernel: Callable, devices: tuple[str, ...] = ("cuda",)) -> Callable:
    """``causal_conv1d_fn`` in transformers' calling convention that runs ``kernel`` (fla's convention) on tensors
    of the ``devices`` types and ``previous`` on anything else; ``kernel`` is opaque to dynamo."""
    opaque = torch.compiler.disable(kernel)

    def causal_conv1d_fn(hidden_states=None, weight=None, bias=None, activation=None, **kwargs):
        x = kwargs.pop("x", hidden_states)  # causal-conv1d's own keyword, as older modeling files pass it
        if x.device.type not in devices or kwargs.get("seq_idx") is not None:
            return previous(x, weight, bias, activation=activation, **kwargs)
        cu_seqlens = kwargs.get("cu_seqlens")
        y, _ = opaque(x.transpose(1, 2), weight, bias, activation=activation, cu_seqlens=cu_seqlens)
        return y.transpose(1, 2)

    causal_conv1d_fn._hsstore_fla_conv = True
    causal_conv1d_fn._hsstore_cpu_safe = True  # CPU tensors already take `previous`: route_cpu_kernels leaves it
    causal_conv1d_fn._hsstore_previous = previous
    return causal_conv1d_fn


def _mixer_modules(model: torch.nn.Module) -> list:
    names = sorted({type(m).__module__ for m in model.modules() if type(m).__name__.endswith(MIXER)})
    return [sys.modules[n] for n in names if n in sys.modules]


def use_fla_conv(model: torch.nn.Module, device: torch.device, kernel: Callable | None = None,
                 devices: tuple[str, ...] = ("cuda",)) -> list[str]:
    """Route ``model``'s Gated DeltaNet short convolutions on ``device`` to fla's Triton kernel (``kernel``: another
    function of fla's calling convention; ``devices``: the device types it runs on), once per modeling module and
    process; logged once. Returns the modules hooked (none on CPU, without fla, with ``HSSTORE_CONV=torch``, or for
    a target without such mixers)."""
    if torch.device(device).type not in devices or env.CONV.get() == "torch":
        return []
    modules = _mixer_modules(model)
    kernel = kernel or (fla_causal_conv1d() if modules else None)
    if kernel is None:
        if modules:
            log.info("flash-linear-attention is not importable: the short convolution stays on PyTorch")
        return []
    hooked = []
    for module in modules:
        fn = getattr(module, HOOKED, None)
        if not callable(fn):
            log.warning("%s has no %s (another transformers version?): its short convolution stays on PyTorch",
                        module.__name__, HOOKED)
            continue
        if not getattr(fn, "_hsstore_fla_conv", False):
            setattr(module, HOOKED, conv_adapter(fn, kernel, devices))
            hooked.append(module.__name__.rsplit(".", 1)[-1])
    if hooked:
        log.info("Gated DeltaNet short convolution on fla's Triton kernel (%s; %s=torch keeps PyTorch's)",
                 ", ".join(hooked), env.CONV.name)
    return hooked


def torch_conv(model: torch.nn.Module) -> list[tuple]:
    """Undo :func:`use_fla_conv` for ``model``'s mixers; returns what :func:`restore_conv` puts back (the
    benchmark's paired torch-convolution mode)."""
    undone = []
    for module in _mixer_modules(model):
        fn = getattr(module, HOOKED, None)
        if getattr(fn, "_hsstore_fla_conv", False):
            setattr(module, HOOKED, fn._hsstore_previous)
            undone.append((module, fn))
    return undone


def restore_conv(undone: list[tuple]) -> None:
    for module, fn in undone:
        setattr(module, HOOKED, fn)
