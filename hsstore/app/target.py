"""The target model as extraction, audit and eval load and read it: one loader, one way to find its decoder layers,
one capture of a tap.

Extraction and eval must compute the same tensor for a tap, with the same kernels: a drafter is fed at
evaluation what it was trained on, and the audit compares the roundings extraction made. So :func:`load_target`
routes CPU forwards to transformers' torch paths (``devices.route_cpu_kernels``) and, on CUDA, the Gated DeltaNet
short convolution to fla's kernel (``conv.use_fla_conv``) for every caller; and :func:`tapped` captures tap ``l``
as the output of decoder layer ``l`` (before the final norm, the last layer's too) with a forward hook, never as
HF's ``hidden_states[l + 1]`` (whose last entry transformers replaces by the norm's output).

"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from ..progress import is_terminal
from .conv import use_fla_conv
from .devices import route_cpu_kernels

log = logging.getLogger(__name__)


def text_config(config: Any) -> Any:
    """The decoder's part of a target config, a transformers config or its dict (multimodal configs such as
    ``qwen3_5`` nest it as ``text_config``; others are their own)."""
    inner = config.get("text_config") if isinstance(config, dict) else getattr(config, "text_config", None)
    return inner or config


def load_target(model_path: str, dtype: torch.dtype, device: torch.device, progress: bool = True) -> nn.Module:
    """The target from a local directory (nothing downloaded, no remote code), in ``dtype`` on ``device``, in eval
    mode, with the kernels every command runs (module docstring); transformers' weight-loading bar only with
    ``progress`` and on a terminal (its bar redraws with carriage returns)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    if not progress or not is_terminal():
        hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, local_files_only=True,
                                                 trust_remote_code=False)
    return to_device(model, device)


def to_device(model: nn.Module, device: torch.device) -> nn.Module:
    """A loaded target on ``device`` with the kernels :func:`load_target` gives (for a model built in process)."""
    route_cpu_kernels(model)  # a CPU forward never reaches fla's Triton kernels, installed or not
    use_fla_conv(model, device)  # on CUDA: the short convolution on fla's Triton kernel, not PyTorch's fallback
    note_kernel_compiles(model, device)
    return model.to(device).eval()


def triton_cache_dir() -> Path:
    """Where Triton keeps compiled kernels and autotuning results between processes (``TRITON_CACHE_DIR``, else
    ``~/.triton/cache``)."""
    env = os.environ.get("TRITON_CACHE_DIR", "").strip()
    return Path(env) if env else Path.home() / ".triton" / "cache"


def note_kernel_compiles(model: nn.Module, device: torch.device) -> bool:
    """Say, once per process, that fla's Triton kernels will compile and autotune on their first use when this
    machine has none compiled yet (an empty Triton cache): the first forward of a Gated DeltaNet target on CUDA
    then waits about a minute, whatever the model's size, and later processes reuse the cache. Returns whether
    it said so."""
    if torch.device(device).type != "cuda" or _NOTED or not any(
            type(m).__name__.endswith("GatedDeltaNet") for m in model.modules()):
        return False
    cache = triton_cache_dir()
    try:
        empty = not cache.is_dir() or next(cache.iterdir(), None) is None
    except OSError:
        empty = True
    if empty:
        log.warning("compiling kernels, once per machine: fla's Triton kernels compile and autotune on their first "
                    "use here (about a minute before the first batch; later runs reuse %s)", cache)
        _NOTED.append(True)
    return empty


_NOTED: list[bool] = []


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's list of decoder layers: the ModuleList with ``num_hidden_layers`` entries
    (``model.model.layers`` for most causal LMs, ``...language_model.layers`` for multimodal ones)."""
    n = text_config(model.config).num_hidden_layers
    candidates = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == n]
    # prefer the language model's stack over a vision tower of the same depth
    candidates.sort(key=lambda nm: ("visual" in nm[0] or "vision" in nm[0], nm[0].count(".")))
    if not candidates:
        raise ValueError(f"cannot find the {n} decoder layers of {type(model).__name__}")
    return candidates[0][1]


def final_norm(model: nn.Module) -> nn.Module:
    """The norm applied after the last decoder layer: the ``norm`` beside the decoder-layer list
    (``model.model.norm``, ``...language_model.norm``)."""
    stack = decoder_layers(model)
    for name, m in model.named_modules():
        if m is stack:
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            norm = getattr(parent, "norm", None)
            if isinstance(norm, nn.Module):
                return norm
    raise ValueError(f"cannot find the final norm of {type(model).__name__} (a 'norm' beside its decoder layers)")


def base_model(model: nn.Module) -> nn.Module:
    """The decoder without the lm_head (calling it skips the vocabulary projection entirely)."""
    inner = getattr(model, "model", None)
    return inner if isinstance(inner, nn.Module) else model


class StopForward(Exception):
    """Raised by the last tap's hook when the rest of the forward is wasted work (``tapped(stop=True)``)."""


@contextmanager
def tapped(model: nn.Module, layers: list[int], final_hidden: bool = False, stop: bool = False,
           ) -> Iterator[dict[int | str, torch.Tensor]]:
    """Within the block, a forward fills the yielded dict ``{layer_id: [B, T, H]}``: each tap the output of its
    decoder layer (``final_hidden``: also the final norm's output, as ``"final_hidden"``). ``stop``: the hook of
    the last capture raises :class:`StopForward` (the caller catches it), so nothing after it runs."""
    stack = decoder_layers(model)
    captured: dict[int | str, torch.Tensor] = {}
    last = "final_hidden" if final_hidden else max(layers)
    handles = []

    def make_hook(layer_id: int | str):
        def hook(_module, _inputs, output):
            captured[layer_id] = output[0] if isinstance(output, (tuple, list)) else output
            if stop and layer_id == last:
                raise StopForward

        return hook

    try:
        for l in layers:
            handles.append(stack[l].register_forward_hook(make_hook(l)))
        if final_hidden:
            handles.append(final_norm(model).register_forward_hook(make_hook("final_hidden")))
        yield captured
    finally:
        for h in handles:
            h.remove()
