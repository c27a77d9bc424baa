"""The training process: its rank, device and process group under torchrun, and its CPU threads.

DDP (``torchrun``): gloo on CPU, nccl on GPU, and a gloo group beside nccl for the small all-reduces of
metrics and lockstep (they live on the CPU).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from hsstore.app.devices import resolve_device
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


def share_cpu_threads(requested: int | None, dev: torch.device) -> int:
    """Threads for torch's CPU ops (the batch collate: a layer-major -> token-major copy of ~1 GB per step).
    torchrun sets ``OMP_NUM_THREADS=1`` unless told otherwise; batches collated straight into pinned memory keep
    up with one thread (docs/PERFORMANCE.md, "Loader"), but other CPU ops need not. Default under torchrun on
    GPUs: each local rank gets its share of this machine's cores (``--cpu-threads`` overrides)."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    n = requested
    if n is None and local_world > 1 and dev.type == "cuda":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        n = max(1, cores // local_world)
    if n:
        torch.set_num_threads(n)
    return torch.get_num_threads()
