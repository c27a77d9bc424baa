"""The streaming loader: ``HiddenStateDataset`` (``dataset``) reads stores in read units planned per epoch
(``plan``: shuffled, split over nodes, ranks and workers, exactly once), resumes mid-epoch (``resume``), packs
samples into token-budget batches (``batching``) and keeps remote chunks in a local cache (``cache``).

Imports: hsstore core, format, layouts, store.
"""

from importlib import import_module

_PUBLIC = {"HiddenStateDataset": "dataset", "read_ahead_units": "dataset", "LoaderStateError": "resume",
           "merge_states": "resume"}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):  # lazily: the plan and the cache are used without torch
    if name not in _PUBLIC:
        raise AttributeError(f"module 'hsstore.loader' has no attribute {name!r}")
    return getattr(import_module(f".{_PUBLIC[name]}", __name__), name)
