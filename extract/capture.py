"""Capturing tapped layers from a target's forward pass, and nothing more.

Forward hooks on the tapped decoder layers only; the hook of the last tapped layer stops the forward
(the remaining layers, the final norm and the lm_head never run). Layer id ``l`` is the output of
decoder layer ``l`` (0-based), which is HF ``hidden_states[l + 1]``.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from hsstore.taps import text_config

log = logging.getLogger(__name__)


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


class _StopForward(Exception):
    """Raised by the last tap's hook: everything after it is wasted work."""


@contextmanager
def tapped(model: nn.Module, layers: list[int]) -> Iterator[dict[int, torch.Tensor]]:
    """Within the block, a forward fills the yielded dict ``{layer_id: [B, T, H]}`` and stops after the
    last tapped layer. Use :func:`run_tapped` to call the model."""
    stack = decoder_layers(model)
    captured: dict[int, torch.Tensor] = {}
    last = max(layers)
    handles = []

    def make_hook(layer_id: int):
        def hook(_module, _inputs, output):
            captured[layer_id] = output[0] if isinstance(output, (tuple, list)) else output
            if layer_id == last:
                raise _StopForward

        return hook

    try:
        for l in layers:
            handles.append(stack[l].register_forward_hook(make_hook(l)))
        yield captured
    finally:
        for h in handles:
            h.remove()


def base_model(model: nn.Module) -> nn.Module:
    """The decoder without the lm_head (calling it skips the vocabulary projection entirely)."""
    inner = getattr(model, "model", None)
    return inner if isinstance(inner, nn.Module) else model


@torch.inference_mode()
def run_tapped(model: nn.Module, layers: list[int], input_ids: torch.Tensor, attention_mask: torch.Tensor,
               ) -> torch.Tensor:
    """One forward over a right-padded batch; returns the taps as ``[B, T, n_layers, H]`` on the model's
    device (stacked on the GPU: one device-to-host copy per batch instead of one per layer)."""
    with tapped(model, layers) as captured:
        try:
            base_model(model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        except _StopForward:
            pass
        missing = [l for l in layers if l not in captured]
        if missing:
            raise RuntimeError(f"forward finished without reaching layers {missing}")
        return torch.stack([captured[l] for l in layers], dim=2)
