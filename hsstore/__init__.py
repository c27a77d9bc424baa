"""hsstore: an offline hidden-state store and streaming loader for training speculative-decoding drafters.

Public API::

    store = hsstore.open(url, **storage_options)      # len(store), store.manifest, store.read(i, layers)
    with hsstore.StoreWriter(url, manifest) as w:      # w.add(sample_id, input_ids, loss_mask, hidden_states)
    ds = hsstore.HiddenStateDataset(url, layers=...)   # torch IterableDataset: exactly once, resumable
"""

from .batching import TokenBatches, collate_packed, collate_padded, token_batches
from .errors import CorruptionError, FetchError, ManifestError, SampleError, StoreError
from .loader import HiddenStateDataset, LoaderStateError, merge_states
from .manifest import FORMAT_VERSION, Manifest, TargetIdentity, TokenizerIdentity
from .process_writer import ProcessWriter
from .reader import Store, open_store
from .version import __version__
from .writer import StoreWriter

open = open_store  # noqa: A001  (hsstore.open mirrors zarr.open / webdataset conventions)

__all__ = [
    "FORMAT_VERSION", "CorruptionError", "FetchError", "HiddenStateDataset", "LoaderStateError", "Manifest",
    "ManifestError", "ProcessWriter", "SampleError", "Store", "StoreError", "StoreWriter", "TargetIdentity",
    "TokenBatches", "TokenizerIdentity", "__version__", "collate_packed", "collate_padded", "merge_states", "open",
    "open_store", "token_batches",
]
