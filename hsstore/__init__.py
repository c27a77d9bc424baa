"""hsstore: an offline hidden-state store and streaming loader for training speculative-decoding drafters.

Public API::

    store = hsstore.open(url, **storage_options)      # len(store), store.manifest, store.read(i, layers)
    with hsstore.StoreWriter(url, manifest) as w:      # w.add(sample_id, input_ids, loss_mask, hidden_states)
    ds = hsstore.HiddenStateDataset(url, layers=...)   # torch IterableDataset: exactly once, resumable
"""

from importlib import import_module

from .errors import CorruptionError, FetchError, ManifestError, SampleError, StoreError
from .version import __version__

# The rest loads on first use (PEP 562): `hsstore --help` and commands that never read a store must not
# pay for torch and zarr.
_LAZY = {
    "TokenBatches": "batching", "collate_packed": "batching", "collate_padded": "batching",
    "count_token_batches": "batching", "token_batches": "batching", "HiddenStateDataset": "loader",
    "LoaderStateError": "resume", "merge_states": "resume", "FORMAT_VERSION": "manifest", "Manifest": "manifest",
    "TargetIdentity": "manifest", "TokenizerIdentity": "manifest", "ProcessWriter": "process_writer",
    "Store": "reader", "open_store": "reader", "open": "reader", "StoreWriter": "writer",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hsstore' has no attribute {name!r}")
    # hsstore.open mirrors zarr.open / webdataset conventions
    value = getattr(import_module(f".{module}", __name__), "open_store" if name == "open" else name)
    globals()[name] = value
    return value


__all__ = [
    "FORMAT_VERSION", "CorruptionError", "FetchError", "HiddenStateDataset", "LoaderStateError", "Manifest",
    "ManifestError", "ProcessWriter", "SampleError", "Store", "StoreError", "StoreWriter", "TargetIdentity",
    "TokenBatches", "TokenizerIdentity", "__version__", "collate_packed", "collate_padded", "count_token_batches",
    "merge_states", "open", "open_store", "token_batches",
]
