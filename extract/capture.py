"""Capturing tapped layers from a target's forward pass, and nothing more.

Forward hooks on the tapped decoder layers only; the hook of the last tapped layer stops the forward
(the remaining layers, the final norm and the lm_head never run). Layer id ``l`` is the output of
decoder layer ``l`` (0-based), which is HF ``hidden_states[l + 1]``. With ``final_hidden`` the forward runs
on to the final norm, whose output (what the lm_head reads; HF's last ``hidden_states``) is captured by a
hook on the norm in the same pass, and the forward stops there.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from hsstore.format.taps import text_config

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


class _StopForward(Exception):
    """Raised by the last tap's hook: everything after it is wasted work."""


@contextmanager
def tapped(model: nn.Module, layers: list[int], final_hidden: bool = False,
           ) -> Iterator[dict[int | str, torch.Tensor]]:
    """Within the block, a forward fills the yielded dict ``{layer_id: [B, T, H]}`` and stops after the
    last tapped layer (``final_hidden``: after the final norm, captured as ``"final_hidden"``). Use
    :func:`run_tapped` to call the model."""
    stack = decoder_layers(model)
    captured: dict[int | str, torch.Tensor] = {}
    last = "final_hidden" if final_hidden else max(layers)
    handles = []

    def make_hook(layer_id: int | str):
        def hook(_module, _inputs, output):
            captured[layer_id] = output[0] if isinstance(output, (tuple, list)) else output
            if layer_id == last:
                raise _StopForward

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


def base_model(model: nn.Module) -> nn.Module:
    """The decoder without the lm_head (calling it skips the vocabulary projection entirely)."""
    inner = getattr(model, "model", None)
    return inner if isinstance(inner, nn.Module) else model


@torch.inference_mode()
def run_tapped(model: nn.Module, layers: list[int], input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
               final_hidden: bool = False) -> torch.Tensor:
    """One forward over a right-padded batch; returns the taps as ``[B, T, n_layers, H]`` on the model's
    device (stacked on the GPU: one device-to-host copy per batch instead of one per layer); with
    ``final_hidden``, ``[B, T, n_layers + 1, H]``, the final norm's output last. ``attention_mask`` may be None
    for right padding: real tokens' features are the same (only the pads' differ)."""
    slots = list(layers) + (["final_hidden"] if final_hidden else [])
    with tapped(model, layers, final_hidden) as captured:
        try:
            base_model(model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        except _StopForward:
            pass
        missing = [l for l in slots if l not in captured]
        if missing:
            raise RuntimeError(f"forward finished without reaching layers {missing}")
        return torch.stack([captured[l] for l in slots], dim=2)
