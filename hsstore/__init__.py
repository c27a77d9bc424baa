"""hsstore: an offline hidden-state store and streaming loader for training speculative-decoding drafters.

Public API::

    store = hsstore.open(url, **storage_options)      # len(store), store.manifest, store.read(i, layers)
    with hsstore.StoreWriter(url, manifest) as w:      # w.add(sample_id, input_ids, loss_mask, hidden_states)
    ds = hsstore.HiddenStateDataset(url, layers=...)   # torch IterableDataset: exactly once, resumable

The package by floor, from the ground up (each subpackage's doc says what it may import; docs/ARCHITECTURE.md names
every module): the core (``distributed``, ``env``, ``errors``, ``locks``, ``progress``, ``redaction``, ``terminal``,
``version``), ``io`` (bytes in and out: filesystems and URLs, listings, the door every store read passes, transfers,
host memory), ``format`` (what a store is on disk), ``layouts`` (how a shard is laid out), ``store`` (open, write,
commit), ``loader`` (streaming: epoch plans and their sources, resume, batches), ``ops`` (info, verify, subset,
merge, convert, upgrade, bench), ``testing`` (the layout contract suite and test helpers, shipped). Above the
library, ``app`` is the applications' floor (settings, devices, the target loader, the command line): extract and
train stand on it, and no library module imports it. Code inside the package imports each name from its defining
module, never from here. """

from importlib import import_module
from typing import TYPE_CHECKING

from .version import __version__

# The public names, each from its defining module. Static tools (type checkers, IDEs) read the real imports
# below; at run time the same names load on first use (PEP 562) from ``_PUBLIC``, because `hsstore --help` and
# the store commands (info, verify, ...) must not pay for torch and zarr. tests/test_architecture.py checks
# that the two lists are one.
if TYPE_CHECKING:
    from .errors import CorruptionError, FetchError, ManifestError, SampleError, StoreError
    from .format.manifest import FORMAT_VERSION, Manifest, TargetIdentity, TokenizerIdentity
    from .loader.batching import TokenBatches, collate_packed, collate_padded, count_token_batches, token_batches
    from .loader.dataset import HiddenStateDataset
    from .loader.options import Planning, Reading, Selection
    from .loader.resume import LoaderStateError, merge_states
    from .store.process_writer import ProcessWriter
    from .store.reader import Store, open
    from .store.writer import StoreWriter
    from .distributed import World

_PUBLIC = {
    "CorruptionError": "errors", "FetchError": "errors", "ManifestError": "errors", "SampleError": "errors",
    "StoreError": "errors",
    "FORMAT_VERSION": "format.manifest", "Manifest": "format.manifest", "TargetIdentity": "format.manifest",
    "TokenizerIdentity": "format.manifest",
    "TokenBatches": "loader.batching", "collate_packed": "loader.batching", "collate_padded": "loader.batching",
    "count_token_batches": "loader.batching", "token_batches": "loader.batching",
    "HiddenStateDataset": "loader.dataset",
    "Planning": "loader.options", "Reading": "loader.options", "Selection": "loader.options",
    "LoaderStateError": "loader.resume", "merge_states": "loader.resume",
    "ProcessWriter": "store.process_writer",
    "Store": "store.reader", "open": "store.reader",
    "StoreWriter": "store.writer",
    "World": "distributed",
}
__all__ = sorted(["__version__", *_PUBLIC])


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'hsstore' has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
