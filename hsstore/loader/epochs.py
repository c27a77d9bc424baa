"""What a ``HiddenStateDataset`` iterates: the epochs of its stores, each planned by an *epoch source*.

``PlanInputs`` is what every source plans from besides the stores: which samples (filters), how often each
store's come (weights), the order and cut (``Planning``), the read unit, a token's feature bytes and the plan's
node count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ..store.reader import Store
from .options import Planning
from .plan import Catalog, Filters, Planner, build_catalog, plan_settings


@dataclass(frozen=True)
class PlanInputs:
    """What an epoch is planned from besides the stores (the ``loader.dataset`` module doc, steps 1-5).

    ``filters`` carry no ``where``: it is applied once, to the dataset's first catalog. ``nodes``: the plan's node
    count (``partition="node"``; None: a global plan, one part over the whole world)."""

    filters: Filters
    weights: tuple[float, ...]
    planning: Planning
    unit_tokens: int
    token_bytes: int
    nodes: int | None

    def catalog(self, stores: Sequence[Store]) -> Catalog:
        """Step 1 over ``stores``: their samples that pass the filters, in read units."""
        return build_catalog(stores, self.filters, self.unit_tokens)

    def planner(self, catalog: Catalog, seed: int | None = None) -> Planner:
        """The plan of ``catalog`` for any epoch (``seed``: another than the planning's own)."""
        p = self.planning
        return Planner(catalog, self.weights, seed=p.seed if seed is None else seed, shuffle=p.shuffle, even=p.even,
                       unit_tokens=self.unit_tokens, token_bytes=self.token_bytes, shuffle_bytes=p.shuffle_bytes,
                       partition=p.partition)

    def settings(self) -> dict[str, Any]:
        """What a resume state must agree on besides the catalog (``Planner.config`` less its ``catalog``)."""
        p = self.planning
        return plan_settings(self.weights, seed=p.seed, shuffle=p.shuffle, even=p.even, unit_tokens=self.unit_tokens,
                             shuffle_bytes=p.shuffle_bytes, partition=p.partition)
