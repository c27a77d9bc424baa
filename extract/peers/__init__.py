"""The peers: the other projects whose files hold hidden states or read a store's, one module each, and their
registry.

``base`` is what a peer module provides (``Peer``: its name, how it numbers the taps, its export and its import)
and ``parse_ids``; ``exporting`` and ``importing`` are what every peer's export and import share (the export
folder, its sidecar and resume; the import through ``StoreWriter``); ``specforge``, ``speculators`` and
``dflash`` are the peers. The registry below declares each peer and what it offers, as data: the commands'
choices come from it without importing a peer's code, and ``get`` gives the module. Every registered peer runs
the one contract suite (tests/test_peer_contract.py). No code outside a peer's module names a peer to choose a
code path (tests/test_architecture.py).

Adding a peer: one module here implementing ``base.Peer``, one ``Declaration`` in ``PEERS``, one subclass of
the contract.
"""

from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the registry's modules, so that the import checks see the edges
    from . import dflash, specforge, speculators
    from .base import Peer

OFFERS = ("export", "import")


@dataclass(frozen=True)
class Declaration:
    """One peer: its name, its module, and which of ``hsstore export`` / ``hsstore import`` it has."""

    name: str
    module: str
    exports: bool
    imports: bool

    def offers(self, what: str) -> bool:
        return {"export": self.exports, "import": self.imports}[what]


PEERS: dict[str, Declaration] = {d.name: d for d in (
    Declaration("specforge", f"{__name__}.specforge", exports=True, imports=True),
    Declaration("speculators", f"{__name__}.speculators", exports=True, imports=True),
    Declaration("dflash", f"{__name__}.dflash", exports=False, imports=False),
)}


def names(offering: str | None = None) -> tuple[str, ...]:
    """Every registered peer, or those that offer ``offering`` (``export`` or ``import``)."""
    if offering is not None and offering not in OFFERS:
        raise ValueError(f"a peer offers one of {OFFERS}, not {offering!r}")
    return tuple(n for n, d in PEERS.items() if offering is None or d.offers(offering))


def get(name: str, offering: str | None = None) -> Peer:
    """The module of peer ``name``; refused in one line when no registered peer of that name offers
    ``offering``."""
    known = names(offering)
    if name not in known:
        raise ValueError(f"unknown peer format {name!r} (one of {', '.join(known)})")
    return importlib.import_module(PEERS[name].module)


# -- the names this package had as one module (extract/peers.py), kept working with a warning --------------------
MOVED = {**{n: "importing" for n in (
    "PAD_TOKEN_ID", "PAD_AMBIGUOUS", "SAMPLE_CAP", "features", "sample_files", "ImportResult", "import_files")},
    "PeerSample": "base", "PeerFile": "base",
    **{n: "specforge" for n in (
        "FEATURE_KEYS", "TARGET_KEYS", "CKPT_SUFFIXES", "GZIP_EXPANSION", "GZIP_FLOOR", "gunzip_bounded",
        "load_ckpt", "trailing_padding", "specforge_sample", "specforge_files", "first_file_has_final_hidden")},
    **{n: "speculators" for n in ("HS_DIR", "speculators_sample", "speculators_files")}}
BY_NAME = {"import_manifest": "import_manifest(peers.get(name), ...)",
           "import_layers": "import_layers(peers.get(name), ...)",
           "peer_files": "peer_files(peers.get(name), ...)"}


def moved(old: str, new: str) -> None:
    warnings.warn(f"{old} is deprecated: {new}", DeprecationWarning, stacklevel=3)


def _by_name(fn: str) -> Any:
    """``importing.fn`` as it was called before the registry: with the peer's name first."""
    target = getattr(importlib.import_module(f"{__name__}.importing"), fn)

    def call(fmt: str, *args, **kw):
        return target(get(fmt, "import"), *args, **kw)
    return call


def __getattr__(name: str) -> Any:
    if name == "FORMATS":
        moved(f"{__name__}.FORMATS", f"{__name__}.names('import')")
        return names("import")
    if name in BY_NAME:
        moved(f"{__name__}.{name}(fmt, ...)", f"{__name__}.importing.{BY_NAME[name]}")
        return _by_name(name)
    if name in MOVED:
        moved(f"{__name__}.{name}", f"{__name__}.{MOVED[name]}.{name}")
        return getattr(importlib.import_module(f"{__name__}.{MOVED[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
