"""The streaming loader: ``HiddenStateDataset`` (``dataset``) reads stores in read units planned per epoch
(``plan``: shuffled, split over nodes, ranks and workers, exactly once) by the epoch's source (``epochs``: the
stores as they stand; ``follow``: a follower's epoch 0, from its journal), resumes mid-epoch (``resume``), packs
samples into token-budget batches (``batching``) and keeps remote chunks in a local cache (``cache``).

Imports: hsstore core, io, format, layouts, store.
"""
