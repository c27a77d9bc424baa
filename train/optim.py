"""Optimizer and schedule of the DFlash recipe: AdamW lr 6e-4, no weight decay, 4% linear warmup,
cosine decay, gradient clipping at 1.0.

Weight decay, where asked for, follows Hugging Face Trainer's ``weight_decay``: AdamW's decoupled decay on every
trainable weight but biases, norm weights and whatever lives in a ``LayerNorm`` (its
``get_decay_parameter_names``: lower-cased names containing ``bias``, ``layernorm``, ``rmsnorm``, a ``norm`` part
or a part ending in ``_norm``). The optimizer has the two groups it has: decayed weights first, then the rest.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

# a parameter name that takes no weight decay (lower-cased), as Hugging Face Trainer decides it
NO_DECAY = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")
DECAY_KEY = "decay"  # a param group's mark: True for the decayed weights (kept in the optimizer's state)


def decay_parameter_names(model: torch.nn.Module) -> set[str]:
    """The names of the trainable parameters AdamW's weight decay applies to."""
    in_layernorm = {f"{m}.{n}" if m else n for m, mod in model.named_modules() if isinstance(mod, torch.nn.LayerNorm)
                    for n, _ in mod.named_parameters(recurse=False)}
    return {n for n, p in model.named_parameters() if p.requires_grad and n not in in_layernorm
            and not NO_DECAY.search(n.lower())}


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """The trainable parameters as AdamW's groups: decayed weights (``weight_decay``), then the rest (none)."""
    decayed = decay_parameter_names(model)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in named if n in decayed], "weight_decay": weight_decay, DECAY_KEY: True},
              {"params": [p for n, p in named if n not in decayed], "weight_decay": 0.0, DECAY_KEY: False}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: torch.nn.Module, lr: float = 6e-4, weight_decay: float = 0.0,
                    betas: tuple[float, float] = (0.9, 0.999), **kwargs) -> torch.optim.AdamW:
    """AdamW over the trainable parameters only (the frozen embedding / lm_head are buffers anyway), in the groups
    of ``parameter_groups``. On CUDA the fused kernel (one launch for all parameters: faster than the foreach
    update, the same update)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if params and all(p.is_cuda for p in params):
        kwargs.setdefault("fused", True)
    return torch.optim.AdamW(parameter_groups(model, weight_decay), lr=lr, weight_decay=weight_decay, betas=betas,
                             **kwargs)


def regrouped(saved_groups: list[dict[str, Any]], model: torch.nn.Module,
              opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """A saved optimizer's param groups in ``opt``'s grouping: a checkpoint written with one group of every
    trainable parameter (in the model's order, before weight decay had groups) split as ``opt`` groups them;
    other saved groups as they are (``load_state_dict`` says what does not fit)."""
    if len(saved_groups) != 1 or len(opt.param_groups) == 1:
        return saved_groups
    ids = saved_groups[0]["params"]
    order = {id(p): i for i, p in enumerate(p for p in model.parameters() if p.requires_grad)}
    if len(ids) != len(order):
        return saved_groups
    return [{**saved_groups[0], "weight_decay": g["weight_decay"], DECAY_KEY: g[DECAY_KEY],
             "params": [ids[order[id(p)]] for p in g["params"]]} for g in opt.param_groups]


def resume_with(opt: torch.optim.Optimizer, scheduler: LambdaLR, lr: float, weight_decay: float) -> None:
    """A restored optimizer and schedule, given this run's peak ``lr`` and ``weight_decay``: a checkpoint restores
    the ones it was saved with, and a resumed run trains with those it is given, from its first step on (the
    schedule's lambdas are this run's already: its length, warmup and floor)."""
    scheduler.base_lrs = [lr] * len(opt.param_groups)
    for group, factor in zip(opt.param_groups, scheduler.lr_lambdas):
        group["initial_lr"] = lr
        group["lr"] = lr * factor(scheduler.last_epoch)
        group["weight_decay"] = weight_decay if group.get(DECAY_KEY, True) else 0.0


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
