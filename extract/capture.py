"""Capturing tapped layers from a target's forward pass, and nothing more.

Forward hooks on the tapped decoder layers only (``hsstore.app.target.tapped``, the capture eval shares); the hook of
the last tapped layer stops the forward (the remaining layers, the final norm and the lm_head never run). Layer id
``l`` is the output of decoder layer ``l`` (0-based) before the final norm, the last layer's too. With
``final_hidden`` the forward runs on to the final norm, whose output (what the lm_head reads; HF's last
``hidden_states``) is captured by a hook on the norm in the same pass, and the forward stops there.
"""

from __future__ import annotations

import torch
from torch import nn

from hsstore.app.target import StopForward, base_model, tapped


@torch.inference_mode()
def run_tapped(model: nn.Module, layers: list[int], input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
               final_hidden: bool = False) -> torch.Tensor:
    """One forward over a right-padded batch; returns the taps as ``[B, T, n_layers, H]`` on the model's
    device (stacked on the GPU: one device-to-host copy per batch instead of one per layer); with
    ``final_hidden``, ``[B, T, n_layers + 1, H]``, the final norm's output last. ``attention_mask`` may be None
    for right padding: real tokens' features are the same (only the pads' differ)."""
    slots = list(layers) + (["final_hidden"] if final_hidden else [])
    with tapped(model, layers, final_hidden, stop=True) as captured:
        try:
            base_model(model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        except StopForward:
            pass
        missing = [l for l in slots if l not in captured]
        if missing:
            raise RuntimeError(f"forward finished without reaching layers {missing}")
        return torch.stack([captured[l] for l in slots], dim=2)
