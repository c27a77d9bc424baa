"""Optimizer and schedule of the DFlash recipe: AdamW lr 6e-4, no weight decay, 4% linear warmup,
cosine decay, gradient clipping at 1.0."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


def build_optimizer(model: torch.nn.Module, lr: float = 6e-4, weight_decay: float = 0.0,
                    betas: tuple[float, float] = (0.9, 0.999), **kwargs) -> torch.optim.AdamW:
    """AdamW over the trainable parameters only (the frozen embedding / lm_head are buffers anyway). On CUDA the
    fused kernel (one launch for all parameters: faster than the foreach update, the same update)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if params and all(p.is_cuda for p in params):
        kwargs.setdefault("fused", True)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas, **kwargs)


def lr_factor(step: int, total_steps: int, warmup_frac: float = 0.04, min_ratio: float = 0.0) -> float:
    """Multiplier of the base lr at ``step`` (0-based): linear warmup to 1, then cosine to min_ratio."""
    warmup = max(1, math.ceil(warmup_frac * total_steps))
    if step < warmup:
        return (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))


def build_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, warmup_frac: float = 0.04,
                    min_ratio: float = 0.0) -> LambdaLR:
    """Call ``scheduler.step()`` once after every ``optimizer.step()``."""
    return LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, warmup_frac, min_ratio))


def set_total_steps(scheduler: LambdaLR, total_steps: int, warmup_frac: float = 0.04, min_ratio: float = 0.0) -> None:
    """The schedule's length changed (a followed store's epoch 0 was estimated, and is now known): the steps from
    here follow the new length (``scheduler.last_epoch`` stays)."""
    scheduler.lr_lambdas = [lambda step: lr_factor(step, total_steps, warmup_frac, min_ratio)
                            for _ in scheduler.lr_lambdas]


def clip_grad(model_or_params, max_norm: float = 1.0) -> torch.Tensor:
    """Clip the global grad norm in place; returns the norm before clipping (log it)."""
    params = model_or_params.parameters() if isinstance(model_or_params, torch.nn.Module) else model_or_params
    params = [p for p in params if p.grad is not None]
    return torch.nn.utils.clip_grad_norm_(params, max_norm)
