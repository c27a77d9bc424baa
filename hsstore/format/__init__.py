"""The on-disk format: what a store is, byte for byte (docs/FORMAT.md is its specification).

Here live the manifest (``manifest``), commit records and their checks (``commit``, ``records``), the columnar
index (``index``), the feature codecs and fp8 scaling (``codec``, ``fp8``), tap naming (``taps``), store assets
(``assets``), the checked mapping from untrusted names to paths inside a store's root (``names``), and what
``verify`` reports (``report``), and the registry of shard layouts (``layout_spec``: each layout's name and
manifest rules, as data). Nothing here knows how shards are laid out, read in order or trained on.

Imports: hsstore core, io.
"""
