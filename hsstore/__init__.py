"""hsstore: an offline hidden-state store and streaming loader for training speculative-decoding drafters.

Public API::

    store = hsstore.open(url, **storage_options)      # len(store), store.manifest, store.read(i, layers)
    with hsstore.StoreWriter(url, manifest) as w:      # w.add(sample_id, input_ids, loss_mask, hidden_states)
    ds = hsstore.HiddenStateDataset(url, layers=...)   # torch IterableDataset: exactly once, resumable

The package by concern (each subpackage's doc says what it may import): ``format`` (what a store is on
disk), ``layouts`` (how a shard is laid out), ``store`` (open, write, commit), ``loader`` (streaming, plans,
resume, batches), ``ops`` (info, verify, subset, merge, convert, upgrade, bench); beside them the core that
all use: ``storage`` (filesystems and URLs), ``redaction``, ``errors``, ``memory``, ``devices``,
``distributed``, ``schema`` and ``config`` (settings), ``cli``.
"""

from importlib import import_module

from . import _moved
from .version import __version__

_moved.install()

# The public names and where they live. They load on first use (PEP 562): `hsstore --help` and commands that
# never read a store must not pay for torch and zarr. `hsstore.open` mirrors zarr.open / webdataset.
_PUBLIC = {
    "CorruptionError": "errors", "FetchError": "errors", "ManifestError": "errors", "SampleError": "errors",
    "StoreError": "errors",
    "FORMAT_VERSION": "format.manifest", "Manifest": "format.manifest", "TargetIdentity": "format.manifest",
    "TokenizerIdentity": "format.manifest",
    "Store": "store.reader", "open_store": "store.reader", "open": "store.reader", "StoreWriter": "store.writer",
    "ProcessWriter": "store.process_writer",
    "HiddenStateDataset": "loader.dataset", "LoaderStateError": "loader.resume", "merge_states": "loader.resume",
    "TokenBatches": "loader.batching", "collate_packed": "loader.batching", "collate_padded": "loader.batching",
    "count_token_batches": "loader.batching", "token_batches": "loader.batching",
}
__all__ = sorted(["__version__", *_PUBLIC])


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        if name in _moved.MOVED:  # `import hsstore; hsstore.reader` of the flat layout
            return import_module(f".{name}", __name__)
        raise AttributeError(f"module 'hsstore' has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), "open_store" if name == "open" else name)
    globals()[name] = value
    return value
