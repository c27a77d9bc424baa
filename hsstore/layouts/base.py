"""Shard layouts (the manifest's ``layout``): the protocol every layout follows, and the modules implementing it.

Manifest, commit records (format/commit.py), the sample index, the loader and ``info`` are shared by all layouts;
a layout only says how one shard's samples become objects, how a token range of a shard is read back, and
how ``verify`` checks a shard. A layout reads through a ``ShardSource`` (layouts/source.py: filesystem, root,
manifest, chunk cache, checked shard locations), never the ``Store``. Each layout is one module that implements :class:`Layout` with plain
functions (as zarr-python's stores implement its ``Store`` ABC, one class per backend): ``zarr``
(layouts/zarr.py: one Zarr v3 group of chunked arrays per shard; the default, compressible, chunk cache) and
``wds`` (layouts/wds.py: one WebDataset tar of ``.npy`` members per shard). What the rest of the package asks of
a layout without its code (its name, manifest rules, whether the chunk cache serves it) is its declaration in
the registry, ``format.layout_spec``; ``get`` gives the module a declaration names.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

import numpy as np

from . import wds, zarr as zarr_layout
from ..format import layout_spec
from ..format.commit import CommitRecord
from ..format.manifest import Manifest
from ..format.report import VerifyReport

if TYPE_CHECKING:
    from .source import ShardSource


class Layout(Protocol):
    """What a layout module provides. Every function checks what it reads: a layout never returns bytes that
    failed their CRC32C, and names the shard and file (or member) at fault."""

    def write_shard(self, fs, root: str, name: str, writer: str, manifest: Manifest, features: dict[int, np.ndarray],
                    input_ids: np.ndarray, loss_mask: np.ndarray, samples: dict[str, list],
                    stats: dict[str, Any] | None = None, scales: dict[int, np.ndarray] | None = None,
                    ) -> CommitRecord:
        """Write shard ``name``'s objects under ``(fs, root)``; return its commit record, not yet published
        (``scales``: fp8 stores' per-row scales of each layer)."""

    def read_into(self, src: ShardSource, rec: CommitRecord, start: int, stop: int, layers: Sequence[int],
                  ids: np.ndarray, mask: np.ndarray, feats: np.ndarray, carry: dict | None = None,
                  scales: np.ndarray | None = None) -> None:
        """Tokens ``start:stop`` of the shard into the caller's arrays (``feats`` layer-major
        ``[n_layers, T, H]``; ``scales``: fp8 stores' ``[n_layers, T]``, else None); ``carry``: objects
        shared by consecutive reads of a scan (see ``Store.read_range``). The shard's files are where
        ``src.locate(rec.shard)`` says; remote chunk reads go through ``src.chunk_cache`` when set."""

    def read_loss_mask(self, src: ShardSource, rec: CommitRecord) -> np.ndarray:
        """The shard's loss_mask whole (``[n_tokens]`` uint8) and nothing else of it, read as ``read_into`` reads
        (through the door, at the sizes the record lists, every byte checked): what holds every sample's loss
        tokens to the record before a shard is handed on as it is (``Store.check_loss_tokens``)."""

    def chunk_files(self, manifest: Manifest, rec: CommitRecord, spans: Sequence[tuple[int, int]],
                    layers: Sequence[int]) -> dict[str, int]:
        """The objects (key -> listed size) that reading the token ``spans`` of ``layers`` of the shard leaves in
        a chunk cache, each once (empty for a layout the chunk cache does not serve): a cache's size, sized
        before it is filled."""

    def check_extent(self, src: ShardSource, rec: CommitRecord) -> None:
        """Raise ``CorruptionError`` when the record claims more tokens than its files can hold (checked before
        a reader sizes buffers from it)."""

    def check_shard(self, src: ShardSource, rec: CommitRecord, report: VerifyReport,
                    progress: Callable[[int], None] | None, tails: dict[str, int] | None = None) -> None:
        """``verify``'s checks of one committed shard whose files are where ``src.locate(rec.shard)`` says
        (another store's for a shard merged by reference), problems added to ``report``; ``progress`` gets
        bytes read; ``tails``: see ``hsstore upgrade``."""

    def file_bound(self, manifest: Manifest, rec: CommitRecord, key: str) -> int:
        """The most bytes file ``key`` of the shard may hold, from the manifest and the record alone: a
        larger one is refused (``door``) before it is read, by ``verify`` and the copiers."""

    def store_objects(self) -> dict[str, bytes]:
        """Objects written once, with the manifest, when a store is created."""

    def shard_of(self, entry: str) -> str | None:
        """The shard an entry of ``shards/`` belongs to (None: not a shard), for verify's debris listing."""


BUILT_IN = (zarr_layout, wds)  # imported here, so that the import checks see the edges


def get(name: str) -> Layout:
    """The module implementing layout ``name`` (its ``format.layout_spec`` declaration names it)."""
    return importlib.import_module(layout_spec.get(name).module)


def names() -> tuple[str, ...]:
    """Every registered layout: the built-in ones (``BUILT_IN``) and any registered from outside."""
    return layout_spec.names()


def own_objects() -> dict[str, bytes]:
    """Every layout's root objects (``store_objects``): what a store folder may hold before its manifest
    (``destination.check_destination``)."""
    return {k: v for name in names() for k, v in get(name).store_objects().items()}
