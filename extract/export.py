"""Where ``hsstore export`` lived before the peers became a registry (``extract/peers/``): each name still
resolves, with a DeprecationWarning naming its new home."""

from __future__ import annotations

import importlib
from typing import Any

from .peers import get, moved

PEERS = "hsstore.extract.peers"
MOVED = {**{n: ("exporting", n) for n in ("SIDECAR", "MARKER", "SIDECAR_CAP", "export_plan", "export_sidecar",
                                         "exported_ids")},
         "ExportResult": ("base", "ExportResult"),
         **{n: ("specforge", n) for n in ("FILE_GROUP_SIZE", "SPECFORGE_LAYOUTS", "consecutive_loss",
                                          "specforge_taps")},
         "export_specforge": ("specforge", "export"),
         "ARROW_FILE": ("speculators", "ARROW_FILE"),
         "export_speculators": ("speculators", "export")}


def export_store(fmt: str, url: str, out: str, **kw) -> Any:
    moved(f"{__name__}.export_store(fmt, ...)", f"{PEERS}.get(fmt, 'export').export(...)")
    return get(fmt, "export").export(url, out, **kw)


def __getattr__(name: str) -> Any:
    if name in MOVED:
        module, new = MOVED[name]
        moved(f"{__name__}.{name}", f"{PEERS}.{module}.{new}")
        return getattr(importlib.import_module(f"{PEERS}.{module}"), new)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
