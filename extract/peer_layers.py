"""Where the peers' layer-id conventions lived before the peers became a registry: each peer's is now its
module's ``LAYERS`` (``extract/peers/``, ``base.LayerConvention``). Each name still resolves, with a
DeprecationWarning naming its new home."""

from __future__ import annotations

import importlib
from typing import Any

from .peers import get, moved, names

PEERS = "hsstore.extract.peers"
MOVED = {"parse_ids": "base", "EAGLE3": "specforge", "EAGLE3_TAPS": "specforge", "eagle3_taps": "specforge",
         "vllm_launch_ids": "speculators"}


def to_hsstore(peer: str, peer_ids: list[int], num_layers: int) -> list[int]:
    moved(f"{__name__}.to_hsstore(peer, ...)", f"{PEERS}.get(peer).LAYERS.to_hsstore(peer, ...)")
    return get(peer).LAYERS.to_hsstore(peer, peer_ids, num_layers)


def from_hsstore(peer: str, layers: list[int]) -> list[int]:
    moved(f"{__name__}.from_hsstore(peer, ...)", f"{PEERS}.get(peer).LAYERS.from_hsstore(...)")
    return get(peer).LAYERS.from_hsstore(layers)


def ambiguity(peer: str, layers: list[int], num_layers: int) -> str | None:
    moved(f"{__name__}.ambiguity(peer, ...)", f"{PEERS}.get(peer).ambiguity(...)")
    return get(peer).ambiguity(layers, num_layers)


def __getattr__(name: str) -> Any:
    if name in ("PEER_OFFSET", "PEER_CONVENTION"):
        field = "offset" if name == "PEER_OFFSET" else "text"
        moved(f"{__name__}.{name}", f"{PEERS}.get(peer).LAYERS.{field}")
        return {n: getattr(get(n).LAYERS, field) for n in names("import")}
    if name in MOVED:
        moved(f"{__name__}.{name}", f"{PEERS}.{MOVED[name]}.{name}")
        return getattr(importlib.import_module(f"{PEERS}.{MOVED[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
