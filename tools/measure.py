"""What the benchmarks in tools/ measure with, once: wall time, this process's memory, cold page cache, ports
(``timed`` and ``drop_page_cache`` are hsstore's own, which ``hsstore bench`` uses).

Two memory figures, named for what they read: ``rss_mb`` is the resident set now (``/proc/self/statm``),
``peak_rss_mb`` the high-water mark (``VmHWM``: unlike ``ru_maxrss`` it starts afresh at exec, not at the
parent's peak; ``reset_peak_rss`` clears it where the kernel allows).
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

from hsstore.ops.bench import drop_page_cache, timed
from hsstore.testing.ports import free_port

__all__ = ["timed", "drop_page_cache", "drop_tree_cache", "rss_mb", "peak_rss_mb", "reset_peak_rss", "free_port"]


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
