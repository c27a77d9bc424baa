"""What a peer module provides (:class:`Peer`), and the one thing every peer has: how it numbers the taps.

A peer is another project whose files hold hidden states or read a store's (SpecForge, speculators, z-lab's
dflash). Each is one module of this package implementing :class:`Peer` with plain module-level names, as a shard
layout implements ``hsstore.layouts.base.Layout``; the registry (``extract/peers/__init__.py``) declares which
peers there are and which of ``export`` / ``files`` (import) each offers, so that the commands' choices come from
it without importing a peer's code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


def parse_ids(text: str, flag: str) -> list[int]:
    """Comma-separated layer ids; an error names the flag and the item that is not an integer."""
    out = []
    for x in (x.strip() for x in text.split(",")):
        if not x:
            continue
        try:
            out.append(int(x))
        except ValueError:
            raise ValueError(f"{flag} {text!r}: {x!r} is not a layer id (expected comma-separated integers, "
                             "e.g. 1,16,31)") from None
    return out


@dataclass(frozen=True)
class LayerConvention:
    """How a peer numbers a target's layers, against hsstore's id ``l`` (the output of decoder layer ``l``):
    the peer's id is ``l + offset``. ``text`` is what the manifest of an import records; ``zero_note`` is said
    when a peer id 0 falls outside the range (it names a tensor that is no layer's output)."""

    offset: int
    text: str
    zero_note: str = ""

    def to_hsstore(self, peer: str, peer_ids: list[int], num_layers: int) -> list[int]:
        """The hsstore ids of ``peer_ids``; refuses ids with no hsstore id."""
        lo, hi = self.offset, num_layers - 1 + self.offset
        bad = [i for i in peer_ids if not lo <= i <= hi]
        if bad:
            extra = f" ({self.zero_note})" if self.zero_note and 0 in bad else ""
            raise ValueError(f"--peer-layers {bad} out of range for {peer}'s convention on a {num_layers}-layer "
                             f"target: valid {lo}..{hi}{extra}")
        return [i - self.offset for i in peer_ids]

    def from_hsstore(self, layers: list[int]) -> list[int]:
        return [l + self.offset for l in layers]


@dataclass
class ExportResult:
    samples: int = 0
    tokens: int = 0
    bytes_written: int = 0
    layout: str = ""
    skipped: int = 0  # samples left out: the peer's loader would refuse them
    already: int = 0  # files an earlier run of the same export had written (resumed)
    notes: list[str] = field(default_factory=list)


@dataclass
class PeerSample:
    sample_id: str
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    hidden_states: torch.Tensor  # [T, L, H]
    source: str
    final_hidden: torch.Tensor | None = None  # [T, H]: the final-norm output, when the file carries it
    pad_tokens: int = 0  # trailing batch padding trimmed off
    pad_ambiguous: str | None = None  # why the padding could not be told from real tokens, or None


@dataclass
class PeerFile:
    """One sample of a peer's layout, not read yet: ``load()`` reads and checks it."""

    sample_id: str
    path: Path
    load: Callable[[], PeerSample] = field(repr=False)


class Peer(Protocol):
    """What a peer module provides. ``export`` and ``files`` exist where the registry declares them (a peer
    whose files hsstore neither writes nor reads has only its name and convention)."""

    NAME: str
    LAYERS: LayerConvention

    def ambiguity(self, layers: list[int], num_layers: int) -> str | None:
        """Why a ``--layers`` list (meant as hsstore ids) may well be this peer's own ids, or None."""

    def export(self, url: str, out: str, *, storage_options: dict | None = None, progress: bool = True,
               layout: str | None = None, layers: list[int] | None = None) -> ExportResult:
        """``hsstore export``: the store at ``url`` as this peer's files in ``out`` (resumable; a folder that
        is not empty nor an earlier run of the same export is refused, nothing written)."""

    def files(self, root: Path, *, ids: list[str] | None, id_prefix: str, source: str | None, n_layers: int,
              hidden: int, hs_dir: str | None, missing: list[str], pad_id: int | None, final_hidden: bool,
              num_rows: int | None) -> list[PeerFile]:
        """``hsstore import``: every sample of this peer's folder ``root``, not read yet, in order (``ids``: the
        store's sample ids an ``hsstore export`` recorded, or None); rows without a file go into ``missing``."""

    def keeps_final_hidden(self, root: Path) -> bool:
        """Whether an import of ``root`` keeps the final norm's output as the store's ``final_hidden``."""
