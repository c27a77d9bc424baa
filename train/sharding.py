"""The optimizer's states sharded over the ranks of a DDP run (ZeRO stage 1, PyTorch's own
``ZeroRedundancyOptimizer``).

AdamW keeps two fp32 moments per trainable parameter, on every rank, beside the fp32 weights and gradients: as
much again as those two. Sharded, each rank keeps and updates the moments of its share
of the parameters only, then sends its updated parameters to the others (one broadcast per parameter after the
step); weights, gradients and DDP's all-reduce stay as they are, so the step is the same one. The memory plan
(``budget.plan_step``) turns it on where a step would otherwise need more recompute or fewer anchors
(``--shard-optimizer auto``), since the broadcast costs less than recomputing layers.

Checkpoints keep one format: before a checkpoint every rank sends its share to rank 0 (``gather_for_save``),
which writes the whole optimizer state as an unsharded run does; a run resumes from it with any number of ranks,
sharded or not, each rank loading its own share.
"""

from __future__ import annotations

import inspect

import torch

from .optim import build_optimizer


def is_sharded(opt: torch.optim.Optimizer) -> bool:
    return isinstance(opt, ShardedOptimizer)


def shard(opt: torch.optim.Optimizer) -> "ShardedOptimizer":
    """``opt`` (built by ``optim.build_optimizer``, its states still empty) as a sharded optimizer of the same
    class, parameter groups and settings, over the default process group."""
    cls = type(opt)
    accepted = inspect.signature(cls.__init__).parameters
    defaults = {k: v for k, v in opt.defaults.items() if k in accepted}
    return ShardedOptimizer([dict(g) for g in opt.param_groups], optimizer_class=cls, **defaults)


def sharded_as_planned(opt: torch.optim.Optimizer, setting: str, world: int) -> torch.optim.Optimizer:
    """``opt`` sharded over the ``world`` ranks where the plan resolved ``--shard-optimizer`` to "on"
    (``budget``); as it is in one process or otherwise."""
    return shard(opt) if setting == "on" and world > 1 else opt


def planned_optimizer(drafter: torch.nn.Module, schedule, setting: str, world: int) -> torch.optim.Optimizer:
    """AdamW over ``drafter`` as the run's ``schedule`` section asks (``optim.build_optimizer``), sharded where the
    plan resolved ``--shard-optimizer`` (``setting``) to "on" (``sharded_as_planned``)."""
    opt = build_optimizer(drafter, lr=schedule.lr, weight_decay=schedule.weight_decay)
    return sharded_as_planned(opt, setting, world)


def gather_for_save(opt: torch.optim.Optimizer) -> None:
    """Every rank, before a checkpoint: a sharded optimizer's shares sent to rank 0, whose ``state_dict()`` then
    holds the whole state (a no-op for an unsharded one)."""
    if is_sharded(opt):
        opt.consolidate_state_dict(to=0)


def _zero_class():
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer


class ShardedOptimizer(_zero_class()):
    """``ZeroRedundancyOptimizer`` whose ``state`` is this rank's share (the local optimizer's), so that code
    reading ``opt.state`` (the checkpoint's shape checks) sees the tensors this rank holds, and a loaded state
    is held once (the base class would keep a second device copy of the share it loads)."""

    def __init__(self, params, optimizer_class, **defaults):
        super().__init__(params, optimizer_class=optimizer_class, **defaults)
        self.state = self.optim.state

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self.state = self.optim.state
