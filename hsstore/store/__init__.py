"""A store as a whole: ``reader`` opens one (``hsstore.open``: the manifest, the index, one sample's arrays),
``writer`` and ``process_writer`` add samples and commit shards atomically, so a crash loses at most the shard
being written; ``fork`` keeps a forked worker's inherited filesystems alive, ``broadcast`` is what ``open_shared``
sends from one rank to the others.

Imports: hsstore core, io, format, layouts.
"""
