"""safetensors files on local disk, created as every other file is: readable as the user's umask says.

``safetensors.torch.save_file`` creates its files owner-only (0600) whatever the umask, so an engine or trainer
running as another user (a serving container, a shared cluster account) gets "Permission denied" on a drafter or
a peer's export whose JSON files beside it it can read. Every safetensors file hsstore writes goes through here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def umask() -> int:
    """This process's umask, read without changing it where Linux says it (``/proc/self/status``); elsewhere set
    and restored at once."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_safetensors(tensors: dict[str, Any], path: str | os.PathLike, metadata: dict[str, str] | None = None,
                     ) -> Path:
    """``tensors`` (contiguous CPU tensors) as a safetensors file at ``path``, mode ``0666 & ~umask``."""
    from safetensors.torch import save_file

    path = Path(path)
    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~umask())
    return path
