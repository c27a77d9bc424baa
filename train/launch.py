"""The training process: its rank, device and process group under torchrun, and its CPU threads.

DDP (``torchrun``): gloo on CPU, nccl on GPU, and a gloo group beside nccl for the small all-reduces of
metrics and lockstep (they live on the CPU).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hsstore.app.devices import resolve_device
from hsstore.app.threads import SMALL_MODEL_PARAMS, apply_cpu_threads, ranks_on_this_node, usable_cores
from hsstore.distributed import local_rank, rank_and_world


def init_distributed(device: str | None):
    """(rank, world, device, CPU group for small all-reduces); starts the process group under torchrun."""
    rank, world = rank_and_world()
    local = local_rank(rank, world)
    dev = resolve_device(device, local)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    group = None
    if world > 1:
        if not dist.is_initialized():
            dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
        if dev.type == "cuda":
            group = dist.new_group(backend="gloo")
    return rank, world, dev, group


def share_cpu_threads(requested: int | None, dev: torch.device, params: int | None = None) -> int:
    """Threads for torch's CPU ops. On a CPU the step's: ``hsstore.app.threads``'s rule for a model of ``params``
    parameters (one thread for a small drafter; None: no model, the cores), each local rank its share. On GPUs the
    host's (the batch collate: a layer-major -> token-major copy of ~1 GB per step): torchrun sets
    ``OMP_NUM_THREADS=1`` unless told otherwise; batches collated straight into pinned memory keep up with one thread
    (docs/PERFORMANCE.md, "Loader"), but other CPU ops need not, so under torchrun each local rank gets its share of
    the cores this process may use. ``--cpu-threads`` overrides both."""
    ranks_here = ranks_on_this_node()
    if dev.type == "cuda" and requested is None:
        if ranks_here > 1:
            torch.set_num_threads(max(1, usable_cores() // ranks_here))
        return torch.get_num_threads()
    return apply_cpu_threads(requested, SMALL_MODEL_PARAMS if params is None else params, "train", ranks_here)
