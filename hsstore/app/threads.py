"""The CPU threads a command's model work runs on, chosen one way by every command that runs a model (extract,
audit, train, eval, demo): ``--cpu-threads N`` when given, else a count that fits the work and the cores this
process may use.

The work: a model whose forward is a few milliseconds (the tiny targets and drafters, under ``SMALL_MODEL_PARAMS``)
has ops too small to split, so it runs on one thread; a larger one's matmuls use every core it may use. The
cores: the CPUs its affinity mask allows, capped by the cgroup's CPU quota (``cpu.max`` of cgroup v2, or
``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` of v1) rounded up, since a container limited to two CPUs' time on a
64-core host that starts 64 threads has them wait on each other. OpenMP's idle threads sleep between parallel
regions instead of spinning (``env.passive_openmp``, set before torch loads), so a busy neighbour costs this
process a share of the cores, not a collapse while its threads spin for cores someone else holds.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

log = logging.getLogger(__name__)

# A model below this many parameters runs on one CPU thread by default: its forwards take milliseconds, and splitting
# each op over cores costs more in hand-offs than it saves (on a busy machine the threads only wait on each other).
SMALL_MODEL_PARAMS = 50_000_000
CGROUP = Path("/sys/fs/cgroup")


def cpu_threads_option(used_for: str = "the model's CPU work", gpus: str = ""):
    """Every command's ``--cpu-threads`` setting: its meaning said once, here (``gpus``: what the default is where
    the model runs on GPUs)."""
    from .schema import option

    return option(None, metavar="N",
                  help=f"torch CPU threads for {used_for} (default: 1 for a model under "
                       f"{SMALL_MODEL_PARAMS // 1_000_000}M parameters, whose ops are too small to split; else the "
                       "cores this process may use: its CPU affinity, capped by its cgroup's CPU quota"
                       + (f"; {gpus}" if gpus else "") + ")")


def cgroup_cpu_limit(root: Path = CGROUP) -> float | None:
    """CPUs' worth of time the cgroup quota allows this process (``2.5``: two and a half CPUs), None when unlimited
    or unknown. Reads cgroup v2's ``cpu.max`` ("QUOTA PERIOD" or "max PERIOD"), else v1's ``cpu/cpu.cfs_quota_us``
    and ``cpu/cpu.cfs_period_us`` (quota -1: unlimited)."""
    def numbers(path: Path) -> list[str] | None:
        try:
            with open(path, encoding="ascii") as f:
                return f.read(256).split()
        except (OSError, UnicodeDecodeError):
            return None

    v2 = numbers(root / "cpu.max")
    if v2 is not None:
        if len(v2) != 2 or v2[0] == "max":
            return None
        quota, period = v2
    else:
        for folder in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
            q, p = numbers(root / folder / "cpu.cfs_quota_us"), numbers(root / folder / "cpu.cfs_period_us")
            if q and p:
                quota, period = q[0], p[0]
                break
        else:
            return None
    try:
        quota_us, period_us = int(quota), int(period)
    except ValueError:
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def usable_cores(root: Path = CGROUP) -> int:
    """The cores this process may run on: its affinity mask's CPUs, at most its cgroup quota rounded up, at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    limit = cgroup_cpu_limit(root)
    if limit is not None:
        cores = min(cores, math.ceil(limit))
    return max(1, cores)


def default_threads(params: int, cores: int, ranks_here: int = 1) -> int:
    """Threads for a model of ``params`` parameters on ``cores`` usable cores shared by ``ranks_here`` processes
    (torchrun's local ranks): 1 for a small model, else this process's share of the cores."""
    if params < SMALL_MODEL_PARAMS:
        return 1
    return max(1, cores // max(1, ranks_here))


def apply_cpu_threads(requested: int | None, params: int, what: str, ranks_here: int = 1) -> int:
    """Set torch's intra-op threads for a model of ``params`` parameters (``requested``: ``--cpu-threads``, which
    wins) and log the count with why; returns it."""
    import torch

    if requested is not None and requested < 1:
        raise ValueError(f"--cpu-threads {requested}: give a count of at least 1")
    cores = usable_cores()
    n = requested if requested is not None else default_threads(params, cores, ranks_here)
    torch.set_num_threads(n)
    why = ("--cpu-threads" if requested is not None else
           f"a model of {params / 1e6:,.1f}M parameters: ops too small to split" if params < SMALL_MODEL_PARAMS else
           f"the {cores} core(s) this process may use" + (f", shared by {ranks_here} local ranks" if ranks_here > 1
                                                          else ""))
    log.info("%s: %d CPU thread(s) (%s; --cpu-threads N to choose)", what, n, why)
    return n


def ranks_on_this_node() -> int:
    """Processes of this job on this machine (torchrun's ``LOCAL_WORLD_SIZE``; 1 outside torchrun)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    except ValueError:
        return 1


def threads_for_model(requested: int | None, model, device, what: str) -> int:
    """:func:`apply_cpu_threads` for ``model`` (its parameters counted) when it runs on the CPU, or when
    ``--cpu-threads`` was given; on a GPU the host's threads are left as they are."""
    import torch

    if getattr(device, "type", str(device)) != "cpu" and requested is None:
        return torch.get_num_threads()
    params = sum(p.numel() for p in model.parameters())
    return apply_cpu_threads(requested, params, what, ranks_on_this_node())
