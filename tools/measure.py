"""What the benchmarks in tools/ measure with, once: wall time, this process's memory, cold page cache, ports
(``timed`` and ``drop_page_cache`` are hsstore's own, which ``hsstore bench`` uses).

Two memory figures, named for what they read: ``rss_mb`` is the resident set now (``/proc/self/statm``),
``peak_rss_mb`` the high-water mark (``VmHWM``: unlike ``ru_maxrss`` it starts afresh at exec, not at the
parent's peak; ``reset_peak_rss`` clears it where the kernel allows).
"""

from __future__ import annotations

import os
import re
import resource
from collections import defaultdict
from pathlib import Path

from hsstore.ops.bench import drop_page_cache, timed
from hsstore.testing.ports import free_port

__all__ = ["timed", "drop_page_cache", "drop_tree_cache", "rss_mb", "peak_rss_mb", "reset_peak_rss", "free_port",
           "class_of", "device_profile"]


def _status(key: str) -> int | None:
    """A ``/proc/self/status`` field in bytes (None off Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def rss_mb() -> float:
    """This process's resident set now, MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    """This process's peak resident set since exec (or ``reset_peak_rss``), MiB."""
    peak = _status("VmHWM")
    return peak / 2**20 if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak_rss() -> float:
    """Reset the peak resident set to the current one (Linux ``clear_refs`` 5); returns the RSS now, MiB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return rss_mb()


def drop_tree_cache(root: str | Path) -> None:
    """``drop_page_cache`` of every file under ``root`` (a store on local disk), for a cold read."""
    drop_page_cache([str(f) for f in Path(root).rglob("*") if f.is_file()])


def class_of(name: str, classes) -> str:
    """The first class of ``classes`` ((class, regex) pairs) whose pattern matches ``name``; "other" if none."""
    for cls, pattern in classes:
        if re.search(pattern, name, re.I):
            return cls
    return "other"


def device_profile(fn, classes, *, by: str = "kernel", top: int = 20) -> dict:
    """Where one call of ``fn`` spends device time, by class: ``{"ms", "by_class_pct", "by_class_ms", "top"}``.

    ``by="kernel"``: CUDA kernels by their own names (what inductor and fla launch); ``by="op"``: each kernel's
    time given to the operator that launched it (self device time: ``aten::mm``, ``aten::_efficient_attention
    _backward``, ...), which names eager code's generic elementwise kernels. Without CUDA, operators' self CPU
    time (a CPU smoke test of the same table). Call ``fn`` once before: compiling and first-touch allocations
    are not what this measures."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    times: dict[str, float] = defaultdict(float)  # microseconds
    for ev in prof.events():
        on_device = ev.device_type == torch.autograd.DeviceType.CUDA
        if cuda and by == "kernel" and on_device:
            times[ev.name] += ev.device_time_total
        elif cuda and by == "op" and not on_device:
            times[ev.name] += ev.self_device_time_total
        elif not cuda and not on_device:
            times[ev.name] += ev.self_cpu_time_total
    times = {k: v for k, v in times.items() if v > 0}
    total = sum(times.values()) or 1.0
    per_class: dict[str, float] = defaultdict(float)
    for name, us in times.items():
        per_class[class_of(name, classes)] += us
    ranked = sorted(per_class.items(), key=lambda kv: -kv[1])
    return {
        "ms": round(total / 1e3, 2),
        "by_class_pct": {k: round(100 * v / total, 2) for k, v in ranked},
        "by_class_ms": {k: round(v / 1e3, 2) for k, v in ranked},
        "top": [{"name": n[:120], "class": class_of(n, classes), "ms": round(us / 1e3, 2),
                 "pct": round(100 * us / total, 2)} for n, us in sorted(times.items(), key=lambda kv: -kv[1])[:top]],
    }
