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
           "class_of", "device_profile", "ops_by_shape", "gemm_profile", "gemm_rate"]


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


def _profiled(fn, record_shapes: bool = False):
    """torch.profiler over one call of ``fn`` (CPU operators, and CUDA kernels where there is a GPU), the device
    synchronised before and after so that only this call's kernels count."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
                 record_shapes=record_shapes) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    return prof


def device_profile(fn, classes, *, by: str = "kernel", top: int = 20) -> dict:
    """Where one call of ``fn`` spends device time, by class: ``{"ms", "by_class_pct", "by_class_ms", "top"}``.

    ``by="kernel"``: CUDA kernels by their own names (what inductor and fla launch); ``by="op"``: each kernel's
    time given to the operator that launched it (self device time: ``aten::mm``, ``aten::_efficient_attention
    _backward``, ...), which names eager code's generic elementwise kernels. Without CUDA, operators' self CPU
    time (a CPU smoke test of the same table). Call ``fn`` once before: compiling and first-touch allocations
    are not what this measures."""
    import torch

    cuda = torch.cuda.is_available()
    prof = _profiled(fn)
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


def ops_by_shape(fn, ops, *, top: int = 12) -> list[dict]:
    """One call of ``fn``'s operators named in ``ops`` grouped by name and input shapes, each with its own device
    time: ``[{"op", "shapes", "calls", "ms"}]``, most time first (without CUDA, CPU time: a smoke test of the same
    table). Names which of many calls of one operator (``aten::copy_``, ``aten::mm``) the time goes to. Call
    ``fn`` once before."""
    import torch

    cuda = torch.cuda.is_available()
    prof = _profiled(fn, record_shapes=True)
    rows: dict[tuple, dict] = {}
    for ev in prof.events():
        if ev.name not in ops or ev.device_type == torch.autograd.DeviceType.CUDA:
            continue
        shapes = tuple(tuple(x) if isinstance(x, (list, tuple)) else () for x in (ev.input_shapes or []))
        r = rows.setdefault((ev.name, shapes), {"op": ev.name, "shapes": [list(x) for x in shapes],
                                                "calls": 0, "us": 0.0})
        r["calls"] += 1
        r["us"] += ev.self_device_time_total if cuda else ev.self_cpu_time_total
    out = [{"op": r["op"], "shapes": r["shapes"], "calls": r["calls"], "ms": round(r["us"] / 1e3, 3)}
           for r in rows.values()]
    return sorted(out, key=lambda r: -r["ms"])[:top]


GEMM_OPS = {"aten::mm": (0, 1), "aten::addmm": (1, 2)}  # operator -> the positions of its two matrices


def gemm_profile(fn, *, top: int = 12) -> list[dict]:
    """One call of ``fn``'s GEMMs (``aten::mm``/``addmm``, eager or as inductor's extern kernels) grouped by shape:
    ``[{"m", "k", "n", "calls", "ms", "flop", "tflops"}]``, most device time first. Call ``fn`` once before."""
    rows: dict[tuple, dict] = {}
    for r in ops_by_shape(fn, GEMM_OPS, top=10**6):
        where = GEMM_OPS[r["op"]]
        shapes = r["shapes"]
        if len(shapes) <= max(where):
            continue
        a, b = shapes[where[0]], shapes[where[1]]
        if len(a) != 2 or len(b) != 2:
            continue
        g = rows.setdefault((a[0], a[1], b[1]), {"m": a[0], "k": a[1], "n": b[1], "calls": 0, "ms": 0.0})
        g["calls"] += r["calls"]
        g["ms"] += r["ms"]
    for g in rows.values():
        g["flop"] = 2.0 * g["m"] * g["k"] * g["n"] * g["calls"]
        g["tflops"] = round(g["flop"] / g["ms"] / 1e9, 1) if g["ms"] else 0.0
        g["ms"] = round(g["ms"], 3)
    return sorted(rows.values(), key=lambda g: -g["ms"])[:top]


def gemm_rate(m: int, k: int, n: int, *, reps: int = 20, dtype=None) -> float:
    """TFLOP/s of ``F.linear`` (x [m, k] by a weight [n, k], as a layer computes) alone on the GPU: the rate
    cuBLAS reaches on that shape without the rest of the forward around it."""
    import torch

    dtype = dtype or torch.bfloat16
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype)
    for _ in range(3):
        torch.nn.functional.linear(x, w)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        torch.nn.functional.linear(x, w)
    end.record()
    torch.cuda.synchronize()
    return 2.0 * m * k * n * reps / (start.elapsed_time(end) / 1e3) / 1e12
