"""A store as a whole: ``reader`` opens one (``hsstore.open``: the manifest, the index, one sample's arrays),
``writer`` and ``process_writer`` add samples and commit shards atomically, so a crash loses at most the shard
being written.

Imports: hsstore core, io, format, layouts.
"""
