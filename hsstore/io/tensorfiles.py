"""safetensors files on local disk, created as every other file is: readable as the user's umask says.

``safetensors.torch.save_file`` creates its files owner-only (0600) whatever the umask, so an engine or trainer
running as another user (a serving container, a shared cluster account) gets "Permission denied" on a drafter or
a peer's export whose JSON files beside it it can read. Every safetensors file hsstore writes goes through here,
and every one it reads from a folder from elsewhere (a drafter, a checkpoint, a peer's files: ``load_beneath``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def save_safetensors(tensors: dict[str, Any], path: str | os.PathLike, metadata: dict[str, str] | None = None,
                     ) -> Path:
    """``tensors`` (contiguous CPU tensors) as a safetensors file at ``path``, mode ``0666 & ~umask``: written under
    a fresh temporary name and renamed into place (``sinks.write_with``), so a link planted at ``path`` is replaced,
    never written through."""
    from safetensors.torch import save_file

    from . import sinks

    path = Path(path)
    sinks.write_with(path.parent, path.name, lambda p: save_file(tensors, p, metadata=metadata),
                     what=f"writing {path}")
    return path


def load_beneath(folder: str | os.PathLike, name: str, *, bound: int, device: str = "cpu") -> dict[str, Any]:
    """The tensors of safetensors file ``name`` of a folder from elsewhere (a drafter, a checkpoint, a peer's
    files), opened through the door: a regular file beneath ``folder`` (no link, FIFO or device), at most ``bound``
    bytes. Anything safetensors cannot read is one ``ValueError`` naming the file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from . import door

    where = os.path.join(os.fspath(folder), name)
    try:
        with door.path_beneath(folder, name, bound=bound, where=os.fspath(folder)) as p:
            return load_file(p, device=device)
    except door.Refused as e:
        raise ValueError(str(e)) from None
    except (SafetensorError, RuntimeError) as e:
        raise ValueError(f"{where}: not a readable safetensors file ({(str(e).splitlines() or [''])[0][:200]})") \
            from None
